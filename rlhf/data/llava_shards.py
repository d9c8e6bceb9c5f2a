"""LLaVA-format records -> WebDataset tar shards (`rlhf preprocess --format llava`), and a streaming reader.

Input: a JSON list (or .jsonl) of `{"id", "image": name | [names] | absent, "conversations": [{"from":
"system"|"human"|"gpt", "value"}, ...]}`, image names relative to an image folder. Each valid record becomes
one sample `<index:08d>.json` (`{"id", "messages"}`: OpenAI chat messages, each `<image>` of a user turn an
image part at its place) plus `<index:08d>.0.png`, `.1.jpg`, ... (the image files' own bytes). Keys come from
the record index because ids may hold dots or slashes, which webdataset reads as extension separators.
Shards hold raw conversations: they are tokenised at train time, by the model's own processor.
"""

from __future__ import annotations

import io
import json
import struct
import sys
import tarfile
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rlhf.data.jsonl import check_input_file, iter_lines, parse_line
from rlhf.errors import UserError

IMAGE = "<image>"
SHARD_GLOB = "shard-[0-9][0-9][0-9][0-9][0-9][0-9].tar"
MAX_REPORTED = 20  # bad records printed one by one (as rlhf.data.preprocess); the rest only counted
ROLES = {"system": "system", "human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant"}


class BadRecord(Exception):
    """A malformed record: `kind` counts it in ShardStats.skipped, the message says what is wrong."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


@dataclass
class ShardStats:
    """Counts from one `write_llava_shards` run; bytes are the samples' payload (json + images)."""

    records: int = 0
    samples: int = 0
    images: int = 0
    bytes: int = 0
    shards: list[str] = field(default_factory=list)
    skipped: Counter[str] = field(default_factory=Counter)

    def summary(self) -> str:
        kinds = ", ".join(f"{n} {kind}" for kind, n in sorted(self.skipped.items()))
        skipped = sum(self.skipped.values())
        return (
            f"{self.samples} samples ({self.images} images, {self.bytes} bytes) in {len(self.shards)} shards "
            f"from {self.records} records; skipped {skipped}" + (f" ({kinds})" if kinds else "")
        )


def _records(path: Path) -> Iterator[tuple[int, int | None, Any]]:
    """(record index, jsonl line or None, record) per record; an invalid .jsonl line's record is a BadRecord.
    Invalid JSON in a .json list is a UserError naming the line: the whole file is unreadable."""
    if path.suffix.lower() == ".jsonl":
        for index, (lineno, line) in enumerate(iter_lines(path)):
            obj, err = parse_line(line)
            bad = err is not None and err.startswith("not valid JSON")
            yield index, lineno, BadRecord("invalid_json", f"{path}:{lineno}: {err}") if bad else obj
        return
    try:
        records = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise UserError(f"{path}:{e.lineno}: not valid JSON ({e.msg} at column {e.colno})") from None
    except UnicodeDecodeError as e:
        raise UserError(f"{path}: not UTF-8 ({e.reason} at byte {e.start})") from None
    if not isinstance(records, list):
        raise UserError(f"{path}: expected a JSON list of records, got {type(records).__name__}")
    for index, obj in enumerate(records):
        yield index, None, obj


def _where(path: Path, index: int, lineno: int | None, record: Any) -> str:
    """"FILE record I (line L, id 'X')", naming what is known."""
    rid = record.get("id") if isinstance(record, dict) else None
    parts = ([] if lineno is None else [f"line {lineno}"]) + ([] if rid is None else [f"id {rid!r}"])
    return f"{path} record {index}" + (f" ({', '.join(parts)})" if parts else "")


def _messages(record: dict, n_images: int) -> list[dict[str, Any]]:
    """The record's conversation as chat messages; BadRecord unless it alternates human/gpt after an optional
    system turn and holds one `<image>` per image."""
    turns = record.get("conversations")
    if not isinstance(turns, list) or not turns:
        raise BadRecord("bad_conversation", "'conversations' must be a non-empty list of turns")
    messages: list[dict[str, Any]] = []
    if isinstance(record.get("system"), str) and record["system"]:
        messages.append({"role": "system", "content": record["system"]})
    placeholders = 0
    for i, turn in enumerate(turns):
        if not isinstance(turn, dict) or not isinstance(turn.get("value"), str):
            raise BadRecord("bad_conversation", f"turn {i} is not a {{'from': ..., 'value': str}} object")
        role = ROLES.get(str(turn.get("from")))
        if role is None:
            raise BadRecord("bad_role", f"turn {i} has role {turn.get('from')!r}; expected one of {', '.join(ROLES)}")
        expected = "assistant" if messages and messages[-1]["role"] == "user" else "user"
        if role != expected and not (role == "system" and not messages):
            raise BadRecord("bad_conversation", f"turn {i} is {turn['from']!r}: turns must alternate human, gpt")
        text: str = turn["value"]
        if role != "user":
            messages.append({"role": role, "content": text})
            continue
        parts: list[dict[str, str]] = []
        for j, piece in enumerate(text.split(IMAGE)):
            if j:
                parts.append({"type": "image"})
                placeholders += 1
                piece = piece.removeprefix("\n")
            if piece:
                parts.append({"type": "text", "text": piece})
        messages.append({"role": "user", "content": parts})
    if not any(m["role"] == "user" for m in messages):
        raise BadRecord("bad_conversation", "the conversation has no human turn")
    if placeholders != n_images:
        raise BadRecord("placeholder_mismatch", f"{placeholders} {IMAGE} placeholders for {n_images} images")
    return messages


def _image(image_dir: Path, name: Any) -> tuple[str, bytes]:
    """(extension, bytes) of one image: PNG and JPEG files as they are, other formats converted to PNG."""
    from PIL import Image

    if not isinstance(name, str) or not name:
        raise BadRecord("bad_image", f"image {name!r} is not a file name")
    path = image_dir / name
    if not path.is_file():
        raise BadRecord("image_missing", f"image {name!r} not found in {image_dir}")
    data = path.read_bytes()
    try:
        with Image.open(io.BytesIO(data)) as im:
            fmt = im.format
            im.verify()
        if fmt == "PNG":
            return "png", data
        if fmt == "JPEG":
            return ("jpeg" if path.suffix.lower() == ".jpeg" else "jpg"), data
        with Image.open(io.BytesIO(data)) as im:
            buf = io.BytesIO()
            im.convert("RGBA" if "A" in im.mode or "transparency" in im.info else "RGB").save(buf, "PNG")
            return "png", buf.getvalue()
    except (OSError, SyntaxError, ValueError, struct.error, Image.DecompressionBombError) as e:
        raise BadRecord("image_corrupt", f"image {name!r} is not a readable image ({e})") from None


def _sample(index: int, record: Any, image_dir: Path) -> dict[str, Any]:
    """The webdataset sample of one record (values bytes); BadRecord if the record is malformed."""
    if not isinstance(record, dict):
        raise BadRecord("not_object", f"expected a JSON object, got {type(record).__name__}")
    if "conversations" not in record:
        raise BadRecord("bad_conversation", "missing 'conversations'")
    names = record.get("image")
    names = [] if names is None else names if isinstance(names, list) else [names]
    messages = _messages(record, len(names))
    sample: dict[str, Any] = {"__key__": f"{index:08d}"}
    for i, name in enumerate(names):
        ext, data = _image(image_dir, name)
        sample[f"{i}.{ext}"] = data
    sample["json"] = json.dumps({"id": record.get("id"), "messages": messages}).encode()
    return sample


def _skip(stats: ShardStats, bad: BadRecord, strict: bool) -> None:
    """Count a bad record and print the first MAX_REPORTED; with strict, raise it as a UserError."""
    if strict:
        raise UserError(str(bad))
    stats.skipped[bad.kind] += 1
    n = sum(stats.skipped.values())
    if n <= MAX_REPORTED:
        print(f"{bad} (skipped)", file=sys.stderr)
    elif n == MAX_REPORTED + 1:
        print("... more malformed records; only counting from here (--strict fails on the first)", file=sys.stderr)


def write_llava_shards(
    input_json: str | Path, image_dir: str | Path, output_dir: str | Path, shard_size: int = 1000,
    strict: bool = False,
) -> ShardStats:
    """Write the valid records of `input_json` as `output_dir/shard-000000.tar`, ... (`shard_size` samples
    each); earlier shards in `output_dir` are removed first. Malformed records are skipped and counted, or
    with `strict` the first is a UserError naming the file, record and id."""
    import webdataset as wds  # type: ignore[import-untyped]  # imports torch: only when writing

    path, image_dir, output_dir = check_input_file(input_json), Path(image_dir), Path(output_dir)
    if not image_dir.is_dir():
        raise UserError(f"image folder {image_dir} does not exist or is not a folder")
    if not isinstance(shard_size, int) or shard_size < 1:
        raise UserError(f"shard size must be a positive integer, got {shard_size!r}")
    output_dir.mkdir(parents=True, exist_ok=True)
    for old in output_dir.glob(SHARD_GLOB):
        old.unlink()
    stats = ShardStats()
    pattern = str(output_dir).replace("%", "%%") + "/shard-%06d.tar"
    writer = None
    try:
        for index, lineno, record in _records(path):
            stats.records += 1
            try:
                if isinstance(record, BadRecord):
                    raise record
                sample = _sample(index, record, image_dir)
            except BadRecord as bad:
                message = str(bad) if bad.kind == "invalid_json" else f"{_where(path, index, lineno, record)}: {bad}"
                _skip(stats, BadRecord(bad.kind, message), strict)
                continue
            if writer is None:
                writer = wds.ShardWriter(pattern, maxcount=shard_size, verbose=0, encoder=False, mtime=0,
                                         post=stats.shards.append)
            writer.write(sample)
            stats.samples += 1
            stats.images += sum(1 for k in sample if k[0].isdigit())
            stats.bytes += sum(len(v) for k, v in sample.items() if k != "__key__")
    finally:
        if writer is not None:
            writer.close()
    if stats.samples == 0:
        raise UserError(f"{path}: no samples to write ({stats.summary()})")
    return stats


def shard_paths(path_or_pattern: str | Path) -> list[Path]:
    """The shards named by a folder (its shard tars in order), a brace pattern (`shard-{000000..000002}.tar`)
    or one file; a UserError if there are none or one is missing."""
    from braceexpand import braceexpand

    p = Path(path_or_pattern)
    paths = sorted(p.glob("*.tar")) if p.is_dir() else [Path(s) for s in braceexpand(str(path_or_pattern))]
    if not paths:
        raise UserError(f"{p}: no .tar shards in this folder")
    for shard in paths:
        if not shard.is_file():
            raise UserError(f"shard {shard} does not exist")
    return paths


def _read(paths: list[Path]) -> Iterator[tuple[dict[str, Any], int]]:
    """(sample, payload bytes) per sample, each tar read as a stream and closed when left. Members group as
    webdataset groups them: consecutive ones sharing the name up to the first dot of the base name."""
    for shard in paths:
        with tarfile.open(shard, "r|") as tar:
            key, files = None, {}
            for member in tar:
                if not member.isfile():
                    continue
                head, _, base = member.name.rpartition("/")
                stem, _, ext = base.partition(".")
                name = f"{head}/{stem}" if head else stem
                if key is not None and name != key:
                    yield _decode(shard, key, files)
                    files = {}
                key, f = name, tar.extractfile(member)
                files[ext] = f.read() if f is not None else b""
            if key is not None:
                yield _decode(shard, key, files)


def _decode(shard: Path, key: str, files: dict[str, bytes]) -> tuple[dict[str, Any], int]:
    if "json" not in files:
        raise UserError(f"shard {shard}: sample {key!r} has no .json")
    meta = json.loads(files["json"])
    images = [d for _, d in sorted((int(e.split(".")[0]), d) for e, d in files.items() if e[0].isdigit())]
    sample = {"key": key, "id": meta.get("id"), "messages": meta["messages"], "images": images}
    return sample, sum(map(len, files.values()))


def iter_llava_shards(path_or_pattern: str | Path) -> Iterator[dict[str, Any]]:
    """Stream `{"key", "id", "messages", "images": [bytes, ...]}` from shards in order, one sample in memory."""
    for sample, _ in _read(shard_paths(path_or_pattern)):
        yield sample


def count_shards(path_or_pattern: str | Path) -> tuple[int, int, int]:
    """(samples, payload bytes, shards), read back by decoding every sample: how `rlhf preprocess` verifies."""
    paths = shard_paths(path_or_pattern)
    samples = size = 0
    for _, n in _read(paths):
        samples, size = samples + 1, size + n
    return samples, size, len(paths)
