"""Images as the rollout engines and the vision tower take them: RGB PIL images, from PIL images or encoded
bytes (PNG / JPEG, as WebDataset shards hold them)."""

from __future__ import annotations

import io
from collections.abc import Sequence
from typing import Any

MAX_IMAGES_PER_PROMPT = 4  # vLLM reserves room (and profiles memory) for this many images in one prompt


def as_pil(image: Any) -> Any:
    """An RGB PIL image from a PIL image or encoded bytes; ValueError for anything else."""
    from PIL import Image

    if isinstance(image, Image.Image):
        return image if image.mode == "RGB" else image.convert("RGB")
    if isinstance(image, (bytes, bytearray, memoryview)):
        with Image.open(io.BytesIO(bytes(image))) as im:
            return im.convert("RGB")
    raise ValueError(f"an image must be a PIL image or encoded bytes, not {type(image).__name__}")


def prompt_images(images: Any, row: int) -> list[Any]:
    """The images of prompt `row` as a list of RGB PIL images (one image or a list of them)."""
    items = list(images) if isinstance(images, (list, tuple)) else [images]
    if len(items) > MAX_IMAGES_PER_PROMPT:
        raise ValueError(f"prompt {row} has {len(items)} images; at most {MAX_IMAGES_PER_PROMPT} per prompt")
    return [as_pil(x) for x in items]


def check_placeholders(ids: Sequence[int], n_images: int, image_token_id: int, row: int) -> None:
    """A prompt must hold one image token per image (the engine expands each into the image's patches)."""
    found = sum(1 for t in ids if t == image_token_id)
    if found != n_images:
        raise ValueError(f"prompt {row} has {n_images} image(s) but {found} image placeholder token(s) "
                         f"(id {image_token_id}); put one image part per image in its messages")
