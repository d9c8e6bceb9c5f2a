"""The one run loop of every training stage (RL; pretraining and SFT; DPO and the reward model).

It owns what the stages share: the resume point, checked before any worker starts; the state every checkpoint
records (RNG, the count of non-finite steps in a row, the resume settings `check_resume` reads); the non-finite
guard; validation at step 0; the validation and checkpoint cadence; and the stop point after SIGTERM / SIGINT.
A stage hands in only what is its own: its step, the metrics after it (validation when due), the state of its
data and the role folders a checkpoint writes.

    loop = RunLoop(cfg, frame, FRESH_START, NonFiniteGuard(limit, skipped, message))  # before any worker
    ... start the workers; when loop.state: load the role folders and the stage's own state, loop.restore()
    last = loop.run(frame.metrics_logger(loop.step), train, after, save, first_validation)
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

from rlhf.config import RunConfig
from rlhf.driver.infra.metrics import MetricsLogger
from rlhf.driver.infra.run_checkpoints import check_resume, resume_state, rng_state, set_rng_state
from rlhf.driver.infra.scaffold import RunScaffold
from rlhf.errors import NonFiniteError

Metrics = dict[str, float]


class NonFiniteGuard:
    """Stops a run whose optimizer steps keep being skipped for a NaN/Inf gradient norm: after `limit` steps in
    a row for which `skipped(metrics)` holds, `check` raises NonFiniteError with `message(step, count, limit)`."""

    def __init__(self, limit: int, skipped: Callable[[Metrics], bool],
                 message: Callable[[int, int, int], str], count: int = 0) -> None:
        self.limit, self.skipped, self.message, self.count = limit, skipped, message, count

    def record(self, metrics: Metrics) -> int:
        """Count a step's update; the number of skipped steps in a row, this one included."""
        self.count = self.count + 1 if self.skipped(metrics) else 0
        return self.count

    def check(self, step: int) -> None:
        if self.count >= self.limit:
            raise NonFiniteError(self.message(step, self.count, self.limit))


class RunLoop:
    """Resume, saved state, the non-finite guard and the steps of one training stage inside a `RunScaffold`.
    Built before any worker starts: a resume the checkpoint cannot honour is refused then (`check_resume`)."""

    def __init__(self, cfg: RunConfig, frame: RunScaffold, fresh_start: str, guard: NonFiniteGuard) -> None:
        self.cfg, self.frame, self.guard = cfg, frame, guard
        self.step = 0
        self.resume_from: Path | None = frame.resume_point()
        self.state: dict[str, Any] | None = None  # the driver state of `resume_from`
        if self.resume_from is not None:
            self.state = frame.ckpt.driver_state(self.resume_from)
            check_resume(self.state, cfg, self.resume_from, fresh_start)

    def restore(self) -> None:
        """The shared part of a resume, once the stage loaded its role folders and own state: the driver's RNG,
        the step and the non-finite count of `resume_from`."""
        assert self.state is not None, "restore() without a resume point"
        set_rng_state(self.state["rng"])
        self.step = int(self.state["step"])
        self.guard.count = int(self.state.get("consecutive_nonfinite", 0))
        print(f"resumed from {self.resume_from} at step {self.step}", flush=True)

    def save(self, step: int, own_state: dict[str, Any], write_roles: Callable[[Path], None]) -> Path:
        """Checkpoint `step`: the stage's `own_state` plus what every resume needs; `write_roles(tmp)` saves the
        worker groups into the step folder."""
        state = {**own_state, "rng": rng_state(), "consecutive_nonfinite": self.guard.count,
                 **resume_state(self.cfg)}
        return self.frame.ckpt.save(step, state, write_roles)

    def run(self, logger: MetricsLogger, train: Callable[[int], Metrics], after: Callable[[int, Metrics], Metrics],
            save: Callable[[int], Any], first_validation: Callable[[], Metrics] | None = None) -> Metrics:
        """Steps `self.step + 1 .. trainer.total_steps`; the last step's metrics. Each step: `train(step)`, the
        guard counts it, `after(step, metrics)` adds to its row (validation when due), the row is logged, the
        guard stops the run when it trips, `save(step)` when a checkpoint is due, then the stop point (which
        saves first when this step is not saved yet). A run from step 0 logs `first_validation()` at step 0."""
        t = self.cfg.trainer
        start = self.step
        if start == 0 and first_validation is not None:
            first = first_validation()
            if first:
                logger.log(0, first)
        last: Metrics = {}
        self.frame.stop_point(start, None)  # a signal while the workers started: nothing new to save
        for step in range(start + 1, t.total_steps + 1):
            self.step = step
            metrics = train(step)
            self.guard.record(metrics)
            metrics.update(after(step, metrics))
            logger.log(step, metrics)
            self.guard.check(step)
            last = metrics
            saved = self.frame.due(step, t.save_every)
            if saved:
                save(step)
            self.frame.stop_point(step, None if saved else partial(save, step))
        return last
