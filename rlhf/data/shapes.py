"""A synthetic visual task: images of coloured shapes drawn with PIL, and questions about them.

Each image (112 x 112, white) holds one to three shapes (circle, square, triangle), each in its own cell of
a 2 x 2 grid so none overlap. Two kinds of questions, answered in one word:
- "What colour is the triangle?" -> "red" (the asked shape appears exactly once);
- "How many circles?" -> "2".
`llava_records` writes the task in LLaVA's format (a JSON list of {"id", "image", "conversations"}), the
input of `rlhf preprocess --format llava`; `write_shapes_data` (`data.task: shapes`) writes train and
validation sets of colour questions that way and packs them into WebDataset shards, the RL prompt sources
`rl_train/` and `rl_val/`. The task asks colours only: the tiny Qwen2-VL answers "0" to every count
question whatever the image, after SFT as after GRPO (bench/RESULTS.md).
"""

from __future__ import annotations

import io
import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SIZE = 112
COLOURS = {"red": (220, 30, 30), "green": (30, 170, 60), "blue": (40, 70, 220), "yellow": (230, 200, 20)}
SHAPES = ("circle", "square", "triangle")
KINDS = ("count", "colour")


@dataclass(frozen=True)
class ShapeItem:
    question: str
    answer: str
    image: Any  # an RGB PIL image


def _draw(shapes: list[tuple[str, str]], rng: random.Random) -> Any:
    from PIL import Image, ImageDraw

    img = Image.new("RGB", (SIZE, SIZE), (255, 255, 255))
    draw = ImageDraw.Draw(img)
    cells = rng.sample(range(4), len(shapes))
    half = SIZE // 2
    for (shape, colour), cell in zip(shapes, cells):
        x0, y0 = (cell % 2) * half, (cell // 2) * half
        r = rng.randint(14, 22)
        cx, cy = x0 + half // 2 + rng.randint(-4, 4), y0 + half // 2 + rng.randint(-4, 4)
        fill = COLOURS[colour]
        if shape == "circle":
            draw.ellipse([cx - r, cy - r, cx + r, cy + r], fill=fill)
        elif shape == "square":
            draw.rectangle([cx - r, cy - r, cx + r, cy + r], fill=fill)
        else:
            draw.polygon([(cx, cy - r), (cx - r, cy + r), (cx + r, cy + r)], fill=fill)
    return img


def make_item(rng: random.Random, kinds: tuple[str, ...] = KINDS) -> ShapeItem:
    """One image and one question about it, of a kind drawn from `kinds` ("count", "colour")."""
    n = rng.randint(1, 3)
    shapes = [(rng.choice(SHAPES), rng.choice(list(COLOURS))) for _ in range(n)]
    coin = rng.random()  # drawn whatever `kinds`: the mixed task keeps its items for a seed
    if "count" in kinds and ("colour" not in kinds or coin < 0.5):
        target = rng.choice(SHAPES)
        count = sum(1 for s, _ in shapes if s == target)
        question, answer = f"How many {target}s?", str(count)
    else:
        target, colour = rng.choice(shapes)
        shapes = [(s, c) for s, c in shapes if s != target] + [(target, colour)]
        question, answer = f"What colour is the {target}?", colour
    return ShapeItem(question, answer, _draw(shapes, rng))


def make_items(n: int, seed: int = 0, kinds: tuple[str, ...] = KINDS) -> list[ShapeItem]:
    rng = random.Random(seed)
    return [make_item(rng, kinds) for _ in range(n)]


def png_bytes(image: Any) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def messages(item: ShapeItem, with_answer: bool = True) -> list[dict[str, Any]]:
    """The chat messages of an item: the image, then the question (and the answer)."""
    msgs: list[dict[str, Any]] = [{"role": "user", "content": [{"type": "image"},
                                                               {"type": "text", "text": item.question}]}]
    if with_answer:
        msgs.append({"role": "assistant", "content": item.answer})
    return msgs


def llava_records(items: list[ShapeItem], image_dir: str | Path, json_path: str | Path) -> Path:
    """Write the items as LLaVA records (PNG files in `image_dir`, the JSON list at `json_path`)."""
    image_dir, json_path = Path(image_dir), Path(json_path)
    image_dir.mkdir(parents=True, exist_ok=True)
    records = []
    for i, item in enumerate(items):
        name = f"shape_{i:06d}.png"
        (image_dir / name).write_bytes(png_bytes(item.image))
        records.append({"id": f"shape-{i}", "image": name, "conversations": [
            {"from": "human", "value": f"<image>\n{item.question}"}, {"from": "gpt", "value": item.answer}]})
    json_path.write_text(json.dumps(records, indent=1))
    return json_path


TRAIN_ITEMS = 16_000  # 300 GRPO steps of 16 prompts never repeat an image (~15 s to write)


def write_shapes_data(data_dir: str | Path, seed: int = 0, val_size: int = 64) -> None:
    """The shapes task's RL data under `data_dir`: LLaVA records and images (`llava_train.json`, `images/`),
    then WebDataset shards `rl_train/` and `rl_val/` (the validation items drawn with another seed), colour
    questions only."""
    from rlhf.data.llava_shards import write_llava_shards

    data_dir = Path(data_dir)
    colour = ("colour",)
    for name, items in (("train", make_items(TRAIN_ITEMS, seed, colour)),
                        ("val", make_items(val_size, seed + 10_000, colour))):
        images = data_dir / f"images_{name}"
        records = llava_records(items, images, data_dir / f"llava_{name}.json")
        write_llava_shards(records, images, data_dir / f"rl_{name}", shard_size=2000, strict=True)
