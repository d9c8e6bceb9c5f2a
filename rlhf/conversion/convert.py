"""Offline HF <-> megatron-core conversion for the hf_map families (validation, spawning, file layout).

Both directions validate everything before writing, spawn TP*PP*EP gloo ranks on 127.0.0.1 (each holds
only its shard; tensors are streamed one at a time) and raise UserError for bad input. Scripts calling
these need an `if __name__ == "__main__":` guard (spawned processes, dist_checkpointing's writer).
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

from rlhf.errors import UserError
from rlhf.paths import staged_output_dir
from workers.dtypes import DTYPE_NAMES
from workers.file_problems import file_errors
from workers.megatron.hf_fields import cfg_get

# Files of a HF model folder that are not weights (copied alongside converted weights).
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack")
_WEIGHT_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")


def _copy_non_weight_files(src: Path, dst: Path) -> list[str]:
    copied = []
    for f in sorted(src.iterdir()):
        if f.is_file() and not f.name.endswith(_WEIGHT_SUFFIXES) and f.name not in _WEIGHT_INDEXES:
            shutil.copy2(f, dst / f.name)
            copied.append(f.name)
    return copied


def _load_config(folder: Path):
    from workers.megatron.hf_fields import load_model_config

    if not (folder / "config.json").is_file():
        raise UserError(f"{folder} has no config.json")
    try:
        return load_model_config(folder)
    except Exception as e:
        raise UserError(f"cannot read {folder / 'config.json'}: {e}") from e


def _check_sizes(tp: int, pp: int, ep: int) -> None:
    if tp < 1 or pp < 1 or ep < 1:
        raise UserError(f"--tp, --pp and --ep must be >= 1 (got tp={tp}, pp={pp}, ep={ep})")


def validate_hf(hf_dir: str | Path, tp: int, pp: int, dtype: str = "auto", ep: int = 1):
    """Check a HF folder for conversion at TP `tp`, PP `pp`; return (config, dtype name). Raises UserError
    naming the tensor or config field: family, heads / KV groups / FFN divisible by TP, layers by PP,
    every expected tensor present exactly once with the config's shape, none extra, one dtype."""
    from workers.megatron.hf_map import check_hf_tensors, family_of, hf_dtype, mtp_tensors
    from workers.megatron.hf_weights import HFTensorSource
    from workers.megatron.model_provider import check_parallel_fit

    folder = Path(hf_dir)
    if not folder.is_dir():
        raise UserError(f"HF model folder {folder} does not exist")
    _check_sizes(tp, pp, ep)
    if dtype != "auto" and dtype not in DTYPE_NAMES:
        raise UserError(f"--dtype must be auto or one of {', '.join(DTYPE_NAMES)}")
    cfg = _load_config(folder)
    try:
        family_of(cfg)
        check_parallel_fit(cfg, tp, pp, ep)
        with HFTensorSource(folder) as src:
            check_hf_tensors(cfg, src.shapes())
            dtypes = src.dtypes()
    except ValueError as e:
        raise UserError(f"{folder}: {e}") from e
    mtp = mtp_tensors(cfg, dtypes)
    if mtp:
        layers = sorted({".".join(n.split(".")[:3]) for n in mtp})
        print(f"note: {folder}: skipping the {len(layers)} multi-token-prediction layer(s) {', '.join(layers)} "
              f"({len(mtp)} tensors; num_nextn_predict_layers): they are not converted", file=sys.stderr)
    names = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}
    first = dtypes["model.embed_tokens.weight"]
    if dtype == "auto":
        import torch

        fixed = {n for n in dtypes if hf_dtype(n, torch.bfloat16) == torch.float32}  # always F32 (V3's router bias)
        odd = next((n for n, t in sorted(dtypes.items()) if t != first and n not in fixed and n not in mtp), None)
        if odd is not None:
            raise UserError(f"{folder}: tensor {odd} is {dtypes[odd]} but model.embed_tokens.weight is {first}; "
                            "pass --dtype to convert all tensors to one dtype")
        if first not in names:
            raise UserError(f"{folder}: unsupported weight dtype {first} (F32, BF16, F16)")
        dtype = names[first]
    return cfg, dtype


def hf_to_mcore(
    hf_dir: str | Path,
    out_dir: str | Path,
    tp: int = 1,
    pp: int = 1,
    force: bool = False,
    dtype: str = "auto",
    timeout_s: float = 1800.0,
    ep: int = 1,
) -> Path:
    """Convert a HF folder into a converted megatron checkpoint folder (see workers.megatron.mcore_checkpoint),
    with TP*PP*EP ranks (EP splits the routed experts; the checkpoint loads at any EP)."""
    from rlhf.conversion.rank_fns import hf_to_mcore_rank
    from workers.megatron.ckpt_key import load_key
    from workers.megatron.launch import run_distributed
    from workers.megatron.model_provider import DEFAULT_VOCAB_DIVISOR, padded_vocab_size

    cfg, dtype = validate_hf(hf_dir, tp, pp, dtype, ep)
    load_key()  # an unusable key file fails now, not after the conversion (it signs the result)
    padded = padded_vocab_size(cfg_get(cfg, "vocab_size"), tp, DEFAULT_VOCAB_DIVISOR)
    with staged_output_dir(out_dir, force) as tmp:  # renamed to out_dir when complete, removed on failure
        run_distributed(hf_to_mcore_rank, tp * pp * ep, args=(str(hf_dir), str(tmp), dtype, padded), tp=tp, pp=pp,
                        ep=ep, timeout_s=timeout_s)
        finish_mcore_checkpoint(tmp, hf_dir, cfg, tp, pp, dtype, padded, ep)
        sign_converted(tmp)
    return Path(out_dir)


def finish_mcore_checkpoint(
    out: Path, hf_dir: str | Path, cfg, tp: int, pp: int, dtype: str, padded: int, ep: int = 1
) -> None:
    """After `out/model` is saved: copy the HF config and tokenizer files to `out/hf`, then write the
    metadata file (last, marking the checkpoint complete)."""
    from workers.megatron.mcore_checkpoint import HF_SUBDIR, CheckpointMeta, write_meta
    from workers.megatron.model_provider import DEFAULT_VOCAB_DIVISOR

    meta = CheckpointMeta(
        family=cfg_get(cfg, "model_type"), tp=tp, pp=pp, vocab_size=cfg_get(cfg, "vocab_size"), padded_vocab_size=padded,
        vocab_divisible_by=DEFAULT_VOCAB_DIVISOR, dtype=dtype, tied=bool(cfg_get(cfg, "tie_word_embeddings")), ep=ep,
    )
    with file_errors(out, "write"):
        (out / HF_SUBDIR).mkdir(exist_ok=True)
        _copy_non_weight_files(Path(hf_dir), out / HF_SUBDIR)
        write_meta(out, meta)


def sign_converted(out: Path) -> None:
    """Sign a finished conversion with this user's key (ckpt_manifest.py): the digests the ranks wrote into
    `out/model`, then a manifest of the rest (`rlhf_mcore.json`, `hf/`) with `model/` nested."""
    from workers.megatron.ckpt_key import load_key
    from workers.megatron.ckpt_manifest import sign_manifest, write_manifest
    from workers.megatron.mcore_checkpoint import MODEL_SUBDIR

    key = load_key()
    with file_errors(out, "write"):
        sign_manifest(out / MODEL_SUBDIR, key)
        write_manifest(out, key, nested=[MODEL_SUBDIR])


def validate_mcore(mcore_dir: str | Path, tp: int, pp: int, trust: bool = False, ep: int = 1, view: bool = False):
    """Check a converted checkpoint folder can be exported at TP `tp`, PP `pp`, EP `ep` and matches its signed
    manifests (ckpt_manifest.py; those of the folder and of `model/`, or of `model/` only for a `view` of a
    training checkpoint), or with `trust` that its index is readable; return its metadata."""
    from workers.megatron.ckpt_manifest import UntrustedCheckpointError, probe_readable, verify_manifest
    from workers.megatron.mcore_checkpoint import HF_SUBDIR, MODEL_SUBDIR, read_meta
    from workers.megatron.model_provider import check_parallel_fit

    _check_sizes(tp, pp, ep)
    folder = Path(mcore_dir)
    if not folder.is_dir():
        raise UserError(f"megatron checkpoint folder {folder} does not exist")
    try:
        meta = read_meta(folder)
    except ValueError as e:
        raise UserError(str(e)) from e
    if not (folder / MODEL_SUBDIR / "metadata.json").is_file():
        raise UserError(f"{folder / MODEL_SUBDIR} is not a dist_checkpointing checkpoint (metadata.json missing)")
    try:  # before any file of the folder is read further, and before any rank starts
        if trust:
            probe_readable(folder / MODEL_SUBDIR)
        else:
            verify_manifest(folder / MODEL_SUBDIR if view else folder)
    except UntrustedCheckpointError as e:
        raise UserError(str(e)) from None
    cfg = _load_config(folder / HF_SUBDIR)
    try:
        check_parallel_fit(cfg, tp, pp, ep)
    except ValueError as e:
        raise UserError(str(e)) from e
    if meta.padded_vocab_size % tp:
        raise UserError(f"padded vocab {meta.padded_vocab_size} of the checkpoint is not divisible by --tp {tp}")
    return meta


def mcore_to_hf(
    mcore_dir: str | Path,
    out_dir: str | Path,
    force: bool = False,
    tp: int = 1,
    pp: int = 1,
    timeout_s: float = 1800.0,
    trust: bool = False,
    ep: int = 1,
) -> Path:
    """Export a converted megatron checkpoint, or a training checkpoint's `<run>/checkpoints/<step>/policy`
    (read through `training_checkpoint_view`), to a HF folder (safetensors, config.json, tokenizer files).
    A checkpoint without a manifest signed with this user's key, or damaged since, is refused unless `trust`
    (see ckpt_manifest.py).

    The checkpoint is loaded at TP `tp` / PP `pp` (any layout works: dist_checkpointing reshards); each
    pipeline stage streams its tensors into its own safetensors file (plus an index when pp > 1).
    """
    from rlhf.conversion.rank_fns import mcore_to_hf_rank
    from workers.megatron.hf_weights import write_hf_index
    from workers.megatron.launch import run_distributed
    from workers.megatron.mcore_checkpoint import HF_SUBDIR, META_FILE

    with tempfile.TemporaryDirectory(prefix="rlhf-convert-") as view_tmp:
        view = not (Path(mcore_dir) / META_FILE).is_file() and (Path(mcore_dir) / "metadata.json").is_file()
        if view:
            mcore_dir = training_checkpoint_view(mcore_dir, Path(view_tmp) / "mcore")
        validate_mcore(mcore_dir, tp, pp, trust, ep, view)
        with staged_output_dir(out_dir, force) as tmp:  # renamed to out_dir when complete, removed on failure
            results = run_distributed(mcore_to_hf_rank, tp * pp * ep, args=(str(mcore_dir), str(tmp), trust),
                                      tp=tp, pp=pp, ep=ep, timeout_s=timeout_s)
            files = {fname: names for r in results if r is not None for fname, names in [r]}
            with file_errors(tmp, "write"):
                if len(files) > 1:
                    write_hf_index(tmp, files)
                _copy_non_weight_files(Path(mcore_dir) / HF_SUBDIR, tmp)
    return Path(out_dir)


def training_checkpoint_view(policy_dir: str | Path, view_dir: str | Path) -> Path:
    """A training checkpoint's policy (`<run>/checkpoints/<step>/policy`, written by the trainer, no
    rlhf_mcore.json) laid out as a converted checkpoint under `view_dir` for `mcore_to_hf`: `model` links to
    the policy folder (its manifest is checked as usual), `hf/` and the metadata come from the model, layout
    and dtype that the run's config.yaml names."""
    from rlhf.config.load import load_config
    from workers.megatron.mcore_checkpoint import HF_SUBDIR, MODEL_SUBDIR
    from workers.megatron.model_provider import DEFAULT_VOCAB_DIVISOR, padded_vocab_size

    policy = Path(policy_dir).resolve()
    run_config = policy.parents[2] / "config.yaml" if len(policy.parents) > 2 else Path("config.yaml")
    if policy.name != "policy" or not run_config.is_file():
        raise UserError(f"{policy_dir} is not a converted megatron checkpoint (no rlhf_mcore.json) nor a training "
                        f"checkpoint <run>/checkpoints/<step>/policy with <run>/config.yaml; convert it with "
                        "`rlhf convert` or pass an HF folder")
    cfg = load_config(run_config, validate=False)
    model = cfg.policy.model_path or cfg.model.path
    if not model or not (Path(model) / "config.json").is_file():
        raise UserError(f"{run_config}: model.path {model!r} (the policy's model) is not an HF folder; the "
                        "training checkpoint cannot be read without its config.json")
    hf_cfg = _load_config(Path(model))
    tp, pp, ep = cfg.policy.parallel.tp, cfg.policy.parallel.pp, cfg.policy.parallel.ep
    view = Path(view_dir)
    with file_errors(view, "write"):
        (view / HF_SUBDIR).mkdir(parents=True, exist_ok=True)
        (view / MODEL_SUBDIR).symlink_to(policy, target_is_directory=True)
        tokenizer = cfg.model.tokenizer_path
        if tokenizer and Path(tokenizer).is_dir():
            _copy_non_weight_files(Path(tokenizer), view / HF_SUBDIR)
        finish_mcore_checkpoint(view, model, hf_cfg, tp, pp, cfg.policy.dtype,
                                padded_vocab_size(cfg_get(hf_cfg, "vocab_size"), tp, DEFAULT_VOCAB_DIVISOR), ep)
    return view
