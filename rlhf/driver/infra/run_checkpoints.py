"""Atomic run checkpoints: write into a temporary folder, rename it, then move the `latest` pointer.

Layout under `<output_dir>/checkpoints/`:
  step-000004/            one finished checkpoint
    driver_state.json     step, data-loader position, KL controller, driver RNG, LR schedule, distributed-optimizer layout
    policy/ critic/ ...   each role's Megatron checkpoint (dist_checkpointing), written by its workers,
                          with the signed manifest that loading checks first (workers/megatron/ckpt_manifest.py)
  latest                  text file naming the newest finished checkpoint folder (a name in this folder only)
A crash while saving leaves a `tmp-*` folder that is ignored and removed on the next save. A resume continues
from `latest`, or from the newest intact step when `latest` is unusable (rlhf/driver/infra/resume_point.py); a save
never deletes a step folder: a save that meets an existing one (left there before this resume) renames it
`step-N.replaced-<time>-<pid>` first.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from rlhf.config import RunConfig
from rlhf.driver.infra.resume_point import Unusable, choose_resume_point, read_driver_state
from rlhf.errors import UserError
from workers.file_problems import FileProblem, os_cause


def rng_state() -> dict[str, Any]:
    """The driver's Python and torch RNG states as JSON-safe values."""
    py = random.getstate()
    return {"python": [py[0], list(py[1]), py[2]], "torch": torch.get_rng_state().tolist()}


def set_rng_state(state: dict[str, Any]) -> None:
    py = state["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))


def schedule_of(cfg: RunConfig) -> dict[str, Any]:
    """The settings a trained role's LR scheduler is built from, saved in each checkpoint: a resume with other
    values would silently bend the schedule mid-run, so `check_schedule` refuses it."""
    roles = ["policy"] + (["critic"] if cfg.critic.enabled else [])
    decays = any(getattr(cfg, role).optim.lr_decay_style != "constant" for role in roles)
    out: dict[str, Any] = {"trainer.total_steps": cfg.trainer.total_steps} if decays else {}  # a constant LR may run longer
    for role in roles:
        o = getattr(cfg, role).optim
        out.update({f"{role}.optim.{k}": getattr(o, k) for k in ("lr", "min_lr", "warmup_steps", "lr_decay_style",
                                                                  "weight_decay")})
    return out


def check_schedule(saved: dict[str, Any] | None, cfg: RunConfig, where: Path,
                   fresh: str = "start a new run from its weights") -> None:
    """Refuse to resume the checkpoint `where` (saved schedule `saved`) under another LR schedule, naming each
    differing field and `fresh`, the way to start over (a checkpoint without a saved schedule resumes on the
    config's)."""
    if not saved:
        return
    now = schedule_of(cfg)
    diff = [f"{k}: checkpoint {saved[k]!r}, config {now[k]!r}" for k in now if k in saved and saved[k] != now[k]]
    if diff:
        raise UserError(f"cannot continue the LR schedule of {where}: " + "; ".join(diff)
                        + f" (keep them, or {fresh})")


def optimizer_layout_of(cfg: RunConfig) -> dict[str, Any]:
    """The model-parallel sizes of each trained role whose optimizer is megatron's distributed one, saved in
    each checkpoint: its state is written in the dp_reshardable format, which reloads at another DP size
    only, so `check_resume` refuses a resume at another TP, PP, EP or CP size before any worker starts."""
    roles = ["policy"] + (["critic"] if cfg.critic.enabled else [])
    return {f"{role}.parallel.{k}": getattr(getattr(cfg, role).parallel, k) for role in roles
            if getattr(cfg, role).optim.use_distributed_optimizer for k in ("tp", "pp", "ep", "cp")}


def resume_state(cfg: RunConfig) -> dict[str, Any]:
    """What a checkpoint records so that `check_resume` can refuse a resume it cannot honour."""
    return {"schedule": schedule_of(cfg), "optimizer_layout": optimizer_layout_of(cfg)}


def check_resume(state: dict[str, Any], cfg: RunConfig, where: Path, fresh: str) -> None:
    """Refuse, with one line naming each field, a resume of `where` (its driver state `state`) under another LR
    schedule or, with the distributed optimizer, at another model-parallel layout."""
    check_schedule(state.get("schedule"), cfg, where, fresh)
    saved, now = state.get("optimizer_layout") or {}, optimizer_layout_of(cfg)
    diff = [f"{k}: checkpoint {saved[k]!r}, config {now[k]!r}" for k in now if k in saved and saved[k] != now[k]]
    if diff:
        raise UserError(f"cannot load the distributed optimizer's state of {where} at another layout (it reloads "
                        "at another data-parallel size only): " + "; ".join(diff) + f" (keep them, or {fresh})")


class CheckpointManager:
    def __init__(self, output_dir: str | Path) -> None:
        self.root = Path(output_dir) / "checkpoints"

    def resume_point(self, trust: bool) -> tuple[Path | None, str | None]:
        """The checkpoint a resumed run continues from and, when `latest` was unusable, the line saying which
        step is used instead (`rlhf.driver.infra.resume_point`); (None, None) when the run holds none."""
        return choose_resume_point(self.root, trust)

    def save(self, step: int, driver_state: dict[str, Any], write_roles: Callable[[Path], None]) -> Path:
        """Write a checkpoint for `step`: `write_roles(tmp_dir)` saves the worker groups into the folder."""
        from workers.megatron.ckpt_manifest import sign_saved

        self.root.mkdir(parents=True, exist_ok=True)
        for stale in self.root.glob("tmp-*"):
            shutil.rmtree(stale, ignore_errors=True)
        name = f"step-{step:06d}"
        tmp = self.root / f"tmp-{name}"
        tmp.mkdir()
        final = self.root / name
        try:
            write_roles(tmp)
            sign_saved(tmp)  # the workers' manifests, signed here: the key stays in this process (ckpt_manifest.py)
            (tmp / "driver_state.json").write_text(json.dumps({"step": step, **driver_state}))
        except BaseException as e:
            shutil.rmtree(tmp, ignore_errors=True)  # nothing half-written stays beside the checkpoints
            cause = disk_cause(e)
            if cause is not None:
                raise FileProblem(final, f"cannot write the checkpoint: {cause}") from e
            raise
        if final.exists():  # a step after the one this run resumed from: kept, never overwritten
            aside = self.root / f"{name}.replaced-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}-{os.getpid()}"
            os.replace(final, aside)
            print(f"checkpoint {final} was not the one this run resumed from: kept as {aside.name}", flush=True)
        os.replace(tmp, final)
        pointer_tmp = self.root / "latest.tmp"
        pointer_tmp.write_text(name)
        os.replace(pointer_tmp, self.root / "latest")
        return final

    @staticmethod
    def check_trusted(path: Path, trust: bool) -> None:
        """Before any worker loads the checkpoint `path` (a step folder or one role's folder): every role
        folder in it matches its manifest, unless `trust` (UserError naming the file otherwise)."""
        from workers.megatron.ckpt_manifest import UntrustedCheckpointError, check_checkpoint

        roles = [path] if (path / "metadata.json").is_file() else sorted(
            p for p in path.iterdir() if p.is_dir() and (p / "metadata.json").is_file())
        try:
            for role in roles:
                check_checkpoint(role, trust)
        except UntrustedCheckpointError as e:
            raise UserError(str(e)) from None

    @staticmethod
    def driver_state(path: Path) -> dict[str, Any]:
        """The driver state saved in the step folder `path`; UserError naming the file when it is damaged."""
        try:
            return read_driver_state(path)
        except Unusable as e:
            raise UserError(str(e)) from None


# How a full or read-only disk reads in an error raised by a worker (its message crosses the process boundary).
_DISK_TEXT = {"no space left on device": "no space left on device", "disk quota exceeded": "disk quota exceeded",
              "read-only file system": "read-only file system", "unexpected pos": "no space left on device"}


def export_hf(path: Path, write: Callable[[str], Any]) -> None:
    """The run's HF export at `path`: `write(folder)` (the policy's collective save) fills a staged folder that
    replaces `path` only when complete. A full or read-only disk, met here or by a worker, ends in one line
    naming the export and the cause, with nothing half-written left."""
    from rlhf.paths import staged_output_dir

    try:
        with staged_output_dir(path, force=True) as tmp:
            write(str(tmp))
    except FileProblem:
        raise
    except BaseException as e:
        cause = disk_cause(e)
        if cause is not None:
            raise FileProblem(path, f"cannot write the HF export: {cause}") from e
        raise


def disk_cause(exc: BaseException) -> str | None:
    """The disk problem behind `exc` (an OSError here, or a worker's error naming one), else None."""
    cause = os_cause(exc)
    if cause is not None:
        return cause
    text = str(exc).lower()
    return next((c for key, c in _DISK_TEXT.items() if key in text), None)
