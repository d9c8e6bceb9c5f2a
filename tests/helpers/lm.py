"""Overrides of the LM stage runs (SFT, pretraining) on the stage tests' inputs (tests/stages/conftest.py)."""

from __future__ import annotations

from pathlib import Path


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
