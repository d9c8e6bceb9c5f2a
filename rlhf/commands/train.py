"""`rlhf train CONFIG [OVERLAY.yaml ...] [KEY=VALUE ...]`: run a GRPO, PPO, SFT, DPO, reward-model or
pretraining config."""

from __future__ import annotations

import argparse


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("train", help="train with a YAML config (algorithm.name: grpo | ppo | sft | pretrain | dpo | rm)")
    p.add_argument("config", help="YAML preset, e.g. configs/grpo_tiny.yaml")
    p.add_argument("overrides", nargs="*",
                   help="overlay YAML files (e.g. from `rlhf plan --out`, merged in order) and dotted overrides, "
                        "e.g. trainer.total_steps=5")
    p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint (trainer.resume=auto)")
    p.add_argument("--force", action="store_true",
                   help="start afresh in an output folder that holds a run, after moving it to <dir>.old-<time>")
    p.add_argument("--address", help="join this Ray cluster instead of starting a local one (or set RAY_ADDRESS)")
    p.add_argument("--trust-checkpoint", action="store_true",
                   help="load checkpoints without a matching rlhf manifest (trainer.trust_checkpoint=true)")
    p.set_defaults(func=run)


def quiet_libraries() -> None:
    """The console shows the run's progress: transformers' per-file progress bars and info lines (the
    warm start saves and loads models in this process) are turned off; its warnings stay."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_warning()


def run(args: argparse.Namespace) -> int:
    from rlhf.config import load_config
    from rlhf.driver.infra.run_dir import claim_output_dir
    from rlhf.driver.warmstart.prepare import prepare_inputs

    overlays = [o for o in args.overrides if "=" not in o and o.endswith((".yaml", ".yml"))]
    overrides = [o for o in args.overrides if o not in overlays]
    if args.resume:
        overrides.append("trainer.resume=auto")
    if args.address:
        overrides.append(f"trainer.ray_address={args.address}")
    if args.trust_checkpoint:
        overrides.append("trainer.trust_checkpoint=true")
    cfg = load_config(args.config, overrides, overlays=overlays)
    aside = claim_output_dir(cfg.trainer.output_dir, resume=cfg.trainer.resume == "auto", force=args.force)
    if aside is not None:
        print(f"moved the previous run in {cfg.trainer.output_dir} to {aside}", flush=True)
    quiet_libraries()
    cfg = prepare_inputs(cfg)  # data and model files are checked (or generated) before any worker starts
    if cfg.algorithm.name == "dpo":
        from rlhf.driver.stages.dpo import run_dpo

        run_dpo(cfg)
    elif cfg.algorithm.name == "rm":
        from rlhf.driver.stages.rm import run_rm

        run_rm(cfg)
    elif cfg.algorithm.name in ("sft", "pretrain"):
        from rlhf.driver.stages.lm import run_lm

        run_lm(cfg)
    else:
        from rlhf.driver.rl.runner import run_rl

        run_rl(cfg)
    return 0  # a worker failure (any role) propagates to rlhf.cli, which prints it as one line, exit code 2
