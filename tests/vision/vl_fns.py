"""Rank functions for the Qwen2-VL Megatron tests (module level so spawned ranks can import them)."""

from __future__ import annotations

import torch


def vl_batch(hf_dir: str, n: int = 3, seed: int = 5):
    """Rows of image + question (right-padded) and one text-only row: HF processor inputs and our per-row
    image layout."""
    from rlhf.data.shapes import make_items, messages
    from workers.vision.hf_compat import load_processor
    from workers.vision.inputs import split_rows

    proc = load_processor(hf_dir)
    proc.tokenizer.padding_side = "right"
    items = make_items(n, seed=seed)
    texts = [proc.apply_chat_template(messages(it), tokenize=False) for it in items]
    texts.append(proc.apply_chat_template([{"role": "user", "content": "no image here"}], tokenize=False))
    enc = proc(text=texts, images=[it.image for it in items], return_tensors="pt", padding=True)
    px, grid = split_rows(enc["pixel_values"], enc["image_grid_thw"], [1] * n + [0])
    return enc, {"pixel_values": px, "image_grid_thw": grid}


def hf_logits(hf_dir: str, enc) -> torch.Tensor:
    from transformers import Qwen2VLForConditionalGeneration

    model = Qwen2VLForConditionalGeneration.from_pretrained(hf_dir, dtype=torch.float32,
                                                            attn_implementation="eager").eval()
    with torch.no_grad():
        return model(**enc).logits


def vl_parity(hf_dir: str) -> dict:
    """Load the HF weights into this world's (TP) megatron Qwen2-VL, compare logits on image batches with
    transformers' on the valid tokens, and check the export gives back every source tensor bit-exactly."""
    from megatron.core import parallel_state
    from safetensors.torch import load_file
    from transformers import AutoConfig

    from workers.megatron.hf_fields import language_view
    from workers.megatron.hf_weights import iter_hf_weights, load_hf_weights
    from workers.megatron.model_provider import build_gpt_model, forward_logits

    cfg = language_view(AutoConfig.from_pretrained(hf_dir))
    model = build_gpt_model(cfg)
    res: dict = {"tp_rank": parallel_state.get_tensor_model_parallel_rank(),
                 "filled": len(load_hf_weights(model, hf_dir, cfg)), "n_params": len(list(model.parameters()))}
    enc, inputs = vl_batch(hf_dir)
    logits = forward_logits(model, enc["input_ids"], inputs=inputs)
    # Without the pixels the image rows must change (the features reach the language model).
    blind = forward_logits(model, enc["input_ids"], inputs={"image_grid_thw": inputs["image_grid_thw"]})
    if logits is not None:
        ref = hf_logits(hf_dir, enc)
        valid = enc["attention_mask"].bool()
        res["max_abs_diff"] = (logits[..., : cfg["vocab_size"]] - ref)[valid].abs().max().item()
        res["blind_diff"] = (blind - logits)[valid].abs().max().item()
    source = load_file(f"{hf_dir}/model.safetensors")
    names, mismatched = [], []
    for name, tensor in iter_hf_weights(model, cfg):
        names.append(name)
        if not (tensor.dtype == source[name].dtype and torch.equal(tensor, source[name])):
            mismatched.append(name)
    res["exported"] = sorted(names)
    res["mismatched"] = mismatched
    res["source"] = sorted(source)
    return res
