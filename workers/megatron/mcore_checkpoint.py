"""Converted megatron-core checkpoints: dist_checkpointing (torch_dist) model weights plus metadata.

Folder layout written by `rlhf convert hf-to-mcore`:
    rlhf_mcore.json   metadata (family, tp, pp, vocab and padded vocab, dtype, tied); written last
    hf/               the HF config.json, generation_config.json and tokenizer files
    model/            dist_checkpointing checkpoint of `model.sharded_state_dict()` (loadable at any TP/PP),
                      with its signed manifest (ckpt_manifest.py), checked before loading
    rlhf_manifest.json  the signed manifest of rlhf_mcore.json and hf/ (model/ nested: it has its own)
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from workers.dtypes import as_dtype
from workers.megatron.ckpt_manifest import check_saved_files, write_manifest

META_FILE = "rlhf_mcore.json"
HF_SUBDIR = "hf"
MODEL_SUBDIR = "model"
FORMAT = "rlhf-mcore-v1"


@dataclass
class CheckpointMeta:
    """What is needed to rebuild the model and convert back to HF."""

    family: str
    tp: int
    pp: int
    vocab_size: int
    padded_vocab_size: int
    vocab_divisible_by: int
    dtype: str
    tied: bool
    format: str = FORMAT
    ep: int = 1  # expert-parallel size it was saved at (any EP loads it: experts are resharded)

    @property
    def torch_dtype(self) -> torch.dtype:
        return as_dtype(self.dtype)


def write_meta(ckpt_dir: str | Path, meta: CheckpointMeta) -> Path:
    """Write the metadata file (do this last: its presence marks a complete conversion)."""
    path = Path(ckpt_dir) / META_FILE
    path.write_text(json.dumps(asdict(meta), indent=2) + "\n")
    return path


def read_meta(ckpt_dir: str | Path) -> CheckpointMeta:
    """Read the metadata; ValueError naming the file when it is missing or malformed."""
    path = Path(ckpt_dir) / META_FILE
    if not path.is_file():
        raise ValueError(f"{ckpt_dir} is not a converted megatron checkpoint: {META_FILE} is missing")
    try:
        raw = json.loads(path.read_text())
        meta = CheckpointMeta(**raw)
    except (json.JSONDecodeError, TypeError) as e:
        raise ValueError(f"{path} is malformed: {e}") from e
    if meta.format != FORMAT:
        raise ValueError(f"{path}: unknown format {meta.format!r} (expected {FORMAT})")
    return meta


def load_hf_config(ckpt_dir: str | Path):
    """The HF config stored with a converted checkpoint."""
    from workers.megatron.hf_fields import load_model_config

    return load_model_config(Path(ckpt_dir) / HF_SUBDIR)


def save_model(model: torch.nn.Module, ckpt_dir: str | Path) -> None:
    """Collective over all ranks: save `model.sharded_state_dict()` with dist_checkpointing (torch_dist).

    `ckpt_dir/model` is created by rank 0; the caller's script needs a `__main__` guard.
    """
    from megatron.core import dist_checkpointing

    target = Path(ckpt_dir) / MODEL_SUBDIR
    if torch.distributed.get_rank() == 0:
        target.mkdir(parents=True, exist_ok=True)
    torch.distributed.barrier()
    dist_checkpointing.save(model.sharded_state_dict(), str(target))
    torch.distributed.barrier()
    if torch.distributed.get_rank() == 0:
        write_manifest(target)  # last: the digests a later load checks; the parent process signs them
    torch.distributed.barrier()


def load_model(model: torch.nn.Module, ckpt_dir: str | Path, trust: bool = False) -> None:
    """Collective: load a converted checkpoint into `model` at the current TP/PP (resharding as needed).
    `model/` must match its manifest's digests (ckpt_manifest.py; the parent process verified its signature)
    unless `trust`. A LoRA run's training checkpoint
    holds only the adapters: the base weights come from the HF folder it names (`meta.lora.base_model`),
    then the adapters are applied and loaded, so the model computes, and exports, W + s B A."""
    from megatron.core import dist_checkpointing

    target = Path(ckpt_dir) / MODEL_SUBDIR
    if not (target / "metadata.json").is_file():
        raise ValueError(f"{target} is not a dist_checkpointing checkpoint (metadata.json missing)")
    check_saved_files(target, trust)  # before anything in the folder is unpickled
    common = dist_checkpointing.load_common_state_dict(str(target))
    lora = (common.get("meta") or {}).get("lora") if isinstance(common, dict) else None
    with torch.no_grad():
        if lora:
            _load_lora_base(model, target, lora)
        wanted = model.sharded_state_dict()
        if lora:
            from workers.megatron.lora import is_adapter_key

            wanted = {k: v for k, v in wanted.items() if is_adapter_key(k)}
        state = _load_matching(wanted, target, Path(ckpt_dir) / HF_SUBDIR / "config.json")
        # a training checkpoint's common state also holds its optimizer, scheduler and metadata: the model's only
        model.load_state_dict({k: v for k, v in state.items() if k in wanted}, strict=not lora)


def _load_matching(wanted: dict, target: Path, config: Path) -> dict:
    """`dist_checkpointing.load` of `wanted` (the sharded state of a model built from `config`); a checkpoint
    whose tensors do not fit that model (an edited config.json, another model's weights) is a FileProblem
    naming both, one line for the CLI, instead of a traceback from inside the load."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.core import CheckpointingException

    from workers.file_problems import FileProblem, _unwrap

    try:
        return dist_checkpointing.load(wanted, str(target))
    except BaseException as e:  # torch's CheckpointException (a BaseException) wraps the ranks' errors
        inner = _unwrap(e)
        if not isinstance(inner, CheckpointingException):
            raise
        first = (str(inner).strip().splitlines() or [type(inner).__name__])[0][:300]
        raise FileProblem(config, f"the model it describes does not match the checkpoint {target} ({first})") from e


def _load_lora_base(model: torch.nn.Module, target: Path, lora: dict) -> None:
    """The base weights of a LoRA checkpoint from the HF folder it names, then its adapters applied."""
    from workers.config import build
    from workers.megatron.hf_fields import load_model_config
    from workers.megatron.hf_weights import load_hf_weights
    from workers.megatron.lora import apply_lora
    from workers.megatron.lora_config import LoRAConfig

    base = Path(lora.get("base_model") or "")
    if not (base / "config.json").is_file():
        raise ValueError(f"{target} holds LoRA adapters only; its base model {str(base)!r} (the run's model.path) "
                         f"is not an HF folder")
    load_hf_weights(model, base, load_model_config(base))
    apply_lora(model, build(LoRAConfig, {k: v for k, v in lora.items() if k != "base_model"}))
