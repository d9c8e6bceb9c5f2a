"""Cut a `Batch` shard into model-ready micro-batches (`Micro`) and put per-token results back.

RL layout: `input_ids` [B, P+R] (prompt left-padded to P, response right-padded to R) with
`attention_mask`; the logits for response token j sit at column P-1+j. Each micro-batch is trimmed to
the columns some row actually uses (all-padding columns on the left and right are dropped), which
changes nothing for the real tokens: RoPE depends only on relative positions and padding keys are
masked. LM layout (`train_lm_step`): `input_ids` [B, S] with `attention_mask` and `loss_mask`.

Packing (`pack=True`, the default of the roles): the real tokens of the batch's sequences are laid end
to end, first-fit-decreasing into as few rows as possible (none longer than the longest sequence), with
a block-diagonal causal mask, and `micro_batch_size` rows make a micro-batch. Little compute is spent on
padding (the RL batch is padded to the longest prompt and response of the whole batch); the losses are
split-invariant (global normaliser), so regrouping the samples does not change the gradients. Each sequence sees only itself, and RoPE
depends only on relative positions, so the results equal the padded ones up to float rounding. The
model output is gathered back to [b, R, ...] by `response_slice`.
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


def response_micros(batch: Batch, micro_batch_size: int, keys: list[str], device: torch.device,
                    pack: bool = False) -> list[Micro]:
    """Micro-batches of an RL batch; `fields` carry `keys` (e.g. responses, advantages). Fields whose
    name starts with '_' are bookkeeping for `response_slice` / `restore_order`.

    Unpacked: `micro_batch_size` consecutive rows per micro-batch. Packed: the batch's sequences are
    packed first-fit-decreasing into rows no longer than the longest sequence, and
    `micro_batch_size` such rows form a micro-batch (so a micro-batch holds at least as many
    sequences, with far less padding); the samples' order changes, `_index` records it."""
    r = batch["responses"].shape[1]
    p = batch["input_ids"].shape[1] - r
    if pack:
        return packed_micros(batch, p, max(1, micro_batch_size), keys, device)
    out = []
    for chunk in batch.chunks(max(1, micro_batch_size)):
        fields = {k: chunk[k] for k in keys if k in chunk}
        micro = make_micro(chunk["input_ids"], chunk["attention_mask"], fields, device, min_cols=p)
        micro.fields["_resp_col"] = torch.tensor(p - 1 - micro.offset)
        out.append(micro)
    return out


def first_fit_decreasing(lens: list[int], cap: int) -> list[list[int]]:
    """Indices of `lens` packed into bins of total length <= cap (longest first; deterministic)."""
    bins: list[list[int]] = []
    fill: list[int] = []
    for i in sorted(range(len(lens)), key=lambda k: (-lens[k], k)):
        row = next((r for r, f in enumerate(fill) if f + lens[i] <= cap), None)
        if row is None:
            bins.append([])
            fill.append(0)
            row = len(bins) - 1
        bins[row].append(i)
        fill[row] += lens[i]
    return bins


def packed_micros(batch: Batch, p: int, rows_per_micro: int, keys: list[str], device: torch.device) -> list[Micro]:
    """Pack every row's real span [first real token, last real token] (see `response_micros`)."""
    ids, attn = batch["input_ids"], batch["attention_mask"].bool()
    width = ids.shape[1]
    cols = torch.arange(width)
    lo = torch.where(attn, cols, torch.full_like(cols, width)).min(1).values.clamp(max=p - 1)  # logit of resp 0
    hi = torch.where(attn, cols + 1, torch.zeros_like(cols)).max(1).values.clamp(min=p)
    lens = (hi - lo).tolist()
    bins = first_fit_decreasing(lens, max(lens, default=1))
    micros = []
    for k in range(0, len(bins), rows_per_micro):
        rows = bins[k:k + rows_per_micro]
        members = [i for row in rows for i in row]
        w = max(sum(lens[i] for i in row) for row in rows)
        tokens = torch.zeros(len(rows), w, dtype=ids.dtype)
        seg = torch.full((len(rows), w), -1, dtype=torch.long)
        pos = torch.zeros(len(rows), w, dtype=torch.long)
        start = {}
        for r, row in enumerate(rows):
            o = 0
            for i in row:
                n = lens[i]
                tokens[r, o:o + n] = ids[i, lo[i]:hi[i]]
                seg[r, o:o + n] = i
                pos[r, o:o + n] = torch.arange(n)
                start[i] = r * w + o
                o += n
        causal = torch.triu(torch.ones(w, w, dtype=torch.bool), diagonal=1)
        mask = (causal[None] | (seg[:, :, None] != seg[:, None, :])).unsqueeze(1)  # [rows, 1, w, w]
        m_idx = torch.tensor(members, dtype=torch.long)
        m_lo, m_hi = lo[m_idx], hi[m_idx]
        m_start = torch.tensor([start[i] for i in members], dtype=torch.long)
        r_eff = int((m_hi - p).max())
        j = torch.arange(r_eff)
        gather = m_start[:, None] + (p - 1 - m_lo)[:, None] + j[None, :]  # [b, R_eff] into the flat output
        gather = torch.where(j[None, :] < (m_hi - p)[:, None], gather, m_start[:, None])  # padding: a real slot
        fields = {k: batch[k][m_idx].to(device) for k in keys if k in batch}
        fields |= {"_gather": gather.to(device), "_index": m_idx}
        micros.append(Micro(tokens.to(device), pos.to(device), mask.to(device), fields))
    return micros


def restore_order(parts: list[torch.Tensor], indices: list[torch.Tensor]) -> torch.Tensor:
    """Concatenate per-micro-batch results [b_i, ...] and put row k back at position indices[k]."""
    values, index = torch.cat(parts), torch.cat(indices)
    out = torch.empty_like(values)
    out[index] = values
    return out


def response_slice(micro: Micro, output: torch.Tensor) -> tuple[torch.Tensor, int]:
    """The model output [b, s, ...] at the positions that predict response tokens: [b, R_eff, ...], R_eff
    (packed micro-batches: output [1, S, ...] gathered per row)."""
    if "_gather" in micro.fields:
        idx = micro.fields["_gather"]
        return output.reshape(-1, *output.shape[2:])[idx], idx.shape[1]
    start = int(micro.fields["_resp_col"])
    r_eff = max(0, min(micro.fields["responses"].shape[1], output.shape[1] - start - 1))
    return output[:, start:start + r_eff], r_eff


def pad_right(x: torch.Tensor, width: int, value: float = 0.0) -> torch.Tensor:
    """Right-pad dim 1 of [b, w] to `width`."""
    if x.shape[1] >= width:
        return x[:, :width]
    return torch.nn.functional.pad(x, (0, width - x.shape[1]), value=value)
