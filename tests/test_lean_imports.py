"""transformers' generation utilities import scikit-learn (and SciPy) in every process unless `workers` was
imported first (workers/lean_imports.py): checked in fresh interpreters, each way."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

PROBE = """
import json, sys
{first}
from transformers import AutoConfig
AutoConfig.for_model("qwen2")
import transformers.generation.candidate_generator as cg
loaded = {{m: m in sys.modules for m in ("sklearn", "scipy")}}
import sklearn.metrics  # still importable for whoever asks for it (lm-eval)
print(json.dumps({{**loaded, "threshold_feature": cg.is_sklearn_available(), "direct": hasattr(sklearn.metrics, "roc_curve")}}))
"""


def _probe(first: str) -> dict:
    out = subprocess.run([sys.executable, "-c", PROBE.format(first=first)], cwd=REPO, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_transformers_imports_no_sklearn_after_workers():
    assert _probe("import workers") == {"sklearn": False, "scipy": False, "threshold_feature": False, "direct": True}


def test_rlhf_installs_the_same_finder():
    assert _probe("import rlhf")["sklearn"] is False


def test_without_it_transformers_imports_sklearn():
    """The control: if transformers stops importing scikit-learn, this fails, and the finder can go."""
    assert _probe("pass") == {"sklearn": True, "scipy": True, "threshold_feature": True, "direct": True}
