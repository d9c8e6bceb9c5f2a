"""The warm start of a vision-language policy: `hf_sft.py`'s plain-PyTorch SFT loop for Qwen2-VL, whose
samples also carry images (the processor expands each image's token and computes its patches).

Records are RL prompt records with `images` (rlhf.data.prompts: read from WebDataset shards): the prompt
messages, the ground truth as the answer. The loss is on the answer and the end-of-turn token only.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import torch

from rlhf.driver.warmstart.hf_sft import warm_start_optimizer, warm_start_update
from workers.vision.images import prompt_images


def _encode(proc: Any, rec: dict[str, Any], with_answer: bool = True) -> dict[str, torch.Tensor]:
    images = prompt_images(rec.get("images") or [], 0)
    prompt = proc.apply_chat_template(rec["messages"], add_generation_prompt=True, tokenize=False)
    answer = f"{rec['ground_truth']}<|im_end|>" if with_answer else ""
    enc = proc(text=[prompt + answer], images=images or None, return_tensors="pt")
    n_prompt = proc(text=[prompt], images=images or None, return_tensors="pt")["input_ids"].shape[1]
    ids = enc["input_ids"][0]
    target = torch.zeros(ids.shape[0])
    target[n_prompt:] = 1.0
    out = {"input_ids": ids, "target": target, "mm_token_type_ids": enc["mm_token_type_ids"][0]}
    if images:
        out.update(pixel_values=enc["pixel_values"], image_grid_thw=enc["image_grid_thw"])
    return out


def _collate(items: list[dict[str, torch.Tensor]], pad: int, left: bool = False) -> dict[str, torch.Tensor]:
    width = max(x["input_ids"].shape[0] for x in items)
    ids = torch.full((len(items), width), pad, dtype=torch.long)
    attn = torch.zeros_like(ids)
    target = torch.zeros((len(items), width))
    types = torch.zeros_like(ids)  # which tokens are image tokens: transformers' M-RoPE needs it
    for i, x in enumerate(items):
        n = x["input_ids"].shape[0]
        cols = slice(width - n, width) if left else slice(0, n)
        ids[i, cols], attn[i, cols], target[i, cols] = x["input_ids"], 1, x["target"]
        types[i, cols] = x["mm_token_type_ids"]
    batch = {"input_ids": ids, "attention_mask": attn, "target": target, "mm_token_type_ids": types}
    with_images = [x for x in items if "pixel_values" in x]
    if with_images:
        batch["pixel_values"] = torch.cat([x["pixel_values"] for x in with_images])
        batch["image_grid_thw"] = torch.cat([x["image_grid_thw"] for x in with_images])
    return batch


def vl_sft_warm_start(model_dir: str | Path, records: list[dict[str, Any]], out_dir: str | Path, steps: int = 300,
                      batch_size: int = 32, lr: float = 1e-3, seed: int = 0) -> Path:
    """Fine-tune the Qwen2-VL folder `model_dir` for `steps` AdamW steps on `records`; save to `out_dir`."""
    from transformers import Qwen2VLForConditionalGeneration

    from workers.vision.hf_compat import load_processor

    torch.manual_seed(seed)
    rng = random.Random(seed)
    proc = load_processor(str(model_dir))
    model = Qwen2VLForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32).train()
    encoded: dict[int, dict[str, torch.Tensor]] = {}
    opt, sched = warm_start_optimizer(model, lr, steps)
    for _ in range(steps):
        keys = [rng.randrange(len(records)) for _ in range(batch_size)]
        for k in keys:
            if k not in encoded:
                encoded[k] = _encode(proc, records[k])
        b = _collate([encoded[k] for k in keys], proc.tokenizer.pad_token_id)
        target = b.pop("target")
        warm_start_update(model, opt, sched, [(b, target)])
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    proc.tokenizer.save_pretrained(out)
    proc.image_processor.save_pretrained(out)
    return out
