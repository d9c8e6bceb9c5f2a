"""A hostile pickle, and checkpoint folders that carry one: for the tests that show a loader never unpickles
what it was handed."""

from __future__ import annotations

import json
import pickle
from collections.abc import Callable
from pathlib import Path


class Plant:
    """Unpickling this creates the marker file (what a hostile `.metadata` could do with any code)."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def plant(folder: Path, marker: Path) -> None:
    (folder / ".metadata").write_bytes(pickle.dumps(Plant(marker)))


def fake_run(root: Path, marker: Path, with_manifest: bool = True,
             forge: Callable[[Path], None] | None = None) -> Path:
    """A run dir whose latest checkpoint's policy folder carries a planted `.metadata` (signed with the session's
    key first when `with_manifest`; `forge(role)` then rewrites its manifest). Returns the policy folder."""
    from workers.megatron.ckpt_key import load_key
    from workers.megatron.ckpt_manifest import write_manifest

    step = root / "checkpoints" / "step-000002"
    role = step / "policy"
    role.mkdir(parents=True)
    (role / "metadata.json").write_text(json.dumps({"sharded_backend": "torch_dist"}))
    (role / "common.pt").write_bytes(b"x")
    (step / "driver_state.json").write_text(json.dumps({"step": 2}))
    if with_manifest:
        write_manifest(role, load_key())
    plant(role, marker)
    if forge is not None:
        forge(role)
    (step.parent / "latest").write_text(step.name)
    return role
