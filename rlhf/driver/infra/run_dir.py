"""No lost history: a folder that holds a run is continued (`--resume`) or moved aside (`--force`), never
overwritten in place. A resumed run keeps every earlier metrics row (rlhf.driver.infra.metrics.mark_resume) and
every step folder (rlhf.driver.infra.run_checkpoints)."""

from __future__ import annotations

import os
import time
from pathlib import Path

from rlhf.errors import UserError

RUN_MARKERS = ("config.yaml", "metrics.jsonl", "checkpoints")  # what a started run leaves in its folder


def holds_run(out: Path) -> bool:
    """Whether `out` holds (the start of) a training run, not only its generated inputs (data/, model/)."""
    return any((out / name).exists() for name in RUN_MARKERS)


def aside_path(out: Path) -> Path:
    """A free `<out>.old-<UTC timestamp>[-k]` next to `out`."""
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    candidate, k = out.with_name(f"{out.name}.old-{stamp}"), 1
    while candidate.exists():
        k += 1
        candidate = out.with_name(f"{out.name}.old-{stamp}-{k}")
    return candidate


def claim_output_dir(out: str | Path, resume: bool, force: bool) -> Path | None:
    """Make `out` ready for a new or resumed run. A folder holding a run is refused unless `resume` (continue
    it) or `force` (move it aside whole, returning where it went). Raises UserError with one line."""
    out = Path(out)
    if resume and force:
        raise UserError("--resume continues the run in the output folder and --force starts afresh: give one")
    if resume or not out.exists() or not holds_run(out):
        return None
    if not force:
        raise UserError(f"trainer.output_dir: {out} holds a run ({', '.join(n for n in RUN_MARKERS if (out / n).exists())}); "
                        f"continue it with --resume, start afresh with --force (moves it to {out.name}.old-<time>), "
                        "or choose another trainer.output_dir")
    aside = aside_path(out)
    try:
        os.replace(out, aside)
    except OSError as e:
        raise UserError(f"trainer.output_dir: cannot move {out} aside to {aside}: {e.strerror or e}") from None
    return aside


def refuse_unclaimed(out: Path, resume: str) -> None:
    """For runs started from Python (`run_rl`, `run_lm`): a folder holding metrics or checkpoints is continued
    only with trainer.resume=auto."""
    if resume != "auto" and ((out / "metrics.jsonl").exists() or (out / "checkpoints").exists()):
        raise UserError(f"trainer.output_dir: {out} holds a run (metrics.jsonl or checkpoints/); set "
                        "trainer.resume=auto to continue it, or choose another trainer.output_dir "
                        "(`rlhf train --force` moves it aside)")
