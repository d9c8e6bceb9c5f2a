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


VISION_LANGUAGE_TYPES = ("qwen2_vl",)
_VL_TOP_FIELDS = ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id",
                  "tie_word_embeddings")


def _as_dict(cfg: Any) -> dict:
    return dict(cfg) if isinstance(cfg, dict) else cfg.to_dict()


def language_view(cfg: Any) -> Any:
    """The config as the GPT builder and the weight map read it. For a vision-language model (Qwen2-VL,
    whose config.json nests `text_config` and `vision_config`): a dict of the text model's fields with
    `model_type` kept, `vision_config` and the image token ids beside them. Other configs unchanged."""
    if cfg_get(cfg, "model_type") not in VISION_LANGUAGE_TYPES or cfg_get(cfg, "text_config") is None:
        return cfg
    out = _as_dict(cfg_get(cfg, "text_config"))
    out["model_type"] = cfg_get(cfg, "model_type")
    out["vision_config"] = _as_dict(cfg_get(cfg, "vision_config"))
    for name in _VL_TOP_FIELDS:
        if cfg_get(cfg, name) is not None:
            out[name] = cfg_get(cfg, name)
    return out


def load_model_config(path: Any) -> Any:
    """The HF config of a model folder as the Megatron side reads it (`language_view` applied)."""
    from transformers import AutoConfig

    return language_view(AutoConfig.from_pretrained(path))
