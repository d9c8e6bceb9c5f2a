"""Helpers for the worker-group tests: RL batches in the driver's layout, an HF reference and policy groups
of several layouts on one local Ray."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from workers.batch import Batch, pad_sequences


def make_rl_batch(n: int = 8, vocab: int = 500, p_max: int = 6, r_max: int = 5, seed: int = 0) -> Batch:
    """Prompts left-padded to P, responses right-padded to R, random lengths (>= 1 token each)."""
    g = torch.Generator().manual_seed(seed)

    def seqs(lo: int, hi: int) -> list[torch.Tensor]:
        return [torch.randint(3, vocab, (int(torch.randint(lo, hi + 1, (1,), generator=g)),), generator=g)
                for _ in range(n)]

    p_ids, p_mask = pad_sequences(seqs(2, p_max), left=True)
    r_ids, r_mask = pad_sequences(seqs(1, r_max))
    batch = Batch({"input_ids": torch.cat([p_ids, r_ids], 1), "attention_mask": torch.cat([p_mask, r_mask], 1),
                   "responses": r_ids, "response_mask": r_mask})
    batch["advantages"] = torch.randn(r_ids.shape, generator=g) * r_mask
    return batch


def policy_groups(model_path: str, log_root: Any, layouts: dict[str, dict[str, Any]],
                  init_kwargs: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Start Ray (4 CPUs), yield one PolicyWorker group per layout {name: WorkerGroup kwargs (tp, dp, cp,
    ...) plus an optional "levers" dict of extra init kwargs}, then shut them and Ray down."""
    import ray

    from workers.group import WorkerGroup
    from workers.roles import PolicyWorker

    ray.init(num_cpus=4, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    groups: dict[str, Any] = {}
    try:
        for name, layout in layouts.items():
            layout = dict(layout)
            levers = layout.pop("levers", {})
            groups[name] = WorkerGroup(
                "policy", PolicyWorker, **{"tp": 1, "pp": 1, "dp": 1, **layout}, name=f"policy-{name}",
                num_cpus_per_worker=0.5, timeout_s=120, log_dir=Path(log_root.mktemp("logs")),
                init_kwargs={"model_path": model_path, **init_kwargs, **levers},
            )
        yield groups
    finally:
        for g in groups.values():
            g.shutdown()
        ray.shutdown()


def hf_logprobs(model_path: str, batch: Batch, temperature: float = 1.0) -> torch.Tensor:
    """Response log-probs from a plain transformers fp32 forward (position ids from the mask), of the
    logits divided by `temperature`."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    am = batch["attention_mask"]
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=am, position_ids=(am.cumsum(-1) - 1).clamp_min(0)).logits
    r = batch["responses"].shape[1]
    lp = torch.log_softmax(logits[:, -r - 1:-1].float() / temperature, -1).gather(-1, batch["responses"].unsqueeze(-1)).squeeze(-1)
    return lp * batch["response_mask"]


@pytest.fixture(scope="session")
def rl_batch_factory():
    return make_rl_batch
