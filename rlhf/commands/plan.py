"""`rlhf plan`: estimate memory per GPU and step time of every parallel layout of a model on a cluster,
print the best ones and write the best as a config overlay."""

from __future__ import annotations

import argparse


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("plan", help="pick TP/PP/DP/EP/CP, micro-batch and recompute from memory and time estimates")
    p.add_argument("--model", required=True,
                   help="HF model folder, a tiny preset or a known model (Llama-3-8B, Qwen2.5-32B, Qwen3-30B-A3B, "
                        "DeepSeek-V3)")
    p.add_argument("--nodes", type=int, default=1)
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument("--gpu", default="H100", help="H100 | H200 | H800 | A100 (peak FLOP/s and bandwidths)")
    p.add_argument("--gpu-mem", help="memory per GPU, e.g. 80GiB (default: the GPU's)")
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--global-batch", type=int, default=128, help="sequences per optimizer step")
    p.add_argument("--roles", default="policy",
                   help="comma list of policy, reference, critic, reward_model, rollout (counted with --colocate)")
    p.add_argument("--colocate", action="store_true", help="all roles share the same GPUs (resident together)")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument("--headroom", type=float, default=0.95, help="fraction of GPU memory a plan may use")
    p.add_argument("--top", type=int, default=10, help="rows to print")
    p.add_argument("--out", help="write the best plan as a config overlay (YAML) for `rlhf train CONFIG OVERLAY`")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from rlhf.errors import UserError
    from rlhf.plan.hardware import get_gpu, parse_bytes
    from rlhf.plan.model import load_model
    from rlhf.plan.overlay import write_overlay
    from rlhf.plan.report import render
    from rlhf.plan.search import ROLES, Planner, Request, advice

    roles = tuple(r.strip() for r in args.roles.split(",") if r.strip())
    bad = [r for r in roles if r not in ROLES]
    if bad or "policy" not in roles:
        raise UserError(f"--roles: expected a comma list with policy among {', '.join(ROLES)}, got {args.roles!r}")
    if not 0 < args.headroom <= 1:
        raise UserError(f"--headroom: expected a fraction in (0, 1], got {args.headroom}")
    gpu = get_gpu(args.gpu)
    req = Request(model=load_model(args.model), gpu=gpu, nodes=args.nodes, gpus_per_node=args.gpus_per_node,
                  gpu_mem=parse_bytes(args.gpu_mem) if args.gpu_mem else gpu.memory, seq=args.seq_len,
                  global_batch=args.global_batch, roles=roles, colocate=args.colocate,
                  param_bytes=2 if args.dtype == "bfloat16" else 4, headroom=args.headroom)
    planner = Planner(req)
    plans = planner.plan()
    fitting = [p for p in plans if p.feasible]
    if not fitting:
        raise UserError(advice(planner, plans))
    print(render(req, fitting, args.top))
    if args.out:
        today = [p for p in fitting if p.runnable_today]
        chosen = today[0] if today else fitting[0]
        path = write_overlay(args.out, chosen, req)
        what = "the best layout today's config can express" if today else "the best layout (see its header)"
        print(f"wrote {what} ({chosen.layout.short()}) to {path}; use: rlhf train CONFIG {path}")
    return 0
