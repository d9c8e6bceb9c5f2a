"""The async buffer's admission policies on a long-tail length mix: 1 prompt in 8 answers 8x longer.

Dropping stale groups (`admission: drop_stale`) drops the long answers, which span the most syncs, so the
trained lengths fall short of what the policy samples; `admission: cap` bounds staleness when a group starts
and drops none, so the trained mean length stays within 10% of the sampled one.

The engine is scripted here (a response's length is set by its prompt), because the subject is the buffer's
bookkeeping across rounds and syncs, and a real engine cannot be made to answer at a chosen length; the
rounds on a real engine are tests/rollout/test_partial_rollouts.py's."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from rlhf.driver.rl.async_buffer import AsyncRollout
from workers.batch import Batch, pad_sequences
from workers.rollout import SamplingConfig

SHORT, LONG, CHUNK = 8, 64, 8  # tokens; a round gives an unfinished sample CHUNK more
WANT, STEPS = 8, 40  # groups a step; steps run


class Scripted:
    """`start(batch, params)` of an engine whose answer to a prompt is LONG tokens when its text says "long",
    else SHORT, given CHUNK (the round's max_tokens) at a time; `.result(score)` gives the round's Batch."""

    def __init__(self) -> None:
        self.rounds = 0

    def __call__(self, batch: Batch, params: Any) -> Any:
        rows = []
        for ids, text in zip(batch["prompt_ids"], batch["prompt"]):
            target, done = (LONG if "long" in text else SHORT), len(ids) - 1  # every prompt is 1 token
            new = min(params.max_tokens, target - done)
            rows.append(([7] * new, "stop" if done + new == target and target < LONG else "length"))
        self.rounds += 1
        responses, mask = pad_sequences([r for r, _ in rows])
        out = Batch(tensors={"responses": responses, "response_mask": mask,
                             "rollout_logprobs": torch.zeros(responses.shape, dtype=torch.float32)},
                    meta={"response_text": ["x" * len(r) for r, _ in rows], "finish_reason": [f for _, f in rows]})

        class Done:
            def result(self, score: Any = None) -> Batch:
                return out

        return Done()


def encode(records: list[dict[str, Any]]) -> tuple[list[list[int]], list[str]]:
    return [[1] for _ in records], [r["prompt"] for r in records]


def run(admission: str) -> tuple[float, float, dict[str, float]]:
    """STEPS steps of take, then sync (one background round between them); the mean trained length, the
    policy's mean answer length over the prompts drawn, and the summed metrics."""
    drawn: list[dict[str, Any]] = []

    def draw() -> list[dict[str, Any]]:
        batch = [{"prompt": "long" if (len(drawn) + i) % 8 == 0 else "short"} for i in range(WANT)]
        drawn.extend(batch)
        return batch

    sampling = SamplingConfig(n=2, temperature=1.0, max_tokens=LONG, seed=0)
    buf = AsyncRollout(Scripted(), encode, sampling, partial_tokens=CHUNK, max_staleness=1, background_rounds=1,
                       admission=admission)
    trained: list[int] = []
    totals: dict[str, float] = {}
    for version in range(1, STEPS + 1):
        batch, metrics = buf.take(draw(), draw, version)
        trained += batch["response_mask"].sum(-1).tolist()
        for k, v in metrics.items():
            totals[k] = totals.get(k, 0.0) + v
        buf.collect(version)  # the sync: the background round finishes on the old weights
    sampled = sum(LONG if r["prompt"] == "long" else SHORT for r in drawn) / len(drawn)
    return sum(trained) / len(trained), sampled, totals


@pytest.mark.parametrize("admission", ["drop_stale", "cap"])
def test_trained_lengths_follow_the_sampled_ones_only_without_drops(admission):
    trained, sampled, totals = run(admission)
    assert sampled == pytest.approx((7 * SHORT + LONG) / 8, rel=0.05)
    if admission == "cap":
        assert totals["rollout/stale_dropped"] == 0
        assert abs(trained - sampled) <= 0.10 * sampled, (trained, sampled)
    else:  # the bias this policy has: the long groups are the dropped ones, in the longest quarters
        assert totals["rollout/stale_dropped"] > 0
        assert trained < 0.7 * sampled, (trained, sampled)
        dropped = [totals[f"rollout/stale_dropped/length_q{q}"] for q in range(1, 5)]
        assert sum(dropped) == totals["rollout/stale_dropped"] and sum(dropped[1:]) > 0, dropped
