"""A checkpoint that cannot be written (full or read-only disk) fails in one line naming the checkpoint and
the cause, and leaves nothing half-written beside the good checkpoints. The disk errors are raised by the
`write_roles` callback here (simulated: a full disk cannot be made without root), in the two forms they reach
the driver: an OSError, and a worker's failure whose message carries the remote error."""

from __future__ import annotations

import errno
from pathlib import Path

import pytest

from rlhf.driver.infra.run_checkpoints import CheckpointManager
from workers.file_problems import FileProblem


def _write_ok(tmp: Path) -> None:
    (tmp / "policy").mkdir()
    (tmp / "policy" / "weights.bin").write_bytes(b"x" * 100)


@pytest.mark.parametrize("error, cause", [
    (OSError(errno.ENOSPC, "No space left on device"), "no space left on device"),
    (RuntimeError("role 'policy' rank 0 (pid 12, node n): the actor died: ... RuntimeError: [enforce fail at "
                  "inline_container.cc:664] . unexpected pos 704 vs 598"), "no space left on device"),
    (RuntimeError("worker failure: OSError: [Errno 30] Read-only file system: '/ckpt/x'"), "read-only file system"),
])
def test_disk_problem_during_save_is_one_line_and_leaves_no_partial(tmp_path, error, cause):
    ckpt = CheckpointManager(tmp_path)
    ckpt.save(2, {"rng": None}, _write_ok)

    def write_fails(tmp: Path) -> None:
        _write_ok(tmp)
        raise error

    with pytest.raises(FileProblem) as info:
        ckpt.save(4, {"rng": None}, write_fails)
    assert str(info.value) == f"{tmp_path / 'checkpoints' / 'step-000004'}: cannot write the checkpoint: {cause}"
    root = tmp_path / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step-000002"]
    assert (root / "latest").read_text() == "step-000002"


def test_other_failures_keep_their_error(tmp_path):
    ckpt = CheckpointManager(tmp_path)

    def write_fails(tmp: Path) -> None:
        raise ValueError("a bug")

    with pytest.raises(ValueError, match="a bug"):
        ckpt.save(1, {}, write_fails)
    assert not list((tmp_path / "checkpoints").glob("tmp-*"))


@pytest.mark.parametrize("error, cause", [
    (OSError(errno.ENOSPC, "No space left on device"), "no space left on device"),
    (RuntimeError("role 'policy' rank 0 (pid 12, node n): save_hf_weights failed: OSError: [Errno 30] "
                  "Read-only file system: '/run/hf/model.safetensors'"), "read-only file system"),
])
def test_hf_export_disk_problem_is_one_line_and_keeps_the_old_export(tmp_path, error, cause):
    """The run's HF export is written by the policy's workers into a staged folder: a disk problem (here or
    reported by a worker) names the export, leaves no partial folder, and the previous export stays whole."""
    from rlhf.driver.infra.run_checkpoints import export_hf

    out = tmp_path / "hf"
    export_hf(out, lambda d: (Path(d) / "model.safetensors").write_bytes(b"old"))
    assert (out / "model.safetensors").read_bytes() == b"old"

    def write_fails(d: str) -> None:
        (Path(d) / "model.safetensors").write_bytes(b"ne")
        raise error

    with pytest.raises(FileProblem) as info:
        export_hf(out, write_fails)
    assert str(info.value) == f"{out}: cannot write the HF export: {cause}"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]
    assert (out / "model.safetensors").read_bytes() == b"old"
