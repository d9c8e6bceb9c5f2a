"""Worker groups of several layouts on the shared Ray (the layout runner), and their weights to compare."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any


@contextlib.contextmanager
def ray_groups() -> Iterator[dict[Any, Any]]:
    """The test process's shared Ray (tests/helpers/ray_cluster.py) and a dict for the worker groups started on
    it; on the way out every group in the dict is shut down and every CPU must be free again."""
    from tests.helpers.ray_cluster import assert_cluster_free, shared_ray

    shared_ray()
    groups: dict[Any, Any] = {}
    try:
        yield groups
    finally:
        for g in groups.values():
            g.shutdown()
    assert_cluster_free(f"the worker groups {', '.join(map(str, groups))}")


def policy_groups(model_path: str, log_root: Any, layouts: dict[str, dict[str, Any]],
                  init_kwargs: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """On the shared Ray, yield one PolicyWorker group per layout {name: WorkerGroup kwargs (tp, dp, cp, ...)
    plus an optional "levers" dict of extra init kwargs}, then shut them down."""
    from workers.group import WorkerGroup
    from workers.roles import PolicyWorker

    with ray_groups() as groups:
        for name, layout in layouts.items():
            layout = dict(layout)
            levers = layout.pop("levers", {})
            groups[name] = WorkerGroup(
                "policy", PolicyWorker, **{"tp": 1, "pp": 1, "dp": 1, **layout}, name=f"policy-{name}",
                num_cpus_per_worker=0.5, timeout_s=120, log_dir=Path(log_root.mktemp("logs")),
                init_kwargs={"model_path": model_path, **init_kwargs, **levers},
            )
        yield groups


def weights(group) -> dict:
    """The group's HF-named weights, as the rollout receives them."""
    from workers.roles import fetch_state_dict

    return fetch_state_dict(group.state_dict_for_rollout())


def max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


def assert_same_lm_step(ref, other, batch, keys=("loss", "grad_norm", "moe/aux_loss")) -> None:
    """One LM step on `batch` in both groups gives the same metrics (`keys`) and weights: after a checkpoint
    load into `other`, its optimizer state resumed too."""
    import pytest

    a, b = ref.train_lm_step(batch), other.train_lm_step(batch)
    for key in keys:
        assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-7), key
    assert max_diff(weights(other), weights(ref)) <= 1e-5


def assert_uneven_micro_batches_match(ep1, ep2) -> None:
    """Packed RL batches give the DP ranks different numbers of micro-batches (3 vs 2, then 4 vs 3); at EP=2
    the rank with fewer runs fillers to keep the EP group's token dispatch in step. The log-probs and a PPO
    update of the EP=2 group `ep2` still equal those of `ep1`."""
    import pytest

    from tests.helpers.batches import make_rl_batch, micro_counts

    rl = make_rl_batch(n=5, seed=4)
    assert micro_counts(rl) == [3, 2]
    lp = {ep: g.compute_logprobs(rl, micro_batch_size=1)["logprobs"] for ep, g in ((1, ep1), (2, ep2))}
    assert (lp[2] - lp[1]).abs().max() <= 1e-5
    batch = make_rl_batch(n=8, seed=0)
    assert micro_counts(batch) == [4, 3]
    batch["old_logprobs"] = ep1.compute_logprobs(batch)["logprobs"]
    out = {ep: g.train_step(batch, {"clip_low": 0.2, "clip_high": 0.28}, micro_batch_size=1)
           for ep, g in ((1, ep1), (2, ep2))}
    for key in ("loss", "grad_norm", "moe/aux_loss", "moe/z_loss", "moe/load_imbalance"):
        assert out[2][key] == pytest.approx(out[1][key], rel=1e-5, abs=1e-7), key
    assert max_diff(weights(ep2), weights(ep1)) <= 1e-5
