"""Every config field is read by some code: a knob that nothing reads silently does nothing."""

from __future__ import annotations

import re
from dataclasses import fields, is_dataclass
from pathlib import Path
from typing import Any

from rlhf.config.schema import RunConfig

ROOT = Path(__file__).resolve().parents[1]
CODE_DIRS = ("rlhf", "workers", "algorithms")
CONFIG_DIR = ROOT / "rlhf" / "config"  # declaring or validating a field is not reading it


def _code() -> str:
    parts = []
    for d in CODE_DIRS:
        for path in sorted((ROOT / d).rglob("*.py")):
            if CONFIG_DIR not in path.parents:
                parts.append(path.read_text())
    return "\n".join(parts)


def _leaves(node: Any, prefix: str = "") -> list[tuple[str, str]]:
    """(dotted key, attribute name) of every non-section field."""
    out = []
    for f in fields(node):
        value = getattr(node, f.name)
        if is_dataclass(value):
            out += _leaves(value, f"{prefix}{f.name}.")
        else:
            out.append((f"{prefix}{f.name}", f.name))
    return out


def _is_read(name: str, code: str) -> bool:
    """``.name`` (attribute access) or ``"name"`` / ``'name'`` (getattr, dict keys) somewhere."""
    return re.search(rf"\.{name}\b|[\"']{name}[\"']", code) is not None


def test_every_config_field_is_read_outside_the_config_package():
    code = _code()
    unread = sorted({key for key, name in _leaves(RunConfig()) if not _is_read(name, code)})
    assert not unread, f"config fields that no code in {', '.join(CODE_DIRS)} reads: {unread}"


def test_the_check_finds_an_unread_field():
    assert _is_read("total_steps", "cfg.trainer.total_steps > 0")
    assert _is_read("tp", 'getattr(par, "tp")')
    assert not _is_read("log_every", "self.log_every_n = 1  # log_every")
