"""A plan as a config overlay for `rlhf train CONFIG OVERLAY`: only keys the schema has today; the levers it
cannot express yet are named in the header comment."""

from __future__ import annotations

from pathlib import Path

import yaml

from rlhf.paths import staged_output_file
from rlhf.plan.hardware import GIB
from rlhf.plan.search import Plan, Request, cp_gathered_extra
from workers.file_problems import file_errors

TRAINED = ("policy", "critic")
FROZEN = ("reference", "reward_model")


def overlay_dict(plan: Plan, req: Request) -> dict:
    """The overlay's sections: every Megatron role in `req.roles` gets the layout, the rollout engine the
    trainer's TP and (colocated) the KV cache the batch needs."""
    lay = plan.layout
    dtype = "bfloat16" if req.param_bytes == 2 else "float32"
    out: dict = {}
    for role in req.roles:
        if role in TRAINED + FROZEN:
            parallel = {"tp": lay.tp, "pp": lay.pp, "dp": lay.dp} | ({"ep": lay.ep} if lay.ep > 1 else {}) \
                | ({"cp": lay.cp} if lay.cp > 1 else {})
            section: dict = {"parallel": parallel, "micro_batch_size": lay.mbs, "dtype": dtype}
            if lay.sp:
                section["sequence_parallel"] = True
            if role in TRAINED:
                section["optim"] = {"use_distributed_optimizer": lay.dp > 1 or lay.offload}
                if lay.offload:
                    section["optim"]["cpu_offload"] = True
                if lay.recompute != "none":  # a frozen role runs no backward: nothing to recompute
                    section["recompute"] = lay.recompute
            out[role] = section
        elif role == "rollout":
            out["rollout"] = {"tp": lay.tp}
            if plan.memory.kv_cache:
                out["rollout"]["kv_cache_gb"] = round(plan.memory.kv_cache / 1e9, 2)
    if set(req.roles) <= {"policy"}:  # SFT / pretraining: sequences per optimizer step
        out["trainer"] = {"global_batch_size": req.global_batch}
    return out


def write_overlay(path: str | Path, plan: Plan, req: Request) -> Path:
    lay, m = plan.layout, req.model
    header = [
        f"rlhf plan: {m.name} on {req.nodes} x {req.gpus_per_node} {req.gpu.name} "
        f"({req.gpu_mem / GIB:.0f} GiB), seq {req.seq}, global batch {req.global_batch}",
        f"layout {lay.short()}: {plan.memory.total / GIB:.1f} GiB per GPU, ~{plan.time.total:.2f} s per step",
    ]
    if plan.missing:
        header.append("not yet configurable, so NOT in this overlay: " + ", ".join(plan.missing))
    if lay.cp > 1:
        header.append(f"cp={lay.cp}: the estimate assumes ring attention; the engine's all-gather CP attention "
                      f"keeps ~{cp_gathered_extra(req, plan.layout) / GIB:.1f} GiB more per GPU (gathered K/V, scores)")
    text = "".join(f"# {line}\n" for line in header) + yaml.safe_dump(overlay_dict(plan, req), sort_keys=False)
    p = Path(path)
    with file_errors(p.parent, "create the folder"):
        p.parent.mkdir(parents=True, exist_ok=True)
    with staged_output_file(p) as tmp:  # complete or absent: a full disk names the file in one line
        tmp.write_text(text)
    return p
