"""The trust check of Megatron checkpoints: a manifest of file digests, signed with this user's key.

A dist_checkpointing folder holds pickles (torch's `.metadata` index, `common.pt`, the objects inside the
`.distcp` shards), and loading it unpickles them, which can run arbitrary code. So every folder we save gets
`rlhf_manifest.json`: the size and sha256 of every other file in it, and an HMAC-SHA256 of that list made
with this user's checkpoint key (ckpt_key.py, kept outside every run folder). Anyone can recompute the
digests of a planted file; only the key's owner can make the HMAC that goes with them.

Who signs, who checks. The key never leaves the process the user started (the CLI, the run's driver):
workers (Ray actors, possibly on nodes with another home folder) and conversion ranks write the manifest's
digests unsigned at save (`write_manifest`), and the driver signs it once the collective save has returned
(`sign_saved`, before the checkpoint is renamed into place). At load, the driver verifies the signature and
the digests (`check_checkpoint`) before any worker starts; the workers re-check the digests right before
they unpickle (`check_saved_files`), which catches a file changed or damaged since. Simpler than handing
the key to every worker, and the key appears in no argument, log or folder of the run.

What a failed check means:
- UntrustedCheckpointError: no manifest, an unsigned or old (v1) one, or a signature that does not match
  this user's key (another user's or machine's checkpoint, or a forged one), or a file that is not listed.
  The message says how to accept the folder if its source is trusted: `rlhf checkpoint trust DIR` (signs
  it with this user's key) or `--trust-checkpoint` / `trainer.trust_checkpoint=true` (skips the check).
- DamagedCheckpointError: the signature is ours, but a listed file is missing or differs in size or content
  (a truncated shard, a partial copy, an edited file). Not a trust problem: restore or re-create the folder.
With `trust`, the manifest is not checked, but the folder's index and common state are read once
(`probe_readable`) so that a corrupt one is reported as one line naming the file instead of failing deep
inside the load.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from workers.megatron.ckpt_key import key_path, load_key

MANIFEST_FILE = "rlhf_manifest.json"
MANIFEST_FORMAT = "rlhf-checkpoint-manifest-v2"
OLD_FORMATS = ("rlhf-checkpoint-manifest-v1",)
DIST_CHECKPOINT_MARK = "metadata.json"  # what marks a dist_checkpointing folder


def trust_hint(folder: str | Path) -> str:
    """What the user can do about an untrusted folder, and why it matters."""
    return (f"loading it unpickles its files, which can run code; if you trust where it comes from, sign it "
            f"with `rlhf checkpoint trust {folder}` or pass --trust-checkpoint (trainer.trust_checkpoint=true)")


class UntrustedCheckpointError(ValueError):
    """A checkpoint folder whose manifest is missing, unsigned, or not signed with this user's key."""


class DamagedCheckpointError(UntrustedCheckpointError):
    """A checkpoint whose manifest is authentic (ours) but a listed file is missing or differs: damaged on disk
    (a truncated shard, a partial copy), not forged. Resume falls back past it to the newest intact step."""


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def files_of(folder: Path, nested: Iterable[str] = ()) -> dict[str, Path]:
    """Every entry under `folder` that is not a folder (relative POSIX path -> path), except the manifest,
    its temp file and the subfolders in `nested` (covered by manifests of their own). Links and special files
    are listed too, so that verification refuses them (links can point anywhere)."""
    nested = tuple(nested)
    skip = tuple(f"{n}/" for n in nested)
    out = {}
    for p in sorted(folder.rglob("*")):
        rel = p.relative_to(folder).as_posix()
        if rel in (MANIFEST_FILE, MANIFEST_FILE + ".tmp") or rel in nested or rel.startswith(skip):
            continue
        if p.is_symlink() or not p.is_dir():
            out[rel] = p
    return out


def _mac(key: bytes, body: dict[str, Any]) -> str:
    """HMAC-SHA256 of the manifest's content (format, files, nested) in a canonical JSON form."""
    canon = json.dumps({k: body[k] for k in ("format", "files", "nested")}, sort_keys=True, separators=(",", ":"))
    return hmac.new(key, canon.encode(), hashlib.sha256).hexdigest()


def _write(folder: Path, body: dict[str, Any]) -> Path:
    tmp = folder / (MANIFEST_FILE + ".tmp")
    tmp.write_text(json.dumps(body, indent=1) + "\n")
    os.replace(tmp, folder / MANIFEST_FILE)
    return folder / MANIFEST_FILE


def write_manifest(folder: str | Path, key: bytes | None = None, nested: Iterable[str] = ()) -> Path:
    """Record the size and sha256 of every file in `folder` (but those under `nested` subfolders, which carry
    their own manifest), signed with `key` when given, else unsigned until `sign_manifest`. Atomic: a temp
    file, then a rename."""
    folder = Path(folder)
    nested = sorted(nested)
    files = {rel: {"size": p.stat().st_size, "sha256": _sha256(p)} for rel, p in files_of(folder, nested).items()}
    body: dict[str, Any] = {"format": MANIFEST_FORMAT, "files": files, "nested": nested}
    if key is not None:
        body["mac"] = _mac(key, body)
    return _write(folder, body)


def sign_manifest(folder: str | Path, key: bytes | None = None) -> Path:
    """Sign the unsigned manifest that a worker wrote into `folder` with `key` (default: this user's key).
    The digests are signed as written: they were computed by the save that just returned."""
    folder = Path(folder)
    body = _read(folder)
    body["mac"] = _mac(key if key is not None else load_key(), body)
    return _write(folder, body)


def sign_saved(folder: str | Path, key: bytes | None = None) -> list[Path]:
    """Sign the manifests that a collective save wrote into `folder` or its immediate subfolders (the role
    folders of a step); returns the folders signed."""
    folder = Path(folder)
    targets = [p for p in (folder, *sorted(folder.iterdir())) if p.is_dir() and (p / MANIFEST_FILE).is_file()]
    key = key if key is not None else load_key()
    for t in targets:
        sign_manifest(t, key)
    return targets


def _read(folder: Path) -> dict[str, Any]:
    """The manifest of `folder` as written by `write_manifest`; UntrustedCheckpointError when it is missing,
    malformed or of an older format."""
    path = folder / MANIFEST_FILE
    if not path.is_file():
        raise UntrustedCheckpointError(f"checkpoint {folder} has no {MANIFEST_FILE}, so it was not written by "
                                       f"rlhf (or by a version before manifests); {trust_hint(folder)}")
    try:
        body = json.loads(path.read_text())
        fmt, files, nested = body["format"], body["files"], body.get("nested", [])
        if fmt in OLD_FORMATS:
            raise UntrustedCheckpointError(f"{path} is an unsigned manifest ({fmt}, written before manifests were "
                                           f"signed), so where the checkpoint comes from cannot be checked; "
                                           f"{trust_hint(folder)}")
        if fmt != MANIFEST_FORMAT:
            raise UntrustedCheckpointError(f"{path}: unknown manifest format {fmt!r} (expected {MANIFEST_FORMAT}); "
                                           f"{trust_hint(folder)}")
        if not isinstance(files, dict) or not all(
                isinstance(v, dict) and isinstance(v.get("size"), int) and isinstance(v.get("sha256"), str)
                for v in files.values()):
            raise TypeError("files is not a mapping of {size, sha256}")
        if not isinstance(nested, list) or not all(isinstance(n, str) and n and "/" not in n and n not in (".", "..")
                                                   for n in nested):
            raise TypeError("nested is not a list of subfolder names")
    except (json.JSONDecodeError, KeyError, TypeError, UnicodeDecodeError) as e:
        raise UntrustedCheckpointError(f"{path} is malformed ({e}); {trust_hint(folder)}") from e
    body["nested"] = nested
    return body


def _check_files(folder: Path, body: dict[str, Any]) -> None:
    """The files of `folder` against the digests of its (authentic) manifest: a file not listed or not regular
    is UntrustedCheckpointError; a listed file missing or different is DamagedCheckpointError."""
    listed, present = body["files"], files_of(folder, body["nested"])
    extra = sorted(set(present) - set(listed))
    if extra:
        raise UntrustedCheckpointError(f"checkpoint {folder}: {extra[0]} is not in its manifest, so it was added "
                                       f"since the checkpoint was saved; {trust_hint(folder)}")
    fix = "restore the folder from a good copy, or use an earlier checkpoint"
    for rel, want in listed.items():
        p = present.get(rel)
        if p is None:
            raise DamagedCheckpointError(f"checkpoint {folder} is damaged: {rel} is missing; {fix}")
        if p.is_symlink() or not p.is_file():
            raise UntrustedCheckpointError(f"checkpoint {folder}: {rel} is not a regular file; {trust_hint(folder)}")
        size = p.stat().st_size
        if size != want["size"]:
            how = (f"truncated or changed: size {size} of {want['size']} bytes" if size < want["size"]
                   else f"changed: size {size}, saved with {want['size']} bytes")
            raise DamagedCheckpointError(f"checkpoint {folder} is damaged: {rel} is {how}; {fix}")
        if _sha256(p) != want["sha256"]:
            raise DamagedCheckpointError(f"checkpoint {folder} is damaged: {rel} changed since it was saved (its "
                                         f"sha256 differs from the signed manifest); {fix}")


def verify_manifest(folder: str | Path, key: bytes | None = None) -> None:
    """Raise UntrustedCheckpointError or DamagedCheckpointError (one line: the folder, what does not match,
    what to do) unless `folder`'s manifest is signed with `key` (default: this user's key) and every file in
    it, and in its nested subfolders, matches. The signature is checked before any digest."""
    folder = Path(folder)
    body = _read(folder)
    mac = body.get("mac")
    if not isinstance(mac, str) or not mac:
        raise UntrustedCheckpointError(f"checkpoint {folder}: {MANIFEST_FILE} is not signed (its save did not "
                                       f"finish, or it was written by hand); {trust_hint(folder)}")
    key = key if key is not None else load_key()
    if not hmac.compare_digest(mac, _mac(key, body)):
        raise UntrustedCheckpointError(f"checkpoint {folder}: {MANIFEST_FILE} is not signed with your checkpoint "
                                       f"key ({key_path()}): it was saved by another user or machine, or forged; "
                                       f"{trust_hint(folder)}")
    _check_files(folder, body)
    for sub in body["nested"]:
        verify_manifest(folder / sub, key)


def check_checkpoint(folder: str | Path, trust: bool) -> None:
    """In the process that holds the key, before any worker loads `folder`: `verify_manifest`, or with
    `trust` (the user vouches for the folder) `probe_readable` only."""
    if trust:
        probe_readable(folder)
    else:
        verify_manifest(folder)


def check_saved_files(folder: str | Path, trust: bool) -> None:
    """In a worker or conversion rank, right before unpickling: the digests of `folder` (whose signature the
    driver verified before this worker started, see the module docstring), unless `trust`."""
    if not trust:
        folder = Path(folder)
        _check_files(folder, _read(folder))


def probe_readable(folder: str | Path) -> None:
    """Read a dist_checkpointing folder's `metadata.json`, `.metadata` index and `common.pt` once;
    DamagedCheckpointError naming the file that could not be read (a truncated shard is named by the loader
    itself, workers.file_problems.file_errors). Unpickles: only for folders the user trusts."""
    folder = Path(folder)
    if not (folder / DIST_CHECKPOINT_MARK).is_file():
        return
    current = DIST_CHECKPOINT_MARK
    try:
        json.loads((folder / DIST_CHECKPOINT_MARK).read_text())
        current = ".metadata"
        if (folder / current).exists():
            from torch.distributed.checkpoint import FileSystemReader

            FileSystemReader(str(folder)).read_metadata()
        current = "common.pt"
        if (folder / current).exists():
            import torch

            torch.load(folder / current, map_location="cpu", weights_only=False)
    except Exception as e:  # noqa: BLE001 - whatever a corrupt file raises, reported as one line naming it
        text = str(e).strip().splitlines()
        detail = f"{type(e).__name__}: {text[0][:300]}" if text else type(e).__name__
        raise DamagedCheckpointError(f"checkpoint {folder}: {current} could not be read ({detail}); the file is "
                                     "damaged or not a checkpoint file") from None
