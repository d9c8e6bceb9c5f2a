"""`rlhf plan` end to end: the table, the overlay `rlhf train` loads, and one-line errors."""

from __future__ import annotations

from pathlib import Path

import yaml

from rlhf.cli import main
from rlhf.config import load_config


def test_plan_writes_an_overlay_train_loads(tmp_path, capsys):
    out = tmp_path / "overlay.yaml"
    rc = main(["plan", "--model", "small-qwen2", "--nodes", "1", "--gpus-per-node", "4", "--gpu-mem", "24GiB",
               "--seq-len", "1024", "--global-batch", "32", "--roles", "policy,reference,rollout", "--colocate",
               "--out", str(out)])
    assert rc == 0
    text = capsys.readouterr().out
    assert "params" in text and "optim" in text and "acts" in text and "kv" in text and "step s" in text
    assert "use: rlhf train CONFIG" in text
    overlay = yaml.safe_load(out.read_text())
    assert set(overlay) == {"policy", "reference", "rollout"}
    par = overlay["policy"]["parallel"]
    assert par["tp"] * par["pp"] * par["dp"] == 4
    # usable as `rlhf train CONFIG OVERLAY`: the schema accepts every key, and the values arrive
    cfg = load_config("configs/grpo_tiny.yaml", ["trainer.total_steps=1"], validate=False, overlays=[out])
    assert cfg.policy.parallel.tp == par["tp"] and cfg.reference.parallel.pp == par["pp"]
    assert cfg.rollout.tp == overlay["rollout"]["tp"] and cfg.policy.dtype == "bfloat16"
    assert cfg.trainer.total_steps == 1  # KEY=VALUE overrides still apply after the overlay


def test_model_that_fits_nowhere_says_by_how_much(capsys):
    # Qwen2.5-32B on one 80 GiB GPU: 65 GB of bf16 weights and 131 GB of fp32 gradients fit on no layout
    rc = main(["plan", "--model", "Qwen2.5-32B", "--nodes", "1", "--gpus-per-node", "1", "--seq-len", "4096",
               "--global-batch", "8"])
    assert rc == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert "does not fit on 1 x 80 GiB" in err and "GiB over the usable 76.0 GiB" in err
    assert "largest share is gradients" in err and "the lever that helps most: twice the GPUs (2 nodes)" in err


def test_bad_input_is_one_line(tmp_path, capsys):
    assert main(["plan", "--model", str(tmp_path / "nope")]) == 2
    assert "is not a folder, a preset" in capsys.readouterr().err
    assert main(["plan", "--model", "tiny-qwen2", "--roles", "policy,judge"]) == 2
    assert "--roles" in capsys.readouterr().err
    bad = tmp_path / "m"
    bad.mkdir()
    (bad / "config.json").write_text("{ not json")
    assert main(["plan", "--model", str(bad)]) == 2
    assert "config.json line 1 is not valid JSON" in capsys.readouterr().err
    assert main(["plan", "--model", "tiny-qwen2", "--gpu-mem", "lots"]) == 2
    assert "--gpu-mem" in capsys.readouterr().err


def test_train_names_a_missing_overlay(tmp_path, capsys):
    missing = Path(tmp_path) / "overlay.yaml"
    assert main(["train", "configs/grpo_tiny.yaml", str(missing)]) == 2
    assert f"config file {missing} does not exist" in capsys.readouterr().err



def test_expert_parallel_layouts_are_expressible_and_reach_the_overlay(tmp_path):
    """An EP layout (experts keeping the dense TP) needs no missing lever, and its overlay carries
    `parallel.ep`, which the schema reads."""
    from rlhf.plan.hardware import GIB, get_gpu
    from rlhf.plan.model import load_model
    from rlhf.plan.overlay import write_overlay
    from rlhf.plan.search import Planner, Request

    req = Request(load_model("Qwen3-30B-A3B"), get_gpu("H100"), 4, 8, 80 * GIB, 4096, 256)
    plans = Planner(req).plan()
    ep_plan = next(p for p in plans if p.layout.ep > 1 and p.layout.etp == p.layout.tp and p.runnable_today)
    out = write_overlay(tmp_path / "moe.yaml", ep_plan, req)
    par = yaml.safe_load(out.read_text())["policy"]["parallel"]
    assert par["ep"] == ep_plan.layout.ep and par["dp"] % par["ep"] == 0, par
    cfg = load_config("configs/grpo_tiny.yaml", [], validate=False, overlays=[out])
    assert cfg.policy.parallel.ep == par["ep"]


def test_recompute_and_sequence_parallel_reach_the_overlay(tmp_path):
    """A layout with sequence parallelism and activation recompute needs no missing lever; its overlay sets
    the trained role's `recompute` and every Megatron role's `sequence_parallel`, which the schema reads."""
    from rlhf.plan.hardware import GIB, get_gpu
    from rlhf.plan.model import load_model
    from rlhf.plan.overlay import write_overlay
    from rlhf.plan.search import Planner, Request

    req = Request(load_model("Llama-3-8B"), get_gpu("H100"), 1, 8, 80 * GIB, 4096, 64,
                  roles=("policy", "reference"))
    plans = Planner(req).plan()
    plan = next(p for p in plans if p.layout.sp and p.layout.recompute != "none" and p.runnable_today)
    out = write_overlay(tmp_path / "levers.yaml", plan, req)
    overlay = yaml.safe_load(out.read_text())
    assert overlay["policy"]["recompute"] == plan.layout.recompute and "recompute" not in overlay["reference"]
    cfg = load_config("configs/grpo_tiny.yaml", [], validate=False, overlays=[out])
    assert cfg.policy.sequence_parallel and cfg.reference.sequence_parallel
    assert cfg.policy.recompute == plan.layout.recompute


def test_optimizer_offload_reaches_the_overlay(tmp_path):
    """A plan that offloads the optimizer is runnable as configured: its overlay turns on the trained roles'
    `optim.cpu_offload` with the distributed optimizer it needs (the schema reads both; CUDA is checked at
    validation, so this loads without it)."""
    from rlhf.plan.hardware import GIB, get_gpu
    from rlhf.plan.model import load_model
    from rlhf.plan.overlay import write_overlay
    from rlhf.plan.search import Planner, Request

    req = Request(load_model("Llama-3-8B"), get_gpu("H100"), 1, 8, 80 * GIB, 4096, 64, roles=("policy",))
    planner = Planner(req)
    lay = next(p.layout for p in planner.plan() if p.runnable_today and p.layout.dp == 1).with_(offload=True)
    plan = planner.evaluate(lay)
    assert plan.missing == []
    out = write_overlay(tmp_path / "offload.yaml", plan, req)
    cfg = load_config("configs/grpo_tiny.yaml", [], validate=False, overlays=[out])
    assert cfg.policy.optim.cpu_offload and cfg.policy.optim.use_distributed_optimizer


def test_context_parallel_reaches_the_overlay(tmp_path):
    """A dense plan with context parallelism is runnable as configured: its overlay sets policy.parallel.cp
    (runs: tests/workers/test_context_parallel.py) and says what the engine's all-gather attention keeps beyond
    the ring attention estimated. Where that extra does not fit, ring attention is a missing lever; with an MoE
    model cp itself is."""
    from rlhf.plan.hardware import GIB, get_gpu
    from rlhf.plan.model import load_model
    from rlhf.plan.overlay import write_overlay
    from rlhf.plan.search import Planner, Request, cp_gathered_extra, missing_levers

    req = Request(load_model("Llama-3-8B"), get_gpu("H100"), 1, 8, 80 * GIB, 2048, 64, roles=("policy",))
    planner = Planner(req)
    plan = planner.evaluate(next(p.layout for p in planner.plan() if p.layout.pp == 1).with_(cp=2))
    assert plan.missing == []
    out = write_overlay(tmp_path / "cp.yaml", plan, req)
    cfg = load_config("configs/grpo_tiny.yaml", [], validate=False, overlays=[out])
    assert cfg.policy.parallel.cp == 2
    extra = next(line for line in out.read_text().splitlines() if line.startswith("# cp=2:"))
    assert f"~{cp_gathered_extra(req, plan.layout) / GIB:.1f} GiB more per GPU" in extra
    # at 8192 tokens the gathered K / V and the scores over all keys (s^2 / cp per head) no longer fit
    long = Request(**{**req.__dict__, "seq": 8192})
    lay = plan.layout.with_(recompute="none", mbs=1)
    long_plan = Planner(long).evaluate(lay)
    assert cp_gathered_extra(long, lay) > 16 * cp_gathered_extra(req, lay) * 0.9
    assert long_plan.missing and long_plan.missing[0].startswith("ring attention for cp=2")
    moe = load_model("Qwen3-30B-A3B")
    assert missing_levers(moe, plan.layout) == ["context parallel cp=2 with an MoE model"]
