"""HF <-> megatron-core name and layout map for the dense Llama and Qwen2 families (defined once).

Placeholder for Part 2; the family table lives here so the model provider and converters share it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Family:
    """What differs between the supported HF families."""

    name: str
    qkv_bias: bool


FAMILIES: dict[str, Family] = {
    "llama": Family("llama", qkv_bias=False),
    "qwen2": Family("qwen2", qkv_bias=True),
}


def _get(cfg: Any, name: str, default: Any = None) -> Any:
    return cfg.get(name, default) if isinstance(cfg, dict) else getattr(cfg, name, default)


def family_of(hf_config: Any) -> Family:
    """The family of a HF config (object or dict); ValueError for unsupported types or features."""
    model_type = _get(hf_config, "model_type")
    if model_type not in FAMILIES:
        raise ValueError(f"model_type {model_type!r} is not supported (supported: {', '.join(FAMILIES)})")
    if model_type == "llama" and (_get(hf_config, "attention_bias") or _get(hf_config, "mlp_bias")):
        raise ValueError("llama configs with attention_bias or mlp_bias are not supported")
    if model_type == "qwen2" and _get(hf_config, "use_sliding_window"):
        raise ValueError("qwen2 configs with use_sliding_window=true are not supported")
    act = _get(hf_config, "hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"hidden_act={act!r} is not supported (silu)")
    return FAMILIES[model_type]
