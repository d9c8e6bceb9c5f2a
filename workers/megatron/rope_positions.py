"""RoPE at explicit position ids for megatron-core GPT models.

megatron-core's GPTModel builds its rotary embedding for positions 0..s-1 of the row and ignores the
`position_ids` it is given (they only feed learned absolute embeddings). That is enough for padding and
for whole-sequence packing (RoPE depends on relative positions only), but not for rows whose tokens are
not one contiguous sequence, e.g. a prompt shared by several responses (workers/roles/micro.py,
`prefix_shared_micros`). `install(model)` makes the model's RotaryEmbedding honour the ids set with
`explicit_positions(ids)` for the duration of a forward call; outside it nothing changes.
Local (non-fused) RoPE only: `_apply_rotary_pos_emb_bshd` broadcasts a [s, b, 1, d] table over the heads.
MLA models (DeepSeek) build their rope inside each attention layer (plain or YaRN, the latter returning
(table, mscale)): each layer's embedding is patched to pick the rows of the ids from its own table.
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Iterator

import torch

_CURRENT: list[torch.Tensor | None] = [None]


def install(model: torch.nn.Module) -> bool:
    """Let `model.rotary_pos_emb` use explicit positions (idempotent); False when the model has no plain
    RotaryEmbedding or uses fused RoPE (then explicit positions are not supported)."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    if getattr(model.config, "multi_latent_attention", False):
        return _install_mla(model)
    rope = getattr(model, "rotary_pos_emb", None)
    if type(rope) is not RotaryEmbedding or getattr(model.config, "apply_rope_fusion", False):
        return False
    if getattr(rope, "_explicit_positions", False):
        return True
    original = rope.forward

    def forward(self, max_seq_len: int, offset: int = 0, packed_seq: bool = False, cp_group=None):
        pos = _CURRENT[0]
        if pos is None:
            return original(max_seq_len, offset, packed_seq, cp_group)
        seq = pos.to(device=self.inv_freq.device, dtype=self.inv_freq.dtype)
        if self.seq_len_interpolation_factor is not None:
            seq = seq / self.seq_len_interpolation_factor
        freqs = seq[..., None] * self.inv_freq  # [b, s, d/2]
        if not self.rotary_interleaved:
            emb = torch.cat((freqs, freqs), dim=-1)
        else:
            emb = torch.stack((freqs, freqs), dim=-1).flatten(-2)
        return emb.transpose(0, 1)[:, :, None, :]  # [s, b, 1, d]

    rope.forward = types.MethodType(forward, rope)
    rope._explicit_positions = True
    return True


def _install_mla(model: torch.nn.Module) -> bool:
    """`install` for MLA: every layer's rotary embedding (RotaryEmbedding or YarnRotaryEmbedding) looks up
    the explicit positions in the table it builds for positions 0..max(ids)."""
    if getattr(model.config, "apply_rope_fusion", False):
        return False
    for layer in model.decoder.layers:
        rope = layer.self_attention.rotary_pos_emb
        if getattr(rope, "_explicit_positions", False):
            continue
        original = rope.forward

        def forward(self, max_seq_len: int, offset: int = 0, packed_seq: bool = False, cp_group=None,
                    _original=original):
            pos = _CURRENT[0]
            if pos is None:
                return _original(max_seq_len, offset, packed_seq, cp_group)
            out = _original(int(pos.max()) + 1, 0, packed_seq, cp_group)
            table, rest = (out[0], out[1:]) if isinstance(out, tuple) else (out, ())
            picked = table[:, 0, 0, :][pos.to(table.device)].transpose(0, 1)[:, :, None, :]  # [s, b, 1, d]
            return (picked, *rest) if rest else picked

        rope.forward = types.MethodType(forward, rope)
        rope._explicit_positions = True
    return True


@contextlib.contextmanager
def explicit_positions(position_ids: torch.Tensor | None) -> Iterator[None]:
    """Forward calls inside use `position_ids` [b, s] for RoPE (None: megatron's default)."""
    previous, _CURRENT[0] = _CURRENT[0], position_ids
    try:
        yield
    finally:
        _CURRENT[0] = previous
