"""The import hooks of workers/lean_imports.py, checked in fresh interpreters, each way: after `import workers`
(or `import rlhf`) transformers' generation utilities import no scikit-learn or SciPy, and megatron-core (on
CPU) imports neither Inductor nor wandb; without the hooks it does (the controls), so a hook that
no longer saves anything is noticed. One interpreter per way, shared by the tests that read it."""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

PROBE = """
import json, sys
{first}
from transformers import AutoConfig
config = AutoConfig.for_model("qwen2")
generation_loaded = "transformers.generation.utils" in sys.modules  # the config's docstring imported it
import transformers.generation.candidate_generator as cg
out = {{m: m in sys.modules for m in ("sklearn", "scipy")}}
out["generation_loaded"], out["config_doc"] = generation_loaded, bool(type(config).__doc__ and "Args" in type(config).__doc__)
out["config_ok"] = config.model_type == "qwen2" and config.vocab_size > 0
import importlib.metadata, transformers.utils.import_utils as iu
out["distributions_equal"] = iu.PACKAGE_DISTRIBUTION_MAPPING == importlib.metadata.packages_distributions()
out["distributions_patched"] = importlib.metadata.packages_distributions.__module__ != "importlib.metadata"
import megatron.core, megatron.core.models.gpt, megatron.core.optimizer  # what a Megatron worker imports
from megatron.core import jit
from megatron.core.fusions.fused_bias_swiglu import bias_swiglu
import torch
out.update({{m: m in sys.modules for m in ("torch._inductor.compile_fx", "wandb")}})  # (transformers imports Dynamo)
out["eager_fuser"] = jit.jit_fuser is jit.noop_decorator
if out["eager_fuser"]:  # compiled, this would need a C++ toolchain at first call; eager, it is the formula
    x, b = torch.randn(4, 8), torch.randn(8)
    y = x + b
    out["swiglu_equal"] = torch.equal(bias_swiglu(x, b), torch.nn.functional.silu(y[:, :4]) * y[:, 4:])
out["threshold_feature"] = cg.is_sklearn_available()
import sklearn.metrics  # still importable for whoever asks for it (lm-eval)
import wandb  # and wandb (trainer.logger=wandb)
out["sklearn_direct"], out["wandb_direct"] = hasattr(sklearn.metrics, "roc_curve"), hasattr(wandb, "init")
print(json.dumps(out))
"""


@functools.cache
def _probe(first: str) -> dict:
    out = subprocess.run([sys.executable, "-c", PROBE.format(first=first)], cwd=REPO, capture_output=True, text=True,
                         timeout=300, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


DIRECT = {"sklearn_direct": True, "wandb_direct": True}


def test_transformers_imports_no_sklearn_after_workers():
    got = _probe("import workers")
    assert {k: got[k] for k in ("sklearn", "scipy", "threshold_feature")} == dict.fromkeys(
        ("sklearn", "scipy", "threshold_feature"), False), got
    assert {k: got[k] for k in DIRECT} == DIRECT


def test_transformers_reads_the_kept_distributions_map_only_while_it_imports():
    """The map transformers keeps is the one importlib computes (the cache file answered it, or wrote it), and
    importlib's own function is back in place afterwards; the same without the hooks."""
    for first in ("import workers", "pass"):
        got = _probe(first)
        assert got["distributions_equal"] and not got["distributions_patched"], (first, got)


def test_reading_a_config_imports_no_model_code_for_its_docstring():
    """After the hooks a config class is defined without transformers writing its docstring (which imports
    the auto-model registry and generation utilities); without them it has the generated one."""
    got = _probe("import workers")
    assert got["config_ok"] and not got["generation_loaded"] and not got["config_doc"], got
    control = _probe("pass")
    assert control["config_ok"] and control["generation_loaded"] and control["config_doc"], control


def test_megatron_imports_neither_inductor_nor_wandb_after_workers_on_cpu():
    got = _probe("import workers")
    assert not got["torch._inductor.compile_fx"] and not got["wandb"], got
    assert got["eager_fuser"] and got["swiglu_equal"], got


def test_rlhf_installs_the_same_hooks():
    got = _probe("import rlhf")
    assert not got["sklearn"] and not got["torch._inductor.compile_fx"] and not got["wandb"] and got["eager_fuser"], got


def test_without_them_the_libraries_import_what_the_hooks_keep_out():
    """The controls: if transformers stops importing scikit-learn, or megatron-core stops compiling its fusions
    at import or importing wandb, this fails, and that hook can go."""
    got = _probe("pass")
    assert got["sklearn"] and got["scipy"] and got["threshold_feature"], got
    assert got["torch._inductor.compile_fx"] and got["wandb"] and not got["eager_fuser"], got
    assert {k: got[k] for k in DIRECT} == DIRECT


def test_a_hidden_module_reads_as_absent_only_while_its_user_imports(tmp_path, monkeypatch):
    """The mechanism behind the wandb and scipy.signal hooks, in this process: the hooked module sees
    ImportError, the hidden module is importable again right after."""
    from workers import lean_imports

    (tmp_path / "lean_probe_user.py").write_text(
        "try:\n    import lean_probe_hidden\nexcept ImportError:\n    lean_probe_hidden = None\n")
    (tmp_path / "lean_probe_hidden.py").write_text("VALUE = 7\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(lean_imports.HOOKS, "lean_probe_user", lean_imports._without("lean_probe_hidden"))
    try:
        import lean_probe_user

        assert lean_probe_user.lean_probe_hidden is None and "lean_probe_hidden" not in sys.modules
        import lean_probe_hidden

        assert lean_probe_hidden.VALUE == 7
    finally:
        for name in ("lean_probe_user", "lean_probe_hidden"):
            sys.modules.pop(name, None)
