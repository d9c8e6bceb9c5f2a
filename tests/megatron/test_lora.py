"""LoRA on the Megatron engine (real megatron-core over gloo, spawned ranks, tiny-qwen2): only the adapters
train and hold optimizer state; TP=2 x PP=2 gives the TP=1 update; the merged weights reproduce the unmerged
model's logits in transformers, and so does PEFT loading our adapter export onto the base model; a
checkpoint holds the adapters only and resumes exactly."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from lora_fns import LORA, train_lora
from safetensors import safe_open

from workers.megatron.launch import run_distributed

pytestmark = pytest.mark.timeout(1800)  # the module fixture trains two layouts; a shared machine is slow


def expected_adapter_numel(cfg: dict, r: int) -> int:
    """Adapter parameters of the LORA targets at TP=1: r x (in + out) per adapted layer."""
    h, heads, kv = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd, ffn = h // heads, cfg["intermediate_size"]
    q, kvd = heads * hd, kv * hd
    per_layer = r * (h + q + 2 * kvd) + r * (q + h) + r * (h + 2 * ffn) + r * (ffn + h)
    return per_layer * cfg["num_hidden_layers"]


def hf_logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids).logits.float()


@pytest.fixture(scope="module")
def runs(tiny_model_factory, tmp_path_factory):
    path = tiny_model_factory("tiny-qwen2")
    out = {name: tmp_path_factory.mktemp(f"lora_{name}") for name in ("tp1", "tp2pp2")}
    t = 800  # generous: on a machine shared by many jobs these take minutes
    res = {"tp1": run_distributed(train_lora, 1, args=(path, str(out["tp1"]), 3, True), timeout_s=t)[0],
           "tp2pp2": run_distributed(train_lora, 4, args=(path, str(out["tp2pp2"])), tp=2, pp=2, timeout_s=t)}
    return path, out, res


def test_only_adapters_train_and_hold_optimizer_state(runs):
    path, _, res = runs
    cfg = json.loads((Path(path) / "config.json").read_text())
    tp1 = res["tp1"]
    expected = expected_adapter_numel(cfg, LORA["rank"])
    assert tp1["frozen_with_grad"] == []
    assert tp1["trainable"] == tp1["adapters"] == tp1["optimizer_params"] == expected
    assert tp1["optimizer_state"] == 2 * expected  # Adam's exp_avg and exp_avg_sq, nothing for the base
    # each rank holds its stage's layers: its shard of the split factors and all of the replicated ones
    assert all(r["trainable"] == r["optimizer_params"] < expected / 2 for r in res["tp2pp2"])


def test_tp2_pp2_gives_the_tp1_update(runs):
    _, _, res = runs
    tp1 = res["tp1"]
    assert tp1["losses"][-1] < tp1["losses"][0] - 0.05, tp1["losses"]
    assert all(torch.equal(tp1["written"][k], v) for k, v in tp1["merged"].items())  # the shm sync's write
    moved = max((tp1["merged"][k] - tp1["base"][k]).abs().max().item() for k in tp1["base"])
    assert moved > 1e-3  # the adapters changed the merged weights
    ranks = res["tp2pp2"]
    assert max(abs(a - b) for a, b in zip(ranks[0]["losses"], tp1["losses"])) < 1e-5, ranks[0]["losses"]
    merged = {k: v for r in ranks if r["merged"] is not None for k, v in r["merged"].items()}
    assert merged.keys() == tp1["merged"].keys()
    diff = max((merged[k] - tp1["merged"][k]).abs().max().item() for k in merged)
    assert diff < 1e-5, diff
    for stage in (0, 1):  # each TP rank's merged shards written into the full tensors (the shm sync's way)
        tp_ranks = [r for r in ranks if r["pp_rank"] == stage]
        names = next(r["merged"] for r in tp_ranks if r["merged"] is not None)
        written = {k: sum(r["written"][k] for r in tp_ranks) for k in names}  # replicated: TP rank 0 only
        assert max((written[k] - merged[k]).abs().max().item() for k in names) < 1e-6, stage


def test_merged_weights_and_peft_adapter_reproduce_the_unmerged_model(runs):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    path, out, res = runs
    tp1 = res["tp1"]
    assert (tp1["logits"] - tp1["logits_before"]).abs().max() > 1e-3  # training changed the outputs
    merged = AutoModelForCausalLM.from_pretrained(out["tp1"] / "hf", dtype=torch.float32).eval()
    assert (hf_logits(merged, tp1["ids"]) - tp1["logits"]).abs().max() < 1e-5
    adapter = out["tp1"] / "hf" / "adapter"
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert config["r"] == LORA["rank"] and config["lora_alpha"] == LORA["alpha"] and config["peft_type"] == "LORA"
    assert "model.layers.1.self_attn.k_proj" in config["target_modules"]
    with safe_open(str(adapter / "adapter_model.safetensors"), "pt") as f:
        names = list(f.keys())
        assert all(".lora_A.weight" in n or ".lora_B.weight" in n for n in names)
        assert f.get_tensor("base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight").shape == (128, 4)
    base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    peft_model = PeftModel.from_pretrained(base, str(adapter)).eval()
    assert (hf_logits(peft_model, tp1["ids"]) - tp1["logits"]).abs().max() < 1e-5
    # the same adapter, whatever layout exported it
    with safe_open(str(out["tp2pp2"] / "hf" / "adapter" / "adapter_model.safetensors"), "pt") as f, \
            safe_open(str(adapter / "adapter_model.safetensors"), "pt") as g:
        assert sorted(f.keys()) == sorted(names)
        # Adam divides by sqrt(v) + eps: an element whose gradients are ~eps (a LoRA factor's first steps, while
        # its partner is ~0) turns the layouts' float reduction order into ~1e-5 of its update. A wrong shard
        # order or transpose differs by the values themselves (~0.1), so within 1e-3 of the scale is the test.
        for n in names:
            a, b = f.get_tensor(n), g.get_tensor(n)
            assert (a - b).abs().max() <= 1e-3 * b.abs().max(), (n, (a - b).abs().max().item(), b.abs().max().item())


def test_checkpoint_holds_adapters_and_resumes_exactly(runs, tmp_path):
    from megatron.core.dist_checkpointing import load_tensors_metadata

    path, out, res = runs
    tp1 = res["tp1"]
    assert tp1["losses_resumed"] == tp1["losses"][1:]
    assert all(torch.equal(tp1["adapters_resumed"][k], v) for k, v in tp1["adapters_trained"].items())
    assert tp1["meta_lora"]["rank"] == LORA["rank"] and tp1["meta_lora"]["base_model"] == path
    keys = list(load_tensors_metadata(str(out["tp1"] / "ckpt")))
    assert keys and all(k.rsplit(".", 1)[-1] in ("lora_a", "lora_b") for k in keys), keys[:5]
    wrong_rank, full_model = tp1["load_errors"]  # the same checkpoint into an engine of rank 8, and without LoRA
    assert "LoRA adapters with rank 4, the config has 8" in wrong_rank
    assert "holds LoRA adapters (rank 4" in full_model and "same policy.lora settings" in full_model


@pytest.mark.gpu
def test_lora_on_transformer_engine_layers_gpu(tiny_model_factory, tmp_path):
    """With CUDA the engine builds Transformer Engine's fused layer-norm linears; their adapters normalise the
    input as the fused GEMM sees it, so the merged export still reproduces the trained model."""
    from transformers import AutoModelForCausalLM

    path = tiny_model_factory("tiny-qwen2")
    res = run_distributed(train_lora, 1, args=(path, str(tmp_path), 3))[0]
    assert res["losses"][-1] < res["losses"][0]
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    assert (hf_logits(merged, res["ids"]) - res["logits"].cpu()).abs().max() < 1e-3  # TF32 GEMMs on GPU
