"""The `agent/*` metrics of a rollout, and their merge across engines.

Counts and times (`agent/tool_calls`, `agent/tool_errors`, `agent/tool_errors/<kind>`, `agent/env_errors`,
`agent/tool_time_s`) add up across engines; per-trajectory means (`MEANS`) are averaged weighted by each
engine's number of trajectories, so the merged value is the mean over all trajectories.
"""

from __future__ import annotations

from collections.abc import Sequence

PREFIX = "agent/"
MEANS = ("agent/turns_mean", "agent/tool_calls_per_trajectory", "agent/truncated", "agent/env_reward_mean")


def merge_agent_metrics(parts: Sequence[tuple[dict[str, float], int]]) -> dict[str, float]:
    """Merge (an engine's info, its number of trajectories) pairs: sums of the counts, trajectory-weighted
    means of `MEANS`. A key an engine did not report (an error kind it never saw) counts 0 there."""
    keys = sorted({k for info, _ in parts for k in info if k.startswith(PREFIX)})
    total = sum(n for _, n in parts)
    out: dict[str, float] = {}
    for k in keys:
        if k in MEANS:
            out[k] = sum(float(info.get(k, 0.0)) * n for info, n in parts) / max(total, 1)
        else:
            out[k] = sum(float(info.get(k, 0.0)) for info, _ in parts)
    return out
