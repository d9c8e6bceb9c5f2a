"""Build megatron-core GPT models (LM and value-head variants) from a HF Llama / Mistral / Qwen2 / Qwen3 /
Qwen2-MoE / Qwen3-MoE / DeepSeek-V2 / DeepSeek-V3 config (DeepSeek: MLA, `workers/megatron/deepseek_config.py`).

The Transformer Engine vs local layer-spec choice is made in `use_transformer_engine()` only.
"""

from __future__ import annotations

import importlib.util
import math
from typing import Any

import torch
import torch.nn.functional as F

from workers.megatron import deepseek_config
from workers.megatron.cpu_compat import cuda_absent
from workers.megatron.hf_fields import rope_parameters
from workers.megatron.hf_map import cfg_get, family_of, moe_layer_pattern, num_experts
from workers.megatron.masks import causal_mask, follow_mask
from workers.megatron.value_head import ValueHead

DEFAULT_VOCAB_DIVISOR = 128


def use_transformer_engine() -> bool:
    """True when the TE layer spec is used: Transformer Engine importable and CUDA present."""
    return not cuda_absent() and importlib.util.find_spec("transformer_engine") is not None


def layer_spec(use_te: bool | None = None, mask_type: Any = None, qk_layernorm: bool = False):
    """The GPT layer spec: TE (fused layernorm-linear) on GPU with TE, megatron-core local otherwise.

    Its attention takes `mask_type` (default `arbitrary`: every batch the engine runs carries an explicit
    mask, see `workers.megatron.masks`) instead of megatron's plain `causal`, which TE would apply in
    place of the padding, packing and prefix-sharing masks.
    """
    from megatron.core.models.gpt import gpt_layer_specs
    from megatron.core.transformer.enums import AttnMaskType

    if use_transformer_engine() if use_te is None else use_te:
        spec = gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(qk_layernorm=qk_layernorm)
    else:
        spec = gpt_layer_specs.get_gpt_layer_local_spec(normalization="RMSNorm", qk_layernorm=qk_layernorm)
    spec.submodules.self_attention.params["attn_mask_type"] = mask_type or AttnMaskType.arbitrary
    return spec


def decoder_spec(config: Any, use_te: bool | None = None, mask_type: Any = None):
    """The layer spec for `config`: `layer_spec` for dense models; for MoE models megatron's block spec
    (this stage's layers, dense or MoE per `moe_layer_freq`), each with the same attention mask type."""
    if not config.num_moe_experts and not config.multi_latent_attention:
        return layer_spec(use_te, mask_type, qk_layernorm=config.qk_layernorm)
    from megatron.core.models.gpt import gpt_layer_specs
    from megatron.core.transformer.enums import AttnMaskType

    te = use_transformer_engine() if use_te is None else use_te
    block = gpt_layer_specs.get_gpt_decoder_block_spec(config, use_transformer_engine=te, normalization="RMSNorm")
    for spec in block.layer_specs:
        spec.submodules.self_attention.params["attn_mask_type"] = mask_type or AttnMaskType.arbitrary
        if config.multi_latent_attention and not te:
            from workers.megatron.mla_attention import MLADotProductAttention

            spec.submodules.self_attention.submodules.core_attention = MLADotProductAttention
    return block


def default_token_dispatcher() -> str:
    """megatron's MoE token dispatcher for this machine: `alltoall` with CUDA; `allgather` on CPU, where
    megatron-core 0.16.1's all-to-all dispatcher cannot be built (it creates a `torch.cuda.Stream`)."""
    return "allgather" if cuda_absent() else "alltoall"


def moe_config_from_hf(hf_config: Any, use_te: bool | None = None) -> dict:
    """The TransformerConfig fields for the MoE part of a HF config ({} for dense families). Routing:
    softmax over all experts then top-k (`moe_router_pre_softmax`) without `norm_topk_prob`; top-k then
    softmax over the k (equal to renormalised top-k probabilities) with it. Training choices (load
    balancing, aux / z loss coefficients, dispatcher) are left to the caller's overrides."""
    fam = family_of(hf_config)
    if not fam.moe:
        return {}
    pattern = moe_layer_pattern(hf_config)
    te = use_transformer_engine() if use_te is None else use_te
    training = dict(moe_grouped_gemm=te, moe_token_dispatcher_type=default_token_dispatcher(),
                    moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0, moe_z_loss_coeff=None)
    if fam.mla:
        return {**deepseek_config.router_fields(hf_config, fam.name), **training}
    out: dict[str, Any] = dict(
        num_moe_experts=num_experts(hf_config),
        moe_router_topk=cfg_get(hf_config, "num_experts_per_tok"),
        moe_ffn_hidden_size=cfg_get(hf_config, "moe_intermediate_size"),
        moe_router_pre_softmax=not cfg_get(hf_config, "norm_topk_prob", False),
        moe_router_score_function="softmax",
        moe_layer_freq=[int(x) for x in pattern],
        moe_grouped_gemm=te,
        moe_token_dispatcher_type=default_token_dispatcher(),
        moe_router_load_balancing_type="none",
        moe_aux_loss_coeff=0.0,
        moe_z_loss_coeff=None,
    )
    if fam.shared_expert:
        out.update(moe_shared_expert_intermediate_size=cfg_get(hf_config, "shared_expert_intermediate_size"),
                   moe_shared_expert_gate=True)
    return out


def padded_vocab_size(vocab_size: int, tp: int, divisible_by: int = DEFAULT_VOCAB_DIVISOR) -> int:
    """Megatron's vocab padding: round up to a multiple of `divisible_by * tp`."""
    multiple = divisible_by * tp
    return int(math.ceil(vocab_size / multiple) * multiple)


def rope_settings(hf_config: Any) -> dict:
    """RoPE base and scaling from a HF config (transformers 5 `rope_parameters` or legacy fields).

    Returns {'theta', 'type', 'factor', 'low_freq_factor', 'high_freq_factor', 'original_max'}; raises
    ValueError for scaling types megatron's RotaryEmbedding cannot reproduce (MLA models: their rope is
    built inside the attention, `deepseek_config.rope_fields`).
    """
    from workers.megatron.hf_fields import rope_type as checked_rope_type

    params, _ = rope_parameters(hf_config)
    rope_type = checked_rope_type(hf_config, ("default", "linear", "llama3"))
    return {
        "theta": float(params.get("rope_theta", cfg_get(hf_config, "rope_theta", 10000.0))),
        "type": rope_type,
        "factor": float(params.get("factor", 1.0)),
        "low_freq_factor": float(params.get("low_freq_factor", 1.0)),
        "high_freq_factor": float(params.get("high_freq_factor", 4.0)),
        "original_max": int(params.get("original_max_position_embeddings", 8192)),
    }


def transformer_config_from_hf(
    hf_config: Any,
    tp: int = 1,
    pp: int = 1,
    dtype: torch.dtype = torch.float32,
    **overrides: Any,
):
    """A megatron `TransformerConfig` equivalent to the HF config (SwiGLU, RMSNorm, GQA, RoPE, no biases
    except Qwen2's qkv bias). `overrides` set further TransformerConfig fields (e.g. recompute)."""
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    fam = family_of(hf_config)
    heads = cfg_get(hf_config, "num_attention_heads")
    hidden = cfg_get(hf_config, "hidden_size")
    head_dim = cfg_get(hf_config, "head_dim") or hidden // heads
    kwargs = dict(
        num_layers=cfg_get(hf_config, "num_hidden_layers"),
        hidden_size=hidden,
        ffn_hidden_size=cfg_get(hf_config, "intermediate_size"),
        num_attention_heads=heads,
        num_query_groups=cfg_get(hf_config, "num_key_value_heads") or heads,
        kv_channels=head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=cfg_get(hf_config, "rms_norm_eps", 1e-6),
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=fam.qkv_bias and bool(cfg_get(hf_config, "qkv_bias", True)),
        qk_layernorm=fam.qk_norm,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
        attention_softmax_in_fp32=True,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        pipeline_dtype=dtype,
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        use_cpu_initialization=cuda_absent(),
    )
    kwargs.update(moe_config_from_hf(hf_config))
    if fam.mla:
        kwargs.update(deepseek_config.mla_fields(hf_config))
        kwargs.pop("kv_channels")
    kwargs.update(overrides)
    return (MLATransformerConfig if fam.mla else TransformerConfig)(**kwargs)


def _stage_flags(pre_process: bool | None, post_process: bool | None) -> tuple[bool, bool]:
    from megatron.core import parallel_state

    if pre_process is None:
        pre_process = parallel_state.is_pipeline_first_stage()
    if post_process is None:
        post_process = parallel_state.is_pipeline_last_stage()
    return pre_process, post_process


def build_gpt_model(
    hf_config: Any,
    dtype: torch.dtype = torch.float32,
    pre_process: bool | None = None,
    post_process: bool | None = None,
    value_head: bool = False,
    vocab_divisible_by: int = DEFAULT_VOCAB_DIVISOR,
    padded_vocab: int | None = None,
    use_te: bool | None = None,
    freeze_vision: bool = False,
    **config_overrides: Any,
):
    """Build the local (TP/PP-sharded) megatron `GPTModel` for the current rank from a HF config.

    Needs `init_distributed` first. The vocab is padded Megatron's way; embeddings are tied when the HF
    config ties them (never for a value head). With `value_head=True` the last stage's output layer is a
    `ValueHead` (hidden -> 1) and the forward returns values [b, s, 1] instead of logits.
    """
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel

    tp = parallel_state.get_tensor_model_parallel_world_size()
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    check_parallel_fit(hf_config, tp, pp, parallel_state.get_expert_model_parallel_world_size())
    pre_process, post_process = _stage_flags(pre_process, post_process)
    ep = parallel_state.get_expert_model_parallel_world_size()
    config = transformer_config_from_hf(hf_config, tp, pp, dtype, expert_model_parallel_size=ep, **config_overrides)
    rope = {"theta": 10000.0, "type": "default", "factor": 1.0} if config.multi_latent_attention \
        else rope_settings(hf_config)  # MLA builds its rope inside each attention layer
    vocab = cfg_get(hf_config, "vocab_size")
    if padded_vocab is None:
        padded_vocab = padded_vocab_size(vocab, tp, vocab_divisible_by)
    elif padded_vocab < vocab or padded_vocab % tp:
        raise ValueError(f"padded vocab {padded_vocab} must be >= vocab_size {vocab} and divisible by TP {tp}")
    tie = bool(cfg_get(hf_config, "tie_word_embeddings", False)) and not value_head
    spec = decoder_spec(config, use_te)
    if parallel_state.get_context_parallel_world_size() > 1:
        from workers.megatron.context_parallel import with_context_parallel_attention

        spec = with_context_parallel_attention(spec)
    fam = family_of(hf_config)
    vision: dict[str, Any] = {}
    if fam.vision:  # Qwen2-VL: M-RoPE positions, and the vision tower on the first stage
        from workers.vision.mcore_model import Qwen2VLGPTModel

        config.mrope_section = list(rope_parameters(hf_config)[0]["mrope_section"])
        vision = dict(vision_config=cfg_get(hf_config, "vision_config"),
                      image_token_id=cfg_get(hf_config, "image_token_id"), freeze_vision=freeze_vision)
    model = (Qwen2VLGPTModel if fam.vision else GPTModel)(  # type: ignore[possibly-undefined]
        config=config,
        transformer_layer_spec=spec,
        vocab_size=padded_vocab,
        max_sequence_length=cfg_get(hf_config, "max_position_embeddings"),
        pre_process=pre_process,
        post_process=post_process,
        share_embeddings_and_output_weights=tie,
        position_embedding_type="mrope" if fam.vision else "rope",
        rotary_base=rope["theta"],
        rope_scaling=rope["type"] == "llama3",
        rope_scaling_factor=rope["factor"],
        seq_len_interpolation_factor=rope["factor"] if rope["type"] == "linear" else None,
        **vision,
    )
    if rope["type"] == "llama3":
        emb = model.rotary_pos_emb
        base = 1.0 / (rope["theta"] ** (torch.arange(0, emb.inv_freq.numel() * 2, 2, dtype=torch.float32)
                                          / (emb.inv_freq.numel() * 2)))
        emb.inv_freq = emb._apply_scaling(
            base.to(emb.inv_freq.device), rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"],
            rope["original_max"],
        ).to(emb.inv_freq.dtype)
    if value_head and post_process:
        model.output_layer = ValueHead(config)
    for p in model.parameters():  # megatron's CPU norm fallback builds fp32 weights; its 16-bit optimizer (and
        if p.is_floating_point() and p.dtype != dtype:  # checkpoint) expects every weight in the model's dtype
            p.data = p.data.to(dtype)
    if not cuda_absent():  # megatron puts its parallel layers on the GPU, plain torch modules (norms) stay put
        model.to(torch.device("cuda", torch.cuda.current_device()))
    if value_head and post_process and tp > 1:  # one init for all TP ranks: the head is replicated
        torch.distributed.broadcast(
            model.output_layer.weight.data,
            src=parallel_state.get_tensor_model_parallel_src_rank(),
            group=parallel_state.get_tensor_model_parallel_group(),
        )
    return model


def check_parallel_fit(hf_config: Any, tp: int, pp: int, ep: int = 1) -> None:
    """Raise ValueError naming the field when heads, KV groups or FFN sizes do not divide by TP, layers by
    PP, or routed experts by EP."""
    fam = family_of(hf_config)
    if fam.moe:
        experts = num_experts(hf_config)
        if experts % ep:
            raise ValueError(f"num_experts={experts} is not divisible by expert parallel size {ep}")
        for field in ("moe_intermediate_size", "shared_expert_intermediate_size"):
            size = cfg_get(hf_config, field)
            if isinstance(size, int) and size % tp:
                raise ValueError(f"{field}={size} is not divisible by tensor parallel size {tp}")
    elif ep > 1:
        raise ValueError(f"expert parallel size {ep} needs an MoE model; model_type {fam.name!r} has no experts")
    if fam.mla:
        _check_mla_fit(hf_config, tp)
    heads = cfg_get(hf_config, "num_attention_heads")
    groups = cfg_get(hf_config, "num_key_value_heads") or heads
    layers = cfg_get(hf_config, "num_hidden_layers")
    ffn = cfg_get(hf_config, "intermediate_size")
    if heads % tp:
        raise ValueError(f"num_attention_heads={heads} is not divisible by tensor parallel size {tp}")
    if groups % tp:
        raise ValueError(f"num_key_value_heads={groups} is not divisible by tensor parallel size {tp}")
    if ffn % tp:
        raise ValueError(f"intermediate_size={ffn} is not divisible by tensor parallel size {tp}")
    if layers % pp:
        raise ValueError(f"num_hidden_layers={layers} is not divisible by pipeline parallel size {pp}")


def _check_mla_fit(hf_config: Any, tp: int) -> None:
    """MLA's column-parallel down projections split their outputs over TP (gathered before the layer norms)."""
    d = deepseek_config.mla_dims(hf_config)
    if d["q_lora"] % tp:
        raise ValueError(f"q_lora_rank={d['q_lora']} is not divisible by tensor parallel size {tp}")
    if (d["kv_lora"] + d["rope"]) % tp:
        raise ValueError(f"kv_lora_rank + qk_rope_head_dim = {d['kv_lora']} + {d['rope']} = "
                         f"{d['kv_lora'] + d['rope']} is not divisible by tensor parallel size {tp}")


def position_ids_for(input_ids: torch.Tensor) -> torch.Tensor:
    """Positions 0..S-1 broadcast to the batch, [b, s]."""
    b, s = input_ids.shape
    return torch.arange(s, device=input_ids.device).unsqueeze(0).expand(b, s)


def forward_logits(model, input_ids: torch.Tensor, gather_tp: bool = True,
                   inputs: dict[str, torch.Tensor] | None = None) -> torch.Tensor | None:
    """Forward-only pass of one batch through the (possibly pipelined) model with the explicit causal
    mask; collective over the model-parallel group. `inputs`: further model inputs (a vision-language
    model's `pixel_values` and `image_grid_thw`, workers/vision/inputs.py).

    Returns on the last PP stage the logits [b, s, padded_vocab] (gathered over TP when `gather_tp`, or
    values [b, s, 1] for a value model), None on other stages.
    """
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    device = next(model.parameters()).device  # inputs may come from anywhere: the model's device is the one
    input_ids = input_ids.to(device)
    inputs = {k: v.to(device) for k, v in (inputs or {}).items()}
    b, s = input_ids.shape
    mask = causal_mask(s, device=device)[None, None]
    follow_mask(model, mask)

    def step(data_iter, mdl):
        ids = next(data_iter)
        out = mdl(input_ids=ids, position_ids=position_ids_for(ids), attention_mask=mask, **inputs)
        return out, None

    model.eval()
    with torch.no_grad():
        out = get_forward_backward_func()(
            forward_step_func=step,
            data_iterator=iter([input_ids]),
            model=[model],
            num_microbatches=1,
            seq_length=s,
            micro_batch_size=b,
            forward_only=True,
        )
    if not parallel_state.is_pipeline_last_stage():
        return None
    logits = out[0]
    if gather_tp and logits.shape[-1] > 1 and parallel_state.get_tensor_model_parallel_world_size() > 1:
        logits = gather_from_tensor_model_parallel_region(logits)
    return logits
