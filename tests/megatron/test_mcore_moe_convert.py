"""Issue 16: HF <-> megatron-core conversion for Qwen3 (dense), Qwen2-MoE and Qwen3-MoE, with expert
parallelism (real transformers vs megatron-core on gloo, allgather token dispatcher, sequential experts).

Spawned worlds: TP1 (also saves TP1 dist checkpoints of the MoE models), EP2 and PP2 (also load them), and
the conversions the CLI runs (hf-to-mcore at EP2 / TP2, mcore-to-hf at EP1 / EP2).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from mcore_convert_fns import _batch, parity_and_reshard
from mcore_moe_fns import routing_agreement
from safetensors.torch import load_file, save_file
from test_mcore_convert import _assert_same_hf

from rlhf.cli import main as cli
from rlhf.tiny_models import create_tiny_model
from workers.megatron.hf_map import expected_hf_shapes
from workers.megatron.launch import run_distributed

FAMILIES = ("tiny-qwen3", "tiny-qwen2-moe", "tiny-qwen3-moe")
MOE = ("tiny-qwen2-moe", "tiny-qwen3-moe")


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("moe_convert")
    out = {p: create_tiny_model(p, root / p) for p in FAMILIES}
    out["root"] = root
    return out


@pytest.fixture(scope="module")
def tp1_world(models) -> tuple[list[dict], dict[str, str]]:
    """The TP1 parity world; it also saves TP1 dist checkpoints of the MoE models for the EP2 / PP2 worlds."""
    from transformers import AutoConfig

    from rlhf.checkpoint.convert import finish_mcore_checkpoint

    dirs = [str(models[p]) for p in FAMILIES]
    ckpts = {str(models[p]): str(models["root"] / f"{p}_tp1") for p in MOE}
    ranks = run_distributed(parity_and_reshard, 1, args=(dirs, {}, ckpts))
    for hf_dir, ckpt in ckpts.items():
        finish_mcore_checkpoint(Path(ckpt), hf_dir, AutoConfig.from_pretrained(hf_dir), 1, 1, "float32", 512)
    return ranks, ckpts


LAYOUTS = [
    pytest.param(1, 1, 1, FAMILIES, id="tp1"),
    pytest.param(1, 1, 2, MOE, id="ep2"),
    pytest.param(1, 2, 1, FAMILIES, id="pp2"),
    pytest.param(2, 1, 2, MOE, id="tp2xep2", marks=pytest.mark.slow),
]


@pytest.mark.parametrize("tp,pp,ep,presets", LAYOUTS)
def test_logits_match_hf_and_weights_round_trip(models, tp1_world, tp, pp, ep, presets):
    tp1_ranks, tp1_ckpts = tp1_world
    dirs = [str(models[p]) for p in presets]
    world = tp * pp * ep
    if world == 1:
        ranks = tp1_ranks
    else:
        ranks = run_distributed(parity_and_reshard, world, args=(dirs, tp1_ckpts, {}), tp=tp, pp=pp, ep=ep,
                                timeout_s=600)
    for hf_dir in dirs:
        per_rank = [r["models"][hf_dir] for r in ranks]
        cfg = json.loads((Path(hf_dir) / "config.json").read_text())
        for r in per_rank:
            assert r["filled"] == r["n_params"]
            assert r["mismatched"] == [], f"iter_hf_weights differs from the source for {r['mismatched']}"
        last = [r for r in per_rank if "max_abs_diff" in r]
        assert len(last) == tp * ep  # the last stage's TP x DP ranks (EP splits DP)
        for r in last:
            assert r["max_abs_diff"] <= 1e-4, (hf_dir, tp, pp, ep, r["max_abs_diff"])
            if world > 1 and hf_dir in tp1_ckpts:  # the TP1 checkpoint resharded to this layout
                assert abs(r["ckpt_loss"] - r["hf_loss"]) < 1e-5, (r["ckpt_loss"], r["hf_loss"])
        yielded = [n for r in per_rank for n in r["yielded"]]
        assert sorted(yielded) == sorted(expected_hf_shapes(cfg)), "source ranks must cover every tensor once"
    values = [r["value"] for r in ranks if "shape" in r["value"]]
    assert len(values) == tp * ep and all(v["max_abs_diff"] <= 1e-4 for v in values)


@pytest.mark.parametrize("preset", MOE)
def test_routing_is_unambiguous_and_equal(models, preset):
    """fp32, a batch whose top-k choices are far from ties: megatron routes every token like transformers."""
    (res,) = run_distributed(routing_agreement, 1, args=(str(models[preset]), _batch(512)))
    assert res["layers"] >= 1 and res["decisions"] == res["layers"] * 48
    assert res["min_gap"] > 1e-5, f"a routing near-tie (gap {res['min_gap']}): pick another batch"
    assert res["differ"] == 0, f"{res['differ']} of {res['decisions']} routing decisions differ"


@pytest.mark.parametrize(
    "preset,conv,export",
    [
        pytest.param("tiny-qwen2-moe", ["--ep", "2"], [], id="qwen2_moe-ep2-to-ep1"),
        pytest.param("tiny-qwen3-moe", [], ["--ep", "2"], id="qwen3_moe-ep1-to-ep2", marks=pytest.mark.slow),
        pytest.param("tiny-qwen3", ["--tp", "2"], [], id="qwen3-tp2-to-tp1", marks=pytest.mark.slow),
    ],
)
def test_round_trip_bit_exact(models, tmp_path, preset, conv, export):
    """HF -> mcore (`rlhf convert hf-to-mcore`) at one layout -> HF exported at another: bit-exact."""
    m = tmp_path / "mcore"
    assert cli(["convert", "hf-to-mcore", "--hf", str(models[preset]), "--out", str(m), *conv]) == 0
    meta = json.loads((m / "rlhf_mcore.json").read_text())
    assert meta["ep"] == (2 if "--ep" in conv else 1)
    back = tmp_path / "back"
    assert cli(["convert", "mcore-to-hf", "--mcore", str(m), "--out", str(back), *export]) == 0
    _assert_same_hf(models[preset], back)


def _variant(src: Path, dst: Path, config: dict | None = None, drop: str | None = None) -> Path:
    shutil.copytree(src, dst)
    if config:
        cfg = json.loads((dst / "config.json").read_text())
        cfg.update(config)
        (dst / "config.json").write_text(json.dumps(cfg))
    if drop:
        sd = load_file(dst / "model.safetensors")
        del sd[drop]
        save_file(sd, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


@pytest.mark.parametrize(
    "case,preset,config,drop,args,message",
    [
        ("ep3", "tiny-qwen2-moe", None, None, ["--ep", "3"], "num_experts=4 is not divisible by expert parallel size 3"),
        ("ep_dense", "tiny-qwen3", None, None, ["--ep", "2"], "expert parallel size 2 needs an MoE model"),
        ("window", "tiny-qwen2-moe", {"use_sliding_window": True}, None, [], "use_sliding_window"),
        ("router", "tiny-qwen3-moe", {"scoring_func": "sigmoid"}, None, [], "scoring_func='sigmoid' is not supported"),
        ("expert", "tiny-qwen2-moe", None, "model.layers.1.mlp.experts.3.down_proj.weight", [],
         "missing tensor model.layers.1.mlp.experts.3.down_proj.weight"),
        ("shared", "tiny-qwen2-moe", {"shared_expert_intermediate_size": 0}, None, [],
         "shared_expert_intermediate_size must be a positive integer"),
    ],
)
def test_bad_moe_input_rejected_cleanly(models, tmp_path, capsys, case, preset, config, drop, args, message):
    src = _variant(models[preset], tmp_path / case, config, drop) if (config or drop) else models[preset]
    out = tmp_path / f"{case}_out"
    assert cli(["convert", "hf-to-mcore", "--hf", str(src), "--out", str(out), *args]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert not out.exists(), "nothing may be written for bad input"

