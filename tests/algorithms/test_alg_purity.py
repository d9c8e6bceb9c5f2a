"""`algorithms` is pure torch: it imports only torch and the standard library."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import algorithms

PKG = Path(algorithms.__file__).parent
FORBIDDEN = ("ray", "megatron", "vllm", "rlhf", "workers", "transformers")  # numpy: torch imports it itself


def test_only_torch_and_stdlib_imports():
    allowed = set(sys.stdlib_module_names) | {"torch", "__future__"}
    for path in sorted(PKG.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                roots = [a.name.split(".")[0] for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                roots = [(node.module or "").split(".")[0]]
            else:
                continue
            bad = [r for r in roots if r not in allowed]
            assert not bad, f"{path.name}:{node.lineno} imports {bad}"


def test_import_pulls_in_no_framework():
    code = (
        f"import sys, algorithms\nbad = [m for m in {FORBIDDEN!r} if m in sys.modules]\nassert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=PKG.parent, timeout=120)
