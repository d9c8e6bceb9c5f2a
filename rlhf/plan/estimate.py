"""Step time of one optimizer step from a roofline: FLOPs / (peak * efficiency), communication volume /
bandwidth, and the pipeline bubble.

- FLOPs (Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters Using
  Megatron-LM", section 5.1): 6 FLOPs per parameter per token for forward and backward (2 + 4), over the
  parameters a token meets (routed experts: top-k of them), plus attention's score and value matmuls,
  3 * s * heads * (d_qk + d_v) per token per layer under a causal mask (half the 4 * s * heads * d of full
  attention, times 3). Full recompute runs the forward twice (8 instead of 6: x 4/3); selective recompute
  runs the attention forward again.
- Pipeline bubble (same paper, section 2.2): with m micro-batches and p stages the schedule takes
  (m + p - 1) / m of the ideal time, (1 + (p - 1) / (v m)) with v interleaved chunks.
- Communication: ring all-reduce moves 2 (n-1)/n of the buffer per rank, all-gather and reduce-scatter
  (n-1)/n each (so sequence parallelism moves what TP's all-reduces move); tensor parallelism does 4 of them
  per layer per micro-batch on the layer's activations (2 forward, 2 backward; 6 with full recompute);
  expert parallelism 4 all-to-alls (dispatch, combine, forward and backward) of the top-k token copies;
  context parallelism passes K and V around the ring (forward, and K, V plus their gradients backward);
  the data-parallel gradient reduction and parameter gather (distributed optimizer) cross the data-parallel
  group once per step, on NVLink when the group sits within a node, on the network otherwise. Nothing is
  assumed overlapped with compute (our engine turns overlap off).
- Optimizer offload: Adam on the CPU reads and writes ~28 bytes per parameter at ~20 GB/s per GPU's share
  of host memory bandwidth, and moves 4 bytes of gradient down and 2 of parameter up over PCIe (~25 GB/s).
"""

from __future__ import annotations

from dataclasses import dataclass

from rlhf.plan.hardware import GPU
from rlhf.plan.layout import Layout
from rlhf.plan.memory import ParamCount, active_params
from rlhf.plan.model import ModelSpec

EFFICIENCY = 0.45  # achieved fraction of peak for the matmuls (Megatron-LM reports 40-55% MFU at scale)
HOST_BW = 20e9
PCIE_BW = 25e9


@dataclass
class StepTime:
    compute: float
    tp_comm: float
    ep_comm: float
    cp_comm: float
    bubble: float
    dp_comm: float
    pp_comm: float
    offload: float

    @property
    def total(self) -> float:
        return (self.compute + self.tp_comm + self.ep_comm + self.cp_comm + self.bubble + self.dp_comm
                + self.pp_comm + self.offload)


def attention_flops_per_token(m: ModelSpec, seq: int) -> float:
    """Forward + backward FLOPs of the score and value matmuls per token, all layers, causal."""
    d_qk = m.qk_nope + m.qk_rope if m.mla else m.head_dim
    d_v = m.v_dim if m.mla else m.head_dim
    return 3.0 * seq * m.heads * (d_qk + d_v) * m.layers


def step_flops(m: ModelSpec, tokens: float, seq: int, recompute: str = "none") -> float:
    """Training FLOPs of one step over `tokens` tokens of sequences of length `seq`."""
    dense = 6.0 * active_params(m) * tokens
    attn = attention_flops_per_token(m, seq) * tokens
    if recompute == "full":
        return (dense + attn) * 4 / 3
    if recompute == "selective":
        return dense + attn * 4 / 3
    return dense + attn


def ring(n: int) -> float:
    """Fraction of a buffer each rank sends in an all-gather or reduce-scatter over n ranks."""
    return (n - 1) / n


def step_time(m: ModelSpec, lay: Layout, gpu: GPU, gpus_per_node: int, seq: int, global_batch: int,
              pc: ParamCount, elem: int = 2, efficiency: float = EFFICIENCY) -> StepTime:
    """Estimated seconds of one optimizer step over `global_batch` sequences (see the module docstring).
    `pc`: the parameters of the fullest rank."""
    micro = global_batch // (lay.dp * lay.mbs)
    tokens = float(global_batch) * seq
    compute = step_flops(m, tokens, seq, lay.recompute) / (lay.world * gpu.bf16_flops * efficiency)
    s = seq / lay.cp
    layers = m.layers / lay.pp
    moe_share = sum(m.moe_layers) / m.layers if m.moe_layers else 0.0
    act = elem * s * lay.mbs * m.hidden  # one layer's activation of one micro-batch
    passes = 6 if lay.recompute == "full" else 4
    tp_comm = layers * micro * passes * 2 * ring(lay.tp) * act / gpu.nvlink_bw if lay.tp > 1 else 0.0
    ep_comm = 0.0
    if lay.ep > 1:
        bw = gpu.nvlink_bw if lay.etp * lay.ep <= gpus_per_node else gpu.net_bw
        tokens_share = lay.tp if lay.sp else 1  # with SP each TP rank dispatches its slice of the tokens
        ep_comm = layers * moe_share * micro * 4 * ring(lay.ep) * act * m.topk / tokens_share / bw
    cp_comm = 0.0
    if lay.cp > 1:
        kv_width = (m.kv_lora + m.qk_rope) if m.mla else 2 * m.kv_heads * m.head_dim
        bw = gpu.nvlink_bw if lay.tp * lay.cp <= gpus_per_node else gpu.net_bw
        cp_comm = layers * micro * 3 * (lay.cp - 1) * elem * s * lay.mbs * kv_width / lay.tp / bw
    busy = compute + tp_comm + ep_comm + cp_comm
    bubble = busy * (lay.pp - 1) / (lay.vpp * micro) if lay.pp > 1 else 0.0
    dp = lay.dp * lay.cp
    dp_comm = 0.0
    if dp > 1:
        bw = gpu.nvlink_bw if lay.tp * dp <= gpus_per_node else gpu.net_bw
        # reduce-scatter of fp32 grads + all-gather of params (distributed optimizer) ~ one all-reduce
        dp_comm = (2 * ring(dp) * pc.dense * 4) / bw
    if lay.edp > 1 and pc.expert:
        bw = gpu.nvlink_bw if lay.tp * dp <= gpus_per_node else gpu.net_bw
        dp_comm += 2 * ring(lay.edp) * pc.expert * 4 / bw
    pp_comm = 0.0
    if lay.pp > 1:
        bw = gpu.nvlink_bw if lay.world <= gpus_per_node else gpu.net_bw
        pp_comm = 2 * micro * act / (lay.tp if lay.sp else 1) / bw
    offload = pc.total * (28 / HOST_BW + 6 / PCIE_BW) if lay.offload else 0.0
    return StepTime(compute, tp_comm, ep_comm, cp_comm, bubble, dp_comm, pp_comm, offload)
