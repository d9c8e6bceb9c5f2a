"""Expert parallelism needs the ranks of an EP group to run their MoE layers together: each micro-batch's
token dispatch is a collective over the group, and megatron-core 0.16.1's allgather dispatcher (the CPU
one) gathers equal token counts from every rank. The data-parallel ranks of a role get different
micro-batches (their own rows, trimmed to their own columns; packing makes their counts differ too).

`align_micros` makes them agree: every rank runs the group's largest number of micro-batches, the i-th
padded to the group's largest i-th [rows, columns]. Padding tokens are masked from attention (each sees
only itself) and from the router losses (`padding`, megatron's MoE `padding_mask`); the extra
micro-batches (`filler`) are run with no loss and no router losses (`MegatronEngine` handles both) and all
their tokens marked as padding (so DeepSeek-V3's expert-bias update does not count them), so the gradients,
metrics and bias updates are those of the real micro-batches. Routing-replay routes are padded with -1 (the
router's own choice) and filler micro-batches replay nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from workers.megatron.masks import causal_mask
from workers.megatron.micro_batch import Micro


@dataclass
class Aligned:
    """A micro-batch as the EP group runs it: the padded `micro`, its real [rows, columns] and
    `padding` ([b, s] bool, True on padding tokens); `filler` micro-batches only keep the group in step."""

    micro: Micro
    rows: int
    cols: int
    padding: torch.Tensor | None = None
    filler: bool = False


def align_micros(micros: list[Micro], group: Any, device: torch.device) -> list[Aligned]:
    """The micro-batches of this rank padded and filled up to the EP group's (collective over `group`)."""
    count = torch.tensor([len(micros)], dtype=torch.long, device=device)
    torch.distributed.all_reduce(count, op=torch.distributed.ReduceOp.MAX, group=group)
    n = int(count.item())
    shapes = torch.zeros(n, 2, dtype=torch.long, device=device)
    for i, m in enumerate(micros):
        shapes[i] = torch.tensor(m.input_ids.shape[:2])
    torch.distributed.all_reduce(shapes, op=torch.distributed.ReduceOp.MAX, group=group)
    out = []
    for i, (b, s) in enumerate(shapes.tolist()):
        if i < len(micros):
            out.append(_pad(micros[i], b, s))
        else:
            ids = torch.zeros(b, s, dtype=torch.long, device=device)
            pos = torch.arange(s, device=device).expand(b, s)
            micro = Micro(ids, pos, causal_mask(s, device=device)[None, None], {})
            padding = torch.ones(b, s, dtype=torch.bool, device=device)  # no token counts for the expert bias
            out.append(Aligned(micro, b, s, padding, filler=True))
    return out


def _pad(m: Micro, b: int, s: int) -> Aligned:
    b0, s0 = m.input_ids.shape[:2]
    padding = torch.ones(b, s, dtype=torch.bool, device=m.input_ids.device)
    padding[:b0, :s0] = False
    if (b0, s0) == (b, s):
        return Aligned(m, b0, s0, padding)
    ids = m.input_ids.new_zeros(b, s)
    ids[:b0, :s0] = m.input_ids
    pos = m.position_ids.new_zeros(b, s)
    pos[:b0, :s0] = m.position_ids
    mb = m.attention_mask.shape[0]
    rows = mb if mb == 1 else b
    mask = torch.ones(rows, 1, s, s, dtype=torch.bool, device=m.attention_mask.device)
    mask[:mb, :, :s0, :s0] = m.attention_mask
    idx = torch.arange(s, device=mask.device)
    mask[:, :, idx[s0:], idx[s0:]] = False  # a padding column sees itself (no fully masked row)
    if rows > mb:
        mask[mb:, :, idx, idx] = False
    routes = None
    if m.routes is not None:
        routes = m.routes.new_full((b, s, *m.routes.shape[2:]), -1)
        routes[:b0, :s0] = m.routes
    micro = Micro(ids, pos, mask, m.fields, offset=m.offset, explicit_positions=m.explicit_positions, routes=routes)
    return Aligned(micro, b0, s0, padding)


def round_columns(run: Aligned, multiple: int) -> Aligned:
    """`run` with its columns padded up to a multiple of `multiple` (sequence parallelism splits the sequence
    over the TP ranks); the added columns are padding like EP alignment's."""
    m = run.micro
    b, s = m.input_ids.shape[:2]
    if s % multiple == 0:
        return run
    width = -(-s // multiple) * multiple
    if run.filler:
        ids = m.input_ids.new_zeros(b, width)
        pos = torch.arange(width, device=ids.device).expand(b, width)
        filler = Micro(ids, pos, causal_mask(width, device=ids.device)[None, None], {})
        return Aligned(filler, b, width, filler=True)
    out = _pad(m, b, width)
    if run.padding is not None:
        out.padding[:, :s] |= run.padding
    return Aligned(out.micro, run.rows, run.cols, out.padding)
