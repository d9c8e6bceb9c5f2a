"""HF <-> megatron-core conversion for dense Llama, Mistral and Qwen2 (real transformers vs megatron-core),
including Llama 3 rope scaling at positions beyond `original_max_position_embeddings`.

Spawned worlds: TP1 (also saves TP1 dist checkpoints), TP2 and PP2 (also load them) parity worlds, plus the
conversions the CLI runs (hf-to-mcore TP2xPP2, mcore-to-hf TP1 and PP2).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from mcore_convert_fns import parity_and_reshard
from safetensors.torch import load_file, save_file

from rlhf.cli import main as cli
from rlhf.tiny_models import create_tiny_model
from tests.helpers.hf import assert_same_hf, source_ranks
from workers.megatron.launch import run_distributed


def _pad_variant(src: Path, dst: Path, vocab: int) -> Path:
    """tiny-qwen2 cut to a vocab that TP/Megatron must pad (rows dropped from the embedding)."""
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg["vocab_size"] = vocab
    (dst / "config.json").write_text(json.dumps(cfg))
    sd = load_file(dst / "model.safetensors")
    sd["model.embed_tokens.weight"] = sd["model.embed_tokens.weight"][:vocab].contiguous()
    save_file(sd, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


# Llama 3 scaling with a short original context, so the test batch's positions 8..23 lie beyond it.
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8}


def _rope_variant(src: Path, dst: Path) -> Path:
    """tiny-llama with Llama 3 rope scaling (same weights)."""
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg["rope_parameters"] = LLAMA3_ROPE
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("convert")
    qwen = create_tiny_model("tiny-qwen2", root / "qwen")
    llama = create_tiny_model("tiny-llama", root / "llama")
    return {"qwen": qwen, "llama": llama, "qwen_pad": _pad_variant(qwen, root / "qwen_pad", 500),
            "llama_rope3": _rope_variant(llama, root / "llama_rope3"),
            "mistral": create_tiny_model("tiny-mistral", root / "mistral"), "root": root}


def _hf_dirs(models) -> list[str]:
    return [str(models[k]) for k in ("qwen", "llama", "qwen_pad", "llama_rope3", "mistral")]


def test_llama3_scaling_changes_logits_beyond_original_context(models):
    """The rope variant is a real test of the scaling: past `original_max_position_embeddings` its logits
    differ from plain RoPE's (the parity test then holds them to transformers' within 1e-4)."""
    from transformers import AutoModelForCausalLM

    ids = torch.randint(0, 512, (1, 24), generator=torch.Generator().manual_seed(0))
    plain = AutoModelForCausalLM.from_pretrained(models["llama"]).eval()
    scaled = AutoModelForCausalLM.from_pretrained(models["llama_rope3"]).eval()
    with torch.no_grad():
        diff = (plain(ids).logits - scaled(ids).logits).abs().amax(dim=-1)[0]
    assert diff[8:].max() > 1e-3, diff


@pytest.fixture(scope="module")
def tp1_world(models) -> tuple[list[dict], dict[str, str]]:
    """The TP1 parity world; it also saves TP1 dist checkpoints of tiny-qwen2 and tiny-llama (with the
    converter's metadata) for the resharding checks of the TP2 / PP2 worlds."""
    from transformers import AutoConfig

    from rlhf.conversion.convert import finish_mcore_checkpoint, sign_converted

    ckpts = {str(models[k]): str(models["root"] / f"{k}_tp1") for k in ("qwen", "llama")}
    ranks = run_distributed(parity_and_reshard, 1, args=(_hf_dirs(models), {}, ckpts))
    for hf_dir, ckpt in ckpts.items():
        finish_mcore_checkpoint(Path(ckpt), hf_dir, AutoConfig.from_pretrained(hf_dir), 1, 1, "float32", 512)
        sign_converted(Path(ckpt))  # as `rlhf convert hf-to-mcore` does
    return ranks, ckpts


@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 1), (1, 2)], ids=["tp1", "tp2", "pp2"])
def test_logits_match_hf_and_weights_round_trip(models, tp1_world, tp, pp):
    tp1_ranks, tp1_ckpts = tp1_world
    if tp * pp == 1:
        ranks = tp1_ranks
    else:
        ranks = run_distributed(parity_and_reshard, tp * pp, args=(_hf_dirs(models), tp1_ckpts, {}), tp=tp, pp=pp)
    for hf_dir in _hf_dirs(models):
        per_rank = source_ranks(ranks, hf_dir)  # every parameter filled, yielded back unchanged, each tensor once
        last = [r for r in per_rank if "max_abs_diff" in r]
        assert len(last) == tp  # the last stage's TP ranks
        for r in last:
            assert r["max_abs_diff"] <= 1e-4, (hf_dir, tp, pp, r["max_abs_diff"])
            assert r["padded_vocab"] == 512
            if tp * pp > 1 and hf_dir in tp1_ckpts:  # the TP1 checkpoint at this layout gives the HF loss
                assert abs(r["ckpt_loss"] - r["hf_loss"]) < 1e-5, (r["ckpt_loss"], r["hf_loss"])
    # Value model (critic) from the causal-LM folder: the LM head is dropped, the value head kept.
    values = [r["value"] for r in ranks]
    assert all(v["filled"] == v["n_params"] - (1 if "shape" in v else 0) for v in values)
    last = [v for v in values if "shape" in v]
    assert len(last) == tp and all(v["shape"] == (2, 24, 1) and v["max_abs_diff"] <= 1e-4 for v in last)
    assert all(torch.equal(v["head"], last[0]["head"]) for v in last)  # replicated over TP


def test_round_trip_bit_exact(models, tp1_world, tmp_path):
    _, tp1_ckpts = tp1_world
    # Qwen2 (tied, qkv bias): HF -> mcore at TP2 x PP2 -> HF (loaded at TP1).
    m = tmp_path / "qwen_tp2pp2"
    assert cli(["convert", "hf-to-mcore", "--hf", str(models["qwen"]), "--out", str(m), "--tp", "2", "--pp", "2"]) == 0
    meta = json.loads((m / "rlhf_mcore.json").read_text())
    assert (meta["family"], meta["tp"], meta["pp"], meta["padded_vocab_size"]) == ("qwen2", 2, 2, 512)
    assert (m / "model" / "metadata.json").is_file()
    back = tmp_path / "qwen_back"
    assert cli(["convert", "mcore-to-hf", "--mcore", str(m), "--out", str(back)]) == 0
    assert load_file(back / "model.safetensors").keys() == load_file(models["qwen"] / "model.safetensors").keys()
    assert_same_hf(models["qwen"], back)
    # Llama (untied): the TP1 checkpoint exported at PP2 (one file per stage plus an index).
    back2 = tmp_path / "llama_back"
    llama_ckpt = tp1_ckpts[str(models["llama"])]
    assert cli(["convert", "mcore-to-hf", "--mcore", llama_ckpt, "--out", str(back2), "--pp", "2"]) == 0
    assert (back2 / "model.safetensors.index.json").is_file()
    assert_same_hf(models["llama"], back2)


def _edit(models, tmp_path, name: str, edit) -> Path:
    dst = tmp_path / name
    shutil.copytree(models["qwen"], dst)
    edit(dst)
    return dst


def _edit_config(**fields):
    def edit(d: Path) -> None:
        cfg = json.loads((d / "config.json").read_text())
        cfg.update(fields)
        (d / "config.json").write_text(json.dumps(cfg))

    return edit


def _edit_tensors(drop: str | None = None, add: str | None = None):
    def edit(d: Path) -> None:
        sd = load_file(d / "model.safetensors")
        if drop:
            del sd[drop]
        if add:
            sd[add] = torch.zeros(4)
        save_file(sd, d / "model.safetensors", metadata={"format": "pt"})

    return edit


@pytest.mark.parametrize(
    "case,edit,extra_args,message",
    [
        ("hidden", _edit_config(hidden_size=64), [], "model.embed_tokens.weight has shape [512, 128]"),
        ("missing", _edit_tensors(drop="model.layers.1.mlp.up_proj.weight"), [],
         "missing tensor model.layers.1.mlp.up_proj.weight"),
        ("extra", _edit_tensors(add="model.layers.0.extra.weight"), [], "unexpected tensor model.layers.0.extra.weight"),
        ("tp_heads", None, ["--tp", "3"], "num_attention_heads=4 is not divisible by tensor parallel size 3"),
        ("pp_layers", None, ["--pp", "3"], "num_hidden_layers=2 is not divisible by pipeline parallel size 3"),
        ("family", _edit_config(model_type="gpt2"), [], "model_type"),
    ],
)
def test_bad_input_rejected_cleanly(models, tmp_path, capsys, case, edit, extra_args, message):
    src = _edit(models, tmp_path, case, edit) if edit else models["qwen"]
    out = tmp_path / f"{case}_out"
    assert cli(["convert", "hf-to-mcore", "--hf", str(src), "--out", str(out), *extra_args]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err, err
    assert not out.exists(), "nothing may be written for bad input"


def test_mcore_to_hf_rejects_non_checkpoint(models, tmp_path, capsys):
    assert cli(["convert", "mcore-to-hf", "--mcore", str(models["qwen"]), "--out", str(tmp_path / "o")]) == 2
    assert "rlhf_mcore.json is missing" in capsys.readouterr().err


def test_mistral_sliding_window_refused(models, tmp_path, capsys):
    """A window shorter than the context cannot be run as full attention: one line naming the field."""
    src = tmp_path / "mistral_window"
    shutil.copytree(models["mistral"], src)
    cfg = json.loads((src / "config.json").read_text())
    cfg["sliding_window"] = 128
    (src / "config.json").write_text(json.dumps(cfg))
    out = tmp_path / "out"
    assert cli(["convert", "hf-to-mcore", "--hf", str(src), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "sliding_window=128 is smaller than max_position_embeddings=512" in err, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1 and not out.exists()
