"""Inputs for the stage tests: a tiny model, an indexed pretraining set, SFT jsonl files, preference pairs (the
runs' overrides: tests/helpers/lm.py; their Ray: the shared `ray_session`, tests/conftest.py)."""

from __future__ import annotations

import json

import pytest


@pytest.fixture(scope="session")
def lm_inputs(tiny_model_factory, tmp_path_factory) -> dict[str, str]:
    """model (HF folder with tokenizer), prefix (indexed pretraining data), sft_train / sft_val (jsonl)."""
    from rlhf.data.arithmetic import pretrain_record, sft_record, split_pairs
    from rlhf.data.preprocess import preprocess_pretrain

    model = tiny_model_factory("tiny-qwen2")
    d = tmp_path_factory.mktemp("lm_data")
    train, val = split_pairs(seed=0, val_size=40)
    files = {"pretrain": [pretrain_record(a, b) for a, b in train[:400]],
             "sft_train": [sft_record(a, b) for a, b in train[:200]],
             "sft_val": [sft_record(a, b) for a, b in val]}
    for name, records in files.items():
        (d / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    prefix, _ = preprocess_pretrain(d / "pretrain.jsonl", d / "arith", model, append_eod=True, progress=False)
    return {"model": model, "prefix": prefix, "sft_train": str(d / "sft_train.jsonl"),
            "sft_val": str(d / "sft_val.jsonl"), "dir": str(d)}


@pytest.fixture(scope="session")
def pair_files(tiny_model_factory, tmp_path_factory) -> dict[str, str]:
    """model (tiny-qwen2), train (8 arithmetic pairs: correct vs wrong sum; one global batch, so each step sees
    the same pairs) and val (16 held-out pairs) jsonl files, for the DPO and reward-model stage tests."""
    import random

    from rlhf.data.arithmetic import preference_record, split_pairs

    d = tmp_path_factory.mktemp("pair_data")
    train, val = split_pairs(seed=0, val_size=16)
    rng = random.Random(0)
    for name, pairs in (("train", train[:8]), ("val", val)):
        recs = [preference_record(a, b, rng) for a, b in pairs]
        (d / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    return {"model": tiny_model_factory("tiny-qwen2"), "train": str(d / "train.jsonl"), "val": str(d / "val.jsonl")}
