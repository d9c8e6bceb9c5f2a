"""The reward-model stage (`algorithm.name: rm`) end to end on the real stack (Ray actors, megatron-core over
gloo, CPU, transformers).

Run A: Bradley-Terry training of tiny-qwen2 (its LM head replaced by a fresh value head) on the DPO tests'
8 arithmetic pairs (correct vs wrong sum) for 6 steps, validation on the 16 held-out pairs (2 x 8), HF export. The
training pairs are learned; the export is an HF sequence classifier whose scores equal a reward-model worker
group's loaded from it (the `reward.model_path` path of PPO / GRPO) within 1e-5, and whose held-out margin,
loss and accuracy are A's final validation metrics. A DP2 run gives A's update. (That a reward model learns
the arithmetic preference on held-out pairs and that PPO raises its reward is the `rm_tiny` /
`ppo_tiny_rm` examples' job, in `make examples`.)
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from rlhf.config import load_config
from rlhf.driver.infra.metrics import read_metrics

STEPS = 6


def overrides(files: dict[str, str], out: Path, *extra: str) -> list[str]:
    return [f"model.path={files['model']}", "algorithm.name=rm", f"data.train_file={files['train']}",
            f"data.val_file={files['val']}", "data.seq_length=32", f"trainer.total_steps={STEPS}",
            "trainer.global_batch_size=8", "policy.micro_batch_size=4", "policy.optim.lr=1e-3",
            "policy.optim.warmup_steps=0", "policy.optim.lr_decay_style=constant", "trainer.eval_iters=2",
            "trainer.progress_bar=false", "trainer.tensorboard=false", "policy.resources.num_cpus_per_worker=0.5",
            f"trainer.output_dir={out}", *extra]


def run(files: dict, out: Path, *extra: str) -> list[dict]:
    from rlhf.driver.stages.rm import run_rm

    run_rm(load_config(None, overrides(files, out, *extra)))
    return read_metrics(out)


@pytest.fixture(scope="module")
def run_a(ray_session, pair_files, tmp_path_factory):
    out = tmp_path_factory.mktemp("rm_a")
    return out, run(pair_files, out)


def test_rm_learns_the_pairs_and_validates_on_held_out_ones(run_a):
    out, rows = run_a
    by = {r["step"]: r for r in rows}
    assert sorted(s for s in by if s > 0) == list(range(1, STEPS + 1))
    losses = [by[s]["loss"] for s in range(1, STEPS + 1)]
    assert losses[-1] < 0.5 * losses[0], losses  # the same 8 pairs every step
    assert by[STEPS]["accuracy"] == 1.0 and by[STEPS]["margin"] > by[1]["margin"]
    assert by[1]["margin"] == pytest.approx(by[1]["scores/chosen"] - by[1]["scores/rejected"], abs=1e-5)
    for step in (0, STEPS):  # validation at the start and the end, on the 16 held-out pairs
        assert {"val/loss", "val/accuracy", "val/margin"} <= set(by[step]) and 0 <= by[step]["val/accuracy"] <= 1
    assert (out / "checkpoints" / "latest").is_file() and (out / "checkpoints" / f"step-{STEPS:06d}" /
                                                           "reward_model" / "metadata.json").is_file()
    assert (out / "logs" / "reward_model" / "dp0-tp0-pp0.log").is_file()


def _val_pairs(files: dict) -> dict[str, torch.Tensor]:
    from rlhf.data.preference_pairs import PairDataset, scored_pairs

    ds = PairDataset(files["val"], files["model"], 32)
    return scored_pairs(ds.collate([ds[i] for i in range(len(ds))]), ds.pad_id)


def _hf_scores(model, ids: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=attn).logits[:, 0].float()


def test_export_is_an_hf_sequence_classifier_scoring_as_the_workers(run_a, pair_files):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from workers.batch import Batch, pad_sequences
    from workers.group import WorkerGroup
    from workers.roles import RewardModelWorker

    out, rows = run_a
    hf_dir = out / "hf"
    cfg = json.loads((hf_dir / "config.json").read_text())
    tok = AutoTokenizer.from_pretrained(hf_dir)
    assert cfg["architectures"] == ["Qwen2ForSequenceClassification"] and cfg["pad_token_id"] == tok.pad_token_id
    model = AutoModelForSequenceClassification.from_pretrained(hf_dir, dtype=torch.float32).eval()
    assert model.config.num_labels == 1 and not hasattr(model, "lm_head")
    # The held-out pairs (right-padded with the pad id): HF pools at each answer's end of turn, as the trained
    # workers did for A's last validation.
    pairs = _val_pairs(pair_files)
    c = _hf_scores(model, pairs["chosen_input_ids"], pairs["chosen_attention_mask"])
    r = _hf_scores(model, pairs["rejected_input_ids"], pairs["rejected_attention_mask"])
    last = {k[4:]: v for k, v in rows[-1].items() if k.startswith("val/")}
    assert float((c - r).mean()) == pytest.approx(last["margin"], abs=1e-5)
    assert float(-F.logsigmoid(c - r).mean()) == pytest.approx(last["loss"], abs=1e-5)
    assert float((c > r).float().mean()) == pytest.approx(last["accuracy"])
    # A reward-model group loaded from the export (what reward.model_path starts) scores RL-layout batches
    # (left-padded prompt, right-padded response) as HF does.
    seqs = [pairs["chosen_input_ids"][i][pairs["chosen_attention_mask"][i].bool()] for i in range(6)]
    ids, attn = pad_sequences(seqs, pad_value=tok.pad_token_id, left=True)
    group = WorkerGroup("reward_model", RewardModelWorker, num_cpus_per_worker=0.5, timeout_s=120,
                        log_dir=out / "logs_reload", init_kwargs={"model_path": str(hf_dir), "micro_batch_size": 4})
    try:
        ours = group.compute_scores(Batch({"input_ids": ids, "attention_mask": attn}))["scores"]
        ours_pairs = group.evaluate_pairs(Batch({k: v[:6] for k, v in pairs.items()}))
    finally:
        group.shutdown()
    want = _hf_scores(model, ids, attn)
    assert torch.allclose(ours, want, atol=1e-5), (ours, want)
    assert torch.allclose(want, c[:6], atol=1e-5)  # left or right padding: the same scores
    assert torch.allclose(ours_pairs["rejected_scores"], r[:6], atol=1e-5)


def test_dp2_gives_the_dp1_update(run_a, pair_files, tmp_path):
    rows = run(pair_files, tmp_path / "dp2", "policy.parallel.dp=2", "trainer.total_steps=2", "trainer.eval_iters=0",
               "trainer.export_hf=false")
    a = {r["step"]: r for r in run_a[1]}
    b = {r["step"]: r for r in rows}
    for step in (1, 2):
        for key in ("loss", "margin", "scores/chosen", "accuracy"):
            assert b[step][key] == pytest.approx(a[step][key], rel=1e-4, abs=1e-5), (step, key)
        assert b[step]["grad_norm"] == pytest.approx(a[step]["grad_norm"], rel=1e-3)
