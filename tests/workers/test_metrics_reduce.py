"""`Metrics.reduce` over two gloo ranks: sums add up, means weigh by their weights, maxima take the largest."""

from __future__ import annotations

from tests.workers.metrics_fns import reduce_metrics_over_ranks
from workers.megatron.launch import run_distributed


def test_sums_means_and_maxima_over_ranks():
    ranks = run_distributed(reduce_metrics_over_ranks, 2, timeout_s=120)
    assert ranks[0] == ranks[1]
    out = ranks[0]
    assert out["tokens"] == 12.0
    assert out["ratio"] == (1 * (0 + 1) + 2 * (10 + 11)) / (1 * 2 + 2 * 2)  # rank 1's micro-batches weigh 2
    assert out["ratio_max"] == 11.0 and out["diff_max"] == 0.0
