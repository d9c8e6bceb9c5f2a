"""Streaming jsonl reading that names the file and line of every problem."""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
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


# Bytes that are not valid UTF-8 decode, with errors="surrogateescape", to lone surrogates U+DC80..U+DCFF,
# which valid UTF-8 never produces: a line holding one had invalid bytes.
_ESCAPED_BYTE = re.compile("[\udc80-\udcff]")

BadLineFn = Callable[[int, str], None]


def invalid_utf8(line: str) -> str | None:
    """None for a line read with errors="surrogateescape" that was valid UTF-8, else the reason."""
    m = _ESCAPED_BYTE.search(line)
    if m is None:
        return None
    byte = ord(m.group()) - 0xDC00
    return f"invalid UTF-8 (byte 0x{byte:02x} at character {m.start() + 1})"


def iter_lines(path: str | Path, on_bad_utf8: BadLineFn | None = None) -> Iterator[tuple[int, str]]:
    """Yield (1-based line number, line without the newline) for each non-blank line, streaming.

    A line that is not valid UTF-8 is never passed on with replacement characters: it is a UserError
    naming file:line, or, with `on_bad_utf8`, given to `on_bad_utf8(line number, reason)` and skipped.
    """
    with open(path, encoding="utf-8", errors="surrogateescape") as f:
        for lineno, line in enumerate(f, start=1):
            line = line.rstrip("\r\n")
            bad = invalid_utf8(line)
            if bad is not None:
                if on_bad_utf8 is None:
                    raise UserError(f"{path}:{lineno}: {bad}")
                on_bad_utf8(lineno, bad)
                continue
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
