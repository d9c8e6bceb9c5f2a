"""The tiny Qwen2-VL preset: a text model of `TinyPreset`'s shape, a small vision tower, and a processor.

The tokenizer is `build_tokenizer`'s plus Qwen2-VL's vision tokens; the chat template is the text one,
where a message's content may also be a list of `{"type": "image"}` / `{"type": "text", "text": ...}`
parts, an image rendering as `<|vision_start|><|image_pad|><|vision_end|>` (the processor then repeats
`<|image_pad|>` once per merged patch). Images are resized to at most `MAX_PIXELS` (112 x 112: 8 x 8
patches of 14, merged 2 x 2 into 16 image tokens).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
IMAGE_PLACEHOLDER = "<|vision_start|><|image_pad|><|vision_end|>"
PATCH_SIZE = 14
MERGE_SIZE = 2
MIN_PIXELS = 56 * 56
MAX_PIXELS = 112 * 112

_CONTENT = (
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}{{ '" + IMAGE_PLACEHOLDER + "' }}"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
)

VL_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['role'] == 'assistant' %}"
    "{% generation %}" + _CONTENT + "{{ '<|im_end|>' }}{% endgeneration %}"
    "{% else %}" + _CONTENT + "{{ '<|im_end|>' }}{% endif %}"
    "{{ '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def vl_config(preset: Any, tokenizer: Any) -> Any:
    """The Qwen2VLConfig of a `qwen2_vl` preset; `preset.extra["vision"]` holds the vision tower's fields."""
    from transformers import Qwen2VLConfig

    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in VISION_TOKENS}
    extra = dict(preset.extra)
    vision = extra.pop("vision")
    text = dict(
        vocab_size=preset.vocab_size, hidden_size=preset.hidden_size, intermediate_size=preset.intermediate_size,
        num_hidden_layers=preset.num_layers, num_attention_heads=preset.num_heads,
        num_key_value_heads=preset.num_kv_heads, max_position_embeddings=preset.max_position_embeddings,
        rms_norm_eps=1e-6, tie_word_embeddings=preset.tie_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": preset.rope_theta,
                         "mrope_section": extra.pop("mrope_section")},
        bos_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, **extra,
    )
    return Qwen2VLConfig(
        text_config=text,
        vision_config=dict(hidden_size=preset.hidden_size, patch_size=PATCH_SIZE, spatial_merge_size=MERGE_SIZE,
                           temporal_patch_size=2, in_channels=3, **vision),
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=preset.tie_embeddings,
    )


def add_vision_tokens(tokenizer: Any) -> Any:
    tokenizer.add_special_tokens({"additional_special_tokens": VISION_TOKENS})
    tokenizer.chat_template = VL_CHAT_TEMPLATE
    return tokenizer


def save_processor(tokenizer: Any, out: Path) -> None:
    """Write the image processor's preprocessor_config.json beside the tokenizer (AutoProcessor reads both)."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    Qwen2VLImageProcessorPil(min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS, patch_size=PATCH_SIZE,
                             merge_size=MERGE_SIZE, temporal_patch_size=2).save_pretrained(out)
    tokenizer.save_pretrained(out)
