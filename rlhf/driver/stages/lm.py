"""The pretraining and SFT runner: `run_lm(cfg)` for `algorithm.name: pretrain | sft`.

The model lives in a policy worker group (`PolicyWorker`, whose LM steps are `workers.roles.lm.LMMixin`:
the same group and Megatron engine as RL) at the configured TP / PP / DP. Each step feeds one global batch of
`trainer.global_batch_size` sequences (= micro batch x gradient accumulation x DP); the workers run the
pipeline schedule over the micro-batches and one optimizer step (distributed optimizer, warmup + cosine /
linear / constant LR to min_lr, weight decay, clipping, NaN/Inf skip). The driver stops after
`optim.max_consecutive_nonfinite` skipped steps in a row. Validation loss every `trainer.val_every`
steps (and at the start and the end); checkpoints every `trainer.save_every` steps and at the end;
`--resume` continues from the latest one (model, optimizer, scheduler, RNG, data position, step);
`trainer.load` starts a new run from a checkpoint (with `no_load_optim` / `no_load_rng`).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from rlhf.config import RunConfig
from rlhf.driver.infra.metrics import MetricsLogger
from rlhf.driver.infra.resume_point import Unusable, read_pointer
from rlhf.driver.infra.run_checkpoints import CheckpointManager, check_resume, export_hf
from rlhf.driver.infra.run_loop import NonFiniteGuard, RunLoop
from rlhf.driver.infra.scaffold import RunScaffold
from rlhf.driver.stages.lm_data import build_lm_data, check_lm_inputs, tokenizer_path
from rlhf.errors import UserError

FRESH_START = "start a new run with trainer.load=... trainer.no_load_optim=true"
ROLE = "policy"  # the worker group of the pretraining, SFT and DPO stages (and its checkpoint folder)


def global_batch_size(cfg: RunConfig) -> int:
    p = cfg.policy
    return cfg.trainer.global_batch_size or p.micro_batch_size * p.parallel.dp


def resolve_checkpoint(path: str | Path, role: str = ROLE) -> Path:
    """The `role` folder to load for `trainer.load`: accepts a run dir, its checkpoints/ folder, a step
    folder or the role folder itself (a dist_checkpointing directory)."""
    p = Path(path)
    for root in (p / "checkpoints", p):
        if (root / "latest").is_file():
            try:  # a pointer naming a path outside its folder is refused (UserError), never followed
                p = read_pointer(root) or p
            except Unusable as e:
                raise UserError(f"trainer.load: {e}") from None
            break
    if (p / role / "metadata.json").is_file():
        return p / role
    if (p / "metadata.json").is_file():
        return p
    raise UserError(f"trainer.load: {p} is not a checkpoint (expected a run dir, its checkpoints/ folder, "
                    f"a step-N folder or a dist_checkpointing folder with metadata.json)")


def make_group(cfg: RunConfig, out: Path, role: str = ROLE, worker_cls: type | None = None) -> Any:
    """The trained model's worker group (settings from the `policy` section, whatever the stage) named
    `role`: `PolicyWorker` unless `worker_cls` is given."""
    from rlhf.workflow import role_group
    from workers.roles import PolicyWorker

    return role_group(role, cfg.policy, cfg, out, worker_cls or PolicyWorker, optimizer_steps=cfg.trainer.total_steps)


class LMRun:
    """One pretraining / SFT run: data, worker group, metrics and checkpoints, inside a `RunScaffold`.
    Subclasses (DPO, the reward model) change the batches and metrics (`train_step`, `validate`), the
    worker class and role name (`worker_class`, `role`) and what happens before the first step (`start`)."""

    role = ROLE

    @classmethod
    def worker_class(cls) -> type:
        """The Ray worker class of the trained model."""
        from workers.roles import PolicyWorker

        return PolicyWorker

    def __init__(self, cfg: RunConfig, data: Any, group: Any, frame: RunScaffold, loop: RunLoop) -> None:
        self.cfg, self.data, self.group, self.frame, self.loop = cfg, data, group, frame, loop
        self.gbs = global_batch_size(cfg)
        self.skipped_total = 0

    @property
    def step(self) -> int:
        return self.loop.step

    # ---- state --------------------------------------------------------------------------------
    def restore(self) -> None:
        """Resume from the latest checkpoint (trainer.resume=auto), else start from trainer.load."""
        t = self.cfg.trainer
        state, latest = self.loop.state, self.loop.resume_from
        if state is not None and latest is not None:
            self.group.load_checkpoint(str(latest / self.role), load_optimizer=True, load_rng=True,
                                       trust=self.cfg.trainer.trust_checkpoint)
            self.data.order.load_state_dict(state["data"])
            self.skipped_total = int(state.get("skipped_total", 0))
            self.loop.restore()
        elif t.load:
            path = resolve_checkpoint(t.load, self.role)
            self.group.load_checkpoint(str(path), load_optimizer=not t.no_load_optim, load_rng=not t.no_load_rng,
                                       trust=t.trust_checkpoint)
            print(f"loaded {path} (optimizer: {not t.no_load_optim}, rng: {not t.no_load_rng})", flush=True)

    def save(self, step: int) -> Path:
        state = {"data": self.data.order.state_dict(), "skipped_total": self.skipped_total,
                 "algorithm": self.cfg.algorithm.name, "global_batch_size": self.gbs}
        return self.loop.save(step, state, lambda tmp: self.group.save_checkpoint(str(tmp / self.role)))

    def start(self) -> None:
        """Before the first step of this process: resume or load (`restore`)."""
        self.restore()

    # ---- steps --------------------------------------------------------------------------------
    def validate(self) -> dict[str, float]:
        if self.cfg.trainer.eval_iters == 0:  # validation off (an empty batch cannot be collated)
            return {}
        batch = self.data.val_batch(self.gbs * self.cfg.trainer.eval_iters)
        if batch is None:
            return {}
        t0 = time.perf_counter()
        out = self.group.eval_lm(batch)
        return {"val/loss": out["loss"], "val/tokens": out["tokens"], "time/val": time.perf_counter() - t0}

    def train_step(self) -> dict[str, float]:
        t0 = time.perf_counter()
        batch = self.data.next_batch(self.gbs)
        t1 = time.perf_counter()
        out = self.group.train_lm_step(batch)
        dt = time.perf_counter() - t0
        skipped = bool(out.get("skipped", 0.0))
        self.skipped_total += int(skipped)
        return {
            "loss": out["loss"], "lr": out["lr"], "grad_norm": out["grad_norm"], "skipped": float(skipped),
            "skipped_steps": float(self.skipped_total), "loss_tokens": out["tokens"],
            "tokens_per_s": batch["tokens"].numel() / dt, "step_time_s": dt,
            "consumed_samples": float(self.data.order.consumed), "time/data": t1 - t0,
            "time/train": time.perf_counter() - t1,
            **{k: v for k, v in out.items() if k.startswith("moe/")},  # MoE models: router losses, expert load
            **{k: out[k] for k in ("loss_scale", "loss_scale_backoff") if k in out},  # fp16
        }

    def after_step(self, step: int, metrics: dict[str, float]) -> dict[str, float]:
        """Said when the step's optimizer step was skipped; validation when due."""
        if metrics["skipped"]:
            print(f"step {step}: non-finite grad norm {metrics['grad_norm']}: optimizer step skipped "
                  f"({self.loop.guard.count} in a row)", flush=True)
        return self.validate() if self.frame.due(step, self.cfg.trainer.val_every) else {}

    def run(self, logger: MetricsLogger) -> dict[str, float]:
        return self.loop.run(logger, lambda step: self.train_step(), self.after_step, self.save, self.validate)


def nonfinite_guard(cfg: RunConfig) -> NonFiniteGuard:
    """Stops the run after policy.optim.max_consecutive_nonfinite optimizer steps in a row skipped for a NaN/Inf
    gradient norm."""
    def message(step: int, count: int, limit: int) -> str:
        return (f"stopped at step {step}: {count} optimizer steps in a row had a NaN/Inf gradient norm "
                f"(policy.optim.max_consecutive_nonfinite={limit}); lower policy.optim.lr or check the data, then "
                "resume from the last checkpoint")

    return NonFiniteGuard(cfg.policy.optim.max_consecutive_nonfinite, lambda m: bool(m["skipped"]), message)


def check_loadable(cfg: RunConfig, role: str) -> None:
    """Refuse a `trainer.load` with its optimizer that the checkpoint's saved schedule and layout cannot honour
    (`check_resume`; a resume is checked by the `RunLoop`)."""
    t = cfg.trainer
    step_dir = resolve_checkpoint(t.load, role).parent if t.load and not t.no_load_optim else None
    if step_dir is not None and (step_dir / "driver_state.json").is_file():
        check_resume(CheckpointManager.driver_state(step_dir), cfg, step_dir, FRESH_START)


def run_stage(cfg: RunConfig, data: Any, run_cls: type[LMRun]) -> dict[str, float]:
    """Run an LM-style stage on prepared `data` (inputs already checked): the worker group of
    `run_cls.worker_class()` inside a `RunScaffold`, `start`, the steps, then the HF export; the last step's
    metrics."""
    out = Path(cfg.trainer.output_dir)
    if cfg.trainer.load:
        CheckpointManager.check_trusted(resolve_checkpoint(cfg.trainer.load, run_cls.role), cfg.trainer.trust_checkpoint)
    with RunScaffold(cfg) as frame:
        loop = RunLoop(cfg, frame, FRESH_START, nonfinite_guard(cfg))  # checks a resume before any worker starts
        if loop.resume_from is None:
            check_loadable(cfg, run_cls.role)
        group = frame.own(make_group(cfg, out, run_cls.role, run_cls.worker_class()))
        run = run_cls(cfg, data, group, frame, loop)
        run.start()
        last = run.run(frame.metrics_logger(run.step))
        if cfg.trainer.export_hf:
            export_hf(out / "hf", lambda d: group.save_hf_weights(d, tokenizer_path(cfg)))
    return last


def run_lm(cfg: RunConfig) -> dict[str, float]:
    """Pretrain or SFT as configured; returns the last step's metrics. Inputs are checked (UserError)
    before Ray or any worker starts."""
    if cfg.algorithm.name not in ("pretrain", "sft"):
        raise UserError(f"algorithm.name: run_lm runs pretrain or sft, got {cfg.algorithm.name!r}")
    check_lm_inputs(cfg)
    out = Path(cfg.trainer.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    return run_stage(cfg, build_lm_data(cfg, global_batch_size(cfg), str(out)), LMRun)
