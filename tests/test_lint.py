"""`make lint` inside the suite, so CI enforces it: ruff on the whole tree, mypy on the typed packages."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


@pytest.mark.parametrize("cmd", [["ruff", "check", "."], ["mypy"]], ids=["ruff", "mypy"])
def test_lint_clean(cmd):
    r = subprocess.run([str(BIN / cmd[0]), *cmd[1:]], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-5000:] + r.stderr[-2000:]
