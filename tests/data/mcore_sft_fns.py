"""Rank function for the megatron SFT packing test (module level so the spawned rank can import it)."""

from __future__ import annotations

import torch


def packed_and_unpacked_losses(
    model_dir: str, batch: dict, samples: list[dict]
) -> tuple[list[float], list[float]]:
    """Per-segment masked loss sums of a packed batch and of each sample alone, through megatron's GPTModel
    (local spec) loaded with the HF weights of `model_dir`."""
    from transformers import AutoConfig

    from workers.megatron.hf_weights import load_hf_weights
    from workers.megatron.masks import causal_mask
    from workers.megatron.model_provider import build_gpt_model

    cfg = AutoConfig.from_pretrained(model_dir)
    model = build_gpt_model(cfg, dtype=torch.float32).eval()
    load_hf_weights(model, model_dir, cfg)
    with torch.no_grad():
        tok_loss = model(
            batch["tokens"], batch["position_ids"], batch["attention_mask"], labels=batch["labels"]
        )
        tok_loss = (tok_loss * batch["loss_mask"]).flatten()
        cu = batch["cu_seqlens"].tolist()
        packed = [float(tok_loss[a:b].sum()) for a, b in zip(cu[:-1], cu[1:])]
        alone = []
        for s in samples:
            n = s["tokens"].numel()
            loss = model(s["tokens"][None], s["position_ids"][None], causal_mask(n)[None, None], labels=s["labels"][None])
            alone.append(float((loss[0] * s["loss_mask"]).sum()))
    return packed, alone
