"""Reading a config is light: the schema (built on worker-side config classes) imports neither Ray, torch
nor vLLM, and validating it (which needs the pure-torch algorithm registries) no Ray, vLLM, megatron or
transformers, so config errors come back fast and tools can load configs without the training stack."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


HEAVY = ("ray", "torch", "vllm", "megatron", "transformers")


def _imported_after(module: str) -> list[str]:
    code = (f"import json, sys; import {module}; "
            f"print(json.dumps(sorted(m for m in {HEAVY!r} if m in sys.modules)))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_schema_and_validation_import_no_heavy_package():
    assert _imported_after("rlhf.config.schema") == []
    assert _imported_after("rlhf.config.validate") == ["torch"]
