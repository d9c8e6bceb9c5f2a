"""This user's checkpoint key: the secret that signs checkpoint manifests (ckpt_manifest.py).

The key is 32 random bytes kept outside every run folder, in `$RLHF_CHECKPOINT_KEY` if set (tests), else
`$XDG_CONFIG_HOME/rlhf/checkpoint.key`, else `~/.config/rlhf/checkpoint.key`. It is created on first use,
atomically (a private temp file hard-linked into place, so concurrent first uses agree on one key), mode 0600
in a folder created 0700. A key file that others can read, or that another user owns, is refused: whoever
reads it can sign a checkpoint that this user's runs would then unpickle.

Only the process the user started (the CLI, the run's driver) reads the key; workers never see it.
"""

from __future__ import annotations

import os
import secrets
import stat
from pathlib import Path

from workers.file_problems import FileProblem

KEY_ENV = "RLHF_CHECKPOINT_KEY"
_KEY_BYTES = 32


class CheckpointKeyError(FileProblem):
    """The key file cannot be used (unsafe permissions, another owner, malformed, unreadable): one line
    naming the file, which the CLI prints with exit code 2."""


def key_path() -> Path:
    """Where this user's checkpoint key lives (see the module docstring)."""
    override = os.environ.get(KEY_ENV)
    if override:
        return Path(override).expanduser()
    config = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(config) / "rlhf" / "checkpoint.key"


def load_key(path: Path | None = None) -> bytes:
    """The key at `path` (default `key_path()`), created on first use; CheckpointKeyError naming the file when
    it is unsafe or unreadable."""
    path = path or key_path()
    if not os.path.lexists(path):
        _create(path)
    return _read(path)


def _create(path: Path) -> None:
    """Write a fresh key to `path` unless another process got there first (then theirs is kept)."""
    folder = path.parent
    try:
        if not folder.is_dir():
            folder.mkdir(mode=0o700, parents=True, exist_ok=True)
            os.chmod(folder, 0o700)  # the umask may have cleared bits, never added: make it exactly 0700
        tmp = folder / f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        try:
            with os.fdopen(fd, "w") as f:
                f.write(secrets.token_hex(_KEY_BYTES) + "\n")
                f.flush()
                os.fsync(f.fileno())
            try:
                os.link(tmp, path)  # fails if the key appeared meanwhile: the first one wins
            except FileExistsError:
                pass
        finally:
            tmp.unlink(missing_ok=True)
    except OSError as e:
        raise CheckpointKeyError(path, f"cannot create the checkpoint key: {e.strerror or e} (set {KEY_ENV} "
                                       "to a file in a private folder)") from None


def _read(path: Path) -> bytes:
    """Read the key, refusing a link, a file of another owner, or one that the group or others can access."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError as e:
        why = "it is a symbolic link" if os.path.islink(path) else (e.strerror or str(e))
        raise CheckpointKeyError(path, f"cannot read the checkpoint key: {why}") from None
    with os.fdopen(fd) as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise CheckpointKeyError(path, "the checkpoint key is not a regular file")
        if st.st_uid != os.getuid():
            raise CheckpointKeyError(path, f"the checkpoint key is owned by uid {st.st_uid}, not by you "
                                           f"(uid {os.getuid()}); it must be your own private file")
        if st.st_mode & 0o077:
            raise CheckpointKeyError(path, f"the checkpoint key has mode {stat.S_IMODE(st.st_mode):04o}: others "
                                           f"can read it and sign checkpoints as you; run `chmod 600 {path}` (or "
                                           "delete it for a new key, which un-trusts your existing checkpoints)")
        text = f.read(4 * _KEY_BYTES).strip()
    try:
        key = bytes.fromhex(text)
    except ValueError:
        key = b""
    if len(key) != _KEY_BYTES:
        raise CheckpointKeyError(path, f"the checkpoint key is malformed (expected {2 * _KEY_BYTES} hex digits)")
    return key
