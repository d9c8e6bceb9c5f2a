"""Rank function of bench/memory.py (module level so spawned ranks can import it)."""

from __future__ import annotations


def saved_activation_bytes(model_dir: str, dtype: str, seq: int, mbs: int) -> dict:
    """Build the engine's model, run one forward with labels (megatron's cross entropy) and count the bytes
    autograd saves for backward (unique storages that are not parameters), then the backward."""
    import torch

    from workers.megatron.engine import MegatronEngine
    from workers.megatron.masks import causal_mask

    eng = MegatronEngine(model_dir, dtype=dtype, trainable=True, load_weights=False, optim={"lr": 1e-3})
    model = eng.module
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor):
        st = t.untyped_storage()
        if st.data_ptr() not in params:
            saved[st.data_ptr()] = st.nbytes()
        return t

    ids = torch.randint(0, 500, (mbs, seq + 1), generator=torch.Generator().manual_seed(0))
    pos = torch.arange(seq).unsqueeze(0).expand(mbs, seq)
    mask = causal_mask(seq)[None, None]
    model.train()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(input_ids=ids[:, :-1], position_ids=pos, attention_mask=mask, labels=ids[:, 1:]).mean()
    loss.backward()
    return {"saved_bytes": sum(saved.values())}
