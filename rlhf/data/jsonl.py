"""Streaming jsonl reading that names the file and line of every problem."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from rlhf.errors import UserError


def check_input_file(path: str | Path, what: str = "input file") -> Path:
    """Raise a UserError unless `path` is an existing regular file."""
    p = Path(path)
    if not p.exists():
        raise UserError(f"{what} {p} does not exist")
    if not p.is_file():
        raise UserError(f"{what} {p} is not a file")
    return p


def iter_lines(path: str | Path) -> Iterator[tuple[int, str]]:
    """Yield (1-based line number, line without the newline) for each non-blank line, streaming."""
    with open(path, encoding="utf-8", errors="replace") as f:
        for lineno, line in enumerate(f, start=1):
            line = line.rstrip("\r\n")
            if line.strip():
                yield lineno, line


def parse_line(line: str) -> tuple[Any, str | None]:
    """(object, None) for a line holding one JSON object, else (None, reason)."""
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        return None, f"not valid JSON ({e.msg} at column {e.colno})"
    if not isinstance(obj, dict):
        return None, f"expected a JSON object, got {type(obj).__name__}"
    return obj, None


def get_text(obj: dict, key: str) -> tuple[str | None, str | None]:
    """(text, None) when obj[key] is a string, else (None, reason)."""
    if key not in obj:
        return None, f"missing key {key!r}"
    value = obj[key]
    if not isinstance(value, str):
        return None, f"key {key!r} is {type(value).__name__}, expected a string"
    return value, None


def read_jsonl(path: str | Path) -> Iterator[tuple[int, dict]]:
    """Yield (line number, object) for each non-blank line; a bad line is a UserError naming file:line."""
    for lineno, line in iter_lines(path):
        obj, err = parse_line(line)
        if err:
            raise UserError(f"{path}:{lineno}: {err}")
        yield lineno, obj
