"""Issues 16 and 17: HF <-> megatron-core conversion for Qwen3 (dense), Qwen2-MoE, Qwen3-MoE, DeepSeek-V3 and
DeepSeek-V2 (MLA; V3 with plain rope and with YaRN), with expert parallelism (real transformers vs megatron-core
on gloo, allgather token dispatcher, sequential experts, megatron's non-TE MLA).

Spawned worlds: TP1 (also saves TP1 dist checkpoints of the MoE models), EP2, PP2 and TP2 (DeepSeek; also load
them), and the conversions the CLI runs (hf-to-mcore at EP2 / TP2, mcore-to-hf at EP1 / EP2).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from mcore_convert_fns import _batch, parity_and_reshard
from mcore_moe_fns import explicit_positions_parity, routing_agreement
from safetensors.torch import load_file, save_file

from rlhf.cli import main as cli
from rlhf.tiny_models import create_tiny_model
from tests.helpers.hf import assert_same_hf, source_ranks
from workers.megatron.hf_map import expected_hf_shapes
from workers.megatron.launch import run_distributed

FAMILIES = ("tiny-qwen3", "tiny-qwen2-moe", "tiny-qwen3-moe", "tiny-deepseek-v3", "tiny-deepseek-v2")
# tiny-deepseek-v3's weights with YaRN as in DeepSeek-V3's config (factor, mscale = mscale_all_dim), the original
# context (16) shorter than the test batch's 24 tokens
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16,
        "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}
DEEPSEEK = ("tiny-deepseek-v3", "tiny-deepseek-v2")
MOE = ("tiny-qwen2-moe", "tiny-qwen3-moe", *DEEPSEEK)  # TP1 checkpoints saved for the EP2 / PP2 worlds
EP = ("tiny-qwen2-moe", "tiny-qwen3-moe", "tiny-deepseek-v3")  # V2's experts are laid out like V3's
ALL = (*FAMILIES, "deepseek-v3-yarn")  # YaRN at TP1 only: the rope does not depend on the layout


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("moe_convert")
    out = {p: create_tiny_model(p, root / p) for p in FAMILIES}
    out["deepseek-v3-yarn"] = _variant(out["tiny-deepseek-v3"], root / "deepseek-v3-yarn", {"rope_parameters": YARN})
    out["root"] = root
    return out


@pytest.fixture(scope="module")
def tp1_world(models) -> tuple[list[dict], dict[str, str]]:
    """The TP1 parity world; it also saves TP1 dist checkpoints of the MoE models for the EP2 / PP2 worlds."""
    from transformers import AutoConfig

    from rlhf.conversion.convert import finish_mcore_checkpoint, sign_converted

    dirs = [str(models[p]) for p in ALL]
    ckpts = {str(models[p]): str(models["root"] / f"{p}_tp1") for p in MOE}
    ranks = run_distributed(parity_and_reshard, 1, args=(dirs, {}, ckpts))
    for hf_dir, ckpt in ckpts.items():
        finish_mcore_checkpoint(Path(ckpt), hf_dir, AutoConfig.from_pretrained(hf_dir), 1, 1, "float32", 512)
        sign_converted(Path(ckpt))  # as `rlhf convert hf-to-mcore` does
    return ranks, ckpts


LAYOUTS = [
    pytest.param(1, 1, 1, ALL, id="tp1"),
    pytest.param(1, 1, 2, EP, id="ep2"),
    pytest.param(1, 2, 1, FAMILIES, id="pp2"),
    pytest.param(2, 1, 1, DEEPSEEK, id="tp2"),  # MLA's column-parallel down projections and heads
    pytest.param(2, 1, 2, EP, id="tp2xep2"),
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
        per_rank = source_ranks(ranks, hf_dir)  # every parameter filled, yielded back unchanged, each tensor once
        last = [r for r in per_rank if "max_abs_diff" in r]
        assert len(last) == tp * ep  # the last stage's TP x DP ranks (EP splits DP)
        for r in last:
            assert r["max_abs_diff"] <= 1e-4, (hf_dir, tp, pp, ep, r["max_abs_diff"])
            if world > 1 and hf_dir in tp1_ckpts:  # the TP1 checkpoint resharded to this layout
                assert abs(r["ckpt_loss"] - r["hf_loss"]) < 1e-5, (r["ckpt_loss"], r["hf_loss"])
    values = [r["value"] for r in ranks if "shape" in r["value"]]
    assert len(values) == tp * ep and all(v["max_abs_diff"] <= 1e-4 for v in values)


def test_mla_rope_at_explicit_positions(models):
    """Prefix sharing needs RoPE at explicit position ids: MLA's per-layer rope (plain and YaRN) takes them."""
    dirs = [str(models[p]) for p in ("tiny-deepseek-v3", "deepseek-v3-yarn")]
    (res,) = run_distributed(explicit_positions_parity, 1, args=(dirs,))
    for d in dirs:
        assert res[d]["moved"] > 1e-3 and res[d]["diff"] <= 1e-4, (d, res[d]["moved"], res[d]["diff"])
    yarn_effect = (res[dirs[0]]["logits"] - res[dirs[1]]["logits"]).abs().max().item()
    assert yarn_effect > 1e-3, yarn_effect  # so the YaRN parity above checks the YaRN mapping, not plain rope


@pytest.mark.parametrize("preset", ("tiny-qwen2-moe", "tiny-qwen3-moe"))
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
        pytest.param("tiny-deepseek-v3", ["--ep", "2"], [], id="deepseek_v3-ep2-to-ep1"),
        pytest.param("tiny-qwen3-moe", [], ["--ep", "2"], id="qwen3_moe-ep1-to-ep2"),
        pytest.param("tiny-qwen3", ["--tp", "2"], [], id="qwen3-tp2-to-tp1"),
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
    assert_same_hf(models[preset], back)
    if "deepseek" in preset:  # the router bias is real data here (the preset draws it), and stays fp32
        bias = load_file(back / "model.safetensors")["model.layers.1.mlp.gate.e_score_correction_bias"]
        assert bias.dtype == torch.float32 and bias.abs().min() > 0


def test_mtp_layers_skipped_with_a_note(models, tmp_path, capsys):
    """A DeepSeek checkpoint with a multi-token-prediction layer (model.layers.{N}.*) validates; the layer is
    named in a note and not part of the tensors the conversion reads."""
    from rlhf.conversion.convert import validate_hf

    src = _variant(models["tiny-deepseek-v3"], tmp_path / "mtp", {"num_nextn_predict_layers": 1})
    sd = load_file(src / "model.safetensors")
    sd.update({k.replace("model.layers.1.", "model.layers.2."): v.clone() for k, v in sd.items()
               if k.startswith("model.layers.1.")})
    sd["model.layers.2.eh_proj.weight"] = torch.zeros(128, 256)
    save_file(sd, src / "model.safetensors", metadata={"format": "pt"})
    cfg, dtype = validate_hf(src, 1, 1)
    assert dtype == "float32"
    err = capsys.readouterr().err
    assert "model.layers.2" in err and "multi-token-prediction" in err, err
    assert not any(n.startswith("model.layers.2.") for n in expected_hf_shapes(cfg))


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
        ("mla_rope_odd", "tiny-deepseek-v3", {"qk_rope_head_dim": 63}, None, [], "qk_rope_head_dim=63 must be even"),
        ("mla_dims", "tiny-deepseek-v3", {"qk_nope_head_dim": 48}, None, [],
         "qk_head_dim=96 must equal qk_nope_head_dim + qk_rope_head_dim = 48 + 64 = 112"),
        ("mla_shapes", "tiny-deepseek-v3", {"qk_nope_head_dim": 48, "qk_head_dim": 112}, None, [],
         "tensor model.layers.0.self_attn.q_b_proj.weight has shape [384, 64] but the config"),
        ("mla_kv_lora", "tiny-deepseek-v3", {"kv_lora_rank": 0}, None, [], "kv_lora_rank must be a positive integer"),
        ("rope_type", "tiny-deepseek-v3", {"rope_parameters": {"rope_type": "dynamic", "factor": 2.0,
                                                                "rope_theta": 10000.0}}, None, [],
         "config field rope_parameters.rope_type='dynamic' is not supported"),
        ("topk_group", "tiny-deepseek-v3", {"topk_group": 3}, None, [], "topk_group=3 is larger than n_group=2"),
        ("noaux_tc", "tiny-deepseek-v3", {"topk_method": "greedy"}, None, [], "topk_method='greedy' is not supported"),
        ("group_score", "tiny-deepseek-v3", {"num_experts_per_tok": 1}, None, [],
         "num_experts_per_tok // topk_group = 1 experts, transformers by its top 2"),
        ("v2_norm", "tiny-deepseek-v2", {"norm_topk_prob": True}, None, [], "norm_topk_prob=true is not supported"),
        ("interleave", "tiny-deepseek-v3", {"rope_interleave": False}, None, [], "rope_interleave=false"),
        ("mla_tp", "tiny-deepseek-v3", {"q_lora_rank": 63}, None, ["--tp", "2"],
         "q_lora_rank=63 is not divisible by tensor parallel size 2"),
    ],
)
def test_bad_moe_input_rejected_cleanly(models, tmp_path, capsys, case, preset, config, drop, args, message):
    src = _variant(models[preset], tmp_path / case, config, drop) if (config or drop) else models[preset]
    out = tmp_path / f"{case}_out"
    assert cli(["convert", "hf-to-mcore", "--hf", str(src), "--out", str(out), *args]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert not out.exists(), "nothing may be written for bad input"

