"""Small data files for the tests."""

from __future__ import annotations

import json
from pathlib import Path


def write_lines(path: Path, lines: list) -> Path:
    """Write dicts as JSON lines and strings verbatim."""
    with open(path, "w") as f:
        for line in lines:
            f.write((line if isinstance(line, str) else json.dumps(line)) + "\n")
    return path
