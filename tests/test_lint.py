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


def test_gpu_check_script_parses_and_keeps_its_python_in_a_module():
    """bench/gpu_check.sh cannot run here (no GPU): it must parse, and hold no Python heredoc (its Python is
    in bench/_gpu_sections.py, which ruff checks); the standard-library steps run with any Python."""
    script = REPO / "bench" / "gpu_check.sh"
    r = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    assert "<<" not in script.read_text()
    r = subprocess.run([sys.executable, str(REPO / "bench" / "_gpu_sections.py"), "missing"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "'megatron-core" not in r.stdout, r.stderr  # installed here: not missing
