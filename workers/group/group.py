"""`WorkerGroup`: N Ray actors of one role forming one torch.distributed world, called like one object.

    group = WorkerGroup("policy", PolicyWorker, tp=2, pp=1, dp=2, num_cpus_per_worker=0.5,
                        log_dir="runs/x/logs", init_kwargs={"model_path": ...})
    out = group.compute_logprobs(batch)            # waits; returns the gathered result
    fut = group.compute_logprobs.remote(batch)     # returns a GroupFuture at once
    out = fut.get()                                # ... wait for it later

Every wait has a timeout; a rank that raises or dies makes the call fail within about a second with
an error naming the role, rank, node and the rank's last log lines, even while the other ranks are
blocked in a collective (results are polled with `ray.wait`, never waited on one by one).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import ray

from workers.dispatch import (
    ALL_TO_ALL,
    DP_COMPUTE,
    ONE_TO_ALL,
    DispatchSpec,
    collect_dp,
    collect_one_to_all,
    get_spec,
    split_dp_args,
)
from workers.group.errors import (
    NodeLostError,
    WorkerDiedError,
    WorkerGroupError,
    WorkerTimeoutError,
    describe_rank,
    first_lines,
    oom_note,
    refuse_taken_names,
)
from workers.group.nodes import node_lost, register, unregister
from workers.group.pool import ResourcePool
from workers.group.wait import Failure, is_death, settle, wait_all
from workers.group.worker import WorkerContext, cp_rank_of, layout_of, tail_file
from workers.net import LOOPBACK, is_multi_node

log = logging.getLogger("workers")
_GRACE_S = 2.0  # after one rank fails, how long the others get to finish before the group is marked broken


def rank_name(role: str, dp_rank: int, tp_rank: int, pp_rank: int, cp_rank: int | None = None,
              node: str | None = None) -> str:
    """The actor name of a rank, e.g. 'policy/dp0-tp1-pp0' ('policy/dp0-cp1-tp0-pp0' with context parallelism,
    'policy/dp0-tp1-pp0@10.0.0.2' in a cluster of several nodes: the node it runs on)."""
    cp = "" if cp_rank is None else f"-cp{cp_rank}"
    at = "" if node is None else f"@{node}"
    return f"{role}/dp{dp_rank}{cp}-tp{tp_rank}-pp{pp_rank}{at}"


def _put(arg: Any) -> Any:
    """Put bulky arguments into the object store once (every rank then fetches the same object)."""
    return arg if arg is None or isinstance(arg, bool | int | float | str) else ray.put(arg)


class GroupFuture:
    """A pending group call. `get()` waits (with the group's timeout unless given) and collects."""

    def __init__(self, group: WorkerGroup, what: str, refs: list, ranks: list[int],
                 collect: Callable[[list], Any]) -> None:
        self._group, self._what, self._refs, self._ranks, self._collect = group, what, refs, ranks, collect
        self._done = False
        self._value: Any = None

    def done(self) -> bool:
        """True when every rank has finished (successfully or not); does not wait."""
        ready, _ = ray.wait(self._refs, num_returns=len(self._refs), timeout=0)
        return len(ready) == len(self._refs)

    def get(self, timeout_s: float | None = None) -> Any:
        if not self._done:
            results = self._group._wait(self._refs, self._ranks, timeout_s, self._what)
            self._value, self._done = self._collect(results), True
        return self._value


class _Method:
    """`group.name(...)` waits for the result; `group.name.remote(...)` returns a GroupFuture."""

    def __init__(self, group: WorkerGroup, name: str, spec: DispatchSpec) -> None:
        self._group, self._name, self._spec = group, name, spec

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.remote(*args, **kwargs).get()

    def remote(self, *args: Any, **kwargs: Any) -> GroupFuture:
        return self._group._submit(self._name, self._spec, args, kwargs)

    def __repr__(self) -> str:
        return f"<{self._group.name}.{self._name} ({self._spec.mode})>"


class WorkerGroup:
    """`tp * cp * pp * dp` actors of `worker_cls` (a `workers.group.worker.Worker` subclass) in one world.

    Resources: each rank takes `num_cpus_per_worker` CPUs (fractions allowed) and `num_gpus_per_worker`
    GPUs from bundle `rank` of `resource_pool`; without a pool the group creates its own (roles placed
    apart), one bundle per tensor x context-parallel group (so it stays on one node), spread over the nodes
    by `placement` (pack | spread | strict_pack | strict_spread). Pass the same `ResourcePool` to several
    groups to colocate them. In a cluster of several nodes each rank's name ends in '@<node address>'.
    `timeout_s` bounds every call (override per call with `GroupFuture.get(timeout_s=)`),
    `collective_timeout_s` every torch.distributed collective, `init_timeout_s` the start-up.
    Each rank logs to `log_dir/<name>/<dpX-tpY-ppZ>.log`. `niceness` (default 0) undoes Ray's nice 15
    for the ranks (None keeps it); `num_threads` sets torch's intra-op threads per rank.
    """

    def __init__(
        self,
        role: str,
        worker_cls: type,
        tp: int = 1,
        pp: int = 1,
        dp: int = 1,
        num_cpus_per_worker: float = 0.5,
        num_gpus_per_worker: float = 0.0,
        timeout_s: float = 300.0,
        log_dir: str | Path = "runs/logs",
        init_kwargs: dict[str, Any] | None = None,
        resource_pool: ResourcePool | None = None,
        name: str | None = None,
        init_timeout_s: float | None = None,
        collective_timeout_s: float | None = None,
        seed: int = 1234,
        num_threads: int | None = None,
        env_vars: dict[str, str] | None = None,
        backend: str | None = None,
        niceness: int | None = 0,
        cp: int = 1,
        placement: str = "pack",
    ) -> None:
        if min(tp, pp, dp, cp) < 1:
            raise ValueError(f"{role}: tp, cp, pp and dp must be >= 1, got tp={tp} cp={cp} pp={pp} dp={dp}")
        if not ray.is_initialized():
            raise WorkerGroupError(f"{role}: ray is not initialised; call ray.init() first")
        self.role, self.name, self.worker_cls = role, name or role, worker_cls
        self.tp, self.pp, self.dp, self.cp = tp, pp, dp, cp
        self.world_size = tp * cp * pp * dp
        self.timeout_s = timeout_s
        self.log_dir = Path(log_dir).resolve()
        self._cpus, self._gpus = float(num_cpus_per_worker), float(num_gpus_per_worker)
        self._broken: str | None = None
        self._actors: list = []
        self._own_pool = resource_pool is None
        per = tp * cp  # a tensor x context-parallel group shares one bundle, so it stays on one node
        self.pool = resource_pool or ResourcePool(self.name, self.world_size // per, self._cpus * per,
                                                  self._gpus * per, placement=placement,
                                                  timeout_s=min(timeout_s, 60.0), ranks_per_bundle=per)
        self._reserved: list[int] = []
        try:
            for rank in range(self.world_size):
                self.pool.reserve(rank, self._cpus, self._gpus, who=f"{self.name} rank {rank}")
                self._reserved.append(rank)
            self.names = [rank_name(self.name, *layout_of(r, tp, pp, dp, cp), cp_rank_of(r, tp, cp) if cp > 1 else None,
                                    node=self.pool.node_of(r) if is_multi_node() else None)
                          for r in range(self.world_size)]
            self.infos: list[dict[str, Any]] = [{"name": n, "rank": r} for r, n in enumerate(self.names)]
            self._spawn(init_kwargs or {}, collective_timeout_s or timeout_s, seed, num_threads, env_vars, backend,
                        niceness)
            self._init_world(init_timeout_s or max(timeout_s, 120.0))
        except BaseException:
            self.shutdown()
            raise

    # ---- start-up -----------------------------------------------------------------------------
    def _spawn(self, init_kwargs: dict, collective_timeout_s: float, seed: int, num_threads: int | None,
               env_vars: dict[str, str] | None, backend: str | None, niceness: int | None) -> None:
        remote_cls = ray.remote(self.worker_cls)
        refuse_taken_names(self.names, WorkerGroupError)
        for rank, name in enumerate(self.names):
            ctx = WorkerContext(
                role=self.role, name=name, rank=rank, world_size=self.world_size, tp=self.tp, pp=self.pp,
                dp=self.dp, log_path=str(self.log_dir / self.name / (name.split("/", 1)[1] + ".log")),
                timeout_s=collective_timeout_s, backend=backend, seed=seed, num_threads=num_threads,
                niceness=niceness, cp=self.cp,
            )
            options: dict[str, Any] = dict(
                name=name,
                num_cpus=self._cpus,
                num_gpus=self._gpus,
                max_restarts=0,
                scheduling_strategy=self.pool.scheduling(rank),
            )
            if env_vars:
                options["runtime_env"] = {"env_vars": dict(env_vars)}
            self._actors.append(remote_cls.options(**options).remote(ctx, **init_kwargs))

    def _init_world(self, timeout_s: float) -> None:
        all_ranks = list(range(self.world_size))
        infos = self._wait([a.rank_info.remote() for a in self._actors], all_ranks, timeout_s, "start-up")
        self.infos = infos
        same_node = len({i["node_id"] for i in infos}) == 1
        addr = LOOPBACK if same_node else infos[0]["node_ip"]
        port = self._wait([self._actors[0].free_port.remote(addr)], [0], timeout_s, "rendezvous")[0]
        refs = [a.init_world.remote(addr, port) for a in self._actors]
        self.infos = self._wait(refs, all_ranks, timeout_s, "init_world")
        for rank, info in enumerate(self.infos):
            expect = (*layout_of(rank, self.tp, self.pp, self.dp, self.cp), cp_rank_of(rank, self.tp, self.cp))
            got = (info["dp_rank"], info["tp_rank"], info["pp_rank"], info.get("cp_rank", 0))
            if got != expect:
                raise WorkerGroupError(f"{self.names[rank]}: rank {rank} has layout dp/tp/pp/cp={got}, expected {expect}")
        register(self)
        self.output_ranks = [next(i["rank"] for i in self.infos if i["is_output"] and i["dp_rank"] == d)
                             for d in range(self.dp)]
        log.info("%s: %d ranks up (tp=%d cp=%d pp=%d dp=%d) rendezvous %s:%d", self.name, self.world_size,
                 self.tp, self.cp, self.pp, self.dp, addr, port)

    # ---- calling ------------------------------------------------------------------------------
    def __getattr__(self, name: str) -> _Method:
        if name.startswith("_"):
            raise AttributeError(name)
        cls = self.__dict__.get("worker_cls")
        spec = get_spec(cls, name) if cls is not None else None
        if spec is None:
            raise AttributeError(f"{getattr(cls, '__name__', '?')}.{name} is not a registered group method "
                                 f"(decorate it with workers.dispatch.register)")
        return _Method(self, name, spec)

    def _submit(self, method: str, spec: DispatchSpec, args: Sequence[Any], kwargs: dict[str, Any]) -> GroupFuture:
        if self._broken:
            raise WorkerGroupError(f"{self.name}: the group is unusable after an earlier failure; "
                                   f"shut it down and create a new one. Earlier failure: {self._broken}")
        what = f"{self.name}.{method}"
        ranks = list(range(self.world_size))
        if spec.mode == ONE_TO_ALL:
            a, kw = [_put(x) for x in args], {k: _put(v) for k, v in kwargs.items()}
            refs = [getattr(actor, method).remote(*a, **kw) for actor in self._actors]
            return GroupFuture(self, what, refs, ranks, lambda r: collect_one_to_all(r, spec.collect))
        if spec.mode == ALL_TO_ALL:
            for x in list(args) + list(kwargs.values()):
                if not isinstance(x, Sequence) or len(x) != self.world_size:
                    raise ValueError(f"{what} (all-to-all): every argument must be a list of {self.world_size} items")
            refs = [getattr(actor, method).remote(*[x[r] for x in args], **{k: v[r] for k, v in kwargs.items()})
                    for r, actor in enumerate(self._actors)]
            return GroupFuture(self, what, refs, ranks, list)
        if spec.mode == DP_COMPUTE:
            shards, n_pad = (spec.split or split_dp_args)(args, kwargs, self.dp, spec.pad)
            put = [([_put(x) for x in a], {k: _put(v) for k, v in kw.items()}) for a, kw in shards]
            refs = []
            for rank, actor in enumerate(self._actors):
                a, kw = put[self.infos[rank]["dp_rank"]]
                refs.append(getattr(actor, method).remote(*a, **kw))
            out_ranks = self.output_ranks
            return GroupFuture(self, what, refs, ranks, lambda r: collect_dp([r[i] for i in out_ranks], n_pad))
        raise ValueError(f"unknown dispatch mode {spec.mode!r}")

    # ---- waiting and failures -----------------------------------------------------------------
    def _wait(self, refs: list, ranks: list[int], timeout_s: float | None, what: str) -> list[Any]:
        """Results of `refs` (one per rank in `ranks`); raises on the first failure or at the deadline."""
        timeout_s = self.timeout_s if timeout_s is None else timeout_s

        def timed_out(pending: list[int]) -> BaseException:
            stuck = [ranks[i] for i in pending]
            self._broken = f"{what} timed out after {timeout_s:g}s on ranks {stuck}"
            return WorkerTimeoutError(f"{what} did not finish within {timeout_s:g}s; still running on "
                                      + "; ".join(self._describe(r) for r in stuck) + self._tails(stuck))

        def failed(failures: list[Failure], pending: list[int]) -> BaseException:
            return self._failure(refs, ranks, failures, pending, what)

        return wait_all(refs, timeout_s, failed, timed_out)

    def _failure(self, refs: list, ranks: list[int], failures: list[Failure], pending: list[int],
                 what: str) -> BaseException:
        """The error for the most telling failure: a dead rank before one that only lost its peer."""
        if pending and not any(is_death(e) for _, e in failures):
            # The others may finish (a symmetric failure) or be stuck in a collective with a dead peer.
            more, pending = settle(refs, pending, _GRACE_S)
            failures = failures + more
        by_rank = sorted(((ranks[i], e) for i, e in failures), key=lambda f: not is_death(f[1]))
        rank, exc = by_rank[0]
        died = is_death(exc)
        head = f"{what} failed on {self._describe(rank)}"
        if died:
            msg = f"{head}: the actor died ({type(exc).__name__}: {first_lines(str(exc), 6)}){oom_note()}"
        else:
            msg = f"{head}: {type(exc).__name__}: {first_lines(str(exc), 60)}"
        others = sorted({r for r, _ in by_rank[1:]} - {rank})
        if others:
            msg += f"\n(also failed on ranks {others})"
        if died or pending:
            self._broken = f"{head} ({'actor died' if died else 'other ranks still blocked'})"
        msg += self._tails([rank])
        lost = node_lost(self.infos[rank].get("node_id")) if died and rank < len(self.infos) else None
        if lost:
            msg = f"{what} failed: {lost}\n(first failure: {msg})"
        err = (NodeLostError if lost else WorkerDiedError if died else WorkerGroupError)(msg)
        err.__cause__ = exc
        return err

    def _describe(self, rank: int) -> str:
        return describe_rank(self.role, rank, self.names[rank], self.infos[rank] if rank < len(self.infos) else {})

    def _tails(self, ranks: list[int], lines: int = 20) -> str:
        out = []
        for rank in ranks[:4]:
            path = self.log_path(rank)
            text = tail_file(path, lines)
            out.append(f"\n--- last log lines of {self.names[rank]} ({path}) ---\n{text or '(log file empty or on another node)'}")
        return "".join(out)

    def log_path(self, rank: int) -> Path:
        return self.log_dir / self.name / (self.names[rank].split("/", 1)[1] + ".log")

    # ---- lifecycle ----------------------------------------------------------------------------
    @property
    def actors(self) -> list:
        return list(self._actors)

    def shutdown(self) -> None:
        """Kill the actors and give their resources back (safe to call twice)."""
        for actor in self._actors:
            try:
                ray.kill(actor, no_restart=True)
            except Exception:  # noqa: BLE001 - already dead
                pass
        self._actors = []
        unregister(self)
        self._broken = self._broken or "the group was shut down"
        for rank in self._reserved:
            self.pool.release(rank, self._cpus, self._gpus)
        self._reserved = []
        if self._own_pool:
            self.pool.shutdown()

    def __enter__(self) -> WorkerGroup:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()

    def __repr__(self) -> str:
        return f"WorkerGroup({self.name!r}, tp={self.tp}, pp={self.pp}, dp={self.dp})"

