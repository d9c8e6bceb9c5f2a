"""The tests share helpers through tests/helpers, never through each other: no file under tests/ (other than
tests/helpers itself) imports a test module (`test_*.py` or `conftest.py`), at the top or inside a function,
as a bare `from test_x import` (its folder on sys.path) or as `tests.a.test_x` / `tests.a.conftest`."""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent
HELPERS = TESTS / "helpers"


def _is_test_module(name: str) -> bool:
    last = name.split(".")[-1]
    return last.startswith("test_") or last == "conftest"


def _imported_modules(node: ast.AST) -> list[str]:
    """The modules an import statement loads: `import a.b` -> a.b; `from a.b import c` -> a.b, and a.b.c where c
    may be a module of the tests (`from tests.a import test_x`, `from . import conftest`)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if isinstance(node, ast.ImportFrom):
        base = node.module or ""
        out = [base] if base else []
        if not base or base == "tests" or base.startswith("tests."):
            out += [f"{base}.{a.name}" if base else a.name for a in node.names]
        return out
    return []


def test_imports_across_test_modules():
    bad = []
    for path in sorted(TESTS.rglob("*.py")):
        if HELPERS in path.parents:
            continue
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):  # top-level and function-level imports alike
            for name in _imported_modules(node):
                if _is_test_module(name):
                    bad.append(f"{path.relative_to(TESTS.parent)}:{node.lineno} imports {name}")
    assert not bad, "import shared helpers from tests/helpers, not from another test module:\n" + "\n".join(bad)


def test_the_check_sees_each_form():
    forms = ["from test_rl_e2e import FAST", "import test_failures", "from tests.stages.conftest import x",
             "from tests.workers.test_prefix_sharing import grouped_batch", "import tests.data.conftest",
             "from . import conftest", "from tests.a import test_x", "def f():\n    from test_ray_private import exposed"]
    for src in forms:
        names = [n for node in ast.walk(ast.parse(src)) for n in _imported_modules(node)]
        assert any(_is_test_module(n) for n in names), src
    for src in ["from tests.helpers.cli import rlhf", "from tests.workers.metrics_fns import f", "import torch",
                "from mcore_convert_fns import parity_and_reshard", "from hypothesis import strategies",
                "from somelib import test_utils"]:
        names = [n for node in ast.walk(ast.parse(src)) for n in _imported_modules(node)]
        assert not any(_is_test_module(n) for n in names), src
