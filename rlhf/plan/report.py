"""The ranked table `rlhf plan` prints."""

from __future__ import annotations

from rlhf.plan.hardware import GIB
from rlhf.plan.search import Plan, Request


def _row(rank: str, p: Plan) -> str:
    b = p.memory
    cells = [b.params, b.grads, b.optimizer, b.activations, b.kv_cache, b.buffers, b.total]
    return (f"{rank:>4} {p.layout.short():<42} " + " ".join(f"{c / GIB:7.1f}" for c in cells)
            + f" {p.time.total:9.3g}  {'yes' if p.runnable_today else 'no'}")


def render(req: Request, fitting: list[Plan], top: int) -> str:
    m = req.model
    head = (f"{m.name}: {req.world} x {req.gpu.name} ({req.gpu_mem / GIB:.0f} GiB, {req.headroom:.0%} usable), "
            f"seq {req.seq}, global batch {req.global_batch}, roles {','.join(req.roles)}"
            f"{' colocated' if req.colocate else ''}; {len(fitting)} layouts fit")
    cols = (f"{'#':>4} {'layout':<42} {'params':>7} {'grads':>7} {'optim':>7} {'acts':>7} {'kv':>7} "
            f"{'buffers':>7} {'total':>7} {'step s':>9}  today")
    lines = [head, cols + "   (GiB per GPU, fullest pipeline rank)"]
    lines += [_row(str(i + 1), p) for i, p in enumerate(fitting[:top])]
    today = next(((i, p) for i, p in enumerate(fitting) if p.runnable_today), None)
    if today and today[0] >= top:
        lines.append(_row(str(today[0] + 1), today[1]) + "   <- best with today's config")
    best = fitting[0]
    if best.missing:
        lines.append("best layout needs levers the config cannot set yet: " + ", ".join(best.missing))
    if today is None:
        lines.append("no fitting layout runs with today's config (policy.parallel has tp, pp, dp only; no recompute, "
                     "offload, sequence/context/expert parallel keys)")
    lines.append("'today' = expressible with today's config keys; step time: roofline (FLOPs / 45% of peak, "
                 "communication / bandwidth, pipeline bubble), no overlap")
    return "\n".join(lines)
