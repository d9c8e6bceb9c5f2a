"""What every group of Ray actors shares, worker ranks and rollout engines alike (`RankedActors`).

- Reservation: rank r books its CPUs / GPUs in its bundle of a placement group, the group's own (placed apart)
  or one shared with colocated roles; shutdown gives them back and removes a pool of the group's own.
- Naming: on a cluster of several nodes an actor's name ends in '@<node address>', the node of its bundle.
- Failures: the error for a failed call names the role, the rank, its node and pid; a dead rank comes before
  one that only raised (or lost its peer); a rank lost with its node gives a NodeLostError naming the node and
  every rank lost with it; the rank's last log lines follow.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from workers.group.errors import NodeLostError, describe_rank, first_lines, oom_note
from workers.group.nodes import node_lost, unregister
from workers.group.wait import is_death
from workers.group.worker import tail_file
from workers.net import is_multi_node

if TYPE_CHECKING:
    from workers.group.pool import ResourcePool

RankFailure = tuple[int, BaseException]  # (rank, what its call raised)


class RankedActors:
    """The shared part of `WorkerGroup` and `RolloutGroup`. A subclass sets `name`, `names` (one per rank) and
    `infos` (what each rank reported: node_ip, node_id, pid), calls `_use_pool` before reserving, and says
    which role its ranks play (`ranks_role`) and where each rank logs (`rank_log`)."""

    name: str
    names: list[str]
    infos: list[dict[str, Any]]
    pool: ResourcePool | None

    # ---- reservation --------------------------------------------------------------------------
    def _use_pool(self, pool: ResourcePool | None, cpus: float, gpus: float) -> None:
        """Each rank will take `cpus` / `gpus` in `pool` (None: one of the group's own from `_make_pool`, or
        none for ranks that ask for no resources)."""
        self.pool, self._own_pool = pool, False
        self._cpus, self._gpus = float(cpus), float(gpus)
        self._reserved: list[int] = []

    def _make_pool(self, num_bundles: int, placement: str, timeout_s: float, ranks_per_bundle: int = 1) -> None:
        """A placement group of the group's own: `num_bundles` bundles of `ranks_per_bundle` ranks each."""
        from workers.group.pool import ResourcePool

        per = ranks_per_bundle
        self.pool = ResourcePool(self.name, num_bundles, self._cpus * per, self._gpus * per, placement=placement,
                                 timeout_s=min(timeout_s, 60.0), ranks_per_bundle=per)
        self._own_pool = True

    def _reserve(self, rank: int, who: str) -> dict[str, Any]:
        """Book rank `rank`'s share of its bundle; the actor options that place it there ({} without a pool)."""
        if self.pool is None:
            return {}
        self.pool.reserve(rank, self._cpus, self._gpus, who=who)
        self._reserved.append(rank)
        return {"scheduling_strategy": self.pool.scheduling(rank)}

    def _at_nodes(self, names: list[str]) -> list[str]:
        """`names` (one per rank), each ending in '@<node address>' of its bundle on a cluster of several nodes."""
        if self.pool is None or not is_multi_node():
            return names
        return [f"{n}@{self.pool.node_of(rank)}" for rank, n in enumerate(names)]

    def _release(self) -> None:
        """Give back every rank's booking, stop naming these ranks in node-loss errors and remove an own pool
        (safe to call twice)."""
        for rank in self._reserved:
            self.pool.release(rank, self._cpus, self._gpus)  # type: ignore[union-attr]
        self._reserved = []
        unregister(self)
        if self._own_pool and self.pool is not None:
            self.pool.shutdown()
            self._own_pool = False

    # ---- failures -----------------------------------------------------------------------------
    def ranks_role(self) -> str:
        """The role named in errors (`role 'policy' rank 1 ...`)."""
        raise NotImplementedError

    def rank_log(self, rank: int) -> str | None:
        """The log file of `rank`, None when it logs to the console."""
        raise NotImplementedError

    def _describe(self, rank: int) -> str:
        return describe_rank(self.ranks_role(), rank, self.names[rank], self.infos[rank] if rank < len(self.infos) else {})

    def _tails(self, ranks: list[int], lines: int = 20) -> str:
        """The last log lines of (at most four of) `ranks`."""
        out = []
        for rank in ranks[:4]:
            path = self.rank_log(rank)
            if path is not None:
                text = tail_file(path, lines)
                out.append(f"\n--- last log lines of {self.names[rank]} ({path}) ---\n"
                           f"{text or '(log file empty or on another node)'}")
        return "".join(out)

    def _failure_error(self, what: str, failures: list[RankFailure], died_cls: type[BaseException],
                       error_cls: type[BaseException], cause: Callable[[BaseException], BaseException] = lambda e: e,
                       passthrough: Callable[[BaseException], BaseException | None] = lambda e: None
                       ) -> tuple[BaseException, int, bool]:
        """(the error, its rank, whether that rank died) for the most telling of `failures` of the call `what`:
        a dead rank first. A dead rank's error is `died_cls`, or NodeLostError when its node left the cluster;
        for a rank that raised, `passthrough(exc)` may give an error to raise as it is, else `error_cls` with
        `cause(exc)` (the user's exception inside Ray's wrapper). Other failed ranks are listed."""
        ordered = sorted(failures, key=lambda f: not is_death(f[1]))
        rank, exc = ordered[0]
        died = is_death(exc)
        if not died:
            own = passthrough(exc)
            if own is not None:
                own.__cause__ = exc
                return own, rank, died
        head = f"{what} failed on {self._describe(rank)}"
        if died:
            msg = f"{head}: the actor died ({type(exc).__name__}: {first_lines(str(exc), 6)}){oom_note()}"
        else:
            inner = cause(exc)
            msg = f"{head}: {type(inner).__name__}: {first_lines(str(inner), 60)}"
        others = sorted({r for r, _ in ordered[1:]} - {rank})
        if others:
            msg += f"\n(also failed on ranks {others})"
        msg += self._tails([rank])
        lost = node_lost(self.infos[rank].get("node_id")) if died and rank < len(self.infos) else None
        if lost:
            msg = f"{what} failed: {lost}\n(first failure: {msg})"
        err = (NodeLostError if lost else died_cls if died else error_cls)(msg)
        err.__cause__ = exc
        return err, rank, died
