"""Bytes per GPU of one trainer rank: parameters, gradients, optimizer state, activations, KV cache.

Parameters per rank follow megatron-core's GPTModel layout (what `workers/megatron/model_provider.py`
builds): the vocab padded to a multiple of 128 * TP and split over TP (embedding on the first pipeline
stage, output layer on the last, or shared with the embedding when tied and PP = 1; a tied model with PP > 1
keeps a second copy on the last stage); QKV, projection and MLP weights split over TP; norms, q/k norms and
the MoE router replicated; routed experts split over EP (E/EP per rank) and expert-TP.

Optimizer state (ZeRO paper, Rajbhandari et al. 2019, "ZeRO: Memory Optimizations Toward Training Trillion
Parameter Models", section 3.1: mixed-precision Adam keeps 2 bytes of fp16/bf16 parameters, 2 of gradients
and K = 12 bytes of fp32 master copy, momentum and variance per parameter; stage 1 shards the 12 over the
data-parallel ranks), adapted to what our engine builds (workers/megatron/engine.py): gradients live in an
fp32 buffer (`grad_reduce_in_fp32=True`, 4 bytes); bf16 parameters get an fp32 master copy plus Adam's m and
v (12 bytes); fp32 parameters are their own master copy (8 bytes); megatron's distributed optimizer shards
this state over the data-parallel ranks (dense parameters over DP x CP, experts over the expert-DP group).

Activations per layer (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer
Models", section 4.1, eq. 1-2): sbh(34 + 5as/h) bytes for a GPT layer in 16-bit (11sbh + 5as^2b attention,
19sbh MLP, 4sbh two layer-norm inputs), with TP t only the TP-split parts divide by t
(sbh(10 + 24/t + 5as/(ht))), with sequence parallelism all of it (sbh/t (34 + 5as/h)). Generalised here term
by term to GQA (Q, K, V of different widths), gated MLPs (SwiGLU stores the 2F-wide FC1 output and the
F-wide product), MoE (top-k copies of each token through the experts), MLA and dropout off (no masks).
Flash attention, like selective recompute, keeps no s^2 scores (only fp32 log-sum-exp). Pipeline (section
4.2.2): with 1F1B the first stage holds PP micro-batches in flight, so it stores the activations of L layers
in all, times (1 + (p-1)/(p v)) with v interleaved chunks. Full recompute keeps each layer's input only,
plus one layer's full activations while it is recomputed. Context parallelism divides the tokens of a rank
by cp; the plan assumes ring attention (Transformer Engine's kernels), while the engine's own CP attention
(`cp_gathered_kv`, what runs today) also keeps the gathered K / V and the scores over the whole sequence.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

from rlhf.plan.layout import Layout
from rlhf.plan.model import ModelSpec

VOCAB_DIVISOR = 128  # workers/megatron/model_provider.py DEFAULT_VOCAB_DIVISOR
GRAD_BYTES = 4  # fp32 gradient buffer (grad_reduce_in_fp32=True in our engine)
BUFFER_BYTES = 2 * 1024**3  # CUDA context, NCCL and cuBLAS workspaces: a fixed allowance, not a formula


def padded_vocab(vocab: int, tp: int) -> int:
    multiple = VOCAB_DIVISOR * tp
    return math.ceil(vocab / multiple) * multiple


# ---- parameters ----------------------------------------------------------------------------------------
@dataclass
class ParamCount:
    """Parameters held by one rank: `dense` (sharded by the distributed optimizer over DP x CP) and `expert`
    (routed experts, sharded over the expert-DP group)."""

    dense: int = 0
    expert: int = 0

    @property
    def total(self) -> int:
        return self.dense + self.expert


def attention_params(m: ModelSpec, tp: int) -> int:
    """One layer's attention block on one TP rank, its input norm included."""
    h = m.hidden
    if m.mla:
        q_out = m.heads * (m.qk_nope + m.qk_rope)
        q = (h * m.q_lora + m.q_lora + m.q_lora * q_out // tp) if m.q_lora else h * q_out // tp
        kv = h * (m.kv_lora + m.qk_rope) + m.kv_lora + m.kv_lora * m.heads * (m.qk_nope + m.v_dim) // tp
        return h + q + kv + m.heads * m.v_dim // tp * h
    qkv = (m.heads + 2 * m.kv_heads) * m.head_dim // tp
    return h + qkv * h + (qkv if m.qkv_bias else 0) + (2 * m.head_dim if m.qk_norm else 0) + m.heads * m.head_dim // tp * h


def mlp_params(m: ModelSpec, layer: int, tp: int, ep: int, etp: int) -> ParamCount:
    """One layer's MLP or MoE block on one rank, its input norm included (gated: FC1 is 2F wide)."""
    h = m.hidden
    if not m.is_moe_layer(layer):
        return ParamCount(dense=h + 3 * m.ffn // tp * h)
    dense = h + m.experts * h  # norm, router (replicated)
    if m.shared_ffn:
        dense += 3 * m.shared_ffn // tp * h + (h if m.shared_gate else 0)
    return ParamCount(dense=dense, expert=m.experts // ep * 3 * (m.moe_ffn // etp) * h)


def rank_layers(layers: int, pp: int, vpp: int, rank: int) -> list[int]:
    """Layer indices on pipeline rank `rank`: pp*vpp chunks in order, chunk c on rank c % pp; an uneven
    split gives the first chunks one layer more."""
    chunks = pp * vpp
    base, extra = divmod(layers, chunks)
    out: list[int] = []
    start = 0
    for c in range(chunks):
        n = base + (1 if c < extra else 0)
        if c % pp == rank:
            out += range(start, start + n)
        start += n
    return out


def rank_params(m: ModelSpec, lay: Layout, rank: int, value_head: bool = False) -> ParamCount:
    """Parameters on pipeline rank `rank` of one TP/EP rank (every TP rank holds the same count)."""
    pc = ParamCount()
    for i in rank_layers(m.layers, lay.pp, lay.vpp, rank):
        mlp = mlp_params(m, i, lay.tp, lay.ep, lay.etp)
        pc.dense += attention_params(m, lay.tp) + mlp.dense
        pc.expert += mlp.expert
    emb = padded_vocab(m.vocab, lay.tp) // lay.tp * m.hidden
    if rank == 0:
        pc.dense += emb
    if rank == lay.pp - 1:
        pc.dense += m.hidden  # final norm
        if value_head:
            pc.dense += m.hidden
        elif not (m.tie and lay.pp == 1):
            pc.dense += emb
    return pc


def total_params(m: ModelSpec) -> int:
    """All parameters as HF counts them (unpadded vocab, one embedding when tied)."""
    one = Layout()
    pc = rank_params(m, one, 0)
    pad = (padded_vocab(m.vocab, 1) - m.vocab) * m.hidden
    return pc.total - pad * (1 if m.tie else 2)


def active_params(m: ModelSpec) -> float:
    """Parameters that touch each token in matmuls (the output layer yes, the embedding lookup no): routed
    experts count topk / experts."""
    n = float(m.vocab * m.hidden)
    for i in range(m.layers):
        mlp = mlp_params(m, i, 1, 1, 1)
        n += attention_params(m, 1) + mlp.dense + (mlp.expert * m.topk / m.experts if m.experts else 0)
    return n


# ---- parameter, gradient and optimizer bytes -----------------------------------------------------------
def state_bytes(pc: ParamCount, lay: Layout, param_bytes: int, trainable: bool) -> dict[str, float]:
    """params / grads / optimizer bytes of one rank (ZeRO accounting as our engine builds it, see the module
    docstring); every weight, norms included, in the model's dtype. Frozen roles hold parameters only."""
    out = {"params": float(pc.total * param_bytes), "grads": 0.0, "optimizer": 0.0}
    if not trainable:
        return out
    out["grads"] = float(pc.total * GRAD_BYTES)
    if lay.offload:
        return out

    def adam(n: int, n16: int) -> float:  # m and v for all, an fp32 master copy for the 16-bit ones
        return 8.0 * n + 4.0 * n16

    dense16 = pc.dense if param_bytes < 4 else 0
    expert16 = pc.expert if param_bytes < 4 else 0
    if lay.dist_opt:
        out["optimizer"] = adam(pc.dense, dense16) / (lay.dp * lay.cp) + adam(pc.expert, expert16) / lay.edp
    else:
        out["optimizer"] = adam(pc.dense, dense16) + adam(pc.expert, expert16)
    return out


# ---- activations ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ActOptions:
    """How activations are kept: element size (2 for bf16) and which kernels run."""

    elem: int = 2
    flash_attention: bool = True  # GPU attention kernels: no s^2 scores stored
    dropout: bool = False  # our models train without dropout: no masks
    gated: bool = True  # SwiGLU (every model family here)
    # The unfused paths megatron's local spec takes on CPU (bench/memory.py shows them in the saved tensors):
    norm_bytes: float = 0.0  # bytes a norm keeps per input element (0: elem; torch's CPU RMSNorm keeps 2 fp32)
    softmax_extra: int = 0  # bytes per score beyond elem (4: a 16-bit model's fp32 softmax output)
    fused_swiglu: bool = True  # False: SiLU's output is kept too (F more per token)
    # With cp > 1: the engine's own CP attention (all-gathered K/V into megatron's unfused attention, on CPU and
    # GPU alike) instead of Transformer Engine's ring kernels: a rank keeps the whole sequence's K / V and
    # scores its queries against all s x cp keys.
    cp_gathered_kv: bool = False


def layer_activation_per_token(m: ModelSpec, layer: int, lay: Layout, s: float, opt: ActOptions) -> float:
    """Bytes one layer keeps for backward, per token of a micro-batch on this rank (s = the sequence length
    one rank sees, after CP). Korthikanti et al. eq. 1-2 term by term (module docstring)."""
    e, h, t = opt.elem, m.hidden, lay.tp
    mask = 1 if opt.dropout else 0
    # Not TP-split (divided by t only with SP): two norm inputs, QKV input, MLP input, two dropout masks.
    replicated = 2 * (opt.norm_bytes or e) * h + e * h + e * h + 2 * mask * h
    split: float
    if m.mla:
        replicated += e * (2 * m.q_lora + 2 * (m.kv_lora + m.qk_rope))  # low-rank activations (not TP-split)
        split = e * m.heads * (2 * (m.qk_nope + m.qk_rope) + 2 * m.v_dim)  # Q, K, V, projection input
    else:
        split = e * (m.heads + 2 * m.kv_heads) * m.head_dim + e * m.heads * m.head_dim  # Q, K, V, proj input
    heads = m.heads
    keys, flash = s, opt.flash_attention
    if opt.cp_gathered_kv and lay.cp > 1 and not m.mla:  # unfused scores over every key
        keys, flash = s * lay.cp, False
        split += e * 2 * m.kv_heads * m.head_dim * (lay.cp - 1)  # the other ranks' K / V, gathered and kept
    if lay.recompute == "none" and not flash:
        split += heads * keys * (e + opt.softmax_extra + mask + (e if opt.dropout else 0))  # softmax (+ dropout)
    elif flash:
        split += 4 * heads  # flash attention's fp32 log-sum-exp (selective recompute without it: nothing)
    own = 0.0  # already per rank: the routed experts' hidden activations, split by expert-TP
    if m.is_moe_layer(layer):
        replicated += 8 * m.experts + 2 * e * h * m.topk  # fp32 router logits and probs; top-k token copies
        own = 3 * e * m.moe_ffn / lay.etp * m.topk  # FC1 output (2F) and product (F) of each copy
        if m.shared_ffn:
            split += 3 * e * m.shared_ffn
    else:
        split += ((3 if opt.fused_swiglu else 4) if opt.gated else 2) * e * m.ffn
    return (replicated / t if lay.sp else replicated) + split / t + own


def in_flight(lay: Layout, rank: int, micro_batches: int) -> float:
    """Micro-batches whose activations pipeline rank `rank` holds at its peak: 1F1B keeps pp - rank of them;
    interleaved, the first rank (1 + (p-1)/(pv)) * p layer-chunks' worth (Korthikanti 4.2.2)."""
    if lay.pp == 1:
        return 1.0
    if lay.vpp == 1:
        return float(min(lay.pp - rank, micro_batches))
    return min(lay.pp * (1 + (lay.pp - 1) / (lay.pp * lay.vpp)), float(micro_batches))


def stage_activation_bytes(m: ModelSpec, lay: Layout, seq: int, micro_batches: int, rank: int,
                           opt: ActOptions, per_token: Callable[[int, Layout], float] | None = None) -> float:
    """Peak activation bytes on pipeline rank `rank` (1F1B, interleaved with vpp > 1). `per_token(layer,
    layout)`: bytes per token of one layer (default `layer_activation_per_token`; the planner caches it)."""
    s = seq / lay.cp
    if per_token is None:
        def per_token(i: int, lay_: Layout) -> float:
            return layer_activation_per_token(m, i, lay_, s, opt)
    tokens = s * lay.mbs
    layers = rank_layers(m.layers, lay.pp, lay.vpp, rank)
    flight = in_flight(lay, rank, micro_batches)
    if lay.recompute == "full":
        kept = opt.elem * m.hidden / (lay.tp if lay.sp else 1) * tokens * len(layers)
        sel = lay.with_(recompute="selective")
        one = max((per_token(i, sel) for i in _kinds(m, layers)), default=0.0) * tokens
        acts = kept * flight + one
    else:
        acts = sum(per_token(i, lay) for i in layers) * tokens * flight
    if rank == lay.pp - 1:  # logits of the micro-batch being processed: 16-bit logits + fp32 softmax
        acts += (opt.elem + 4) * tokens * padded_vocab(m.vocab, lay.tp) / lay.tp
    return acts


def _kinds(m: ModelSpec, layers: list[int]) -> list[int]:
    """One dense and one MoE layer index among `layers` (those that exist)."""
    out: dict[bool, int] = {}
    for i in layers:
        out.setdefault(m.is_moe_layer(i), i)
    return list(out.values())


# ---- the rollout engine's KV cache ---------------------------------------------------------------------
def kv_cache_bytes(m: ModelSpec, tokens: float, tp: int, elem: int = 2) -> float:
    """KV cache for `tokens` tokens on one GPU of an engine with TP `tp`: K and V of every layer (GQA heads
    split over TP, at least one per rank); MLA caches the compressed latent and the RoPE key, replicated."""
    if m.mla:
        return m.layers * (m.kv_lora + m.qk_rope) * elem * tokens
    heads = max(m.kv_heads / tp, 1)
    return 2 * m.layers * heads * m.head_dim * elem * tokens


@dataclass
class Breakdown:
    """Bytes on the fullest GPU, by kind."""

    params: float = 0.0
    grads: float = 0.0
    optimizer: float = 0.0
    activations: float = 0.0
    kv_cache: float = 0.0
    buffers: float = BUFFER_BYTES
    notes: list[str] = field(default_factory=list)

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer + self.activations + self.kv_cache + self.buffers
