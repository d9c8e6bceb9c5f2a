"""The warm start's length buckets: a batch of short answers and long traces runs as several forwards whose
update equals the single padded batch's."""

from __future__ import annotations

import copy

import pytest
import torch

from rlhf.driver.warmstart.hf_sft import _padded, length_buckets, warm_start_optimizer, warm_start_update


def test_length_buckets_group_by_ratio():
    lengths = [150, 30, 32, 148, 40, 90]
    groups = length_buckets(lengths, ratio=1.5)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    assert [[lengths[i] for i in g] for g in groups] == [[30, 32, 40], [90], [148, 150]]
    assert length_buckets([]) == []


def test_bucketed_update_equals_one_padded_batch(tiny_model_factory):
    from transformers import AutoModelForCausalLM

    gen = torch.Generator().manual_seed(0)
    items = []
    for n in (40, 9, 38, 7, 12):  # long and short items, targets on their second halves
        seq = torch.randint(3, 200, (n,), generator=gen).tolist()
        items.append((seq, [0] * (n // 2) + [1] * (n - n // 2)))
    base = AutoModelForCausalLM.from_pretrained(tiny_model_factory("tiny-qwen2"), dtype=torch.float32)
    results = []
    for parts in ([_padded(items, 0)],
                  [_padded([items[i] for i in g], 0) for g in length_buckets([len(s) for s, _ in items])]):
        model = copy.deepcopy(base)
        opt, sched = warm_start_optimizer(model, 1e-3, 10)
        loss = warm_start_update(model, opt, sched, parts)
        results.append((loss, [p.detach().clone() for p in model.parameters()]))
    assert len(length_buckets([len(s) for s, _ in items])) > 1
    assert results[0][0] == pytest.approx(results[1][0], rel=1e-5)
    for a, b in zip(results[0][1], results[1][1]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
