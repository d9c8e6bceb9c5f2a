"""Pretraining and SFT end to end on the real stack (Ray actors, megatron-core over gloo, CPU).

Runs (each one worker group): A pretrain TP1 (4 steps); pretrain TP2; pretrain DP2 with the distributed
optimizer (checkpoints at 2 and 4), then resumed from its step-2 checkpoint; SFT packed at PP2 starting
from A's checkpoint without its optimizer / RNG; a run diverging on purpose.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from rlhf.config import load_config
from rlhf.driver.infra.metrics import read_metrics
from tests.helpers.lm import lm_overrides


def run(inputs: dict, algo: str, out: Path, *extra: str) -> tuple[list[dict], object]:
    from rlhf.driver.stages.lm import run_lm

    cfg = load_config(None, lm_overrides(inputs, algo, out, *extra))
    run_lm(cfg)
    return read_metrics(out), cfg


def by_step(rows: list[dict], key: str) -> dict[int, float]:
    return {r["step"]: r[key] for r in rows if key in r}


def hf_loss(model_dir: str | Path, batch) -> float:
    """Token-mean loss of an HF model on an LM batch, each packed segment run on its own."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    nll, n = 0.0, 0.0
    with torch.no_grad():
        for b in range(len(batch)):
            pos = batch["position_ids"][b]
            starts = (pos == 0).nonzero().flatten().tolist() + [pos.numel()]
            for s, e in zip(starts[:-1], starts[1:]):
                logits = model(input_ids=batch["tokens"][b, s:e][None]).logits[0].float()
                logp = torch.log_softmax(logits, -1).gather(-1, batch["labels"][b, s:e, None])[:, 0]
                mask = batch["loss_mask"][b, s:e]
                nll += float(-(logp * mask).sum())
                n += float(mask.sum())
    return nll / n


def val_batch(cfg, out: Path):
    from rlhf.driver.stages.lm import global_batch_size
    from rlhf.driver.stages.lm_data import build_lm_data

    gbs = global_batch_size(cfg)
    return build_lm_data(cfg, gbs, str(out)).val_batch(gbs * cfg.trainer.eval_iters)


@pytest.fixture(scope="module")
def run_a(ray_session, lm_inputs, tmp_path_factory):
    out = tmp_path_factory.mktemp("run_a")
    rows, cfg = run(lm_inputs, "pretrain", out, "trainer.val_every=2", "trainer.save_every=2",
                    "trainer.export_hf=true")
    return out, rows, cfg


@pytest.fixture(scope="module")
def run_tp2(ray_session, lm_inputs, tmp_path_factory):
    out = tmp_path_factory.mktemp("run_tp2")
    rows, _ = run(lm_inputs, "pretrain", out, "policy.parallel.tp=2", "policy.micro_batch_size=1")
    return rows


DP2 = ["policy.parallel.dp=2", "policy.optim.use_distributed_optimizer=true", "trainer.save_every=2",
       "trainer.val_every=2"]


@pytest.fixture(scope="module")
def run_dp2(ray_session, lm_inputs, tmp_path_factory):
    out = tmp_path_factory.mktemp("run_dp2")
    rows, _ = run(lm_inputs, "pretrain", out, *DP2)
    return out, rows


def test_pretrain_loss_falls_with_schedule_validation_and_export(run_a):
    out, rows, cfg = run_a
    loss, lr, val = by_step(rows, "loss"), by_step(rows, "lr"), by_step(rows, "val/loss")
    assert list(loss) == [1, 2, 3, 4] and list(val) == [0, 2, 4]
    assert max(loss[3], loss[4]) < min(loss[1], loss[2]) - 0.3 and val[4] < val[2] < val[0]
    assert lr[1] == 0.0 and lr[2] == pytest.approx(2e-3) and 1e-4 < lr[4] < lr[3] < lr[2]  # warmup, cosine
    for key in ("grad_norm", "tokens_per_s", "skipped", "skipped_steps", "loss_tokens", "step_time_s"):
        assert key in rows[-1], key
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["latest", "step-000002", "step-000004"]
    state = json.loads((out / "checkpoints" / "step-000004" / "driver_state.json").read_text())
    assert state["data"] == {"consumed": 32} and state["step"] == 4
    # the exported HF folder scores the validation set as the Megatron model did after step 4
    assert (out / "hf" / "tokenizer_config.json").is_file()
    assert hf_loss(out / "hf", val_batch(cfg, out)) == pytest.approx(val[4], abs=1e-4)


@pytest.mark.parametrize("layout", ["run_tp2", "run_dp2"])
def test_tp2_and_dp2_match_tp1(run_a, layout, request):
    """TP=2 with 8 micro-batches, and DP=2 with the distributed optimizer and 2 micro-batches per rank,
    against TP=1 with 4 micro-batches: the same loss at step 1 and after three updates."""
    rows = request.getfixturevalue(layout)
    rows = rows[1] if isinstance(rows, tuple) else rows
    la, lb = by_step(run_a[1], "loss"), by_step(rows, "loss")
    assert abs(la[1] - lb[1]) < 1e-5
    assert by_step(run_a[1], "grad_norm")[1] == pytest.approx(by_step(rows, "grad_norm")[1], rel=1e-4)
    for step in (2, 3, 4):
        assert abs(la[step] - lb[step]) < 1e-4, (step, la[step], lb[step])


def test_resume_two_plus_two_equals_four(run_dp2, lm_inputs, tmp_path):
    """The DP=2 distributed-optimizer run, resumed in new workers from its step-2 checkpoint. A resume at
    TP=2 is refused before any worker starts: that optimizer state reloads at another DP size only."""
    from rlhf.errors import UserError

    out_b, rows_b = run_dp2
    out = tmp_path / "resumed"
    (out / "checkpoints").mkdir(parents=True)
    shutil.copytree(out_b / "checkpoints" / "step-000002", out / "checkpoints" / "step-000002")
    (out / "checkpoints" / "latest").write_text("step-000002")
    with pytest.raises(UserError, match=r"distributed optimizer's state .* policy.parallel.tp: checkpoint 1, "
                                        r"config 2 \(keep them"):
        run(lm_inputs, "pretrain", out, *DP2, "policy.parallel.dp=1", "policy.parallel.tp=2", "trainer.resume=auto")
    assert not (out / "logs" / "policy").exists()  # no worker started
    rows, _ = run(lm_inputs, "pretrain", out, *DP2, "trainer.resume=auto")
    assert [r["step"] for r in rows] == [3, 4]
    for key in ("loss", "grad_norm", "lr", "consumed_samples"):
        want, got = by_step(rows_b, key), by_step(rows, key)
        for step in (3, 4):
            assert got[step] == pytest.approx(want[step], rel=1e-6, abs=1e-7), (key, step)
    assert by_step(rows, "val/loss")[4] == pytest.approx(by_step(rows_b, "val/loss")[4], rel=1e-6)


def test_resume_under_another_schedule(run_a, lm_inputs, tmp_path):
    """Run A's step-2 checkpoint resumed with another peak lr and more steps is refused, naming both fields.
    A checkpoint that saved no schedule resumes on the config's: the cosine from the new peak over the new
    length, from the checkpoint's step (the workers' scheduler takes the config's values, not the saved ones)."""
    import math

    from rlhf.errors import UserError

    out = tmp_path / "relr"
    (out / "checkpoints").mkdir(parents=True)
    step2 = out / "checkpoints" / "step-000002"
    shutil.copytree(run_a[0] / "checkpoints" / "step-000002", step2)
    (out / "checkpoints" / "latest").write_text("step-000002")
    other = ("trainer.resume=auto", "policy.optim.lr=1e-3", "trainer.total_steps=5")
    with pytest.raises(UserError, match=r"trainer.total_steps: checkpoint 4, config 5; "
                                        r"policy.optim.lr: checkpoint 0.002, config 0.001 \(keep them"):
        run(lm_inputs, "pretrain", out, *other)
    state = json.loads((step2 / "driver_state.json").read_text())
    del state["schedule"]
    (step2 / "driver_state.json").write_text(json.dumps(state))
    rows, _ = run(lm_inputs, "pretrain", out, *other)
    lr = by_step(rows, "lr")
    assert list(lr) == [3, 4, 5]
    for step in (3, 4, 5):  # warmup 1, cosine from 1e-3 to 1e-4 over the remaining 4 steps
        want = 1e-4 + 0.5 * (1e-3 - 1e-4) * (1 + math.cos(math.pi * (step - 2) / 4))
        assert lr[step] == pytest.approx(want, rel=1e-6), (step, lr[step], want)


def test_sft_packed_pp2_from_pretrained_checkpoint(run_a, lm_inputs, tmp_path):
    out_a = run_a[0]
    out = tmp_path / "sft"
    rows, cfg = run(lm_inputs, "sft", out, "policy.parallel.pp=2", "data.pack=true", "data.seq_length=64",
                    "trainer.total_steps=3", f"trainer.load={out_a}", "trainer.no_load_optim=true",
                    "trainer.no_load_rng=true", "trainer.export_hf=true")
    loss, val, lr = by_step(rows, "loss"), by_step(rows, "val/loss"), by_step(rows, "lr")
    assert list(val) == [0, 3] and val[3] < val[0] and loss[3] < loss[1]
    assert lr[1] == 0.0  # a fresh scheduler: no_load_optim
    batch = val_batch(cfg, out)
    assert (batch["position_ids"] == 0).sum() > len(batch)  # rows hold several packed conversations
    # step 0 runs A's final weights (resharded to PP2) with block-diagonal masks: HF per segment agrees
    assert hf_loss(out_a / "hf", batch) == pytest.approx(val[0], abs=1e-4)
    files = sorted(p.name for p in (out / "hf").glob("*.safetensors"))
    assert files == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    assert hf_loss(out / "hf", batch) == pytest.approx(val[3], abs=1e-4)


def test_nonfinite_steps_are_skipped_then_stop(ray_session, lm_inputs, tmp_path):
    from rlhf.errors import NonFiniteError

    out = tmp_path / "diverge"
    with pytest.raises(NonFiniteError, match=r"stopped at step \d: 2 optimizer steps in a row"):
        run(lm_inputs, "pretrain", out, "policy.optim.lr=1e30", "policy.optim.warmup_steps=0",
            "policy.optim.lr_decay_style=constant", "policy.optim.max_consecutive_nonfinite=2",
            "trainer.total_steps=6")
    rows = read_metrics(out)
    assert [r["skipped"] for r in rows if "skipped" in r][-2:] == [1.0, 1.0]
    assert rows[-1]["skipped_steps"] == 2.0


def test_fp16_loss_scale_backoffs_do_not_stop_the_run(ray_session, lm_inputs, tmp_path):
    """fp16: megatron's dynamic loss scale starts at 2^32, so the first steps overflow and back it off. Those
    are the scaler's search, not NaN/Inf gradients: logged as loss_scale_backoff, not counted toward
    policy.optim.max_consecutive_nonfinite (3), which stopped every fp16 run at step 3."""
    rows, _ = run(lm_inputs, "pretrain", tmp_path / "fp16", "policy.dtype=float16", "trainer.total_steps=4",
                  "trainer.val_every=0", "trainer.save_every=0")
    steps = [r for r in rows if r["step"] > 0]
    assert [r["step"] for r in steps] == [1, 2, 3, 4]
    assert all(r["skipped"] == 0 and r["loss_scale_backoff"] == 1 for r in steps), steps
    scales = [r["loss_scale"] for r in steps]
    assert scales == sorted(scales, reverse=True) and scales[-1] < scales[0], scales
