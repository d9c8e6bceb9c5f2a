"""Reading fields of a HF config given as a transformers config object or as a config.json dict."""

from __future__ import annotations

from typing import Any


def cfg_get(cfg: Any, name: str, default: Any = None) -> Any:
    """A field of a HF config given as an object or a dict."""
    return cfg.get(name, default) if isinstance(cfg, dict) else getattr(cfg, name, default)


def rope_parameters(cfg: Any) -> tuple[dict, str]:
    """The RoPE parameters of a HF config and the field they came from: transformers 5's `rope_parameters`,
    else the legacy `rope_scaling` (as in the published DeepSeek-V3 and Llama 3 config.json files) with
    `rope_theta` beside it."""
    params = dict(cfg_get(cfg, "rope_parameters") or {})
    if params:
        return params, "rope_parameters"
    params = dict(cfg_get(cfg, "rope_scaling") or {})
    params.setdefault("rope_theta", cfg_get(cfg, "rope_theta", 10000.0))
    return params, "rope_scaling"


def rope_type(cfg: Any, allowed: tuple[str, ...]) -> str:
    """The RoPE type of a HF config ('default' when unscaled); ValueError naming the field when it is not
    one of `allowed`."""
    params, field = rope_parameters(cfg)
    key = "rope_type" if "rope_type" in params else "type"
    value = params.get(key) or "default"
    if value not in allowed:
        raise ValueError(f"config field {field}.{key}={value!r} is not supported (supported: {', '.join(allowed)})")
    return value
