"""Rank function for the exact-bytes test (module level so spawned ranks can import it)."""

from __future__ import annotations


def engine_state_bytes(model_dirs: list[str], dist_opt: bool) -> list[dict]:
    """Build a trainable bf16 MegatronEngine per model on this rank, take one optimizer step (Adam creates
    its state), and count the bytes of parameters, gradient buffers and optimizer state the rank holds."""
    import torch
    from megatron.core import parallel_state as ps

    from workers.megatron.engine import MegatronEngine

    out = []
    for d in model_dirs:
        eng = MegatronEngine(d, dtype="bfloat16", trainable=True, load_weights=False,
                             optim={"lr": 1e-3, "use_distributed_optimizer": dist_opt})
        eng.optimizer_step()
        params = list(eng.module.parameters())
        model_storage = {p.untyped_storage().data_ptr() for p in params}
        opt_bytes = 0
        for sub in getattr(eng.optimizer, "chained_optimizers", [eng.optimizer]):
            inner = sub.optimizer
            for group in inner.param_groups:
                for q in group["params"]:
                    if q.untyped_storage().data_ptr() not in model_storage:  # fp32 master copy (or shard)
                        assert q.dtype == torch.float32
                        opt_bytes += q.numel() * q.element_size()
                    state = inner.state[q]
                    opt_bytes += sum(state[k].numel() * state[k].element_size() for k in ("exp_avg", "exp_avg_sq"))
        out.append({
            "params": sum(p.numel() * p.element_size() for p in params),
            "grads": sum(p.main_grad.numel() * p.main_grad.element_size() for p in params),
            "optimizer": opt_bytes,
            "pp_rank": ps.get_pipeline_model_parallel_rank(),
            "param_dtypes": sorted({str(p.dtype) for p in params}),
        })
    return out
