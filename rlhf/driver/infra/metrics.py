"""Metric sinks for every stage: metrics.jsonl, TensorBoard, Ray gauges, a console progress bar and,
when configured, Weights & Biases. A full or read-only disk under metrics.jsonl or TensorBoard's folder
raises a FileProblem naming the file (one line from the CLI); a wandb failure only turns wandb off.
metrics.jsonl is only appended to: a resume that logs steps again first appends a marker row, and
`read_metrics` reads the history with the superseded rows left out (`mark_resume`)."""

from __future__ import annotations

import json
import math
import re
import threading
import time
import warnings
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

from workers.file_problems import FileProblem, file_errors

if TYPE_CHECKING:
    from rlhf.config.schema import RunConfig

# Ray gauges exported for the dashboard / Prometheus (keys of the step metrics -> gauge name).
GAUGE_KEYS = (
    "reward_mean", "kl", "policy_loss", "entropy", "response_length_mean", "step_time_s", "tokens_per_s",
    "loss", "lr", "grad_norm",
)
BAR_KEYS = ("reward_mean", "val/accuracy", "kl", "loss", "grad_norm", "step_time_s")
_NOT_IN_GAUGE_NAME = re.compile(r"[^a-zA-Z0-9_:]")


def gauge_name(prefix: str, key: str) -> str:
    """A Ray gauge name for a metric key: Ray accepts only `[a-zA-Z_:][a-zA-Z0-9_:]*`, so every other character
    (`/`, `-`, `@`, `.`) becomes `_` (`eval/humaneval/pass@1` -> `rlhf_eval_humaneval_pass_1`)."""
    name = _NOT_IN_GAUGE_NAME.sub("_", f"{prefix}_{key}")
    return name if re.match(r"[a-zA-Z_:]", name) else f"_{name}"


class PhaseTimer:
    """Accumulates wall time per phase (`time/<phase>` keys)."""

    def __init__(self) -> None:
        self.times: dict[str, float] = {}

    @contextmanager
    def phase(self, name: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            self.times[f"time/{name}"] = self.times.get(f"time/{name}", 0.0) + time.perf_counter() - start

    def pop(self) -> dict[str, float]:
        out, self.times = self.times, {}
        return out


def _plain(v: Any) -> Any:
    if hasattr(v, "item") and getattr(v, "numel", lambda: 1)() == 1:
        v = v.item()
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    return v


def wandb_args(cfg: RunConfig) -> dict[str, Any] | None:
    """`wandb.init` arguments for trainer.wandb (None when off); raises ConfigError if wandb is missing."""
    from rlhf.config.validate import check_wandb

    t = cfg.trainer
    check_wandb(t)
    if not t.wandb:
        return None
    name = Path(t.output_dir).resolve().name
    return {"project": t.wandb_project, "mode": t.wandb_mode, "name": name, "config": asdict(cfg)}


class MetricsLogger:
    """Writes one JSON object per step to `metrics.jsonl` and mirrors scalars to the other sinks.

    `wandb`: `wandb.init` arguments (see `wandb_args`) or None; the run's files go under `run_dir/wandb`.
    A wandb failure warns once and turns that sink off; it never stops training."""

    def __init__(self, run_dir: str | Path, total_steps: int, tensorboard: bool = True, progress_bar: bool = True,
                 start_step: int = 0, prefix: str = "rlhf", wandb: dict[str, Any] | None = None) -> None:
        self.path = Path(run_dir) / "metrics.jsonl"
        with file_errors(self.path, "write"):
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = self.path.open("a")
        self._tb = None
        self._tb_dir = Path(run_dir) / "tensorboard"
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            _quiet_tensorboard_thread()
            with file_errors(self._tb_dir, "write"):
                self._tb = SummaryWriter(str(self._tb_dir))
        self._gauges: dict[str, Any] = {}
        self._prefix = prefix
        self._bar = None
        if progress_bar:
            from rlhf.progress import progress_bar as bar

            self._bar = bar(total_steps, prefix, initial=start_step)
        self._wandb = None
        if wandb is not None:
            try:
                import wandb as wb

                # console="off": leave stdout/stderr (and the progress bar) alone
                self._wandb = wb.init(dir=str(run_dir), settings=wb.Settings(console="off"), **wandb)
            except Exception as e:  # noqa: BLE001 - wandb never stops training
                self._wandb_failed("init", e)

    def _wandb_failed(self, what: str, e: Exception) -> None:
        self._wandb = None
        warnings.warn(f"wandb {what} failed, wandb logging is off for this run: {e!r}", stacklevel=3)

    def _gauge(self, key: str, value: float) -> None:
        try:
            import ray
            from ray.util.metrics import Gauge

            if not ray.is_initialized():
                return
            if key not in self._gauges:
                self._gauges[key] = Gauge(gauge_name(self._prefix, key), description=f"{self._prefix} {key}")
            self._gauges[key].set(float(value))
        except Exception:  # noqa: BLE001 - metrics export must never break training
            pass

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        row = {"step": step, **{k: _plain(v) for k, v in metrics.items()}}
        with file_errors(self.path, "write"):
            self._file.write(json.dumps(row) + "\n")
            self._file.flush()
        for k, v in row.items():
            if k == "step" or not isinstance(v, (int, float)):
                continue
            if self._tb is not None:
                self._tensorboard(lambda tb, k=k, v=v: tb.add_scalar(k, v, step))
            if k in GAUGE_KEYS or k.startswith("time/") or k.startswith(("val/", "eval/")):
                self._gauge(k, v)
        if self._wandb is not None:
            try:
                self._wandb.log({k: v for k, v in row.items() if k != "step" and isinstance(v, (int, float))},
                                step=step)
            except Exception as e:  # noqa: BLE001 - wandb never stops training
                self._wandb_failed("log", e)
        if self._bar is not None:
            shown = {k: f"{row[k]:.4g}" for k in BAR_KEYS if isinstance(row.get(k), (int, float))}
            self._bar.set_postfix(shown, refresh=False)
            self._bar.update(step - self._bar.n)  # redraws no more often than mininterval

    def _tensorboard(self, call: Any) -> None:
        """`call(writer)`; a disk problem is raised once, naming the folder, and ends the TensorBoard sink."""
        try:
            with file_errors(self._tb_dir, "write"):
                call(self._tb)
        except FileProblem:
            self._tb = None
            raise

    def close(self) -> None:
        """Close every sink (all of them, also when one fails; the first disk problem is raised after)."""
        try:
            with file_errors(self.path, "write"):
                self._file.close()
        finally:
            try:
                if self._tb is not None:
                    self._tensorboard(lambda tb: tb.close())
                    self._tb = None
            finally:
                self._close_others()

    def _close_others(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        if self._wandb is not None:
            try:
                import wandb as wb

                run, self._wandb = self._wandb, None
                run.finish()
                # finish() can return before wandb's service has flushed the run file; teardown waits for the
                # service to exit, so the offline run is complete on disk (for `wandb sync`) once close returns.
                wb.teardown()
            except Exception as e:  # noqa: BLE001 - wandb never stops training
                self._wandb_failed("finish", e)


def _quiet_tensorboard_thread() -> None:
    """Leave out the traceback Python prints when TensorBoard's writer thread fails (a full disk): the
    writer raises the same error again in the logging thread at its next call, where it is named."""
    previous = threading.excepthook
    if getattr(previous, "_rlhf_quiet", False):
        return

    def hook(args: Any) -> None:
        if type(args.thread).__name__ == "_AsyncWriterThread" and isinstance(args.exc_value, OSError):
            return
        previous(args)

    hook._rlhf_quiet = True  # type: ignore[attr-defined]
    threading.excepthook = hook


RESUME_KEY = "resumed_at_step"  # the marker row a resume writes when metrics.jsonl holds rows after its step


def _parse(lines: list[str]) -> list[dict]:
    """The JSON object rows of metrics.jsonl lines; a torn line (a killed run's last write) is skipped."""
    rows = []
    for line in lines:
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict) and isinstance(row.get("step"), int):
            rows.append(row)
    return rows


def _superseded(row: dict, resumed_at: int) -> bool:
    """Whether a run resumed at step `resumed_at` logs `row`'s step again (all of them when it starts over)."""
    return resumed_at == 0 or row["step"] > resumed_at


def effective_rows(rows: list[dict]) -> list[dict]:
    """The run's history: each resume marker hides the rows before it that the resumed run logs again."""
    out: list[dict] = []
    for row in rows:
        if RESUME_KEY in row:
            out = [r for r in out if not _superseded(r, row[RESUME_KEY])]
        else:
            out.append(row)
    return out


def mark_resume(path: Path, step: int, source: Path | None) -> int:
    """Before a run that starts at `step` (from the checkpoint `source`, or none) appends to `path`: when
    the file holds rows that run logs again, append a marker row `{"step": step, "resumed_at_step": step,
    "resumed_from": ..., "superseded_rows": n}` after them, never deleting a row. A torn last line (a killed
    run's) is ended first, so that the next row starts a line of its own. Returns n."""
    if not path.is_file():
        return 0
    with file_errors(path, "read"):
        text = path.read_text()
    n = sum(_superseded(r, step) for r in effective_rows(_parse(text.splitlines())))
    add = "" if text.endswith("\n") or not text else "\n"
    if n:
        add += json.dumps({"step": step, RESUME_KEY: step, "resumed_from": str(source) if source else None,
                           "superseded_rows": n}) + "\n"
    if add:
        with file_errors(path, "write"), path.open("a") as f:
            f.write(add)
    return n


def read_metrics(run_dir: str | Path) -> list[dict]:
    """The rows of `run_dir/metrics.jsonl` as the run's history (`effective_rows`): each step once, the rows a
    resumed run logged again replacing the earlier ones, torn lines left out."""
    path = Path(run_dir) / "metrics.jsonl"
    return effective_rows(_parse(path.read_text().splitlines())) if path.exists() else []
