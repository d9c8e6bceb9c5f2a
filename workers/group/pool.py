"""`ResourcePool`: a placement group whose bundles host the ranks of one role, or one rank of each colocated role.

Roles placed apart each get their own pool (the default), whose bundles hold `ranks_per_bundle` ranks each: a
worker group puts a whole tensor- (x context-) parallel group in one bundle, and a bundle lies on one node, so
those ranks never talk across nodes. Colocated roles share one pool: rank i of every role sits in bundle i and
takes a fraction of that bundle (e.g. 0.5 CPU or 0.5 GPU each, so on GPU both ranks see the same device).
How the bundles spread over nodes is the placement strategy (workers/placement.py: Ray's PACK, SPREAD, STRICT_PACK,
STRICT_SPREAD). Creation checks the cluster first and waits for the placement group with a timeout, so an
impossible request fails with a message instead of pending forever.
"""

from __future__ import annotations

import logging
from typing import Any

import ray
from ray.util.placement_group import placement_group, remove_placement_group

from workers.group.errors import ResourceUnavailableError
from workers.placement import ray_strategy

log = logging.getLogger("workers")
_EPS = 1e-6


def _fmt(res: dict[str, float]) -> str:
    keys = [k for k in ("CPU", "GPU") if k in res] + sorted(k for k in res if k in ("memory",))
    return ", ".join(f"{k}={res.get(k, 0):g}" for k in keys) or "nothing"


class ResourcePool:
    """`num_bundles` bundles of {CPU: cpus_per_bundle, GPU: gpus_per_bundle} in one placement group whose
    strategy is `placement` (a key of workers.placement.PLACEMENTS); rank r books its share of bundle r // ranks_per_bundle."""

    def __init__(self, name: str, num_bundles: int, cpus_per_bundle: float, gpus_per_bundle: float = 0.0,
                 placement: str = "pack", timeout_s: float = 60.0, ranks_per_bundle: int = 1) -> None:
        strategy = ray_strategy(placement, f"resource pool {name!r}: placement")
        if num_bundles < 1:
            raise ValueError(f"resource pool {name!r}: num_bundles must be >= 1, got {num_bundles}")
        if cpus_per_bundle <= 0 and gpus_per_bundle <= 0:
            raise ValueError(f"resource pool {name!r}: a bundle needs some CPU or GPU")
        self.name = name
        self.num_bundles, self.ranks_per_bundle = num_bundles, ranks_per_bundle
        self.bundle = {"CPU": float(cpus_per_bundle)} | ({"GPU": float(gpus_per_bundle)} if gpus_per_bundle else {})
        self._used = [{"CPU": 0.0, "GPU": 0.0} for _ in range(num_bundles)]
        self._check_cluster(strategy)
        self.pg = placement_group([dict(self.bundle) for _ in range(num_bundles)], strategy=strategy,
                                  name=f"{name}_pool")
        ready, _ = ray.wait([self.pg.ready()], timeout=timeout_s)
        if not ready:
            remove_placement_group(self.pg)
            raise ResourceUnavailableError(
                f"resource pool {name!r}: asked for {num_bundles} bundle(s) of {{{_fmt(self.bundle)}}} "
                f"({placement}); the placement group was not ready after {timeout_s:g}s. The cluster has "
                f"{_fmt(ray.cluster_resources())} in total and {_fmt(ray.available_resources())} available "
                f"(nodes: {self._node_summary()})."
            )
        self.bundle_nodes = self._bundle_nodes()
        log.info("resource pool %s ready: %d x %s (%s) on %s", name, num_bundles, self.bundle, placement,
                 ", ".join(f"bundle {b}: {ip}" for b, ip in enumerate(self.bundle_nodes)))

    def _bundle_nodes(self) -> list[str]:
        """The address of the node that holds each bundle."""
        from ray.util.placement_group import placement_group_table

        by_id = {n["NodeID"]: n.get("NodeManagerAddress", "?") for n in ray.nodes()}
        where = placement_group_table(self.pg).get("bundles_to_node_id", {})
        return [by_id.get(where.get(b, ""), "?") for b in range(self.num_bundles)]

    def bundle_of(self, rank: int) -> int:
        """The bundle that hosts rank `rank` of a group in this pool."""
        return rank // self.ranks_per_bundle

    def node_of(self, rank: int) -> str:
        """The address of the node rank `rank` will run on."""
        return self.bundle_nodes[self.bundle_of(rank)]

    def _needed(self) -> dict[str, float]:
        return {k: v * self.num_bundles for k, v in self.bundle.items()}

    def _node_summary(self) -> str:
        parts = []
        for node in ray.nodes():
            if node.get("Alive"):
                parts.append(f"{node.get('NodeManagerAddress')}: {_fmt(node.get('Resources', {}))}")
        return "; ".join(parts) or "none alive"

    def _check_cluster(self, strategy: str) -> None:
        total, avail = ray.cluster_resources(), ray.available_resources()
        need = self._needed()
        for key, amount in need.items():
            if amount > total.get(key, 0.0) + _EPS:
                raise ResourceUnavailableError(
                    f"resource pool {self.name!r}: asked for {self.num_bundles} bundle(s) of "
                    f"{{{_fmt(self.bundle)}}} = {amount:g} {key} in total, but the cluster has only "
                    f"{total.get(key, 0.0):g} {key} ({_fmt(total)} in total, {_fmt(avail)} available; "
                    f"nodes: {self._node_summary()})"
                )
        per_node_max = {k: max((n.get("Resources", {}).get(k, 0.0) for n in ray.nodes() if n.get("Alive")),
                               default=0.0) for k in self.bundle}
        for key, amount in self.bundle.items():
            if amount > per_node_max[key] + _EPS:
                raise ResourceUnavailableError(
                    f"resource pool {self.name!r}: one bundle asks for {amount:g} {key} but no node has that "
                    f"much (largest node: {per_node_max[key]:g} {key}; nodes: {self._node_summary()})"
                )
        nodes = [n.get("Resources", {}) for n in ray.nodes() if n.get("Alive")]
        if strategy == "STRICT_SPREAD":
            fit = sum(all(r.get(k, 0.0) + _EPS >= v for k, v in self.bundle.items()) for r in nodes)
            if fit < self.num_bundles:
                raise ResourceUnavailableError(
                    f"resource pool {self.name!r}: placement strict_spread puts each of its {self.num_bundles} "
                    f"bundle(s) of {{{_fmt(self.bundle)}}} on a node of its own, but only {fit} node(s) can hold "
                    f"one (nodes: {self._node_summary()}); use spread or pack"
                )
        if strategy == "STRICT_PACK" and not any(all(r.get(k, 0.0) + _EPS >= v for k, v in need.items()) for r in nodes):
            raise ResourceUnavailableError(
                f"resource pool {self.name!r}: placement strict_pack puts all {self.num_bundles} bundle(s) "
                f"({_fmt(need)} in total) on one node, and no node has that much (nodes: {self._node_summary()}); "
                f"use pack or spread"
            )

    def reserve(self, rank: int, cpus: float, gpus: float, who: str) -> None:
        """Book rank `rank`'s share of its bundle; raises if the bundle would be over-committed (Ray would hang)."""
        bundle_index = self.bundle_of(rank)
        if not 0 <= bundle_index < self.num_bundles:
            raise ResourceUnavailableError(
                f"{who}: resource pool {self.name!r} has {self.num_bundles} bundle(s), rank needs bundle {bundle_index}"
            )
        used = self._used[bundle_index]
        for key, amount in (("CPU", cpus), ("GPU", gpus)):
            if used[key] + amount > self.bundle.get(key, 0.0) + _EPS:
                raise ResourceUnavailableError(
                    f"{who}: asks for {amount:g} {key} in bundle {bundle_index} of pool {self.name!r}, which "
                    f"holds {{{_fmt(self.bundle)}}} with {used[key]:g} {key} already taken by colocated roles"
                )
        used["CPU"] += cpus
        used["GPU"] += gpus

    def release(self, rank: int, cpus: float, gpus: float) -> None:
        used = self._used[self.bundle_of(rank)]
        used["CPU"] = max(0.0, used["CPU"] - cpus)
        used["GPU"] = max(0.0, used["GPU"] - gpus)

    def scheduling(self, rank: int) -> Any:
        """The scheduling strategy that puts rank `rank` in its bundle."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        return PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=self.bundle_of(rank))

    def shutdown(self) -> None:
        """Remove the placement group (kill the groups in it first)."""
        try:
            remove_placement_group(self.pg)
        except Exception:  # noqa: BLE001 - already gone with the cluster
            pass
