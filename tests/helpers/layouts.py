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
