"""`rlhf checkpoint trust DIR`: import a checkpoint from elsewhere by signing it with this user's key.

Checkpoints load without `--trust-checkpoint` only when their manifest is signed with this user's checkpoint
key (workers/megatron/ckpt_manifest.py). One from another user or machine, or from before signed manifests,
is refused; after the user confirms they trust where it comes from, this command records the digests of its
files as they are now and signs them, so that later loads check the folder against that state.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("checkpoint", help="manage the trust of Megatron checkpoints")
    action = p.add_subparsers(dest="action", metavar="ACTION")
    action.required = True
    t = action.add_parser(
        "trust", help="sign a checkpoint from elsewhere with your checkpoint key, so it loads without "
                      "--trust-checkpoint",
        description="Sign every Megatron checkpoint folder under DIR (a converted checkpoint, a run, a step or a "
                    "role folder) with your checkpoint key. Loading a checkpoint unpickles its files, which can "
                    "run code: sign only checkpoints whose source you trust.")
    t.add_argument("dir", metavar="DIR", help="converted checkpoint, run folder, step folder or role folder")
    t.add_argument("--yes", action="store_true", help="do not ask for confirmation")
    t.set_defaults(func=run_trust)


def _targets(root: Path) -> list[tuple[Path, list[str]]]:
    """The folders to sign under `root`, each with its nested subfolders: every dist_checkpointing folder
    (holding metadata.json) first, then every converted checkpoint (rlhf_mcore.json) with `model/` nested."""
    from workers.megatron.ckpt_manifest import DIST_CHECKPOINT_MARK
    from workers.megatron.mcore_checkpoint import META_FILE, MODEL_SUBDIR

    found = [root, *sorted(p for p in root.rglob("*") if p.is_dir() and not p.is_symlink())]
    dist: list[tuple[Path, list[str]]] = [(p, []) for p in found if (p / DIST_CHECKPOINT_MARK).is_file()]
    converted = [(p, [MODEL_SUBDIR]) for p in found if (p / META_FILE).is_file() and (p / MODEL_SUBDIR).is_dir()]
    return dist + converted


def _refuse_links(folder: Path, nested: list[str]) -> None:
    """A folder holding links or special files cannot be signed: verification refuses them later anyway."""
    from rlhf.errors import UserError
    from workers.megatron.ckpt_manifest import files_of

    odd = next((rel for rel, p in files_of(folder, nested).items() if p.is_symlink() or not p.is_file()), None)
    if odd is not None:
        raise UserError(f"{folder / odd} is a link or not a regular file; copy the checkpoint without links "
                        "before signing it")


def run_trust(args: argparse.Namespace) -> int:
    from rlhf.errors import UserError
    from workers.megatron.ckpt_key import key_path, load_key
    from workers.megatron.ckpt_manifest import MANIFEST_FILE, files_of, write_manifest

    root = Path(args.dir)
    if not root.is_dir():
        raise UserError(f"{root} is not a folder")
    targets = _targets(root)
    if not targets:
        raise UserError(f"{root} holds no Megatron checkpoint (no metadata.json nor rlhf_mcore.json under it)")
    for folder, nested in targets:
        _refuse_links(folder, nested)
    key = load_key()
    print(f"Signing with your checkpoint key ({key_path()}) records these folders as they are now:")
    for folder, nested in targets:
        print(f"  {folder} ({len(files_of(folder, nested))} files)")
    print("Loading a checkpoint unpickles its files, which can run code: sign it only if you trust its source.")
    if not args.yes:
        try:
            answer = input(f"Sign {len(targets)} folder(s)? [y/N] ")
        except EOFError:
            answer = ""
        if answer.strip().lower() not in ("y", "yes"):
            print("nothing signed", file=sys.stderr)
            return 1
    for folder, nested in targets:
        write_manifest(folder, key, nested)
        print(f"signed {folder / MANIFEST_FILE}")
    return 0
