"""HF <-> megatron-core name and layout map for the Llama, Mistral, Qwen2, Qwen3, Qwen2-MoE, Qwen3-MoE,
DeepSeek-V2, DeepSeek-V3 and Qwen2-VL families (defined once).

Used by the offline converter and the live weight sync (`workers/megatron/hf_weights.py`).

Layouts (megatron-core GPTModel, local or TE layer spec):
- `linear_qkv.weight` fuses q, k, v per query group: for each of the `ng` KV groups, the group's
  `nq/ng` query heads, then its key head, then its value head (rows of `head_dim`). TP splits whole
  groups: TP rank r holds groups [r*ng/tp, (r+1)*ng/tp), i.e. a contiguous chunk along dim 0. Same for
  the Qwen2 qkv bias.
- `linear_fc1.weight` fuses gate and up; TP rank r holds [gate rows of r; up rows of r] (each split
  along dim 0 separately), so the full fused tensor is not a plain concatenation of the shards.
- Column-parallel (`linear_qkv`, `linear_fc1`): dim 0; row-parallel (`linear_proj`, `linear_fc2`): dim 1.
- Embedding and untied output layer: vocab-parallel along dim 0 over the vocab padded Megatron's way
  (zero rows added on load, removed on export).
- Layer norms: local spec `input_layernorm` / `pre_mlp_layernorm`; TE spec fuses them into
  `self_attention.linear_qkv.layer_norm_weight` / `mlp.linear_fc1.layer_norm_weight`. A rule lists both
  names and binds to whichever the live model has (checkpoints use the TE key in both specs).
- PP: each stage holds a contiguous range of layers, numbered locally in parameter names; the global
  index is `layer.layer_number - 1`. The embedding lives on the first stage, final norm and output
  layer on the last. With tied embeddings and PP > 1 the last stage keeps a copy of the embedding as
  `output_layer.weight` (an alias of `model.embed_tokens.weight`: filled on load, not exported).
- Qwen3 q/k norms: `self_attention.q_layernorm` / `k_layernorm` (RMSNorm over one head) <-> HF
  `self_attn.q_norm` / `k_norm`, replicated.
- MoE layers (HF `num_experts` > 0, layer i sparse unless in `mlp_only_layers` or (i+1) %
  `decoder_sparse_step` != 0): router `mlp.router.weight` <-> `mlp.gate.weight` (replicated); expert e
  `mlp.experts.local_experts.{e}.linear_fc1/fc2` (local or TE sequential experts) or
  `mlp.experts.linear_fc1.weight{e}` (TE grouped GEMM) <-> HF `mlp.experts.{E}.gate_proj/up_proj/down_proj`
  with the FC1 / row layouts of a dense MLP (experts keep TP as their tensor-parallel size). EP rank r
  holds experts [r*E/ep, (r+1)*E/ep) numbered locally: global E = r*E/ep + e. Qwen2-MoE's shared expert
  `mlp.shared_experts.linear_fc1/fc2` <-> `mlp.shared_expert.*`, its sigmoid gate
  `mlp.shared_experts.gate_weight` <-> `mlp.shared_expert_gate.weight` (replicated).
- DeepSeek (MLA, local spec; `workers/megatron/deepseek_config.py` has the config side): `self_attn.q_a_proj`
  -> `self_attention.linear_q_down_proj`, `kv_a_proj_with_mqa` -> `linear_kv_down_proj` (column-parallel: rows
  over TP, gathered before the layer norms), `q_b_proj` -> `linear_q_up_proj` (or `q_proj` -> `linear_q_proj`
  without q_lora_rank; per head [nope | rope] rows), `kv_b_proj` -> `linear_kv_up_proj` (per head [k_nope | v]),
  all column-parallel, heads split over TP; `q_a_layernorm` / `kv_a_layernorm` -> `q_layernorm` /
  `kv_layernorm` (TE spec: fused into `linear_q_up_proj` / `linear_kv_up_proj` as `layer_norm_weight`),
  replicated. HF's interleaved rope (`rope_interleave`) is megatron MLA's rope: no permutation. Shared experts
  `mlp.shared_experts.*` (plural, no gate, width n_shared_experts x moe_intermediate_size). V3's router bias
  `mlp.gate.e_score_correction_bias` <-> the router's fp32 buffer `mlp.router.expert_bias` (replicated; always
  float32 in HF files, `hf_dtype`). Multi-token-prediction layers (`model.layers.{N}.` for N >=
  num_hidden_layers) are skipped on import (`mtp_tensors`).
- Qwen2-VL (config read through `hf_fields.language_view`): the language model is Qwen2's (same names
  under `model.`); the vision tower `vision.*` (workers/vision/tower.py, first PP stage) <-> `visual.*`,
  replicated over TP.
- Value head (`ValueHead`, hidden -> 1): `output_layer.weight` <-> HF `score.weight` (as in
  *ForSequenceClassification with one label), replicated over TP.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch

from workers.megatron import deepseek_config
from workers.megatron.hf_fields import cfg_get as cfg_get  # re-exported: callers read config fields here
from workers.megatron.hf_fields import rope_type
from workers.megatron.value_head import ValueHead
from workers.vision.tower import hf_shapes as vision_hf_shapes


@dataclass(frozen=True)
class Family:
    """What differs between the supported HF families."""

    name: str
    qkv_bias: bool
    qk_norm: bool = False  # per-head RMSNorm on q and k (Qwen3)
    moe: bool = False  # routed experts (`mlp.experts.{E}.*`, router `mlp.gate`)
    shared_expert: bool = False  # Qwen2-MoE's shared expert with its sigmoid gate
    mla: bool = False  # DeepSeek: multi-head latent attention, dense first layers, shared experts without a gate
    expert_bias: bool = False  # DeepSeek-V3: sigmoid router with the expert-bias correction
    vision: bool = False  # Qwen2-VL: a vision tower (`vision.*` <-> `visual.*`, replicated) and M-RoPE


FAMILIES: dict[str, Family] = {
    "llama": Family("llama", qkv_bias=False),
    "mistral": Family("mistral", qkv_bias=False),  # Llama's layout; a sliding window is refused (family_of)
    "qwen2": Family("qwen2", qkv_bias=True),
    "qwen3": Family("qwen3", qkv_bias=False, qk_norm=True),
    "qwen2_moe": Family("qwen2_moe", qkv_bias=True, moe=True, shared_expert=True),
    "qwen3_moe": Family("qwen3_moe", qkv_bias=False, qk_norm=True, moe=True),
    "deepseek_v2": Family("deepseek_v2", qkv_bias=False, moe=True, mla=True),  # V3's layout; softmax router
    "deepseek_v3": Family("deepseek_v3", qkv_bias=False, moe=True, mla=True, expert_bias=True),
    # Qwen2-VL: Qwen2's language model (read through `language_view`) with M-RoPE, plus the vision tower
    "qwen2_vl": Family("qwen2_vl", qkv_bias=True, vision=True),
}


def num_experts(hf_config: Any) -> Any:
    """Routed experts per MoE layer: `num_experts` (Qwen3-MoE's config.json spells it `num_local_experts`,
    DeepSeek's `n_routed_experts`)."""
    for field in ("num_experts", "num_local_experts", "n_routed_experts"):
        value = cfg_get(hf_config, field)
        if value is not None:
            return value
    return None


def family_of(hf_config: Any) -> Family:
    """The family of a HF config (object or dict); ValueError for unsupported types or features."""
    model_type = cfg_get(hf_config, "model_type")
    if model_type not in FAMILIES:
        raise ValueError(f"model_type {model_type!r} is not supported (supported: {', '.join(FAMILIES)})")
    if model_type == "llama" and (cfg_get(hf_config, "attention_bias") or cfg_get(hf_config, "mlp_bias")):
        raise ValueError("llama configs with attention_bias or mlp_bias are not supported")
    if model_type == "mistral":
        _check_mistral_window(hf_config)
    if model_type != "llama" and cfg_get(hf_config, "use_sliding_window"):
        raise ValueError(f"{model_type} configs with use_sliding_window=true are not supported")
    if model_type in ("qwen3", "qwen3_moe") and cfg_get(hf_config, "attention_bias"):
        raise ValueError(f"{model_type} configs with attention_bias=true are not supported")
    layer_types = cfg_get(hf_config, "layer_types") or []
    if any(t != "full_attention" for t in layer_types):
        raise ValueError(f"layer_types {sorted(set(layer_types))} is not supported (full_attention only)")
    act = cfg_get(hf_config, "hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"hidden_act={act!r} is not supported (silu)")
    fam = FAMILIES[model_type]
    if fam.vision and cfg_get(hf_config, "vision_config") is None:
        raise ValueError(f"{model_type}: read the config through workers.megatron.hf_fields.language_view "
                         "(its text fields are nested under text_config)")
    if fam.mla:
        deepseek_config.check_deepseek(hf_config, fam.name)
    else:
        rope_type(hf_config, ("default", "linear", "llama3"))
        if fam.moe:
            _check_moe_fields(hf_config, fam)
    return fam


def _check_mistral_window(hf_config: Any) -> None:
    """Mistral's sliding window: megatron's attention here is full causal, which equals sliding-window
    attention only when no sequence is longer than the window, i.e. a window of at least
    max_position_embeddings (or none)."""
    window, max_pos = cfg_get(hf_config, "sliding_window"), cfg_get(hf_config, "max_position_embeddings")
    if window is not None and (not isinstance(max_pos, int) or window < max_pos):
        raise ValueError(f"config field sliding_window={window} is smaller than max_position_embeddings={max_pos}: "
                         f"sliding-window attention is not supported (full attention equals it only when the "
                         f"window is at least max_position_embeddings; set sliding_window to null or >= {max_pos})")


def _check_moe_fields(hf_config: Any, fam: Family) -> None:
    """Refuse MoE config features megatron-core cannot express, naming the field."""
    experts, topk = num_experts(hf_config), cfg_get(hf_config, "num_experts_per_tok")
    if not isinstance(experts, int) or experts < 1:
        raise ValueError(f"config field num_experts must be a positive integer, got {experts!r}")
    if not isinstance(topk, int) or not 1 <= topk <= experts:
        raise ValueError(f"config field num_experts_per_tok={topk!r} must be in 1..num_experts={experts}")
    step = cfg_get(hf_config, "decoder_sparse_step", 1)
    if not isinstance(step, int) or step < 1:
        raise ValueError(f"config field decoder_sparse_step must be a positive integer, got {step!r}")
    for field, allowed in (("scoring_func", "softmax"), ("topk_method", "greedy")):
        value = cfg_get(hf_config, field)
        if value not in (None, allowed):
            raise ValueError(f"config field {field}={value!r} is not supported (router: {allowed})")
    if cfg_get(hf_config, "router_jitter_noise"):
        raise ValueError("config field router_jitter_noise is not supported (must be 0)")
    if fam.shared_expert:
        size = cfg_get(hf_config, "shared_expert_intermediate_size")
        if not isinstance(size, int) or size < 1:
            raise ValueError(f"config field shared_expert_intermediate_size must be a positive integer, got {size!r}")


def moe_layer_pattern(hf_config: Any) -> tuple[bool, ...]:
    """Per layer: True where the layer is an MoE layer (HF Qwen-MoE rule: not in `mlp_only_layers` and
    (i+1) % `decoder_sparse_step` == 0); all False for dense families."""
    layers = cfg_get(hf_config, "num_hidden_layers")
    fam = family_of(hf_config)
    if not fam.moe:
        return (False,) * layers
    if fam.mla:
        return deepseek_config.moe_layers(hf_config)
    step = cfg_get(hf_config, "decoder_sparse_step", 1)
    only_mlp = set(cfg_get(hf_config, "mlp_only_layers") or [])
    return tuple(i not in only_mlp and (i + 1) % step == 0 for i in range(layers))


@dataclass(frozen=True)
class Dims:
    """Sizes from the HF config that the layouts need."""

    hidden: int
    heads: int
    groups: int
    head_dim: int
    ffn: int
    vocab: int
    layers: int
    tied: bool
    qkv_bias: bool
    qk_norm: bool = False
    experts: int = 0  # routed experts per MoE layer (0: dense)
    moe_ffn: int = 0  # one expert's intermediate size
    shared_ffn: int = 0  # the shared expert's intermediate size (0: none)
    moe_layers: tuple[bool, ...] = ()  # per layer: an MoE layer
    shared_gate: bool = False  # Qwen2-MoE's gated `shared_expert` (else DeepSeek's `shared_experts`)
    mla: bool = False  # DeepSeek's multi-head latent attention, with the sizes below
    q_lora: int = 0  # q_lora_rank (0: `q_proj`, no query compression)
    kv_lora: int = 0
    qk_nope: int = 0
    qk_rope: int = 0
    v_dim: int = 0
    expert_bias: bool = False  # V3's router bias `mlp.gate.e_score_correction_bias`

    @classmethod
    def from_hf(cls, hf_config: Any) -> Dims:
        fam = family_of(hf_config)
        hidden, heads = cfg_get(hf_config, "hidden_size"), cfg_get(hf_config, "num_attention_heads")
        for field in ("hidden_size", "num_attention_heads", "intermediate_size", "vocab_size", "num_hidden_layers"):
            value = cfg_get(hf_config, field)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"config field {field} must be a positive integer, got {value!r}")
        return cls(
            hidden=hidden,
            heads=heads,
            groups=cfg_get(hf_config, "num_key_value_heads") or heads,
            head_dim=cfg_get(hf_config, "head_dim") or hidden // heads,
            ffn=cfg_get(hf_config, "intermediate_size"),
            vocab=cfg_get(hf_config, "vocab_size"),
            layers=cfg_get(hf_config, "num_hidden_layers"),
            tied=bool(cfg_get(hf_config, "tie_word_embeddings", False)),
            qkv_bias=fam.qkv_bias and bool(cfg_get(hf_config, "qkv_bias", True)),
            qk_norm=fam.qk_norm,
            experts=num_experts(hf_config) if fam.moe else 0,
            moe_ffn=cfg_get(hf_config, "moe_intermediate_size") if fam.moe else 0,
            shared_ffn=_shared_ffn(hf_config, fam),
            moe_layers=moe_layer_pattern(hf_config),
            shared_gate=fam.shared_expert,
            expert_bias=fam.expert_bias,
            **_mla_dims(hf_config, fam),
        )


def _shared_ffn(hf_config: Any, fam: Family) -> int:
    if fam.shared_expert:
        return cfg_get(hf_config, "shared_expert_intermediate_size")
    if fam.mla:
        return cfg_get(hf_config, "n_shared_experts") * cfg_get(hf_config, "moe_intermediate_size")
    return 0


def _mla_dims(hf_config: Any, fam: Family) -> dict[str, Any]:
    if not fam.mla:
        return {}
    m = deepseek_config.mla_dims(hf_config)
    return {"mla": True, "q_lora": m["q_lora"], "kv_lora": m["kv_lora"], "qk_nope": m["nope"], "qk_rope": m["rope"],
            "v_dim": m["v"]}


# Layouts ("kind") of a megatron tensor relative to its HF tensors.
REPLICATED, COLUMN, ROW, VOCAB, QKV, FC1 = "replicated", "column", "row", "vocab", "qkv", "fc1"


@dataclass(frozen=True)
class Rule:
    """One megatron parameter <-> its HF tensor(s). Names under `decoder.layers.{i}.` use `{L}` in `hf`."""

    mcore: tuple[str, ...]  # candidate megatron names (local spec first, then TE); the model has one
    hf: tuple[str, ...]
    kind: str


_LAYER_RULES: tuple[Rule, ...] = (
    Rule(("input_layernorm.weight", "self_attention.linear_qkv.layer_norm_weight"),
         ("model.layers.{L}.input_layernorm.weight",), REPLICATED),
    Rule(("self_attention.linear_qkv.weight",),
         ("model.layers.{L}.self_attn.q_proj.weight", "model.layers.{L}.self_attn.k_proj.weight",
          "model.layers.{L}.self_attn.v_proj.weight"), QKV),
    Rule(("self_attention.linear_qkv.bias",),
         ("model.layers.{L}.self_attn.q_proj.bias", "model.layers.{L}.self_attn.k_proj.bias",
          "model.layers.{L}.self_attn.v_proj.bias"), QKV),
    Rule(("self_attention.linear_proj.weight",), ("model.layers.{L}.self_attn.o_proj.weight",), ROW),
    Rule(("pre_mlp_layernorm.weight", "mlp.linear_fc1.layer_norm_weight"),
         ("model.layers.{L}.post_attention_layernorm.weight",), REPLICATED),
    Rule(("mlp.linear_fc1.weight",),
         ("model.layers.{L}.mlp.gate_proj.weight", "model.layers.{L}.mlp.up_proj.weight"), FC1),
    Rule(("mlp.linear_fc2.weight",), ("model.layers.{L}.mlp.down_proj.weight",), ROW),
    Rule(("self_attention.q_layernorm.weight",), ("model.layers.{L}.self_attn.q_norm.weight",), REPLICATED),
    Rule(("self_attention.k_layernorm.weight",), ("model.layers.{L}.self_attn.k_norm.weight",), REPLICATED),
    Rule(("mlp.router.weight",), ("model.layers.{L}.mlp.gate.weight",), REPLICATED),
    Rule(("mlp.shared_experts.linear_fc1.weight",),
         ("model.layers.{L}.mlp.shared_expert.gate_proj.weight", "model.layers.{L}.mlp.shared_expert.up_proj.weight"),
         FC1),
    Rule(("mlp.shared_experts.linear_fc2.weight",), ("model.layers.{L}.mlp.shared_expert.down_proj.weight",), ROW),
    Rule(("mlp.shared_experts.gate_weight",), ("model.layers.{L}.mlp.shared_expert_gate.weight",), REPLICATED),
)
# DeepSeek (MLA): matched before _LAYER_RULES (q_layernorm and shared_experts mean other HF tensors there).
_MLA_RULES: tuple[Rule, ...] = (
    Rule(("self_attention.linear_q_down_proj.weight",), ("model.layers.{L}.self_attn.q_a_proj.weight",), COLUMN),
    Rule(("self_attention.q_layernorm.weight", "self_attention.linear_q_up_proj.layer_norm_weight"),
         ("model.layers.{L}.self_attn.q_a_layernorm.weight",), REPLICATED),
    Rule(("self_attention.linear_q_up_proj.weight",), ("model.layers.{L}.self_attn.q_b_proj.weight",), COLUMN),
    Rule(("self_attention.linear_q_proj.weight",), ("model.layers.{L}.self_attn.q_proj.weight",), COLUMN),
    Rule(("self_attention.linear_kv_down_proj.weight",), ("model.layers.{L}.self_attn.kv_a_proj_with_mqa.weight",),
         COLUMN),
    Rule(("self_attention.kv_layernorm.weight", "self_attention.linear_kv_up_proj.layer_norm_weight"),
         ("model.layers.{L}.self_attn.kv_a_layernorm.weight",), REPLICATED),
    Rule(("self_attention.linear_kv_up_proj.weight",), ("model.layers.{L}.self_attn.kv_b_proj.weight",), COLUMN),
    Rule(("mlp.shared_experts.linear_fc1.weight",),
         ("model.layers.{L}.mlp.shared_experts.gate_proj.weight", "model.layers.{L}.mlp.shared_experts.up_proj.weight"),
         FC1),
    Rule(("mlp.shared_experts.linear_fc2.weight",), ("model.layers.{L}.mlp.shared_experts.down_proj.weight",), ROW),
    Rule(("mlp.router.expert_bias",), ("model.layers.{L}.mlp.gate.e_score_correction_bias",), REPLICATED),
)
EXPERT_BIAS_SUFFIX = "mlp.router.expert_bias"  # a buffer (fp32), bound like a parameter
# One routed expert's weights (`{E}`: global expert index); the megatron names are matched by _EXPERT_RE.
_EXPERT_RULES: dict[str, Rule] = {
    "linear_fc1": Rule(("linear_fc1",), ("model.layers.{L}.mlp.experts.{E}.gate_proj.weight",
                                         "model.layers.{L}.mlp.experts.{E}.up_proj.weight"), FC1),
    "linear_fc2": Rule(("linear_fc2",), ("model.layers.{L}.mlp.experts.{E}.down_proj.weight",), ROW),
}
_EXPERT_RE = re.compile(r"^mlp\.experts\.(?:local_experts\.(\d+)\.(linear_fc[12])\.weight|(linear_fc[12])\.weight(\d+))$")
EMBEDDING = Rule(("embedding.word_embeddings.weight",), ("model.embed_tokens.weight",), VOCAB)
FINAL_NORM = Rule(("decoder.final_layernorm.weight",), ("model.norm.weight",), REPLICATED)
OUTPUT = Rule(("output_layer.weight",), ("lm_head.weight",), VOCAB)
TIED_OUTPUT = Rule(("output_layer.weight",), ("model.embed_tokens.weight",), VOCAB)
VALUE_OUTPUT = Rule(("output_layer.weight",), ("score.weight",), REPLICATED)


def expected_hf_shapes(hf_config: Any, value_head: bool = False) -> dict[str, tuple[int, ...]]:
    """Every HF tensor a full model of this config has, with its shape (the global, pre-TP view)."""
    d = Dims.from_hf(hf_config)
    q, kv = d.heads * d.head_dim, d.groups * d.head_dim
    layer = {
        "input_layernorm.weight": (d.hidden,),
        **(_mla_shapes(d) if d.mla else {
            "self_attn.q_proj.weight": (q, d.hidden),
            "self_attn.k_proj.weight": (kv, d.hidden),
            "self_attn.v_proj.weight": (kv, d.hidden),
            "self_attn.o_proj.weight": (d.hidden, q),
        }),
        "post_attention_layernorm.weight": (d.hidden,),
        "mlp.gate_proj.weight": (d.ffn, d.hidden),
        "mlp.up_proj.weight": (d.ffn, d.hidden),
        "mlp.down_proj.weight": (d.hidden, d.ffn),
    }
    if d.qkv_bias:
        layer.update({"self_attn.q_proj.bias": (q,), "self_attn.k_proj.bias": (kv,), "self_attn.v_proj.bias": (kv,)})
    if d.qk_norm:
        layer.update({"self_attn.q_norm.weight": (d.head_dim,), "self_attn.k_norm.weight": (d.head_dim,)})
    dense_mlp = ("mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight")
    moe_layer = {k: v for k, v in layer.items() if k not in dense_mlp}
    moe_layer["mlp.gate.weight"] = (d.experts, d.hidden)
    for e in range(d.experts):
        moe_layer.update({
            f"mlp.experts.{e}.gate_proj.weight": (d.moe_ffn, d.hidden),
            f"mlp.experts.{e}.up_proj.weight": (d.moe_ffn, d.hidden),
            f"mlp.experts.{e}.down_proj.weight": (d.hidden, d.moe_ffn),
        })
    if d.shared_ffn:
        shared = "mlp.shared_expert." if d.shared_gate else "mlp.shared_experts."
        moe_layer.update({
            shared + "gate_proj.weight": (d.shared_ffn, d.hidden),
            shared + "up_proj.weight": (d.shared_ffn, d.hidden),
            shared + "down_proj.weight": (d.hidden, d.shared_ffn),
        })
        if d.shared_gate:
            moe_layer["mlp.shared_expert_gate.weight"] = (1, d.hidden)
    if d.expert_bias:
        moe_layer["mlp.gate.e_score_correction_bias"] = (d.experts,)
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (d.vocab, d.hidden)}
    for i in range(d.layers):
        this = moe_layer if d.moe_layers[i] else layer
        shapes.update({f"model.layers.{i}.{k}": v for k, v in this.items()})
    shapes["model.norm.weight"] = (d.hidden,)
    if family_of(hf_config).vision:
        shapes.update(vision_hf_shapes(cfg_get(hf_config, "vision_config")))
    if value_head:
        shapes["score.weight"] = (1, d.hidden)
    elif not d.tied:
        shapes["lm_head.weight"] = (d.vocab, d.hidden)
    return shapes


def _mla_shapes(d: Dims) -> dict[str, tuple[int, ...]]:
    """The attention tensors of an MLA layer."""
    qk = d.qk_nope + d.qk_rope
    q: dict[str, tuple[int, ...]] = {"self_attn.q_proj.weight": (d.heads * qk, d.hidden)} if not d.q_lora else {
        "self_attn.q_a_proj.weight": (d.q_lora, d.hidden),
        "self_attn.q_a_layernorm.weight": (d.q_lora,),
        "self_attn.q_b_proj.weight": (d.heads * qk, d.q_lora),
    }
    return {
        **q,
        "self_attn.kv_a_proj_with_mqa.weight": (d.kv_lora + d.qk_rope, d.hidden),
        "self_attn.kv_a_layernorm.weight": (d.kv_lora,),
        "self_attn.kv_b_proj.weight": (d.heads * (d.qk_nope + d.v_dim), d.kv_lora),
        "self_attn.o_proj.weight": (d.hidden, d.heads * d.v_dim),
    }


def hf_dtype(name: str, dtype: torch.dtype) -> torch.dtype:
    """The dtype tensor `name` is written in when the model's weights are `dtype`: DeepSeek-V3's router bias
    stays float32 (megatron keeps it in fp32; a bf16 copy would round the balancing state)."""
    return torch.float32 if name.endswith(".mlp.gate.e_score_correction_bias") else dtype


def mtp_tensors(hf_config: Any, names: Any) -> list[str]:
    """The names among `names` that belong to multi-token-prediction layers (`model.layers.{N}.*`, N >=
    num_hidden_layers, DeepSeek's `num_nextn_predict_layers`): skipped on import."""
    if not family_of(hf_config).mla:
        return []
    prefixes = deepseek_config.mtp_prefixes(hf_config)
    return sorted(n for n in names if n.startswith(prefixes)) if prefixes else []


def check_hf_tensors(hf_config: Any, shapes: dict[str, tuple[int, ...]], value_head: bool = False) -> None:
    """Check a HF checkpoint's tensor names and shapes against its config: every expected tensor present
    with the right shape, none extra (multi-token-prediction layers aside: `mtp_tensors`). Raises ValueError
    naming the tensor (and the config fields)."""
    expected = expected_hf_shapes(hf_config, value_head)
    mtp = set(mtp_tensors(hf_config, shapes))
    shapes = {k: v for k, v in shapes.items() if k not in mtp}
    missing = [n for n in expected if n not in shapes]
    if missing:
        raise ValueError(f"missing tensor {missing[0]}" + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
    extra = sorted(n for n in shapes if n not in expected)
    if extra:
        more = f" (and {len(extra) - 1} more)" if len(extra) > 1 else ""
        hint = " (the config ties the embeddings)" if extra[0] == "lm_head.weight" else ""
        raise ValueError(f"unexpected tensor {extra[0]}{hint}{more}: not part of the model described by the config")
    for name, shape in expected.items():
        if tuple(shapes[name]) != tuple(shape):
            raise ValueError(
                f"tensor {name} has shape {list(shapes[name])} but the config (hidden_size, num_attention_heads, "
                f"num_key_value_heads, head_dim, intermediate_size, moe_intermediate_size, num_experts, "
                f"shared_expert_intermediate_size, {_MLA_FIELDS if Dims.from_hf(hf_config).mla else ''}"
                f"vocab_size) implies {list(shape)}"
            )


_MLA_FIELDS = "q_lora_rank, kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim, v_head_dim, n_shared_experts, "

# --------------------------------------------------------------------------------------- binding


@dataclass(frozen=True)
class Binding:
    """A live megatron parameter bound to its rule, with HF names resolved to global layer indices."""

    mcore_name: str
    param: torch.Tensor  # a parameter, or the router's expert-bias buffer
    hf_names: tuple[str, ...]
    kind: str
    alias: bool = False  # tied output layer on the last PP stage: filled on load, never exported
    expert: tuple[str, ...] = ()  # a routed expert: `hf_names` with `{E}` left open (see `expert_hf_names`)
    local_expert: int = 0  # its index among this EP rank's experts
    local_experts: int = 0  # experts per EP rank


def expert_hf_names(b: Binding, ep_rank: int) -> tuple[str, ...]:
    """The HF names of expert `b.local_expert` of EP rank `ep_rank` (same layer, same weight)."""
    return tuple(t.format(E=ep_rank * b.local_experts + b.local_expert) for t in b.expert)


def ep_layout() -> tuple[int, int, Any]:
    """(rank, size, group) of this rank's expert-parallel group (1, no group without megatron state)."""
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        return 0, 1, None
    return ps.get_expert_model_parallel_rank(), ps.get_expert_model_parallel_world_size(), \
        ps.get_expert_model_parallel_group()


VISION_PREFIX, HF_VISION_PREFIX = "vision.", "visual."
_LAYER_RE = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")


def bind(model: torch.nn.Module, hf_config: Any) -> list[Binding]:
    """Bind every parameter of the local (TP/PP-sharded) GPTModel to its HF tensors.

    Raises ValueError naming the parameter when one has no rule (so every parameter gets filled).
    """
    d = Dims.from_hf(hf_config)
    is_value = isinstance(getattr(model, "output_layer", None), ValueHead)
    ep_rank, ep, _ = ep_layout()
    if d.experts % ep:
        raise ValueError(f"num_experts={d.experts} is not divisible by expert parallel size {ep}")
    per_rank = d.experts // ep
    out: list[Binding] = []
    rules = _MLA_RULES + _LAYER_RULES if d.mla else _LAYER_RULES
    tensors: list[tuple[str, torch.Tensor]] = list(model.named_parameters())
    tensors += [(n, b) for n, b in model.named_buffers() if n.endswith(EXPERT_BIAS_SUFFIX)]
    for name, param in tensors:
        if getattr(param, "lora_adapter", False):  # a LoRA factor: not an HF tensor (workers/megatron/lora.py)
            continue
        if name.startswith(VISION_PREFIX):  # the vision tower: HF's names under `visual.`, replicated
            out.append(Binding(name, param, (HF_VISION_PREFIX + name[len(VISION_PREFIX):],), REPLICATED))
            continue
        m = _LAYER_RE.match(name)
        if m:
            local, suffix = int(m.group(1)), m.group(2)
            global_idx = model.decoder.layers[local].layer_number - 1
            em = _EXPERT_RE.match(suffix)
            if em:
                e = int(em.group(1) if em.group(1) is not None else em.group(4))
                rule = _EXPERT_RULES[em.group(2) or em.group(3)]
                templates = tuple(h.replace("{L}", str(global_idx)) for h in rule.hf)
                hf = tuple(t.format(E=ep_rank * per_rank + e) for t in templates)
                out.append(Binding(name, param, hf, rule.kind, expert=templates, local_expert=e,
                                   local_experts=per_rank))
                continue
            rule = next((r for r in rules if suffix in r.mcore), None)
            if rule is None:
                raise ValueError(f"megatron parameter {name} has no HF mapping")
            hf = tuple(h.format(L=global_idx) for h in rule.hf)
            out.append(Binding(name, param, hf, rule.kind))
            continue
        if name in EMBEDDING.mcore:
            rule, alias = EMBEDDING, False
        elif name in FINAL_NORM.mcore:
            rule, alias = FINAL_NORM, False
        elif name in OUTPUT.mcore:
            if is_value:
                rule, alias = VALUE_OUTPUT, False
            elif d.tied:
                rule, alias = TIED_OUTPUT, True
            else:
                rule, alias = OUTPUT, False
        else:
            raise ValueError(f"megatron parameter {name} has no HF mapping")
        out.append(Binding(name, param, rule.hf, rule.kind, alias))
    return out


# --------------------------------------------------------------------------------------- layouts


def _qkv_split_sizes(d: Dims) -> tuple[int, int]:
    return d.heads // d.groups * d.head_dim, d.head_dim


def qkv_to_mcore(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, d: Dims, tp_rank: int = 0, tp: int = 1):
    """Interleave HF q/k/v (weights [out, in] or biases [out]) into this TP rank's `linear_qkv` shard."""
    qg, hd = _qkv_split_sizes(d)
    g0, g1 = tp_rank * d.groups // tp, (tp_rank + 1) * d.groups // tp
    tail = q.shape[1:]
    qs = q.reshape(d.groups, qg, *tail)[g0:g1]
    ks = k.reshape(d.groups, hd, *tail)[g0:g1]
    vs = v.reshape(d.groups, hd, *tail)[g0:g1]
    return torch.cat([qs, ks, vs], dim=1).reshape(-1, *tail)


def qkv_to_hf(full: torch.Tensor, d: Dims) -> list[torch.Tensor]:
    """Split the full (all TP shards concatenated) `linear_qkv` tensor back into HF q, k, v."""
    qg, hd = _qkv_split_sizes(d)
    tail = full.shape[1:]
    grouped = full.reshape(d.groups, qg + 2 * hd, *tail)
    q, k, v = torch.split(grouped, [qg, hd, hd], dim=1)
    return [t.reshape(-1, *tail).contiguous() for t in (q, k, v)]


def to_mcore_shard(kind: str, hf: list[torch.Tensor], d: Dims, tp_rank: int, tp: int, padded_vocab: int):
    """The TP rank's megatron shard of one parameter from its full HF tensor(s)."""
    if kind == REPLICATED:
        return hf[0]
    if kind == COLUMN:
        return hf[0].chunk(tp, dim=0)[tp_rank]
    if kind == ROW:
        return hf[0].chunk(tp, dim=1)[tp_rank]
    if kind == VOCAB:
        per = padded_vocab // tp
        lo, hi = tp_rank * per, (tp_rank + 1) * per
        src = hf[0]
        shard = src.new_zeros((per, *src.shape[1:]))
        if lo < src.shape[0]:
            shard[: min(hi, src.shape[0]) - lo] = src[lo:hi]
        return shard
    if kind == QKV:
        return qkv_to_mcore(hf[0], hf[1], hf[2], d, tp_rank, tp)
    if kind == FC1:
        return torch.cat([hf[0].chunk(tp, dim=0)[tp_rank], hf[1].chunk(tp, dim=0)[tp_rank]], dim=0)
    raise ValueError(f"unknown layout {kind!r}")


def shard_into_hf(kind: str, shard: torch.Tensor, hf_out: list[torch.Tensor], d: Dims, tp_rank: int, tp: int) -> int:
    """Copy one TP rank's megatron shard into its part of the full HF tensor(s) `hf_out`, in place (the
    inverse of `to_mcore_shard`; casts to `hf_out`'s dtype; vocab padding dropped). With every rank of
    the TP group doing this, `hf_out` ends up equal to `to_hf` of the gathered shards, without a gather.
    Replicated tensors: every rank holds the whole tensor (callers let one rank write it).
    Returns the number of elements written."""
    with torch.no_grad():
        if kind == REPLICATED:
            hf_out[0].copy_(shard)
            return shard.numel()
        if kind == COLUMN:
            hf_out[0].chunk(tp, dim=0)[tp_rank].copy_(shard)
            return shard.numel()
        if kind == ROW:
            hf_out[0].chunk(tp, dim=1)[tp_rank].copy_(shard)
            return shard.numel()
        if kind == VOCAB:
            lo = tp_rank * shard.shape[0]
            hi = min(lo + shard.shape[0], hf_out[0].shape[0])
            if hi <= lo:
                return 0
            hf_out[0][lo:hi].copy_(shard[: hi - lo])
            return shard[: hi - lo].numel()
        if kind == QKV:
            qg, hd = _qkv_split_sizes(d)
            g0, g1 = tp_rank * d.groups // tp, (tp_rank + 1) * d.groups // tp
            tail = shard.shape[1:]
            local = shard.reshape(g1 - g0, qg + 2 * hd, *tail)
            hf_out[0].view(d.groups, qg, *tail)[g0:g1].copy_(local[:, :qg])
            hf_out[1].view(d.groups, hd, *tail)[g0:g1].copy_(local[:, qg:qg + hd])
            hf_out[2].view(d.groups, hd, *tail)[g0:g1].copy_(local[:, qg + hd:])
            return shard.numel()
        if kind == FC1:
            gate, up = shard.chunk(2, dim=0)
            hf_out[0].chunk(tp, dim=0)[tp_rank].copy_(gate)
            hf_out[1].chunk(tp, dim=0)[tp_rank].copy_(up)
            return shard.numel()
    raise ValueError(f"unknown layout {kind!r}")


def tp_concat_dim(kind: str) -> int | None:
    """The dim along which TP shards of this layout are concatenated (None: replicated)."""
    return {REPLICATED: None, COLUMN: 0, ROW: 1, VOCAB: 0, QKV: 0, FC1: 0}[kind]


def to_hf(kind: str, shards: list[torch.Tensor], d: Dims) -> list[torch.Tensor]:
    """Full HF tensor(s) from all TP shards (index = TP rank) of one megatron parameter."""
    if kind == REPLICATED:
        return [shards[0]]
    if kind in (COLUMN, ROW):
        return [torch.cat(shards, dim=tp_concat_dim(kind))]
    if kind == VOCAB:
        return [torch.cat(shards, dim=0)[: d.vocab].contiguous()]
    if kind == QKV:
        return qkv_to_hf(torch.cat(shards, dim=0), d)
    if kind == FC1:
        halves = [s.chunk(2, dim=0) for s in shards]
        return [torch.cat([h[0] for h in halves], dim=0), torch.cat([h[1] for h in halves], dim=0)]
    raise ValueError(f"unknown layout {kind!r}")

