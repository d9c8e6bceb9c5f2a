"""The example that must learn: the shipped tiny configs raise greedy held-out accuracy on the arithmetic task.

These are the full runs of `configs/grpo_tiny.yaml` and `configs/ppo_tiny.yaml` (warm start, RL, validation
on 200 held-out prompts every 100 / 50 steps), so they are marked `slow` (`make test-quick` skips them).
They assert learning, not speed: wall time is reported by the run itself (metrics.jsonl, summary.txt) and in
bench/RESULTS.md.
"""

from __future__ import annotations

import pytest

from tests.driver.test_rl_e2e import metrics, rlhf


def val_curve(run) -> list[tuple[int, float]]:
    return [(row["step"], row["val/accuracy"]) for row in metrics(run) if "val/accuracy" in row]


def train_curve(run, config: str) -> list[tuple[int, float]]:
    """Run `config` as shipped (no checkpoints) into `run`; its (step, greedy accuracy) evaluations."""
    r = rlhf("train", config, "trainer.progress_bar=false", "trainer.save_every=0", f"trainer.output_dir={run}",
             timeout=1700)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    assert (run / "report.png").is_file()
    return val_curve(run)


def assert_grpo_learned(curve: list[tuple[int, float]]) -> None:
    """+25 points at the best evaluation (the run's best checkpoint), and +20 on the mean of the last two
    (it keeps what it learned). One evaluation of 200 prompts moves by ~3 points between neighbours, and
    other CPUs round differently, so the run is not expected to repeat a curve to the point."""
    start = curve[0][1]
    best = max(acc for _, acc in curve[1:])
    end = sum(acc for _, acc in curve[-2:]) / 2
    assert best - start >= 0.25, f"greedy accuracy {start:.1%} -> best {best:.1%}; curve {curve}"
    assert end - start >= 0.20, f"greedy accuracy {start:.1%} -> {end:.1%} at the end; curve {curve}"


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_grpo_tiny_raises_accuracy_by_25_points(tmp_path):
    assert_grpo_learned(train_curve(tmp_path / "grpo", "configs/grpo_tiny.yaml"))


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_ppo_tiny_raises_accuracy(tmp_path):
    curve = train_curve(tmp_path / "ppo", "configs/ppo_tiny.yaml")
    start, end = curve[0][1], sum(acc for _, acc in curve[-2:]) / 2
    assert end - start >= 0.05, f"greedy accuracy {start:.1%} -> {end:.1%}; curve {curve}"
