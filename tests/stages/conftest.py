"""Inputs for the pretraining / SFT stage tests: a tiny model, an indexed pretraining set, SFT jsonl files."""

from __future__ import annotations

import json
from pathlib import Path

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


def lm_overrides(inputs: dict[str, str], algo: str, out: Path, *extra: str) -> list[str]:
    """Fast settings for a tiny run: 8 sequences of 32 tokens per step, cosine LR with 1 warmup step."""
    base = [f"model.path={inputs['model']}", f"algorithm.name={algo}", "trainer.total_steps=4",
            "trainer.global_batch_size=8", "policy.micro_batch_size=2", "data.seq_length=32",
            "policy.optim.lr=2e-3", "policy.optim.min_lr=1e-4", "policy.optim.warmup_steps=1",
            "policy.optim.lr_decay_style=cosine", "policy.optim.weight_decay=0.01", "trainer.eval_iters=1",
            "trainer.progress_bar=false", "trainer.tensorboard=false", "trainer.export_hf=false",
            "policy.resources.num_cpus_per_worker=0.5", f"trainer.output_dir={out}"]
    if algo == "pretrain":
        base += [f"data.data_prefix=[{inputs['prefix']}]", "data.split=90,10,0"]
    else:
        base += [f"data.train_file={inputs['sft_train']}", f"data.val_file={inputs['sft_val']}"]
    return base + list(extra)
