"""Context parallelism: each sequence of a micro-batch split over the `cp` ranks of a context-parallel group.

The columns of a row are cut into 2 x cp equal chunks and rank r holds chunks r and 2cp-1-r, so every rank
gets the same share of the causal attention work (megatron-core's load-balanced order). A rank runs its
chunks' tokens through the whole model; only attention needs the other ranks' tokens. The core attention
here (`context_parallel_attention`) all-gathers the keys and values over the group, puts them back in
sequence order and attends to them with the rows of the batch's own mask that belong to this rank's
queries, so padding, packing and prefix-sharing masks work unchanged. Its backward sums the key / value
gradients of every rank's queries. The output (logits or values) is gathered the same way, so the losses
see whole rows; every rank of the group computes the same loss, and the backward keeps each rank's own
columns, so the ranks' gradients sum to the whole sequence's. Megatron DDP reduces the gradients over the
data x context parallel ranks and divides by the data-parallel size only, which is that sum (measured: the
gradient norm equals CP1's).

This all-gather scheme keeps the full K / V of a layer on each rank (not the ring of Transformer Engine's
`p2p` kernels), while the activations of every other layer part shrink by cp. It runs on CPU over gloo and
on GPU the same way.
"""

from __future__ import annotations

from typing import Any

import torch


def local_columns(seq_len: int, cp: int, rank: int, device: torch.device | str | None = None) -> torch.Tensor:
    """Column indices (into a row of `seq_len`, a multiple of 2 x cp) held by context-parallel `rank`."""
    if seq_len % (2 * cp):
        raise ValueError(f"sequence length {seq_len} is not a multiple of 2 x cp = {2 * cp}")
    chunk = seq_len // (2 * cp)
    first = torch.arange(rank * chunk, (rank + 1) * chunk, device=device)
    second = torch.arange((2 * cp - 1 - rank) * chunk, (2 * cp - rank) * chunk, device=device)
    return torch.cat([first, second])


def sequence_order(seq_len: int, cp: int, device: torch.device | str | None = None) -> torch.Tensor:
    """The permutation that puts the concatenation of every rank's local columns (rank 0's, rank 1's, ...)
    back into sequence order: `gathered[..., sequence_order]` is the whole row."""
    held = torch.cat([local_columns(seq_len, cp, r, device) for r in range(cp)])
    return torch.argsort(held)


class _GatherSequence(torch.autograd.Function):
    """All-gather along `dim` over the CP group into sequence order. Backward: `reduce` sums the gradient
    over the group first (the gathered tensor fed different computations on each rank, as K and V do);
    without it each rank keeps its own columns of the gradient (every rank computed the same function of
    the gathered tensor, as the loss is)."""

    @staticmethod
    def forward(ctx: Any, local: torch.Tensor, dim: int, group: Any, reduce: bool) -> torch.Tensor:
        cp, rank = torch.distributed.get_world_size(group), torch.distributed.get_rank(group)
        parts = [torch.empty_like(local) for _ in range(cp)]
        torch.distributed.all_gather(parts, local.contiguous(), group=group)
        whole = torch.cat(parts, dim=dim)
        seq = whole.shape[dim]
        ctx.dim, ctx.group, ctx.reduce = dim, group, reduce
        ctx.mine = local_columns(seq, cp, rank, local.device)
        return whole.index_select(dim, sequence_order(seq, cp, local.device))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        grad = grad.contiguous()
        if ctx.reduce:
            torch.distributed.all_reduce(grad, group=ctx.group)
        return grad.index_select(ctx.dim, ctx.mine), None, None, None


def gather_sequence(local: torch.Tensor, dim: int, group: Any, reduce: bool = False) -> torch.Tensor:
    """Every rank's columns of `local` along `dim`, in sequence order (see `_GatherSequence`)."""
    return _GatherSequence.apply(local, dim, group, reduce)


def context_parallel_attention(base: type) -> type:
    """A subclass of megatron's core attention class `base` (DotProductAttention or one taking its
    arguments) that attends this rank's queries to the whole sequence's keys and values (module docstring).
    The model's TransformerConfig keeps context_parallel_size 1 (megatron-core 0.16.1's local core attention
    refuses more): the split is this module's, over parallel_state's context-parallel group."""

    class ContextParallelAttention(base):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            from megatron.core import parallel_state as ps

            super().__init__(*args, **kwargs)
            self.cp_group = ps.get_context_parallel_group()

        def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    attention_mask: torch.Tensor | None, *args: Any, **kwargs: Any) -> torch.Tensor:
            key = gather_sequence(key, 0, self.cp_group, reduce=True)  # [s, b, groups, head dim]
            value = gather_sequence(value, 0, self.cp_group, reduce=True)
            return super().forward(query, key, value, attention_mask, *args, **kwargs)

    ContextParallelAttention.__name__ = f"ContextParallel{base.__name__}"
    return ContextParallelAttention


def with_context_parallel_attention(spec: Any) -> Any:
    """`spec` (a GPT layer spec or a decoder block spec) with every layer's core attention replaced by
    `context_parallel_attention` of it; Transformer Engine's core attention becomes megatron's local one."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    for layer in getattr(spec, "layer_specs", None) or [spec]:
        sub = layer.submodules.self_attention.submodules
        core = sub.core_attention
        base = core if isinstance(core, type) and issubclass(core, DotProductAttention) else DotProductAttention
        sub.core_attention = context_parallel_attention(base)
    return spec
