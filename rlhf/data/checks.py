"""Up-front validation of data arguments, so bad input fails with a clear UserError before any work starts."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from rlhf.errors import UserError
from rlhf.model_config import read_config_json

_SPLIT_RE = re.compile(r"^\s*\d+(\.\d*)?(\s*[,/:]\s*\d+(\.\d*)?){0,2}\s*$")
_MAX_POSITION_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length")


def parse_split(split: str) -> list[float]:
    """Parse a Megatron train:valid:test split ("949,50,1", "98,2", "100") into three normalised weights."""
    if not isinstance(split, str) or not _SPLIT_RE.match(split):
        raise UserError(
            f"split {split!r} does not parse: expected up to three non-negative numbers separated by "
            "commas, e.g. '949,50,1' (train,valid,test)"
        )
    values = [float(v) for v in re.split(r"[,/:]", split)]
    values += [0.0] * (3 - len(values))
    total = sum(values)
    if total <= 0:
        raise UserError(f"split {split!r} has weights summing to 0")
    return [v / total for v in values]


def data_prefix_paths(prefix: str | Path) -> tuple[Path, Path]:
    """The .bin and .idx paths of an indexed dataset prefix."""
    p = str(prefix)
    return Path(p + ".bin"), Path(p + ".idx")


def check_data_prefix(prefix: str | Path) -> None:
    """Raise a UserError unless `prefix.bin` and `prefix.idx` both exist; suggest the full prefix if close."""
    bin_path, idx_path = data_prefix_paths(prefix)
    if bin_path.is_file() and idx_path.is_file():
        return
    missing = [str(p) for p in (bin_path, idx_path) if not p.is_file()]
    hint = ""
    parent = Path(str(prefix)).parent
    stem = Path(str(prefix)).name
    if parent.is_dir():
        near = sorted(p.name[: -len(".idx")] for p in parent.glob(f"{stem}*.idx"))
        if near:
            hint = f" (found: {', '.join(str(parent / n) for n in near[:3])} -- pass the full prefix)"
    raise UserError(f"data prefix {prefix}: missing {' and '.join(missing)}{hint}")


def max_positions(model_dir_or_config: Any) -> int | None:
    """The model's maximum positions from a model folder, a config.json path, a dict or a config object."""
    cfg: Any = model_dir_or_config
    if isinstance(cfg, str | Path):
        cfg = read_config_json(cfg, "model config")
    get = cfg.get if isinstance(cfg, dict) else (lambda k, d=None: getattr(cfg, k, d))
    for key in _MAX_POSITION_KEYS:
        value = get(key, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def check_seq_length(seq_length: int, model_dir_or_config: Any) -> None:
    """Raise a UserError when `seq_length` is not positive or exceeds the model's maximum positions."""
    if not isinstance(seq_length, int) or isinstance(seq_length, bool) or seq_length <= 0:
        raise UserError(f"seq_length must be a positive integer, got {seq_length!r}")
    limit = max_positions(model_dir_or_config)
    if limit is not None and seq_length > limit:
        raise UserError(
            f"seq_length {seq_length} exceeds the model's max_position_embeddings {limit}; "
            f"use a seq_length <= {limit}"
        )
