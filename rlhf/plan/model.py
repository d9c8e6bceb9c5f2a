"""The numbers of a model that memory and time depend on, read from an HF config.json, a tiny preset or a
built-in table of well-known models.

The table copies each model's public config.json (the URL is beside each entry); only the fields used here.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlhf.errors import UserError
from rlhf.model_config import read_config_json


@dataclass(frozen=True)
class ModelSpec:
    """A decoder-only transformer. MoE: `experts` routed experts of width `moe_ffn` on the layers flagged in
    `moe_layers`, `topk` per token, plus a shared expert of width `shared_ffn`. MLA (DeepSeek): `q_lora`,
    `kv_lora`, `qk_nope`, `qk_rope`, `v_dim` set (kv_lora > 0)."""

    name: str
    family: str  # HF model_type
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int  # dense MLP width
    vocab: int
    tie: bool
    qkv_bias: bool = False
    qk_norm: bool = False
    experts: int = 0
    topk: int = 0
    moe_ffn: int = 0
    shared_ffn: int = 0
    shared_gate: bool = False  # Qwen2-MoE's sigmoid gate on the shared expert (1 x hidden)
    moe_layers: tuple[bool, ...] = ()
    q_lora: int = 0
    kv_lora: int = 0
    qk_nope: int = 0
    qk_rope: int = 0
    v_dim: int = 0
    max_positions: int = 0

    @property
    def moe(self) -> bool:
        return self.experts > 0

    @property
    def mla(self) -> bool:
        return self.kv_lora > 0

    def is_moe_layer(self, i: int) -> bool:
        return bool(self.moe_layers) and self.moe_layers[i]


# Public config.json of well-known models (fields used here; values as published).
KNOWN: dict[str, dict[str, Any]] = {
    # https://huggingface.co/meta-llama/Meta-Llama-3-8B/blob/main/config.json
    "Llama-3-8B": dict(model_type="llama", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                       num_attention_heads=32, num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=False,
                       max_position_embeddings=8192),
    # https://huggingface.co/Qwen/Qwen2.5-32B/blob/main/config.json
    "Qwen2.5-32B": dict(model_type="qwen2", hidden_size=5120, intermediate_size=27648, num_hidden_layers=64,
                        num_attention_heads=40, num_key_value_heads=8, vocab_size=152064, tie_word_embeddings=False,
                        max_position_embeddings=131072),
    # https://huggingface.co/Qwen/Qwen3-30B-A3B/blob/main/config.json
    "Qwen3-30B-A3B": dict(model_type="qwen3_moe", hidden_size=2048, intermediate_size=6144, num_hidden_layers=48,
                          num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128,
                          num_experts_per_tok=8, moe_intermediate_size=768, decoder_sparse_step=1,
                          mlp_only_layers=[], vocab_size=151936, tie_word_embeddings=False,
                          max_position_embeddings=40960),
    # https://huggingface.co/deepseek-ai/DeepSeek-V3/blob/main/config.json (the MTP module, one more layer
    # used only in pretraining, is left out)
    "DeepSeek-V3": dict(model_type="deepseek_v3", hidden_size=7168, intermediate_size=18432, num_hidden_layers=61,
                        num_attention_heads=128, num_key_value_heads=128, n_routed_experts=256, n_shared_experts=1,
                        num_experts_per_tok=8, moe_intermediate_size=2048, first_k_dense_replace=3, moe_layer_freq=1,
                        q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
                        v_head_dim=128, vocab_size=129280, tie_word_embeddings=False,
                        max_position_embeddings=163840),
}


def _int(c: dict, key: str, source: str, default: Any = None) -> int:
    v = c.get(key, default)
    if not isinstance(v, int) or isinstance(v, bool) or v < 0:
        raise UserError(f"{source}: field {key} must be a non-negative integer, got {v!r}")
    return v


def spec_from_hf(c: dict, name: str, source: str) -> ModelSpec:
    """A `ModelSpec` from the fields of an HF config.json (dense, Qwen2/3-MoE, DeepSeek-V2/V3 MLA + MoE)."""
    family = str(c.get("model_type", "llama"))
    hidden, layers = _int(c, "hidden_size", source), _int(c, "num_hidden_layers", source)
    heads = _int(c, "num_attention_heads", source)
    if not hidden or not layers or not heads:
        raise UserError(f"{source}: hidden_size, num_hidden_layers and num_attention_heads must be > 0")
    kv = _int(c, "num_key_value_heads", source, heads) or heads
    head_dim = _int(c, "head_dim", source, hidden // heads) or hidden // heads
    experts = c.get("num_experts", c.get("num_local_experts", c.get("n_routed_experts"))) or 0
    experts = _int({"num_experts": experts}, "num_experts", source)
    moe_layers: tuple[bool, ...] = ()
    shared_ffn, shared_gate = 0, False
    if experts:
        only = set(c.get("mlp_only_layers") or [])
        if family.startswith("deepseek"):  # dense first_k_dense_replace layers, then every moe_layer_freq-th
            first, freq = c.get("first_k_dense_replace") or 0, c.get("moe_layer_freq") or 1
            moe_layers = tuple(i >= first and i % freq == 0 for i in range(layers))
        else:  # Qwen-MoE: sparse unless in mlp_only_layers or (i+1) % decoder_sparse_step != 0
            step = c.get("decoder_sparse_step") or 1
            moe_layers = tuple(i not in only and (i + 1) % step == 0 for i in range(layers))
        if c.get("shared_expert_intermediate_size"):  # Qwen2-MoE
            shared_ffn, shared_gate = _int(c, "shared_expert_intermediate_size", source), True
        elif c.get("n_shared_experts"):  # DeepSeek: n shared experts of the routed width
            shared_ffn = _int(c, "n_shared_experts", source) * _int(c, "moe_intermediate_size", source)
    mla = bool(c.get("kv_lora_rank"))
    return ModelSpec(
        name=name, family=family, hidden=hidden, layers=layers, heads=heads, kv_heads=kv, head_dim=head_dim,
        ffn=_int(c, "intermediate_size", source, 4 * hidden), vocab=_int(c, "vocab_size", source),
        tie=bool(c.get("tie_word_embeddings", False)),
        qkv_bias=family in ("qwen2", "qwen2_moe") or bool(c.get("attention_bias", False)),
        qk_norm=family in ("qwen3", "qwen3_moe"),
        experts=experts, topk=_int(c, "num_experts_per_tok", source, 0) if experts else 0,
        moe_ffn=_int(c, "moe_intermediate_size", source, 0) if experts else 0,
        shared_ffn=shared_ffn, shared_gate=shared_gate, moe_layers=moe_layers,
        q_lora=c.get("q_lora_rank") or 0 if mla else 0, kv_lora=c.get("kv_lora_rank") or 0,
        qk_nope=c.get("qk_nope_head_dim") or 0 if mla else 0, qk_rope=c.get("qk_rope_head_dim") or 0 if mla else 0,
        v_dim=c.get("v_head_dim") or 0 if mla else 0, max_positions=c.get("max_position_embeddings") or 0,
    )


def preset_config(preset: str) -> dict:
    """The config.json fields of a tiny preset (rlhf/tiny_models.py), without building a tokenizer."""
    from rlhf.tiny_models import PRESETS

    p = PRESETS[preset]
    return dict(model_type=p.family, hidden_size=p.hidden_size, intermediate_size=p.intermediate_size,
                num_hidden_layers=p.num_layers, num_attention_heads=p.num_heads, num_key_value_heads=p.num_kv_heads,
                vocab_size=p.vocab_size, tie_word_embeddings=p.tie_embeddings,
                max_position_embeddings=p.max_position_embeddings, **p.extra)


def load_model(ref: str) -> ModelSpec:
    """`ref`: an HF model folder (or its config.json), a tiny preset name or a well-known model name."""
    from rlhf.tiny_models import PRESETS

    path = Path(ref)
    if path.is_dir() or path.suffix == ".json":
        cfg_file = path / "config.json" if path.is_dir() else path
        c = read_config_json(path, "--model")
        return spec_from_hf(c, path.name if path.is_dir() else path.parent.name, str(cfg_file))
    if ref in PRESETS:
        return spec_from_hf(preset_config(ref), ref, f"preset {ref}")
    known = {k.lower(): k for k in KNOWN}
    if ref.lower() in known:
        name = known[ref.lower()]
        return spec_from_hf(KNOWN[name], name, f"built-in {name}")
    raise UserError(f"--model: {ref!r} is not a folder, a preset ({', '.join(PRESETS)}) "
                    f"or a known model ({', '.join(KNOWN)})")
