"""End-of-run report: `report.png` with the reward / accuracy / KL (or loss) curves and `summary.txt`."""

from __future__ import annotations

from pathlib import Path

from rlhf.driver.infra.metrics import read_metrics
from rlhf.paths import staged_output_file

PANELS = (
    ("reward", ("reward_mean", "val/reward_mean")),
    ("accuracy", ("val/accuracy",)),
    ("kl / loss", ("kl", "policy_loss", "loss", "val/loss")),
)


def _series(rows: list[dict], key: str) -> tuple[list[int], list[float]]:
    pts = [(r["step"], r[key]) for r in rows if isinstance(r.get(key), (int, float))]
    return [p[0] for p in pts], [p[1] for p in pts]


def write_report(run_dir: str | Path, title: str = "") -> str:
    """Draw the curves from metrics.jsonl and write a text summary; return the summary."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run_dir = Path(run_dir)
    rows = read_metrics(run_dir)
    fig, axes = plt.subplots(1, len(PANELS), figsize=(5 * len(PANELS), 3.6))
    for ax, (name, keys) in zip(axes, PANELS):
        for key in keys:
            xs, ys = _series(rows, key)
            if xs:
                ax.plot(xs, ys, marker="." if len(xs) < 30 else None, label=key)
        ax.set_title(name)
        ax.set_xlabel("step")
        if ax.lines:
            ax.legend(fontsize=8)
    fig.suptitle(title or run_dir.name)
    fig.tight_layout()
    try:
        with staged_output_file(run_dir / "report.png") as tmp:  # a full disk: one line, no half-drawn file
            fig.savefig(tmp, dpi=90, format="png")
    finally:
        plt.close(fig)
    lines = [f"run: {run_dir}", f"steps logged: {len(rows)}"]
    for key in ("reward_mean", "val/accuracy", "val/reward_mean", "kl", "loss", "val/loss", "step_time_s"):
        xs, ys = _series(rows, key)
        if ys:
            lines.append(f"{key}: first {ys[0]:.4g} (step {xs[0]}) -> last {ys[-1]:.4g} (step {xs[-1]}), "
                         f"best {max(ys):.4g}")
    summary = "\n".join(lines) + "\n"
    with staged_output_file(run_dir / "summary.txt") as tmp:
        tmp.write_text(summary)
    return summary
