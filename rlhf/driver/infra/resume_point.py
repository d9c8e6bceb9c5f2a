"""Which checkpoint `--resume` continues from: the step `checkpoints/latest` names when it is intact, else the
newest intact step folder, said in one line; refused in one line when a run's checkpoints hold none.

A step folder is intact when its `driver_state.json` parses and records its step, and every role folder in it
matches its manifest (`workers/megatron/ckpt_manifest.py`). A file that differs from an authentic manifest
(DamagedCheckpointError: a truncated shard, a partial copy) makes the step damaged and the search goes on
to older steps; a manifest that is missing or not ours (UntrustedCheckpointError) is refused as a trust
problem, unless the run trusts its checkpoints. `latest` names a step folder inside `checkpoints/`: an
absolute path, a `..` component or a link leaving the folder is refused, never followed.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

from rlhf.errors import UserError

STEP_NAME = re.compile(r"step-(\d+)")  # the folders CheckpointManager.save writes
_SHOWN = 60  # characters of a bad pointer shown in a message


class Unusable(Exception):
    """Why a pointer or a step folder cannot be resumed from (one line, no trust problem)."""


def _outside(path: Path, root: Path) -> bool:
    return path.resolve().parent != root.resolve()


def read_pointer(root: Path) -> Path | None:
    """The step folder `root/latest` names; None when there is no pointer. Raises Unusable for a pointer that
    is unreadable or names a step that is missing, and UserError for one that leaves `root`."""
    pointer = root / "latest"
    if not pointer.exists() and not pointer.is_symlink():
        return None
    try:
        name = pointer.read_bytes().decode("utf-8").strip()
    except (OSError, UnicodeDecodeError) as e:
        raise Unusable(f"{pointer} is unreadable ({getattr(e, 'strerror', None) or e})") from None
    shown = repr(name[:_SHOWN] + ("..." if len(name) > _SHOWN else ""))
    if os.path.isabs(name) or ".." in Path(name).parts or "\\" in name:
        raise UserError(f"{pointer}: names {shown}, a path outside {root}; it must name a step folder in it "
                        "(step-N): fix or remove the file")
    if not STEP_NAME.fullmatch(name):
        raise Unusable(f"{pointer} names {shown}, not a step folder (step-N)")
    step_dir = root / name
    if step_dir.is_symlink() and _outside(step_dir, root):
        raise UserError(f"{pointer}: names {name}, a link to {step_dir.resolve()} outside {root}; refusing to "
                        "follow it: fix or remove the file")
    if not step_dir.is_dir():
        raise Unusable(f"{pointer} names {name}, which does not exist")
    return step_dir


def read_driver_state(step_dir: Path) -> dict:
    """`step_dir/driver_state.json`, checked to be a JSON object with its step; Unusable naming the file
    otherwise (a truncated write, a partial copy)."""
    path = step_dir / "driver_state.json"
    try:
        state = json.loads(path.read_text())
    except FileNotFoundError:
        raise Unusable(f"{path} is missing") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise Unusable(f"{path} is damaged (truncated or not JSON: {getattr(e, 'strerror', None) or e})") from None
    if not isinstance(state, dict) or not isinstance(state.get("step"), int):
        raise Unusable(f"{path} is damaged (no step recorded)")
    return state


def role_folders(step_dir: Path) -> list[Path]:
    """The role checkpoints (policy/, critic/, ...) in a step folder: each subfolder holding a
    dist_checkpointing index or an rlhf manifest."""
    from workers.megatron.ckpt_manifest import MANIFEST_FILE

    return sorted(p for p in step_dir.iterdir() if p.is_dir() and not p.is_symlink()
                  and ((p / "metadata.json").is_file() or (p / MANIFEST_FILE).is_file()))


def check_intact(step_dir: Path, trust: bool) -> None:
    """Raise Unusable when the step folder `step_dir` is damaged (driver state, a role's files), and
    UserError when a role's manifest is missing or not ours and `trust` is off."""
    from workers.megatron.ckpt_manifest import (
        DamagedCheckpointError,
        UntrustedCheckpointError,
        check_checkpoint,
        verify_manifest,
    )

    state = read_driver_state(step_dir)
    m = STEP_NAME.fullmatch(step_dir.name)
    if m is not None and state["step"] != int(m.group(1)):
        raise Unusable(f"{step_dir / 'driver_state.json'} records step {state['step']}, not {int(m.group(1))}")
    roles = role_folders(step_dir)
    if not roles:
        raise Unusable(f"{step_dir} holds no role checkpoint")
    for role in roles:
        try:
            try:
                verify_manifest(role)  # also under trust: damage to one of our own checkpoints is still damage
            except DamagedCheckpointError:
                raise
            except UntrustedCheckpointError as e:
                if not trust:
                    raise UserError(str(e)) from None
                check_checkpoint(role, trust=True)  # what the run's trust still checks
        except DamagedCheckpointError as e:
            raise Unusable(str(e)) from None


def step_folders(root: Path) -> list[Path]:
    """The step folders under `root`, newest first."""
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := STEP_NAME.fullmatch(p.name)) and p.is_dir()]
    return [p for _, p in sorted(found, reverse=True)]


def choose_resume_point(root: Path, trust: bool) -> tuple[Path | None, str | None]:
    """The step folder a resumed run continues from and, when `latest` could not be used, the one line that
    says why and which step is used instead. (None, None): the run holds no checkpoint, it starts at step 0.
    Raises UserError (one line) when `latest` leaves `root`, a checkpoint is untrusted, or no step is intact."""
    if not root.is_dir():
        return None, None
    named: Path | None = None
    missing = False
    try:
        named = read_pointer(root)
        if named is None:
            missing = True
            raise Unusable(f"{root / 'latest'} is missing")
        check_intact(named, trust)
        return named, None
    except Unusable as e:
        why = f"{root / 'latest'} names {named.name}, which is not intact: {e}" if named is not None else str(e)
    skipped = []
    for step_dir in step_folders(root):
        if step_dir == named or (step_dir.is_symlink() and _outside(step_dir, root)):
            continue
        try:
            check_intact(step_dir, trust)
        except Unusable as e:
            skipped.append(str(e))
            continue
        also = f" (newer, not intact: {_first(skipped)})" if skipped else ""
        return step_dir, f"resume: {why}; resuming from {step_dir.name}, the newest intact step{also}"
    if missing and not skipped:
        return None, None  # no checkpoint was ever finished (stopped before its first save)
    found = f"no step folder is intact ({_first(skipped)})" if skipped else "there is no other step folder"
    raise UserError(f"cannot resume: {why}, and {found}; start afresh with `rlhf train --force` (moves the run "
                    "aside)")


def _first(reasons: list[str], shown: int = 2) -> str:
    more = len(reasons) - shown
    return "; ".join(reasons[:shown]) + (f"; and {more} more" if more > 0 else "")
