"""Online DPO's pairs (rlhf/driver/rl/online_dpo.py), without workers: each prompt group's best-vs-worst
pair, all-equal groups skipped, ties broken by the first row; the pair batch is the DPO step's layout, with
the loss on the response tokens only (not the prompt, the padding or tool output)."""

from __future__ import annotations

import pytest
import torch

from rlhf.driver.rl.online_dpo import best_worst_pairs, preference_batch
from workers.batch import LM_KEYS, Batch


def scored(groups: list[list[float]]) -> Batch:
    """Rows of `group_id` and `scores`, the groups in order."""
    gid = [g for g, s in enumerate(groups) for _ in s]
    return Batch({"scores": torch.tensor([x for s in groups for x in s])}, {"group_id": gid})


def test_best_and_worst_of_each_group():
    pairs, groups = best_worst_pairs(scored([[0.0, 1.0, 0.5, 0.2], [0.3, -1.0, 2.0, 0.0]]))
    assert (pairs, groups) == ([(1, 0), (6, 5)], 2)


def test_all_equal_groups_are_skipped_and_counted():
    pairs, groups = best_worst_pairs(scored([[1.0, 1.0, 1.0], [0.0, 1.0, 0.0], [0.0, 0.0, 0.0]]))
    assert (pairs, groups) == ([(4, 3)], 3)
    assert best_worst_pairs(scored([[0.5, 0.5], [0.0, 0.0]])) == ([], 2)


def test_ties_take_the_first_row():
    pairs, _ = best_worst_pairs(scored([[0.0, 1.0, 0.0, 1.0], [1.0, 1.0, 0.0, 0.0]]))
    assert pairs == [(1, 0), (4, 6)]


def test_groups_need_not_be_contiguous():
    """The rows of a group found by `group_id`, whatever their order (a refilled or merged batch)."""
    batch = Batch({"scores": torch.tensor([0.0, 5.0, 1.0, 2.0])}, {"group_id": [7, 3, 7, 3]})
    assert best_worst_pairs(batch) == ([(2, 0), (1, 3)], 2)


def rollout_rows() -> Batch:
    """Two rows laid out as the engine returns them: [prompt left-padded to 3 | response right-padded to 4];
    the second response has a tool-output token (response_mask 0 inside the response)."""
    pad = 0
    input_ids = torch.tensor([[pad, 11, 12, 21, 22, 23, pad],
                              [13, 14, 15, 31, 32, 33, 34]])
    attn = (torch.arange(7)[None, :] >= torch.tensor([[1], [0]])) & ~((input_ids == pad) & (torch.arange(7) >= 3))
    response_mask = torch.tensor([[1, 1, 1, 0], [1, 0, 1, 1]])
    return Batch({"input_ids": input_ids, "attention_mask": attn.long(), "responses": input_ids[:, 3:].clone(),
                  "response_mask": response_mask, "scores": torch.tensor([1.0, 0.0])}, {"group_id": [0, 0]})


def test_pair_batch_is_the_dpo_layout():
    batch = rollout_rows()
    pairs, _ = best_worst_pairs(batch)
    assert pairs == [(0, 1)]
    out = preference_batch(batch, pairs)
    assert sorted(out.keys()) == sorted(f"{s}_{k}" for s in ("chosen", "rejected") for k in LM_KEYS)
    width = 6  # the longer sequence (7 ids) less the shift
    assert all(v.shape == (1, width) for v in out.tensors.values())
    # chosen: prompt 11 12, response 21 22 23 (5 ids -> 4 inputs), padded to 6
    assert out["chosen_tokens"][0, :4].tolist() == [11, 12, 21, 22]
    assert out["chosen_labels"][0, :4].tolist() == [12, 21, 22, 23]
    assert out["chosen_loss_mask"][0].tolist() == [0, 1, 1, 1, 0, 0]  # the targets 21 22 23 only
    assert out["chosen_position_ids"][0, :4].tolist() == [0, 1, 2, 3]
    # rejected: prompt 13 14 15, response 31 (model) 32 (tool output) 33 34 (model)
    assert out["rejected_tokens"][0].tolist() == [13, 14, 15, 31, 32, 33]
    assert out["rejected_labels"][0].tolist() == [14, 15, 31, 32, 33, 34]
    assert out["rejected_loss_mask"][0].tolist() == [0, 0, 1, 0, 1, 1]


@pytest.mark.parametrize("override, words", [
    ("rollout.n=1", "rollout.n: expected an integer >= 2 (online_dpo pairs the best and the worst"),
    ("reference.enabled=false", "reference.enabled: algorithm.dpo.loss=sigmoid rewards each answer by its log-prob "
     "ratio to a frozen copy of the starting policy"),
    ("algorithm.dpo.loss=ipo reference.enabled=false", "reference.enabled: algorithm.dpo.loss=ipo"),
    ("algorithm.dpo.loss=kto", "algorithm.dpo.loss=kto: online_dpo trains best-vs-worst pairs"),
    ("algorithm.dpo.beta=0", "algorithm.dpo.beta: expected a number > 0"),
    ("critic.enabled=true", "critic.enabled: online_dpo trains no value model"),
])
def test_online_dpo_config_refusals(override, words):
    from rlhf.config import load_config
    from rlhf.errors import ConfigError

    with pytest.raises(ConfigError) as e:
        load_config("configs/online_dpo_tiny.yaml", override.split())
    assert str(e.value).startswith(words), str(e.value)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("loss", ["simpo", "orpo"])
def test_reference_free_losses_need_no_reference(loss):
    from rlhf.config import load_config

    cfg = load_config("configs/online_dpo_tiny.yaml", [f"algorithm.dpo.loss={loss}", "reference.enabled=false"])
    assert cfg.algorithm.name == "online_dpo" and not cfg.reference.enabled
