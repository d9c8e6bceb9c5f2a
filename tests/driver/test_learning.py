"""The example that must learn: the shipped tiny configs raise greedy held-out accuracy on the arithmetic task.

These are the full runs of `configs/grpo_tiny.yaml` and `configs/ppo_tiny.yaml` (warm start, RL, validation
every 50 steps on 200 held-out prompts), so they are marked `slow` (`make test-quick` skips them). They
assert learning, not speed: wall time is reported by the run itself (metrics.jsonl, summary.txt) and in
bench/RESULTS.md.
"""

from __future__ import annotations

import pytest

from tests.driver.test_rl_e2e import metrics, rlhf


def val_curve(run) -> list[tuple[int, float]]:
    return [(row["step"], row["val/accuracy"]) for row in metrics(run) if "val/accuracy" in row]


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_grpo_tiny_raises_accuracy_by_25_points(tmp_path):
    run = tmp_path / "grpo"
    r = rlhf("train", "configs/grpo_tiny.yaml", "trainer.progress_bar=false", "trainer.save_every=0",
             f"trainer.output_dir={run}", timeout=1700)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    curve = val_curve(run)
    start = curve[0][1]
    end = sum(acc for _, acc in curve[-2:]) / 2  # the last two evaluations: one evaluation moves by ~3 points
    assert end - start >= 0.25, f"greedy accuracy {start:.1%} -> {end:.1%}; curve {curve}"
    assert (run / "report.png").is_file()


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_ppo_tiny_raises_accuracy(tmp_path):
    run = tmp_path / "ppo"
    r = rlhf("train", "configs/ppo_tiny.yaml", "trainer.progress_bar=false", "trainer.save_every=0",
             f"trainer.output_dir={run}", timeout=1700)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    curve = val_curve(run)
    start = curve[0][1]
    end = sum(acc for _, acc in curve[-2:]) / 2
    assert end - start >= 0.05, f"greedy accuracy {start:.1%} -> {end:.1%}; curve {curve}"
