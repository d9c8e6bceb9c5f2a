"""Cut a `Batch` shard into model-ready micro-batches (`Micro`) and put per-token results back.

RL layout: `input_ids` [B, P+R] (prompt left-padded to P, response right-padded to R) with
`attention_mask`; the logits for response token j sit at column P-1+j. Each micro-batch is trimmed to
the columns some row actually uses (all-padding columns on the left and right are dropped), which
changes nothing for the real tokens: RoPE depends only on relative positions and padding keys are
masked. LM layout (`train_lm_step`): `input_ids` [B, S] with `attention_mask` and `loss_mask`.
"""

from __future__ import annotations

import torch

from workers.batch import Batch
from workers.megatron.engine import Micro


def attention_mask_4d(attn: torch.Tensor) -> torch.Tensor:
    """[b, s] 1 on real tokens -> [b, 1, s, s] bool, True where attention is masked (future or padding)."""
    s = attn.shape[1]
    causal = torch.triu(torch.ones(s, s, dtype=torch.bool, device=attn.device), diagonal=1)
    return (causal[None] | (attn == 0)[:, None, :]).unsqueeze(1)


def position_ids(attn: torch.Tensor) -> torch.Tensor:
    return (attn.long().cumsum(-1) - 1).clamp_min(0)


def make_micro(ids: torch.Tensor, attn: torch.Tensor, fields: dict[str, torch.Tensor],
               device: torch.device, min_cols: int = 0) -> Micro:
    """A Micro of the columns [lo, hi) that hold real tokens (hi >= min_cols so the caller's slices exist)."""
    used = attn.bool().any(0).nonzero().flatten()
    lo = int(used.min()) if used.numel() else 0
    hi = int(used.max()) + 1 if used.numel() else 1
    lo, hi = min(lo, max(min_cols - 1, 0)), max(hi, min(min_cols, ids.shape[1]))
    ids, attn = ids[:, lo:hi].to(device), attn[:, lo:hi].to(device)
    return Micro(ids, position_ids(attn), attention_mask_4d(attn).to(device),
                 {k: v.to(device) for k, v in fields.items()}, offset=lo)


def response_micros(batch: Batch, micro_batch_size: int, keys: list[str], device: torch.device) -> list[Micro]:
    """Micro-batches of an RL batch; `fields` carry `keys` (e.g. responses, advantages) and `prompt_len`."""
    r = batch["responses"].shape[1]
    p = batch["input_ids"].shape[1] - r
    out = []
    for chunk in batch.chunks(max(1, micro_batch_size)):
        fields = {k: chunk[k] for k in keys if k in chunk}
        micro = make_micro(chunk["input_ids"], chunk["attention_mask"], fields, device, min_cols=p)
        micro.fields["_resp_col"] = torch.tensor(p - 1 - micro.offset)
        out.append(micro)
    return out


def response_slice(micro: Micro, output: torch.Tensor) -> tuple[torch.Tensor, int]:
    """The model output [b, s, ...] at the columns that predict response tokens: [b, R_eff, ...], R_eff."""
    start = int(micro.fields["_resp_col"])
    r_eff = max(0, min(micro.fields["responses"].shape[1], output.shape[1] - start - 1))
    return output[:, start:start + r_eff], r_eff


def pad_right(x: torch.Tensor, width: int, value: float = 0.0) -> torch.Tensor:
    """Right-pad dim 1 of [b, w] to `width`."""
    if x.shape[1] >= width:
        return x[:, :width]
    return torch.nn.functional.pad(x, (0, width - x.shape[1]), value=value)
