"""Log-probabilities and entropy from vocab-parallel logits (each TP rank holds a vocab slice).

The logits of a TP rank are [..., V/tp] for vocab ids [rank*V/tp, (rank+1)*V/tp). Columns at or past
the real vocab size (Megatron pads the vocab) are excluded. The reductions over the vocab use
all-reduces whose backward is the identity (megatron's `reduce_from_tensor_model_parallel_region`),
so gradients are right on every rank. With TP=1 this is plain log-softmax arithmetic.
"""

from __future__ import annotations

from typing import Any

import torch

from workers.megatron.dist_setup import tp_layout


def vocab_parallel_logprobs(
    logits: torch.Tensor, labels: torch.Tensor, vocab_size: int, with_entropy: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(log p(labels), entropy or None) from local logits [..., V_local] and labels [...]; float32."""
    from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

    rank, world, group = tp_layout()
    v_local = logits.shape[-1]
    start = rank * v_local
    z = logits.float()
    n_real = vocab_size - start
    if n_real < v_local:
        pad = torch.arange(v_local, device=z.device) >= max(n_real, 0)
        z = z.masked_fill(pad, float("-inf"))
    m = z.detach().max(dim=-1).values
    if world > 1:
        torch.distributed.all_reduce(m, op=torch.distributed.ReduceOp.MAX, group=group)
    shifted = z - m.unsqueeze(-1)
    e = torch.exp(shifted)
    s = e.sum(dim=-1)
    in_shard = (labels >= start) & (labels < start + v_local)
    idx = (labels - start).clamp(0, v_local - 1).long()
    picked = torch.where(in_shard, shifted.gather(-1, idx.unsqueeze(-1)).squeeze(-1), torch.zeros_like(m))
    if world > 1:
        s = reduce_from_tensor_model_parallel_region(s)
        picked = reduce_from_tensor_model_parallel_region(picked)
    log_s = torch.log(s)
    logp = picked - log_s
    if not with_entropy:
        return logp, None
    # H = log S - sum_v p_v * shifted_v   (shifted = z - m; padded columns have p = 0)
    p_shift = (e * torch.where(torch.isfinite(shifted), shifted, torch.zeros_like(shifted))).sum(dim=-1)
    if world > 1:
        p_shift = reduce_from_tensor_model_parallel_region(p_shift)
    entropy = log_s - p_shift / s
    return logp, entropy


def _real_vocab_slice(logits: torch.Tensor, vocab_size: int) -> tuple[torch.Tensor, int, int, Any]:
    """(this TP rank's logits as float32 without gradient, the padded vocab columns at -inf; the slice's first
    vocab id; the TP world size; the TP group)."""
    rank, world, group = tp_layout()
    v_local = logits.shape[-1]
    start = rank * v_local
    z = logits.detach().float()
    n_real = vocab_size - start
    if n_real < v_local:
        z = z.masked_fill(torch.arange(v_local, device=z.device) >= max(n_real, 0), float("-inf"))
    return z, start, world, group


def vocab_parallel_greedy_hits(logits: torch.Tensor, labels: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Bool [...]: True where labels[...] has the largest logit, i.e. is what greedy decoding picks there
    (a tie counts as a hit). No gradient."""
    z, start, world, group = _real_vocab_slice(logits, vocab_size)
    v_local = z.shape[-1]
    m = z.max(dim=-1).values
    in_shard = (labels >= start) & (labels < start + v_local)
    idx = (labels - start).clamp(0, v_local - 1).long()
    picked = torch.where(in_shard, z.gather(-1, idx.unsqueeze(-1)).squeeze(-1), torch.full_like(m, float("-inf")))
    if world > 1:
        torch.distributed.all_reduce(m, op=torch.distributed.ReduceOp.MAX, group=group)
        torch.distributed.all_reduce(picked, op=torch.distributed.ReduceOp.MAX, group=group)
    return picked >= m


def vocab_parallel_argmax(logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Long [...]: the vocab id with the largest logit (the greedy pick), over every TP rank's slice; on a tie
    the largest id. Padded vocab columns never win. No gradient."""
    z, start, world, group = _real_vocab_slice(logits, vocab_size)
    v_local = z.shape[-1]
    local_max = z.max(dim=-1).values
    # the largest id among the local maxima: flip, take the first, flip back
    local_id = v_local - 1 - z.flip(-1).argmax(dim=-1) + start
    if world == 1:
        return local_id
    m = local_max.clone()
    torch.distributed.all_reduce(m, op=torch.distributed.ReduceOp.MAX, group=group)
    ids = torch.where(local_max >= m, local_id, torch.full_like(local_id, -1))
    torch.distributed.all_reduce(ids, op=torch.distributed.ReduceOp.MAX, group=group)
    return ids
