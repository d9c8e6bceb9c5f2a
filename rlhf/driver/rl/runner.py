"""The RL runner: data, roles, validation, checkpoints, metrics and resume around a step function.

`run_rl(cfg, step_fn)` runs any step function written with the workflow API; GRPO and PPO are two of them.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from algorithms import make_kl_controller
from rlhf.config import RunConfig
from rlhf.driver.infra.metrics import PhaseTimer
from rlhf.driver.infra.run_checkpoints import export_hf
from rlhf.driver.infra.run_loop import NonFiniteGuard, RunLoop
from rlhf.driver.infra.scaffold import RunScaffold
from rlhf.driver.rl.context import StepContext, accuracy
from rlhf.driver.rl.sources import rollout_source
from rlhf.workflow import Roles

StepFn = Callable[[Roles, StepContext], dict[str, float]]


def validate(roles: Roles, prompts: list[dict[str, Any]], batch_size: int = 256) -> dict[str, float]:
    """Greedy decoding on held-out prompts: mean reward and exact-match accuracy (by `reward.fn` also when a
    reward model gives the reward, `RewardHandle.check_scores`); with tools or an environment
    the rollout runs the agent loop here too, and its `agent/*` metrics are reported as `val/agent/*`."""
    from workers.agent.metrics import merge_agent_metrics

    scores, checks, infos = [], [], []
    for i in range(0, len(prompts), batch_size):
        batch = roles.rollout.generate(prompts[i: i + batch_size], score=roles.reward, n=1, temperature=0.0, seed=0)
        scores.append(batch["scores"])
        checks.append(roles.reward.check_scores(batch))
        infos.append((batch.info, len(batch)))
    s = torch.cat(scores) if scores else torch.zeros(0)
    c = torch.cat(checks) if checks else torch.zeros(0)
    agent = {f"val/{k}": v for k, v in merge_agent_metrics(infos).items()}
    return {"val/reward_mean": float(s.mean()) if len(s) else 0.0, "val/accuracy": accuracy(c), **agent}


def eval_tasks(cfg: RunConfig) -> Callable[[Roles], dict[str, float]] | None:
    """trainer.eval_tasks loaded now (a bad name or file fails before Ray starts), as a function that
    evaluates the current policy on the running engine."""
    t = cfg.trainer
    if not t.eval_every:
        return None
    from transformers import AutoTokenizer

    from rlhf.eval.run import EvalOptions, eval_metrics
    from rlhf.eval.tasks import load_task

    tasks = [load_task(name, t.eval_limit, seed=t.seed) for name in t.eval_tasks]
    tokenizer = AutoTokenizer.from_pretrained(cfg.model.tokenizer_path or cfg.model.path)
    opts = EvalOptions(max_tokens=t.eval_max_tokens, seed=t.seed, progress=False)  # the training bar is on
    return lambda roles: eval_metrics(roles.rollout.group, tokenizer, tasks, opts)


def nonfinite_guard(cfg: RunConfig) -> NonFiniteGuard:
    """Stops a run whose policy updates keep being skipped (NaN/Inf gradient norm), as the LM stages do: a step
    counts when every optimizer step of its policy update was skipped."""
    def skipped(metrics: dict[str, float]) -> bool:
        total = metrics.get("num_steps", 0.0)
        return bool(total and metrics.get("skipped_steps", 0.0) >= total)

    def message(step: int, count: int, limit: int) -> str:
        return (f"stopped at step {step}: the policy update of {count} steps in a row was skipped for a "
                f"NaN/Inf gradient norm (policy.optim.max_consecutive_nonfinite={limit}); check the rewards "
                "and advantages or lower policy.optim.lr, then resume from the last checkpoint")

    return NonFiniteGuard(cfg.policy.optim.max_consecutive_nonfinite, skipped, message)


def default_step_fn(cfg: RunConfig) -> StepFn:
    if cfg.algorithm.name == "ppo":
        from rlhf.driver.rl.ppo import ppo_step

        return ppo_step
    if cfg.algorithm.name == "online_dpo":
        from rlhf.driver.rl.online_dpo import online_dpo_step

        return online_dpo_step
    if cfg.teacher.enabled and cfg.algorithm.distill.mode == "forward_kl":
        from rlhf.driver.rl.distill import forward_kl_step

        return forward_kl_step
    from rlhf.driver.rl.grpo import grpo_step

    return grpo_step


def report_sandbox(cfg: RunConfig) -> str | None:
    """When the run executes untrusted code (the `python` tool, a code-execution reward of rlhf.eval.code),
    the sandbox's isolation level on this machine, printed at startup: a warning when the kernel refuses
    namespaces and the sandbox falls back to resource limits alone (no network isolation)."""
    if "python" not in cfg.rollout.tools and not (cfg.reward.fn or "").startswith("rlhf.eval.code:"):
        return None
    from workers.sandbox import namespaces_available

    line = ("sandbox: namespaces (no network, private PID space, read-only root) and resource limits"
            if namespaces_available() else
            "WARNING sandbox: resource limits only, the kernel refused namespaces: model-written code runs "
            "WITHOUT network isolation or a private file system")
    print(line, flush=True)
    return line


def report_preset(cfg: RunConfig) -> str | None:
    """The algorithm preset in force, printed at startup with the settings it stands for (the validator
    checked that the config holds them)."""
    name = cfg.algorithm.preset
    if name is None:
        return None
    from algorithms.presets import ALGORITHM_PRESETS

    line = f"algorithm preset {name}: " + ", ".join(f"{k}={v}" for k, v in ALGORITHM_PRESETS[name].items())
    print(line, flush=True)
    return line


FRESH_START = ("start a new run from its policy weights: rlhf convert mcore-to-hf --mcore <checkpoint>/policy, "
               "then model.path=<that folder>")


def run_rl(cfg: RunConfig, step_fn: StepFn | None = None) -> dict[str, float]:
    """Train with `step_fn` (by default GRPO, PPO or online DPO, `default_step_fn`) and return the last metrics row."""
    from rlhf.data.prompts import PromptLoader
    from rlhf.driver.warmstart.prepare import load_rl_prompts, megatron_warm_start_due, warm_start_items

    step_fn = step_fn or default_step_fn(cfg)
    t, d, a = cfg.trainer, cfg.data, cfg.algorithm
    train, val = load_rl_prompts(cfg)  # over-long prompts dropped (counted) or refused before Ray starts
    loader = PromptLoader(train, d.prompts_per_step, seed=d.seed)
    evals = eval_tasks(cfg)
    report_sandbox(cfg)
    report_preset(cfg)
    kl_ctrl = make_kl_controller(a.kl_ctrl, a.kl_coef, target=a.kl_target, horizon=a.kl_horizon)
    with RunScaffold(cfg) as run:
        torch.manual_seed(t.seed)
        loop = RunLoop(cfg, run, FRESH_START, nonfinite_guard(cfg))  # checks a resume before any worker starts
        if megatron_warm_start_due(cfg, run.out):
            from rlhf.driver.warmstart.megatron_sft import megatron_warm_start

            cfg.model.path = str(megatron_warm_start(cfg, run.out, warm_start_items(cfg, run.out),
                                                     [(p["prompt"] or p["messages"], p["ground_truth"]) for p in val]))
        roles = run.own(Roles.create(cfg, run.out))
        state, resume_from = loop.state, loop.resume_from
        if state is not None and resume_from is not None:
            roles.policy.load(resume_from / "policy", trust=t.trust_checkpoint)
            if roles.critic is not None:
                roles.critic.load(resume_from / "critic", trust=t.trust_checkpoint)
            loader.load_state_dict(state["loader"])
            kl_ctrl.load_state_dict(state["kl_ctrl"])
            loop.restore()
        start = loop.step
        source = rollout_source(cfg, roles, loader)  # the schedule: sync, one_step_off or async
        roles.rollout.sync_weights(roles.policy)  # the first sync: the log-prob canary unless verify_every=0
        if state is not None:  # the version count and (async) the buffer's samples
            source.load_state_dict(state.get("rollout", {}))
        logger = run.metrics_logger(start)

        def write_roles(tmp: Path) -> None:
            roles.policy.save(tmp / "policy")
            if roles.critic is not None:
                roles.critic.save(tmp / "critic")

        def save(step: int) -> None:
            loop.save(step, {"loader": source.loader_state(), "kl_ctrl": kl_ctrl.state_dict(),
                             "rollout": source.state_dict()}, write_roles)

        def train_step(step: int) -> dict[str, float]:
            t0 = time.perf_counter()
            ctx = StepContext(cfg, step, source.prompts(step), kl_ctrl, loader.next_batch, PhaseTimer(),
                              source=source)
            metrics = step_fn(roles, ctx)
            metrics.update(ctx.metrics)
            metrics.update(ctx.timer.pop())
            metrics["step_time_s"] = time.perf_counter() - t0
            metrics["tokens_per_s"] = metrics.get("response_tokens", 0.0) / metrics["step_time_s"]
            return metrics

        def after(step: int, metrics: dict[str, float]) -> dict[str, float]:
            extra: dict[str, float] = {}
            if val and run.due(step, t.val_every):
                extra.update(validate(roles, val))
            if evals and run.due(step, t.eval_every):
                extra.update(evals(roles))
            extra.update(roles.reward.pop_metrics())
            return extra

        def first_validation() -> dict[str, float]:
            return {**validate(roles, val), **roles.reward.pop_metrics()}

        last = loop.run(logger, train_step, after, save, first_validation if val else None)
        if t.export_hf:
            export_hf(run.out / "hf", lambda d: roles.policy.export_hf(Path(d), cfg.model.tokenizer_path or cfg.model.path))
    return last
