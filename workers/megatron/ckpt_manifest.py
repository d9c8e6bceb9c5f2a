"""The trust check of Megatron checkpoints: a manifest of sha256 digests, written at save, verified at load.

A dist_checkpointing folder holds pickles (torch's `.metadata` index, `common.pt`, the objects inside the
`.distcp` shards), and loading it unpickles them, which can run arbitrary code. So every folder we save
gets `rlhf_manifest.json` (format version, sha256 of every other file in the folder, written last) and
every load first checks the folder against it, before anything is unpickled. A folder without a matching
manifest (written by another tool, downloaded, or modified since) is refused unless the user trusts it
explicitly (`--trust-checkpoint`, `trainer.trust_checkpoint=true`).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

MANIFEST_FILE = "rlhf_manifest.json"
MANIFEST_FORMAT = "rlhf-checkpoint-manifest-v1"
TRUST_HINT = ("loading it unpickles its files, which can run code; if you trust where it comes from, pass "
              "--trust-checkpoint (or set trainer.trust_checkpoint=true)")


class UntrustedCheckpointError(ValueError):
    """A checkpoint folder without a manifest that matches its files."""


class DamagedCheckpointError(UntrustedCheckpointError):
    """A checkpoint whose manifest is authentic (ours) but a listed file is missing or differs: damaged on disk
    (a truncated shard, a partial copy), not forged. Resume falls back past it to the newest intact step."""


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def _files(folder: Path) -> dict[str, Path]:
    """Every file under `folder` (relative POSIX path -> path), the manifest and its temp file excepted."""
    out = {}
    for p in sorted(folder.rglob("*")):
        rel = p.relative_to(folder).as_posix()
        if rel in (MANIFEST_FILE, MANIFEST_FILE + ".tmp"):
            continue
        if p.is_symlink() or not (p.is_file() or p.is_dir()):
            out[rel] = p  # listed so that verification refuses it (links can point anywhere)
        elif p.is_file():
            out[rel] = p
    return out


def write_manifest(folder: str | Path) -> Path:
    """Hash every file in `folder` and write the manifest (atomically: temp file, then rename)."""
    folder = Path(folder)
    digests = {rel: _sha256(p) for rel, p in _files(folder).items()}
    tmp = folder / (MANIFEST_FILE + ".tmp")
    tmp.write_text(json.dumps({"format": MANIFEST_FORMAT, "files": digests}, indent=1) + "\n")
    os.replace(tmp, folder / MANIFEST_FILE)
    return folder / MANIFEST_FILE


def verify_manifest(folder: str | Path) -> None:
    """Raise UntrustedCheckpointError (one line: the folder, what does not match, why it matters) unless
    every file in `folder` is listed in its manifest with the same sha256 and every listed file exists."""
    folder = Path(folder)
    path = folder / MANIFEST_FILE
    if not path.is_file():
        raise UntrustedCheckpointError(f"checkpoint {folder} has no {MANIFEST_FILE}, so it was not written by "
                                       f"rlhf (or by a version before manifests); {TRUST_HINT}")
    try:
        raw = json.loads(path.read_text())
        fmt, listed = raw["format"], raw["files"]
        if not isinstance(listed, dict):
            raise TypeError("files is not a mapping")
    except (json.JSONDecodeError, KeyError, TypeError, UnicodeDecodeError) as e:
        raise UntrustedCheckpointError(f"{path} is malformed ({e}); {TRUST_HINT}") from e
    if fmt != MANIFEST_FORMAT:
        raise UntrustedCheckpointError(f"{path}: unknown manifest format {fmt!r} (expected {MANIFEST_FORMAT}); "
                                       f"{TRUST_HINT}")
    present = _files(folder)
    extra = sorted(set(present) - set(listed))
    missing = sorted(set(listed) - set(present))
    if extra or missing:
        what = f"{extra[0]} is not in its manifest" if extra else f"{missing[0]} is missing"
        raise UntrustedCheckpointError(f"checkpoint {folder}: {what}, so it changed since it was saved; "
                                       f"{TRUST_HINT}")
    for rel, p in present.items():
        if p.is_symlink() or not p.is_file():
            raise UntrustedCheckpointError(f"checkpoint {folder}: {rel} is not a regular file; {TRUST_HINT}")
        if _sha256(p) != listed[rel]:
            raise UntrustedCheckpointError(f"checkpoint {folder}: {rel} does not match its sha256 in "
                                           f"{MANIFEST_FILE}, so it changed since it was saved; {TRUST_HINT}")


def check_checkpoint(folder: str | Path, trust: bool) -> None:
    """`verify_manifest` unless the user trusts the checkpoint explicitly."""
    if not trust:
        verify_manifest(folder)
