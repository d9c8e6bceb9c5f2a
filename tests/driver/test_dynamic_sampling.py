"""Dynamic sampling (DAPO) keeps only informative groups; the batch it hands the trainer is made of whole
groups and divides into algorithm.mini_batches x DP, so the train step's split cannot fail mid-run."""

from __future__ import annotations

import pytest
import torch

from rlhf.config import RunConfig
from rlhf.driver.rl.grpo import informative_groups, train_divisor, whole_groups_dividing
from workers.batch import Batch


def batch_of(scores_per_group: list[list[float]]) -> Batch:
    scores = [s for group in scores_per_group for s in group]
    gid = [g for g, group in enumerate(scores_per_group) for _ in group]
    return Batch({"scores": torch.tensor(scores), "input_ids": torch.arange(len(scores))[:, None]},
                 meta={"group_id": gid})


def test_informative_groups_drop_the_groups_of_equal_scores():
    b = informative_groups(batch_of([[1, 1, 1, 1], [0, 1, 0, 0], [0, 0, 0, 0], [1, 0, 1, 1]]))
    assert list(b["group_id"]) == [1] * 4 + [3] * 4
    assert b["input_ids"][:, 0].tolist() == [4, 5, 6, 7, 12, 13, 14, 15]


@pytest.mark.parametrize(("groups", "divisor", "rows"), [
    (3, 8, 8),    # 3 groups of 4 = 12 rows, 8 divides 8 (two groups)
    (3, 4, 12),   # all three fit
    (1, 8, 0),    # one group of 4 cannot make 8: none
    (5, 6, 12),   # 20 rows; 12 (three groups) is the largest whole-group prefix divisible by 6
])
def test_whole_groups_dividing_keeps_the_longest_fitting_prefix(groups, divisor, rows):
    b = whole_groups_dividing(batch_of([[0, 1, 0, 1]] * groups), divisor)
    assert len(b) == rows and len(b) % divisor == 0
    assert b["input_ids"][:, 0].tolist() == list(range(rows))


def test_train_divisor_is_mini_batches_times_the_dp_sizes_lcm():
    cfg = RunConfig()
    cfg.algorithm.mini_batches, cfg.policy.parallel.dp, cfg.critic.parallel.dp = 2, 2, 3
    cfg.critic.enabled = False
    assert train_divisor(cfg) == 4
    cfg.critic.enabled = True
    cfg.algorithm.mini_batches = 3
    assert train_divisor(cfg) == 18


class _Rollout:
    """Stands in for the engines in a test of the step's bookkeeping alone (the real stack runs in
    tests/driver/test_rl_e2e.py::test_grpo_two_steps with dynamic sampling on): prompt p's n samples all
    score `p["score"]` when it is a number (an uninformative group), else 0 and 1 alternately."""

    version, n = 0, 4

    def __init__(self) -> None:
        self.calls: list[int] = []

    def _batch(self, prompts: list[dict]) -> Batch:
        scores_per_group = [[p["score"]] * self.n if p["score"] is not None else [0.0, 1.0] * (self.n // 2)
                            for p in prompts]
        b = batch_of(scores_per_group)
        b["input_ids"] = torch.ones(len(b), 5, dtype=torch.long)  # 2 prompt + 3 response columns
        b["responses"] = torch.ones(len(b), 3, dtype=torch.long)
        b.meta["policy_version"] = [0] * len(b)
        return b

    def generate(self, prompts: list[dict], score=None, seed=None) -> Batch:
        self.calls.append(len(prompts))
        return score(self._batch(prompts)) if score else self._batch(prompts)

    def pop_metrics(self) -> dict:
        return {}


def test_refill_rounds_draw_the_missing_groups_times_the_oversample_factor():
    from types import SimpleNamespace

    from rlhf.driver.infra.metrics import PhaseTimer
    from rlhf.driver.rl.context import StepContext
    from rlhf.driver.rl.grpo import generate_and_score

    cfg = RunConfig()
    cfg.rollout.n, cfg.algorithm.dynamic_sampling, cfg.algorithm.oversample_factor = 4, True, 1.5
    cfg.algorithm.mini_batches = 1
    drawn: list[int] = []
    stream = iter([{"score": None}, {"score": 1.0}] * 50)  # every other drawn prompt is informative

    def next_prompts(k: int | None = None) -> list[dict]:
        drawn.append(k)
        return [next(stream) for _ in range(k or 8)]

    rollout = _Rollout()
    roles = SimpleNamespace(rollout=rollout, reward=lambda b: b)
    prompts = [{"score": 1.0}] * 6 + [{"score": None}] * 2  # 2 of 8 groups informative: 6 missing
    ctx = StepContext(cfg, 1, prompts, None, next_prompts, PhaseTimer())
    out = generate_and_score(roles, ctx)
    # the step's 8 prompts (no rollout source: generated directly); round 1: 6 missing -> ceil(6 x 1.5) = 9
    # prompts, 5 informative -> 7 groups; round 2: 1 missing -> 2
    assert drawn == [9, 2] and rollout.calls == [8, 9, 2], (drawn, rollout.calls)
    assert len(out) == 8 * 4 and ctx.metrics["dynamic_sampling/kept_fraction"] == 1.0
    assert ctx.metrics["dynamic_sampling/rounds"] == 2 and ctx.metrics["dynamic_sampling/extra_prompts"] == 11
