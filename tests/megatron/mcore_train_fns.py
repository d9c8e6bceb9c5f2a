"""Rank functions for the CPU training tests (module level so spawned ranks can import them)."""

from __future__ import annotations

import torch


def tiny_gpt_config(tp: int = 1, pp: int = 1):
    """A 2-layer GPT TransformerConfig for the local spec (RMSNorm, SwiGLU, GQA)."""
    import torch.nn.functional as F
    from megatron.core.transformer import TransformerConfig

    return TransformerConfig(
        num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4, num_query_groups=2,
        normalization="RMSNorm", gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
        hidden_dropout=0.0, attention_dropout=0.0, bias_dropout_fusion=False, masked_softmax_fusion=False,
        apply_rope_fusion=False, gradient_accumulation_fusion=False, tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp, pipeline_dtype=torch.float32, use_cpu_initialization=True,
    )


def train_tiny_gpt(steps: int = 8, seed: int = 0) -> list[float]:
    """Train a 2-layer local-spec GPTModel (our layer spec: attention mask type `arbitrary`, the mask passed
    explicitly) on a fixed batch; return the loss per step (TP-aware)."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer.attention import Attention
    from megatron.core.transformer.enums import AttnMaskType

    from workers.megatron.masks import causal_mask, follow_mask
    from workers.megatron.model_provider import layer_spec

    tp = parallel_state.get_tensor_model_parallel_world_size()
    torch.manual_seed(seed)
    model = GPTModel(
        config=tiny_gpt_config(tp), transformer_layer_spec=layer_spec(use_te=False),
        vocab_size=256, max_sequence_length=64, position_embedding_type="rope",
    )

    def mask_types() -> set:
        return {m.attn_mask_type for m in model.modules() if isinstance(m, Attention)}

    assert mask_types() == {AttnMaskType.arbitrary}
    follow_mask(model, None)
    assert mask_types() == {AttnMaskType.causal}
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(123)
    ids = torch.randint(0, 256, (4, 33), generator=g)
    inputs, labels = ids[:, :-1], ids[:, 1:]
    pos = torch.arange(32).unsqueeze(0).expand(4, 32)
    mask = causal_mask(32)[None, None]
    follow_mask(model, mask)
    assert mask_types() == {AttnMaskType.arbitrary}
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = model(inputs, pos, mask, labels=labels).mean()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def check_cpu_compat() -> dict:
    """Exercise the compat layer in a spawned rank: device rewriting, type names, scope, idempotence."""
    import threading

    from torch.overrides import _get_current_function_mode_stack

    from workers.megatron import cpu_compat

    def modes() -> int:
        return sum(isinstance(m, cpu_compat.CpuDeviceMode) for m in _get_current_function_mode_stack())

    out: dict = {"applied": cpu_compat.apply_cpu_compat()}  # again (init_distributed applied it): no-op
    with cpu_compat.cpu_device_mode():  # nested in the rank's mode: not entered twice
        out["modes_main"] = modes()
    t = torch.zeros(3, device="cuda")
    out["device"] = str(t.device)
    out["cuda_noop"] = t.cuda() is t
    out["type"] = t.type()
    out["to_cuda"] = str(t.to("cuda").device)
    out["pinned"] = str(torch.empty(2, pin_memory=True).device)
    out["current_device"] = str(torch.cuda.current_device())
    torch.cuda.synchronize()

    def in_thread(res: dict) -> None:  # a new thread starts outside the mode; the block scopes it
        res["thread_modes_before"] = modes()
        with cpu_compat.cpu_device_mode():
            res["thread_device"] = str(torch.ones(1, device="cuda").device)
            res["thread_modes"] = modes()
        res["thread_modes_after"] = modes()

    res: dict = {}
    th = threading.Thread(target=in_thread, args=(res,))
    th.start()
    th.join()
    out.update(res)
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    tracker = get_cuda_rng_tracker()
    before = torch.get_rng_state()
    with tracker.fork():
        a = torch.rand(2)
    with tracker.fork():
        b = torch.rand(2)
    out["fork_advances"] = not torch.equal(a, b)
    out["fork_restores"] = torch.equal(before, torch.get_rng_state())
    return out


def compat_then_train() -> tuple[dict, list[float]]:
    """`check_cpu_compat` then `train_tiny_gpt` in the same (single-rank) world, to spare a process."""
    return check_cpu_compat(), train_tiny_gpt()


def masked_vs_alone_logits(hf_dir: str) -> dict:
    """Largest |logit difference| between samples run alone and the same samples in a packed row
    (block-causal mask) or a left-padded batch (padding mask), through `build_gpt_model` (the TE spec on
    GPU with TE); `*_causal_type`: the same with the layers forced to the `causal` mask type."""
    from transformers import AutoConfig

    from workers.megatron.hf_weights import load_hf_weights
    from workers.megatron.masks import causal_mask, follow_mask
    from workers.megatron.model_provider import build_gpt_model, use_transformer_engine
    from workers.roles.lm import lm_attention_mask
    from workers.roles.micro import attention_mask_4d, position_ids

    cfg = AutoConfig.from_pretrained(hf_dir)
    model = build_gpt_model(cfg).eval()
    load_hf_weights(model, hf_dir, cfg)
    dev = next(model.parameters()).device
    g = torch.Generator().manual_seed(0)
    a, b = torch.randint(3, 400, (7,), generator=g), torch.randint(3, 400, (5,), generator=g)

    def run(ids: torch.Tensor, pos: torch.Tensor, mask: torch.Tensor, mask_type_of: torch.Tensor | None) -> torch.Tensor:
        follow_mask(model, mask_type_of)
        with torch.no_grad():
            out = model(input_ids=ids.to(dev), position_ids=pos.to(dev), attention_mask=mask.to(dev))
        return out.float().cpu()

    def alone(x: torch.Tensor) -> torch.Tensor:
        n = x.numel()
        return run(x[None], torch.arange(n)[None], causal_mask(n)[None, None], causal_mask(n))[0]

    ref_a, ref_b = alone(a), alone(b)
    pos = torch.cat([torch.arange(7), torch.arange(5)])[None]
    attn = torch.tensor([[0, 0] + [1] * 5, [1] * 7])
    padded_ids = torch.stack([torch.cat([torch.zeros(2, dtype=torch.long), b]), a])
    out: dict = {"te": use_transformer_engine()}
    for suffix, forced in (("", False), ("_causal_type", True)):
        mask = lm_attention_mask(pos)
        packed = run(torch.cat([a, b])[None], pos, mask, None if forced else mask)[0]
        out["packed" + suffix] = max(float((packed[:7] - ref_a).abs().max()), float((packed[7:] - ref_b).abs().max()))
        mask = attention_mask_4d(attn)
        padded = run(padded_ids, position_ids(attn), mask, None if forced else mask)
        out["padded" + suffix] = max(float((padded[0, 2:] - ref_b).abs().max()), float((padded[1] - ref_a).abs().max()))
    return out


def bf16_checkpoint_round_trip(model_dir: str, ckpt: str) -> dict:
    """A bf16 MegatronEngine (fp32 master weights) saves with its optimizer and a fresh one loads it: every
    weight's dtype, and the largest difference between the saved and the loaded weights and master copies."""
    import torch

    from workers.megatron.engine import MegatronEngine

    def engine() -> MegatronEngine:
        return MegatronEngine(model_dir, dtype="bfloat16", trainable=True, load_weights=False, optim={"lr": 1e-3})

    def masters(eng: MegatronEngine) -> list[torch.Tensor]:
        return [q.detach().clone() for g in eng.optimizer.param_groups for q in g["params"]]

    a = engine()
    a.optimizer_step()  # Adam creates its state
    with torch.no_grad():
        for p in a.module.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())).to(p.dtype))
    a.optimizer.reload_model_params()  # the fp32 master copies follow the weights
    a.save_checkpoint(ckpt)
    import multiprocessing

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    results_queue = type(filesystem_async._results_queue)
    left = [p.name for p in multiprocessing.active_children()]  # the save's writers are gone, no manager runs
    b = engine()
    b.load_checkpoint(ckpt)
    pa, pb = dict(a.module.named_parameters()), dict(b.module.named_parameters())
    return {"results_queue": f"{results_queue.__module__}.{results_queue.__name__}", "children": left,
            "dtypes": sorted({str(p.dtype) for p in pb.values()}),
            "weight_diff": max((pa[k].float() - pb[k].float()).abs().max().item() for k in pa),
            "master_diff": max((x - y).abs().max().item() for x, y in zip(masters(a), masters(b), strict=True))}


def never_stepped_checkpoint_round_trip(model_dir: str, ckpt: str) -> dict:
    """An engine that has not stepped yet (as after fp16 overflows skipped every step) saves with its
    optimizer; a fresh engine loads it with the optimizer, and one optimizer step on each (the same
    gradients) gives the same weights. Returns the largest weight difference and the loaded step count."""
    import torch

    from workers.megatron.engine import MegatronEngine

    def engine() -> MegatronEngine:
        return MegatronEngine(model_dir, trainable=True, load_weights=False, optim={"lr": 1e-2})

    def step(eng: MegatronEngine) -> dict[str, torch.Tensor]:
        for name, p in eng.module.named_parameters():
            p.main_grad.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))))
        eng.optimizer_step()
        return {k: v.detach().clone() for k, v in eng.module.named_parameters()}

    a = engine()
    a.save_checkpoint(ckpt)
    b = engine()
    b.load_checkpoint(ckpt)
    loaded_steps = b.steps
    wa, wb = step(a), step(b)
    return {"steps": loaded_steps, "weight_diff": max((wa[k] - wb[k]).abs().max().item() for k in wa),
            "moved": max((wa[k] - v).abs().max().item() for k, v in engine().module.named_parameters())}


def launch_probe(name: str) -> dict:
    """What a launched rank sees: its parent (the fork server), the variable `name` of its environment, and
    whether the preload module is in memory (only the fork server imports it)."""
    import os
    import sys

    return {"ppid": os.getppid(), "value": os.environ.get(name),
            "preloaded": "workers.megatron.rank_preload" in sys.modules,
            "rank": __import__("torch").distributed.get_rank()}


def launch_fails(message: str) -> None:
    raise ValueError(message)
