"""Dynamic sampling (DAPO) keeps only informative groups; the batch it hands the trainer is made of whole
groups and divides into algorithm.mini_batches x DP, so the train step's split cannot fail mid-run."""

from __future__ import annotations

import pytest
import torch

from rlhf.config import RunConfig
from rlhf.driver.grpo import informative_groups, train_divisor, whole_groups_dividing
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
