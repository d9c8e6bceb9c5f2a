"""Rank function of bench/memory.py (module level so spawned ranks can import it)."""

from __future__ import annotations


def saved_activation_bytes(model_dir: str, dtype: str, seq: int, mbs: int, recompute: str = "none",
                           sequence_parallel: bool = False) -> dict:
    """Build the engine's model (with these memory levers), run one forward with labels (megatron's cross
    entropy) and count the bytes autograd saves for backward on this rank (unique storages that are not
    parameters; what a recomputed block saves is its checkpoint's inputs), then the backward, counting what
    the recomputed blocks save during it (0 without full recompute). With context parallelism (a CP group
    from `run_distributed(cp=)`) the rank runs its own columns, as the engine splits them, with their labels."""
    import torch

    from workers.megatron import rope_positions
    from workers.megatron.engine import MegatronEngine
    from workers.megatron.masks import causal_mask

    eng = MegatronEngine(model_dir, dtype=dtype, trainable=True, load_weights=False, optim={"lr": 1e-3},
                         recompute=recompute, sequence_parallel=sequence_parallel)
    model = eng.module
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor):
        st = t.untyped_storage()
        if st.data_ptr() not in params:
            saved[st.data_ptr()] = st.nbytes()
        return t

    ids = torch.randint(0, 500, (mbs, seq + 1), generator=torch.Generator().manual_seed(0))
    inputs, labels = ids[:, :-1], ids[:, 1:]
    pos = torch.arange(seq).unsqueeze(0).expand(mbs, seq)
    mask = causal_mask(seq)[None, None]
    explicit = None
    if eng.cp > 1:  # this rank's columns (engine._cp_local), RoPE at their positions
        inputs, pos, mask, local = eng._cp_local(inputs, pos, mask, {"labels": labels})
        labels, explicit = local["labels"], pos
    model.train()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), rope_positions.explicit_positions(explicit):
        loss = model(input_ids=inputs, position_ids=pos, attention_mask=mask, labels=labels).mean()
    forward = sum(saved.values())
    saved.clear()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):  # what recompute saves again in backward
        loss.backward()
    return {"saved_bytes": forward, "recomputed_bytes": sum(saved.values())}


def trainer_memory(model_dir: str, lora: dict | None, seq: int = 128, mbs: int = 2) -> dict:
    """One training step of the engine's model (fp32, Adam) with or without LoRA adapters: its parameter,
    trainable-parameter, gradient-buffer and optimizer-state bytes, and this rank's peak RSS (a fresh process)."""
    import resource

    import torch

    from workers.megatron.engine import MegatronEngine, _inner_optimizers
    from workers.megatron.masks import causal_mask
    from workers.megatron.micro_batch import Micro

    eng = MegatronEngine(model_dir, trainable=True, optim={"lr": 1e-4}, lora=lora)
    ids = torch.randint(0, 500, (mbs, seq + 1), generator=torch.Generator().manual_seed(0))
    pos = torch.arange(seq).unsqueeze(0).expand(mbs, seq)
    micro = Micro(ids[:, :-1], pos, causal_mask(seq)[None, None], {"labels": ids[:, 1:]})

    def loss_fn(mb, logits):
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), mb.fields["labels"].flatten())
        return loss, None

    eng.zero_grad()
    eng.forward_backward([micro], loss_fn, forward_only=False)
    eng.optimizer_step()
    params = list(eng.module.parameters())
    inner = _inner_optimizers(eng.optimizer)
    state = sum(t.numel() * t.element_size() for o in inner for s in o.state.values() for t in s.values()
                if isinstance(t, torch.Tensor))
    grads = sum(b.grad_data.numel() * b.grad_data.element_size() for c in eng.chunks for b in c.buffers)
    return {"params": sum(p.numel() for p in params), "param_bytes": sum(p.numel() * p.element_size() for p in params),
            "trainable": sum(p.numel() for p in params if p.requires_grad), "grad_bytes": grads,
            "optimizer_bytes": state, "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
