"""`RunScaffold`: the frame every training stage runs in.

    with RunScaffold(cfg) as run:              # output dir, config.yaml, wandb check, Ray
        group = run.own(make_group(...))        # shut down when the block ends, however it ends
        logger = run.metrics_logger(start_step)
        ...
    # on success: report.png and summary.txt, and the summary printed

Entering saves the resolved config, checks the trackers before Ray starts (a missing wandb fails before
any worker exists) and, in a cluster of several nodes, that every node shares the output dir (shared_dir.py);
leaving closes the metric sinks, shuts down what `own` registered (last
first) and Ray when this run started it. The report is written only when the block ended normally.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import Any, Protocol, TypeVar

from rlhf.config import RunConfig, save_config
from rlhf.driver.infra.metrics import MetricsLogger, mark_resume, wandb_args
from rlhf.driver.infra.preempt import StopSignals
from rlhf.driver.infra.ray_env import EmbeddedRay, init_ray
from rlhf.driver.infra.report import write_report
from rlhf.driver.infra.run_checkpoints import CheckpointManager
from rlhf.driver.infra.run_dir import refuse_unclaimed
from rlhf.driver.infra.shared_dir import check_shared_run_dir
from rlhf.errors import Stopped
from workers.megatron.ckpt_key import load_key


class _Stoppable(Protocol):
    def shutdown(self) -> Any: ...


S = TypeVar("S", bound=_Stoppable)


class RunScaffold:
    """Output dir, saved config, metric sinks, Ray, teardown and report of one run (see module docstring)."""

    def __init__(self, cfg: RunConfig) -> None:
        self.cfg = cfg
        self.out = Path(cfg.trainer.output_dir)
        self.ckpt = CheckpointManager(self.out)
        self.logger: MetricsLogger | None = None
        self._parts: list[_Stoppable] = []
        self._tracking: dict[str, Any] | None = None
        self._own_ray: EmbeddedRay | None = None
        self._resume: Path | None = None
        self.signals = StopSignals(cfg.trainer.stop_grace_s)

    def __enter__(self) -> RunScaffold:
        refuse_unclaimed(self.out, self.cfg.trainer.resume)  # `rlhf train` has moved it aside with --force
        self.out.mkdir(parents=True, exist_ok=True)
        save_config(self.cfg, self.out / "config.yaml")
        self._tracking = wandb_args(self.cfg)  # raises here, before Ray, if trainer.wandb is set without wandb
        self._resume = self._find_resume_point()  # before Ray: an unusable or untrusted checkpoint fails here
        load_key()  # before Ray: an unusable checkpoint key (it signs every save) fails now, not at the first save
        self._own_ray = init_ray(self.cfg.trainer)
        try:
            check_shared_run_dir(self.out, min(self.cfg.trainer.timeout_s, 60.0))  # several nodes: one folder
        except BaseException:
            if self._own_ray is not None:
                self._own_ray.stop()
            raise
        self.signals.install()  # after ray.init, whose own SIGTERM handler would exit mid-step
        return self

    def own(self, part: S) -> S:
        """Register `part` (a worker group or role handles) to be shut down when the run ends."""
        self._parts.append(part)
        return part

    def _find_resume_point(self) -> Path | None:
        """With trainer.resume=auto, the intact checkpoint to continue from (`latest`, else the newest intact
        step, said in one line), verified against its manifests; None otherwise or when the run holds none."""
        if self.cfg.trainer.resume != "auto":
            return None
        path, note = self.ckpt.resume_point(self.cfg.trainer.trust_checkpoint)
        if note is not None:
            print(note, flush=True)
        return path

    def resume_point(self) -> Path | None:
        """The checkpoint this run continues from (chosen on entering), else None."""
        return self._resume

    def metrics_logger(self, start_step: int) -> MetricsLogger:
        """The run's metric sinks (metrics.jsonl, TensorBoard, Ray gauges, progress bar, wandb). Rows a
        resumed run logged after its checkpoint at `start_step` stay in metrics.jsonl, after a resume marker
        row that `read_metrics` applies (`mark_resume`): each step is read once, nothing is deleted."""
        t = self.cfg.trainer
        kept = mark_resume(self.out / "metrics.jsonl", start_step, self._resume)
        if kept:
            print(f"metrics.jsonl: {kept} rows after step {start_step} are from before this resume; kept, marked "
                  "superseded (read_metrics leaves them out)", flush=True)
        self.logger = MetricsLogger(self.out, t.total_steps, tensorboard=t.tensorboard, progress_bar=t.progress_bar,
                                    start_step=start_step, prefix=self.cfg.algorithm.name, wandb=self._tracking)
        return self.logger

    def due(self, step: int, every: int) -> bool:
        """Whether a periodic action (validation, checkpoint) runs after `step`: every `every` steps and
        after the last step."""
        return step == self.cfg.trainer.total_steps or bool(every and step % every == 0)

    def stop_point(self, step: int, save: Callable[[], Any] | None) -> None:
        """At a step boundary: after SIGTERM / SIGINT, call `save` (None: `step` is already checkpointed, or
        nothing was trained) and raise Stopped; the block's exit then releases the actors."""
        if not self.signals.requested:
            return
        if save is not None:
            save()
        raise Stopped(f"stopped at step {step}; resume with --resume", self.signals.exit_code)

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        try:
            try:
                if self.logger is not None:
                    self.logger.close()
            finally:
                for part in reversed(self._parts):
                    part.shutdown()
        finally:
            try:
                if self._own_ray is not None:
                    self._own_ray.stop()
            finally:
                self.signals.restore()
        if exc_type is None:
            print(write_report(self.out, title=f"{self.cfg.algorithm.name} {self.out.name}"), flush=True)
