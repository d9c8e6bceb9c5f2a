"""megatron-core's plain (non-Transformer-Engine) core attention for multi-head latent attention.

MLA builds its core attention with `k_channels` (qk_nope + qk_rope) and `v_channels` (v_head_dim), which
megatron-core 0.16.1's `DotProductAttention` does not take (only TE's attention does), and its output has
`v_head_dim` channels per head rather than `kv_channels`. This subclass takes both and sizes the output by
`v_channels`; the attention itself (scores from q . k over the q/k width, softmax, probs @ v) already works
for q/k and v of different widths.
"""

from __future__ import annotations

from typing import Any

from megatron.core.transformer.dot_product_attention import DotProductAttention


class MLADotProductAttention(DotProductAttention):
    """`DotProductAttention` accepting MLA's `k_channels` / `v_channels` (see module docstring)."""

    def __init__(self, config: Any, layer_number: int, attn_mask_type: Any, attention_type: str,
                 attention_dropout: float | None = None, softmax_scale: float | None = None,
                 cp_comm_type: str | None = None, pg_collection: Any = None, k_channels: int | None = None,
                 v_channels: int | None = None) -> None:
        super().__init__(config, layer_number, attn_mask_type, attention_type, attention_dropout, softmax_scale,
                         cp_comm_type, pg_collection)
        self.hidden_size_per_partition = (v_channels or config.v_head_dim) * self.num_attention_heads_per_partition
