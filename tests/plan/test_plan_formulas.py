"""The planner's formulas on hand-computed cases (no Ray, no megatron)."""

from __future__ import annotations

import pytest

from rlhf.plan.estimate import attention_flops_per_token, step_flops, step_time
from rlhf.plan.hardware import GIB, get_gpu, parse_bytes
from rlhf.plan.layout import Layout
from rlhf.plan.memory import (
    ActOptions,
    ParamCount,
    active_params,
    in_flight,
    kv_cache_bytes,
    layer_activation_per_token,
    padded_vocab,
    rank_params,
    stage_activation_bytes,
    state_bytes,
    total_params,
)
from rlhf.plan.model import KNOWN, ModelSpec, load_model

# GPT as Korthikanti et al. 2022 count it: MHA, a 4h non-gated MLP, dropout on, attention scores stored.
H, A, S = 1024, 16, 2048
GPT = ModelSpec(name="gpt", family="gpt", hidden=H, layers=4, heads=A, kv_heads=A, head_dim=H // A, ffn=4 * H,
                vocab=50304, tie=False)
KORTHIKANTI = ActOptions(elem=2, flash_attention=False, dropout=True, gated=False)


def test_activation_per_layer_is_korthikanti_eq_1_and_2():
    # eq. 1: sbh(34 + 5as/h) bytes per layer, i.e. 34h + 5as per token
    assert layer_activation_per_token(GPT, 0, Layout(), S, KORTHIKANTI) == 34 * H + 5 * A * S
    # eq. 2, TP t without SP: sbh(10 + 24/t + 5as/(ht))
    for t in (2, 4, 8):
        got = layer_activation_per_token(GPT, 0, Layout(tp=t), S, KORTHIKANTI)
        assert got == pytest.approx(10 * H + 24 * H / t + 5 * A * S / t)
        # with sequence parallelism everything divides by t: sbh/t (34 + 5as/h)
        sp = layer_activation_per_token(GPT, 0, Layout(tp=t, sp=True), S, KORTHIKANTI)
        assert sp == pytest.approx((34 * H + 5 * A * S) / t)
    # selective recompute drops the attention scores: 34 sbh
    assert layer_activation_per_token(GPT, 0, Layout(recompute="selective"), S, KORTHIKANTI) == 34 * H


def test_activation_gqa_swiglu_no_dropout_flash():
    # Llama-3-8B, bf16, flash attention, no dropout, per token of one layer:
    # norms 2*2h + QKV input 2h + MLP input 2h + Q 2*4096 + K, V 2*2*1024 + proj input 2*4096
    # + SwiGLU 2*2F + 2F + fp32 log-sum-exp 4*32
    m = load_model("Llama-3-8B")
    h, f = 4096, 14336
    hand = 4 * h + 2 * h + 2 * h + 2 * 4096 + 4 * 1024 + 2 * 4096 + 6 * f + 4 * 32
    assert layer_activation_per_token(m, 0, Layout(), 8192, ActOptions()) == hand


def test_context_parallel_activations_ring_and_gathered():
    # Llama-3-8B at seq 8192, cp 2: a rank sees s = 4096 tokens. Ring attention (the plan's default) keeps the
    # same per-token bytes as without CP. The engine's all-gather CP attention also keeps the other rank's K
    # and V (2 * 2 * 1024 bytes per local token) and, unfused, bf16 scores over all 8192 keys (32 heads x 2
    # bytes) instead of flash's log-sum-exp.
    m = load_model("Llama-3-8B")
    ring = layer_activation_per_token(m, 0, Layout(cp=2), 4096, ActOptions())
    assert ring == layer_activation_per_token(m, 0, Layout(), 8192, ActOptions())
    gathered = layer_activation_per_token(m, 0, Layout(cp=2), 4096, ActOptions(cp_gathered_kv=True))
    assert gathered == ring - 4 * 32 + 2 * 2 * 1024 + 32 * 8192 * 2
    # the stage total divides the tokens by cp
    assert stage_activation_bytes(m, Layout(cp=2), 8192, 1, 0, ActOptions()) == pytest.approx(
        stage_activation_bytes(m, Layout(), 8192, 1, 0, ActOptions()) / 2)


def test_pipeline_in_flight_and_full_recompute():
    lay = Layout(pp=4)
    assert [in_flight(lay, r, 8) for r in range(4)] == [4, 3, 2, 1]
    assert in_flight(lay, 0, 2) == 2  # fewer micro-batches than stages
    assert in_flight(Layout(pp=4, vpp=2), 0, 8) == 4 * (1 + 3 / 8)  # Korthikanti 4.2.2
    # full recompute keeps each layer's input (2sbh) plus one layer's full activations, and the last
    # stage's logits (2 + 4 bytes per vocab entry)
    opt = KORTHIKANTI
    full = stage_activation_bytes(GPT, Layout(recompute="full"), S, 1, 0, opt)
    assert full == 2 * H * S * GPT.layers + 34 * H * S + 6 * S * padded_vocab(GPT.vocab, 1)
    none = stage_activation_bytes(GPT, Layout(), S, 1, 0, opt)
    assert none == (34 * H + 5 * A * S) * S * GPT.layers + 6 * S * padded_vocab(GPT.vocab, 1)


def test_zero_optimizer_accounting():
    pc = ParamCount(dense=10**9)
    dist = Layout(dp=8)
    # mixed precision (ZeRO 3.1): 2 bytes param, our fp32 grad buffer 4, 12 of optimizer state sharded over DP
    assert state_bytes(pc, dist, 2, True) == {"params": 2e9, "grads": 4e9, "optimizer": 12e9 / 8}
    assert state_bytes(pc, dist.with_(dist_opt=False), 2, True)["optimizer"] == 12e9
    assert state_bytes(pc, dist, 4, True)["optimizer"] == 8e9 / 8  # fp32: the parameter is its own master
    assert state_bytes(pc, dist.with_(offload=True), 2, True)["optimizer"] == 0
    assert state_bytes(pc, dist, 2, False) == {"params": 2e9, "grads": 0.0, "optimizer": 0.0}
    # experts shard over expert-DP = tp*cp*dp / (etp*ep): 8 GPUs, ep 4 -> edp 2
    moe = ParamCount(dense=0, expert=10**9)
    assert state_bytes(moe, Layout(dp=8, ep=4, etp=1), 2, True)["optimizer"] == 12e9 / 2
    # norms take the model's dtype like every other weight (the engine casts megatron's fp32 CPU norms)
    got = state_bytes(ParamCount(dense=1000), Layout(dist_opt=False), 2, True)
    assert got == {"params": 1000 * 2, "grads": 4000.0, "optimizer": 12 * 1000}


def test_param_counts_equal_transformers_for_the_known_models():
    """Total parameters equal transformers' count of the same config (built on the meta device)."""
    import torch
    from transformers import AutoModelForCausalLM, DeepseekV3Config, LlamaConfig, Qwen2Config, Qwen3MoeConfig

    classes = {"llama": LlamaConfig, "qwen2": Qwen2Config, "qwen3_moe": Qwen3MoeConfig,
               "deepseek_v3": DeepseekV3Config}
    for name, fields in KNOWN.items():
        cfg = classes[fields["model_type"]](**{k: v for k, v in fields.items() if k != "model_type"})
        with torch.device("meta"):
            hf = AutoModelForCausalLM.from_config(cfg)
        assert total_params(load_model(name)) == sum(p.numel() for p in hf.parameters()), name
    # DeepSeek-V3 technical report: 671B total, 37B activated per token
    ds = load_model("DeepSeek-V3")
    assert total_params(ds) / 1e9 == pytest.approx(671, abs=0.5)
    assert active_params(ds) / 1e9 == pytest.approx(37, abs=0.5)  # matmul weights a token meets


def test_rank_params_split_the_model():
    m = load_model("Qwen3-30B-A3B")
    one = rank_params(m, Layout(), 0).total
    # PP splits the layers (and puts the embedding first, the output last): the stages sum to the whole
    assert sum(rank_params(m, Layout(pp=4), r).total for r in range(4)) == one
    # EP splits the routed experts only
    ep8 = rank_params(m, Layout(ep=8), 0)
    full = rank_params(m, Layout(), 0)
    assert ep8.dense == full.dense and ep8.expert * 8 == full.expert


def test_kv_cache():
    llama = load_model("Llama-3-8B")
    assert kv_cache_bytes(llama, 1, 1) == 2 * 32 * 8 * 128 * 2 == 128 * 1024  # 128 KiB per token
    assert kv_cache_bytes(llama, 1, 8) == 16 * 1024
    assert kv_cache_bytes(llama, 1, 16) == 16 * 1024  # at least one KV head per rank
    ds = load_model("DeepSeek-V3")
    assert kv_cache_bytes(ds, 1, 8) == 61 * (512 + 64) * 2  # MLA: latent + RoPE key, replicated


def test_flops_match_narayanan_with_a_causal_mask():
    # GPT-shaped (gated MLP of width 8h/3 = 8h^2 weights, like a 4h GeLU MLP): Narayanan et al. 2021 count
    # 72 B s l h^2 (1 + s/(6h) + V/(12 l h)) per step; a causal mask halves the s/(6h) attention term.
    h, layers, s, v = 3072, 8, 4096, 51200
    m = ModelSpec(name="g", family="gpt", hidden=h, layers=layers, heads=24, kv_heads=24, head_dim=128,
                  ffn=8 * h // 3, vocab=v, tie=False)
    tokens = 16 * s
    narayanan = 72 * tokens * layers * h * h * (1 + s / (12 * h) + v / (12 * layers * h))
    assert step_flops(m, tokens, s) == pytest.approx(narayanan, rel=2e-4)  # norms (2h per layer) aside
    assert step_flops(m, tokens, s, "full") == pytest.approx(narayanan * 4 / 3, rel=2e-4)
    assert attention_flops_per_token(m, s) == 3 * s * 24 * 256 * layers


def test_pipeline_bubble_and_comm():
    m = load_model("Llama-3-8B")
    gpu = get_gpu("H100")
    lay = Layout(pp=4, dp=2, mbs=1)
    pc = rank_params(m, lay, 0)
    t = step_time(m, lay, gpu, 8, 4096, 32, pc)  # 16 micro-batches per DP rank
    busy = t.compute + t.tp_comm + t.ep_comm + t.cp_comm
    assert t.bubble == pytest.approx(busy * 3 / 16)  # (p-1)/m
    vpp = step_time(m, lay.with_(vpp=2), gpu, 8, 4096, 32, pc)
    assert vpp.bubble == pytest.approx(busy * 3 / 32)  # (p-1)/(v m)
    # compute: FLOPs / (GPUs x peak x 45%)
    assert t.compute == pytest.approx(step_flops(m, 32 * 4096, 4096) / (8 * 989e12 * 0.45))
    # DP=2 within a node: fp32 grads reduce-scattered + params gathered ~ one all-reduce, 2 (n-1)/n x bytes
    assert t.dp_comm == pytest.approx(2 * 0.5 * pc.dense * 4 / 450e9)
    tp2 = Layout(tp=2, pp=1, dp=4, mbs=1)
    t2 = step_time(m, tp2, gpu, 8, 4096, 32, rank_params(m, tp2, 0))
    # 4 all-reduces per layer per micro-batch of s*b*h bf16 values, each moving 2 (t-1)/t of it
    assert t2.tp_comm == pytest.approx(32 * 8 * 4 * 2 * 0.5 * 2 * 4096 * 4096 / 450e9)


def test_parse_bytes():
    assert parse_bytes("80GiB") == 80 * GIB
    assert parse_bytes("141GB") == 141e9
    assert parse_bytes("24") == 24 * GIB
