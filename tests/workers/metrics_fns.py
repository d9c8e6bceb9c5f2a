"""Rank function for test_metrics_reduce.py (module level so spawned ranks can import it)."""

from __future__ import annotations


def reduce_metrics_over_ranks() -> dict[str, float]:
    """Each rank records its own sums, token-weighted means and maxima; all reduce them over the world."""
    import torch

    from workers.roles.optimize import Metrics

    rank = torch.distributed.get_rank()
    acc = Metrics()
    for micro in range(2):  # two micro-batches per rank
        value = float(10 * rank + micro)
        acc.add_sum({"tokens": 3.0})
        acc.add_mean({"ratio": value}, weight=1.0 + rank)
        acc.add_max({"ratio_max": value, "diff_max": -value})
    return acc.reduce(torch.distributed.group.WORLD, True, torch.device("cpu"))
