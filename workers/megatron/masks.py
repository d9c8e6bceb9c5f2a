"""Attention masks as megatron-core takes them (bool, True = masked) and the mask type that goes with one.

Every batch the engine runs carries an explicit mask: causal within each sequence plus padding, packing
(block-diagonal) or prefix sharing (responses see their prompt, never each other). The local layer spec
applies any explicit mask; Transformer Engine's kernels follow the layer's `attn_mask_type` and, with
`causal`, ignore the mask passed in. So the mask type follows the batch: `arbitrary` for an explicit
mask, `causal` only when none is passed.
"""

from __future__ import annotations

import torch


def causal_mask(seq_len: int, device: torch.device | str | None = None) -> torch.Tensor:
    """[S, S] bool, True above the diagonal (a position never sees later ones)."""
    return torch.triu(torch.ones(seq_len, seq_len, dtype=torch.bool, device=device), diagonal=1)


def attn_mask_type_for(attention_mask: torch.Tensor | None):
    """The megatron `AttnMaskType` for a batch's mask: `arbitrary` for an explicit [b, 1, s, s] mask (the
    kernel must read it), `causal` when there is none (the kernel builds the causal mask itself)."""
    from megatron.core.transformer.enums import AttnMaskType

    return AttnMaskType.causal if attention_mask is None else AttnMaskType.arbitrary


def follow_mask(model: torch.nn.Module, attention_mask: torch.Tensor | None) -> None:
    """Set every attention layer of `model` to the mask type of this batch's mask (read at each forward)."""
    from megatron.core.transformer.attention import Attention

    mask_type = attn_mask_type_for(attention_mask)
    for module in model.modules():
        if isinstance(module, Attention):
            module.attn_mask_type = mask_type
