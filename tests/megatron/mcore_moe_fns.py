"""Rank functions for the MoE conversion tests (module level so spawned ranks can import them)."""

from __future__ import annotations

import torch


def routing_agreement(hf_dir: str, ids: torch.Tensor) -> dict:
    """Top-k expert sets chosen by megatron's routers vs transformers' on the same tokens (fp32), per MoE
    layer, and the smallest gap between the k-th and (k+1)-th router probability (how far from a tie).

    Returns {"layers": n MoE layers on this stage, "differ": routing decisions that differ, "decisions":
    decisions compared, "min_gap": smallest margin} (empty on stages without MoE layers)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from workers.megatron.hf_weights import load_hf_weights
    from workers.megatron.model_provider import build_gpt_model, forward_logits

    cfg = AutoConfig.from_pretrained(hf_dir)
    model = build_gpt_model(cfg)
    load_hf_weights(model, hf_dir, cfg)
    maps: dict[int, torch.Tensor] = {}

    def hook(layer_idx: int):
        def fn(_module, _inputs, output):
            maps[layer_idx] = output[1].detach().cpu()  # routing_map [s*b, E], tokens s-major
        return fn

    for layer in model.decoder.layers:
        router = getattr(layer.mlp, "router", None)
        if router is not None:
            router.register_forward_hook(hook(layer.layer_number - 1))
    forward_logits(model, ids)
    hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        out = hf(input_ids=ids, output_router_logits=True)
    sparse = [i for i in range(cfg.num_hidden_layers) if i in maps]
    b, s = ids.shape
    k = cfg.num_experts_per_tok
    differ = decisions = 0
    min_gap = float("inf")
    hf_router = dict(zip(_sparse_layers(cfg), out.router_logits))
    for i in sparse:
        probs = torch.softmax(hf_router[i].float(), dim=-1).reshape(b * s, -1)
        top = torch.topk(probs, k + 1, dim=-1).values
        min_gap = min(min_gap, (top[:, k - 1] - top[:, k]).min().item())
        hf_map = torch.zeros_like(probs, dtype=torch.bool).scatter_(1, torch.topk(probs, k, dim=-1).indices, True)
        mc = maps[i].reshape(s, b, -1).transpose(0, 1).reshape(b * s, -1)
        differ += int((mc != hf_map).any(dim=-1).sum())
        decisions += b * s
    return {"layers": len(sparse), "differ": differ, "decisions": decisions, "min_gap": min_gap}


def _sparse_layers(cfg) -> list[int]:
    from workers.megatron.hf_map import moe_layer_pattern

    return [i for i, sparse in enumerate(moe_layer_pattern(cfg)) if sparse]


def explicit_positions_parity(hf_dirs: list[str]) -> dict[str, float]:
    """Per HF folder: megatron logits at explicit, non-contiguous position ids (a row whose second part
    restarts at position 2, as prefix sharing lays out responses) vs transformers' at the same ids; also
    transformers' logits there."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from workers.megatron import rope_positions
    from workers.megatron.hf_weights import load_hf_weights
    from workers.megatron.model_provider import build_gpt_model, forward_logits

    ids = torch.randint(3, 500, (2, 12), generator=torch.Generator().manual_seed(3))
    pos = torch.tensor([list(range(6)) + list(range(2, 8)), list(range(12))])
    out = {}
    for hf_dir in hf_dirs:
        cfg = AutoConfig.from_pretrained(hf_dir)
        model = build_gpt_model(cfg)
        load_hf_weights(model, hf_dir, cfg)
        assert rope_positions.install(model)
        with rope_positions.explicit_positions(pos):
            got = forward_logits(model, ids)[..., : cfg.vocab_size].float().cpu()
        hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32, attn_implementation="eager").eval()
        with torch.no_grad():
            ref = hf(input_ids=ids, position_ids=pos).logits
            plain = hf(input_ids=ids).logits
        out[hf_dir] = {"diff": (got - ref).abs().max().item(), "moved": (ref - plain).abs().max().item(),
                       "logits": ref}
    return out
