"""`rlhf clean`: a simple streaming cleaning pass before `rlhf preprocess`.

Per document: newlines unified, runs of spaces/tabs collapsed to one space, each line stripped, runs of
blank lines collapsed to one, the whole stripped. Then documents that are empty, shorter than
`min_length` characters, or (with dedup) exact duplicates of an earlier kept document are dropped.
`.txt` input: one document per line (so dedup removes duplicate lines). jsonl: the text under `json_key`;
other fields are kept. The output has the input's format. A line that is not valid UTF-8 is dropped and
reported on stderr by file:line (never passed on with replacement characters). The output is written under
a temporary name and renamed when complete.
"""

from __future__ import annotations

import hashlib
import json
import re
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from rlhf.data.jsonl import check_input_file, get_text, iter_lines, parse_line
from rlhf.errors import UserError
from rlhf.paths import staged_output_file

_SPACES = re.compile(r"[ \t\f\v\u00a0]+")
_BLANK_RUNS = re.compile(r"\n{3,}")
MAX_REPORTED = 20  # invalid lines printed one by one; the rest only counted


def normalize_text(text: str) -> str:
    """Unify newlines, collapse horizontal whitespace, strip lines, collapse blank-line runs, strip."""
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    lines = [_SPACES.sub(" ", line).strip() for line in text.split("\n")]
    return _BLANK_RUNS.sub("\n\n", "\n".join(lines)).strip()


@dataclass
class CleanStats:
    """What was read, kept and dropped (by reason)."""

    read: int = 0
    kept: int = 0
    dropped: Counter = field(default_factory=Counter)
    first_malformed: str | None = None

    def summary(self) -> str:
        reasons = ", ".join(f"{n} {why}" for why, n in sorted(self.dropped.items())) or "none"
        return f"read {self.read}, kept {self.kept}, dropped {sum(self.dropped.values())} ({reasons})"


def clean_file(
    input_path: str | Path,
    output_path: str | Path,
    min_length: int = 0,
    dedup: bool = False,
    json_key: str = "text",
) -> CleanStats:
    """Clean `input_path` into `output_path` (same format); return the counts."""
    src = check_input_file(input_path)
    dst = Path(output_path)
    if dst.resolve() == src.resolve():
        raise UserError(f"--output {dst} is the input file; write to another path")
    if not dst.parent.is_dir():
        raise UserError(f"output folder {dst.parent} does not exist")
    if min_length < 0:
        raise UserError(f"--min-length must be >= 0, got {min_length}")
    is_jsonl = src.suffix.lower() != ".txt"
    seen: set[bytes] = set()
    stats = CleanStats()

    def bad_utf8(lineno: int, reason: str) -> None:
        stats.read += 1
        stats.dropped["invalid_utf8"] += 1
        if stats.dropped["invalid_utf8"] <= MAX_REPORTED:
            print(f"{src}:{lineno}: {reason} (dropped)", file=sys.stderr)

    with staged_output_file(dst) as tmp, open(tmp, "w", encoding="utf-8") as out:
        for lineno, line in iter_lines(src, on_bad_utf8=bad_utf8):
            stats.read += 1
            obj = None
            text: str | None = line
            if is_jsonl:
                obj, err = parse_line(line)
                if err is None:
                    text, err = get_text(obj, json_key)
                if err is not None:
                    stats.dropped["malformed"] += 1
                    stats.first_malformed = stats.first_malformed or f"{src}:{lineno}: {err}"
                    continue
            text = normalize_text(text)
            if not text:
                stats.dropped["empty"] += 1
                continue
            if len(text) < min_length:
                stats.dropped["too_short"] += 1
                continue
            if dedup:
                digest = hashlib.blake2b(text.encode("utf-8"), digest_size=16).digest()
                if digest in seen:
                    stats.dropped["duplicate"] += 1
                    continue
                seen.add(digest)
            if is_jsonl:
                obj[json_key] = text
                out.write(json.dumps(obj, ensure_ascii=False) + "\n")
            else:
                out.write(text.replace("\n", " ") + "\n")
            stats.kept += 1
    return stats
