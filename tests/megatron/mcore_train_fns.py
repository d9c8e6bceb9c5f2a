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
    """Train a 2-layer local-spec GPTModel on a fixed batch; return the loss per step (TP-aware)."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from workers.megatron.cpu_compat import causal_mask

    tp = parallel_state.get_tensor_model_parallel_world_size()
    torch.manual_seed(seed)
    model = GPTModel(
        config=tiny_gpt_config(tp), transformer_layer_spec=get_gpt_layer_local_spec(normalization="RMSNorm"),
        vocab_size=256, max_sequence_length=64, position_embedding_type="rope",
    )
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(123)
    ids = torch.randint(0, 256, (4, 33), generator=g)
    inputs, labels = ids[:, :-1], ids[:, 1:]
    pos = torch.arange(32).unsqueeze(0).expand(4, 32)
    mask = causal_mask(32)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = model(inputs, pos, mask, labels=labels).mean()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def check_cpu_compat() -> dict:
    """Exercise the compat layer in a fresh process: device rewriting, type names, threads, idempotence."""
    import threading

    from workers.megatron import cpu_compat

    out: dict = {}
    cpu_compat.apply_cpu_compat()
    cpu_compat.apply_cpu_compat()  # idempotent
    from torch.overrides import _get_current_function_mode_stack

    out["modes_main"] = sum(isinstance(m, cpu_compat.CpuDeviceMode) for m in _get_current_function_mode_stack())
    t = torch.zeros(3, device="cuda")
    out["device"] = str(t.device)
    out["cuda_noop"] = t.cuda() is t
    out["type"] = t.type()
    out["to_cuda"] = str(t.to("cuda").device)
    out["pinned"] = str(torch.empty(2, pin_memory=True).device)
    out["current_device"] = str(torch.cuda.current_device())
    torch.cuda.synchronize()
    out["mask"] = cpu_compat.causal_mask(3).tolist()

    @cpu_compat.on_cpu_device
    def in_thread(res: dict) -> None:
        res["thread_device"] = str(torch.ones(1, device="cuda").device)
        cpu_compat.ensure_cpu_device_mode()
        res["thread_modes"] = sum(
            isinstance(m, cpu_compat.CpuDeviceMode) for m in _get_current_function_mode_stack()
        )

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
