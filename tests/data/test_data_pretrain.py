"""Pretraining datasets on megatron-core's GPTDataset / BlendedMegatronDatasetBuilder, and their input checks."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from rlhf.data.checks import check_data_prefix, check_seq_length, parse_split
from rlhf.data.indexed import IndexedWriter
from rlhf.data.preprocess import preprocess_pretrain
from rlhf.data.pretrain import build_pretrain_datasets, parse_blend
from rlhf.errors import UserError
from tests.helpers.files import write_lines


@pytest.fixture(scope="module")
def prefixes(tmp_path_factory, tok_dir):
    d = tmp_path_factory.mktemp("pt")
    out = []
    for name, offset in (("a", 0), ("b", 500)):
        src = write_lines(
            d / f"{name}.jsonl", [{"text": f"What is {i}+{i}? {2 * i}"} for i in range(offset, offset + 60)]
        )
        prefix, _ = preprocess_pretrain(src, d / name, tok_dir, append_eod=True, progress=False)
        out.append(prefix)
    return out


def test_blend_split_seed_and_items(prefixes, tok_dir, tokenizer, tmp_path):
    a, b = prefixes
    kwargs = dict(
        split="90,10,0",
        seq_length=32,
        tokenizer_dir_or_obj=tok_dir,
        num_samples=(40, 8, 0),
        path_to_cache=str(tmp_path / "cache"),
    )
    train, valid, test = build_pretrain_datasets(["0.3", a, "0.7", b], seed=1, **kwargs)
    assert test is None and len(train) >= 40 and len(valid) >= 8
    item = train[0]
    assert item["tokens"].shape == item["labels"].shape == item["loss_mask"].shape == (32,)
    assert item["position_ids"].tolist() == list(range(32))
    assert torch.equal(item["tokens"][1:], item["labels"][:-1])
    # the seed fixes the sample order; another seed changes it
    again, _, _ = build_pretrain_datasets(["0.3", a, "0.7", b], seed=1, **kwargs)
    other, _, _ = build_pretrain_datasets(["0.3", a, "0.7", b], seed=2, **kwargs)
    first = [train[i]["tokens"] for i in range(10)]
    assert all(torch.equal(x, again[i]["tokens"]) for i, x in enumerate(first))
    assert not all(torch.equal(x, other[i]["tokens"]) for i, x in enumerate(first))
    # both sources are drawn from, roughly by weight
    ids = np.array([int(train[i]["dataset_id"]) for i in range(len(train))])
    assert 0.15 < (ids == 0).mean() < 0.45


def test_single_prefix_and_eod_mask_loss(prefixes, tok_dir, tokenizer, tmp_path):
    eod = tokenizer.eos_token_id
    kwargs = dict(
        split="100",
        seq_length=16,
        seed=0,
        tokenizer_dir_or_obj=tokenizer,
        num_samples=(20, None, None),
        path_to_cache=str(tmp_path / "cache"),
    )
    plain, _, _ = build_pretrain_datasets([prefixes[0]], **kwargs)
    masked, _, _ = build_pretrain_datasets([prefixes[0]], eod_mask_loss=True, **kwargs)
    assert plain[0]["loss_mask"].min() == 1
    for i in range(5):
        tokens, lm = masked[i]["tokens"], masked[i]["loss_mask"]
        assert (tokens == eod).any()
        assert torch.equal(lm == 0, tokens == eod)


def test_bad_inputs_fail_clearly(prefixes, tok_dir, tmp_path):
    good = dict(
        split="90,10,0",
        seq_length=16,
        seed=0,
        tokenizer_dir_or_obj=tok_dir,
        num_samples=(4, 1, 0),
        path_to_cache=str(tmp_path / "cache"),
    )
    with pytest.raises(UserError, match="tokenizer folder .* does not exist"):
        build_pretrain_datasets(prefixes[:1], **{**good, "tokenizer_dir_or_obj": str(tmp_path / "nope")})
    stem = prefixes[0].removesuffix("_text_document")
    with pytest.raises(UserError, match=r"missing .*\.bin and .*\.idx \(found: .*a_text_document"):
        build_pretrain_datasets([stem], **good)
    with pytest.raises(UserError, match="split 'train=90' does not parse"):
        build_pretrain_datasets(prefixes[:1], **{**good, "split": "train=90"})
    with pytest.raises(UserError, match="valid weight 0"):
        build_pretrain_datasets(prefixes[:1], **{**good, "split": "100,0,0"})
    with pytest.raises(UserError, match="mixes numbers and paths"):
        build_pretrain_datasets(["0.5", prefixes[0], prefixes[1]], **good)


@pytest.mark.timeout(60)  # megatron-core's GPTDataset loops forever on zero tokens: this must fail first
def test_zero_tokens_rejected_before_building(tmp_path, tok_dir):
    empty = tmp_path / "empty_text_document"
    with IndexedWriter(empty, np.uint16) as w:
        w.add([])
        w.add([])
    kwargs = dict(seq_length=16, seed=0, tokenizer_dir_or_obj=tok_dir, num_samples=(4, 0, 0))
    with pytest.raises(UserError, match="has zero tokens"):
        build_pretrain_datasets([str(empty)], split="100", **kwargs)
    few = tmp_path / "few_text_document"
    with IndexedWriter(few, np.uint16) as w:
        for i in range(5):
            w.add([5 + i] * 10)
    with pytest.raises(UserError, match="leaves the valid split with zero tokens"):
        build_pretrain_datasets([str(few)], split="949,50,1", **kwargs)


def test_checks():
    assert parse_split("949,50,1") == pytest.approx([0.949, 0.05, 0.001])
    assert parse_split("98,2") == pytest.approx([0.98, 0.02, 0.0])
    for bad in ("", "a,b", "1,2,3,4", "-1,2", "0,0,0"):
        with pytest.raises(UserError):
            parse_split(bad)
    assert parse_blend(["p"]) == (["p"], None)
    assert parse_blend(["p", "q"]) == (["p", "q"], None)
    assert parse_blend([30, "p", "70", "q"]) == (["p", "q"], [30.0, 70.0])
    with pytest.raises(UserError):
        parse_blend([])
    with pytest.raises(UserError, match="data prefix /nonexistent/x: missing"):
        check_data_prefix("/nonexistent/x")


def test_check_seq_length(tok_dir):
    check_seq_length(512, tok_dir)
    check_seq_length(100, {"max_position_embeddings": 128})
    with pytest.raises(UserError, match="exceeds the model's max_position_embeddings 512"):
        check_seq_length(513, tok_dir)
    with pytest.raises(UserError, match="positive integer"):
        check_seq_length(0, tok_dir)
    with pytest.raises(UserError, match="does not exist"):
        check_seq_length(8, "/nonexistent/model")
