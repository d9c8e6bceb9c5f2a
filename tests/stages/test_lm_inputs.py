"""Pretraining / SFT stage pieces that need no workers: input checks (before Ray starts), the sample
order, packed attention masks and checkpoint paths."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from rlhf.config import load_config
from rlhf.errors import ConfigError, UserError
from tests.helpers.lm import lm_overrides

pytestmark = pytest.mark.usefixtures("no_ray")  # each test proves bad input fails before any Ray starts

def _run(inputs, algo, tmp_path, *extra):
    import ray

    from rlhf.driver.stages.lm import run_lm

    cfg = load_config(None, lm_overrides(inputs, algo, tmp_path / "run", *extra))
    try:
        return run_lm(cfg)
    finally:
        assert not ray.is_initialized(), "bad input must fail before Ray starts"


@pytest.mark.parametrize("extra, match", [
    (("model.tokenizer_path=/no/such/tokenizer",), r"model.tokenizer_path: tokenizer folder /no/such/tokenizer"),
    (("data.data_prefix=[/no/such/prefix]",), r"data.data_prefix: data prefix /no/such/prefix: missing"),
    (("trainer.load=/no/such/run",), r"trainer.load: /no/such/run is not a checkpoint"),
])
def test_bad_pretrain_inputs_fail_before_workers(lm_inputs, tmp_path, extra, match):
    with pytest.raises(UserError, match=match):
        _run(lm_inputs, "pretrain", tmp_path, *extra)


def test_zero_token_prefix_and_empty_split(lm_inputs, tmp_path):
    from rlhf.data.indexed import IndexedWriter

    empty = tmp_path / "empty_text_document"
    with IndexedWriter(empty, np.uint16) as w:
        w.add([])
    with pytest.raises(UserError, match=r"data.data_prefix: data prefix .*empty_text_document has zero tokens"):
        _run(lm_inputs, "pretrain", tmp_path, f"data.data_prefix=[{empty}]")
    with pytest.raises(UserError, match=r"data.data_prefix: .*split '1,1000000,0' leaves the train split"):
        _run(lm_inputs, "pretrain", tmp_path, "data.split=1,1000000,0")


def test_bad_sft_inputs(lm_inputs, tmp_path):
    with pytest.raises(UserError, match=r"data.train_file: .*/no/such.jsonl"):
        _run(lm_inputs, "sft", tmp_path, "data.train_file=/no/such.jsonl")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"messages": [{"role": "user", "content": "hi"}]}\n')
    with pytest.raises(UserError, match=r"data.train_file: .*bad.jsonl:1: the conversation has no assistant turn"):
        _run(lm_inputs, "sft", tmp_path, f"data.train_file={bad}")


@pytest.mark.parametrize("extra, match", [
    (("data.split=90,x",), r"data.split: split '90,x' does not parse"),
    (("data.seq_length=4096",), r"data.seq_length: expected at most the model's max_position_embeddings \(512\)"),
    (("trainer.no_load_optim=true",), r"trainer.no_load_optim applies to trainer.load"),
    (("data.data_prefix=[]",), r"data.data_prefix: pretraining needs"),
    (("trainer.global_batch_size=7",), r"not divisible by policy.micro_batch_size"),
])
def test_bad_config_is_a_config_error(lm_inputs, tmp_path, extra, match):
    with pytest.raises(ConfigError, match=match):
        load_config(None, lm_overrides(lm_inputs, "pretrain", tmp_path, *extra))


def test_sample_order_resumes_and_reshuffles():
    from rlhf.driver.stages.lm_data import SampleOrder

    a = SampleOrder(range(5), seed=3, shuffle=True)
    first = a.take(7)
    b = SampleOrder(range(5), seed=3, shuffle=True)
    b.load_state_dict(a.state_dict())
    assert a.take(6) == b.take(6)
    assert sorted(first[:5]) == list(range(5)) and first[:5] != SampleOrder(range(5), 4, True).take(5)
    assert SampleOrder([7, 8], seed=0, shuffle=False).take(3) == [7, 8, 7]


def test_packed_mask_from_positions(lm_inputs):
    from rlhf.data.sft import SFTDataset
    from workers.roles.lm import lm_attention_mask

    ds = SFTDataset(lm_inputs["sft_train"], lm_inputs["model"], 64, pack=True)
    batch = ds.collate([ds[i] for i in range(4)])
    expected = []  # causal within each packed sample (and the padding tail), blocked across them
    for row in ds.rows[:4]:
        lengths = [ds.lengths[i] for i in row]
        seg = torch.repeat_interleave(torch.arange(len(lengths) + 1), torch.tensor([*lengths, 64 - sum(lengths)]))
        allowed = torch.ones(64, 64, dtype=torch.bool).tril() & (seg[:, None] == seg[None, :])
        expected.append(~allowed)
    assert any(len(row) > 1 for row in ds.rows[:4])
    assert torch.equal(lm_attention_mask(batch["position_ids"]), torch.stack(expected)[:, None])
    plain = torch.arange(8).repeat(3, 1)
    assert torch.equal(lm_attention_mask(plain), torch.ones(8, 8, dtype=torch.bool).triu(1)[None, None])


def test_resolve_checkpoint(tmp_path):
    from rlhf.driver.stages.lm import resolve_checkpoint

    step = tmp_path / "run" / "checkpoints" / "step-000002"
    (step / "policy").mkdir(parents=True)
    (step / "policy" / "metadata.json").write_text("{}")
    (step.parent / "latest").write_text("step-000002")
    for given in (tmp_path / "run", step.parent, step, step / "policy"):
        assert resolve_checkpoint(given) == step / "policy"


def test_resume_refuses_a_changed_lr_schedule(lm_inputs, tmp_path):
    from rlhf.driver.infra.run_checkpoints import check_schedule, schedule_of

    cfg = load_config(None, lm_overrides(lm_inputs, "pretrain", tmp_path))
    saved = schedule_of(cfg)
    check_schedule(saved, cfg, tmp_path)
    longer = load_config(None, lm_overrides(lm_inputs, "pretrain", tmp_path, "trainer.total_steps=8"))
    with pytest.raises(UserError, match=r"trainer.total_steps: checkpoint 4, config 8"):
        check_schedule(saved, longer, tmp_path)
    # a constant LR does not depend on the run's length: a longer run may resume it, another lr may not
    flat = ["policy.optim.lr_decay_style=constant", "policy.optim.warmup_steps=0"]
    saved = schedule_of(load_config(None, lm_overrides(lm_inputs, "pretrain", tmp_path, *flat)))
    check_schedule(saved, load_config(None, lm_overrides(lm_inputs, "pretrain", tmp_path, *flat,
                                                         "trainer.total_steps=8")), tmp_path)
    with pytest.raises(UserError, match=r"policy.optim.lr: checkpoint 0.002, config 0.001"):
        check_schedule(saved, load_config(None, lm_overrides(lm_inputs, "pretrain", tmp_path, *flat,
                                                             "policy.optim.lr=1e-3")), tmp_path)
