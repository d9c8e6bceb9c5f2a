"""What a step function sees: the config, the prompts of this step, timers, the KL controller."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from rlhf.config.schema import RunConfig
from rlhf.driver.infra.metrics import PhaseTimer
from workers.batch import Batch


@dataclass
class StepContext:
    cfg: RunConfig
    step: int
    prompts: list[dict[str, Any]]
    kl_ctrl: Any
    next_prompts: Callable[..., list[dict[str, Any]]]  # next_prompts(k): k more prompts (default: a step's)
    timer: PhaseTimer = field(default_factory=PhaseTimer)
    metrics: dict[str, float] = field(default_factory=dict)
    # the run's rollout schedule (`rlhf.driver.rl.sources`): `source.generate(ctx, score)` gives this step's
    # samples, whatever the mode (sync, one_step_off, async); None outside a run (then generate directly)
    source: Any = None
    _rounds: int = 0

    def phase(self, name: str):
        """`with ctx.phase("generate"): ...` times a phase into `time/<name>`."""
        return self.timer.phase(name)

    def timed(self, name: str, fn: Callable[[Batch], Batch]) -> Callable[[Batch], Batch]:
        """`fn`, timed into `time/<name>` at each call (e.g. the reward, called inside generate as engines return)."""
        def call(batch: Batch) -> Batch:
            with self.phase(name):
                return fn(batch)
        return call

    def sample_seed(self) -> int:
        """A fresh, reproducible sampling seed for each generate call of each step."""
        self._rounds += 1
        return self.cfg.rollout.seed + 1_000_003 * self.step + 10_007 * self._rounds

    def next_step_seed(self) -> int:
        """The seed the next step's first generate call gets (`sample_seed` there), for a prefetch."""
        return self.cfg.rollout.seed + 1_000_003 * (self.step + 1) + 10_007

    def resample_round(self) -> int:
        return self._rounds


def rollout_metrics(batch: Batch) -> dict[str, float]:
    mask = batch["response_mask"].float()
    lengths = mask.sum(-1)
    scores = batch["scores"].float()
    out = {
        "reward_mean": float(scores.mean()),
        "reward_std": float(scores.std()) if len(scores) > 1 else 0.0,
        "response_length_mean": float(lengths.mean()),
        "response_tokens": float(lengths.sum()),
        "batch_size": float(len(batch)),
    }
    if "finish_reason" in batch:
        out["response_clip_ratio"] = sum(r == "length" for r in batch["finish_reason"]) / max(len(batch), 1)
    if "entropy" in batch:
        out["entropy"] = float((batch["entropy"] * mask).sum() / mask.sum().clamp(min=1))
    out.update({k: float(v) for k, v in batch.info.items() if k.startswith("agent/")})
    return out


def accuracy(scores: torch.Tensor) -> float:
    return float((scores.float() >= 1.0 - 1e-6).float().mean()) if len(scores) else 0.0
