"""`RolloutGroup`: the driver's handle on one or more rollout engines (Ray actors, or one in-process).

Engine calls are waited on like a worker group's (`workers.group.wait`), and their failures are
`WorkerGroupError`s naming role 'rollout', the engine's rank, node and pid, like any other role's.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from workers.agent.options import AgentOptions
from workers.batch import Batch
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
from workers.group.wait import Failure, is_death, wait_all
from workers.group.worker import tail_file
from workers.net import is_multi_node
from workers.rollout.config import EngineConfig
from workers.rollout.prompts import as_batch, concat_rollouts
from workers.rollout.sampling import SamplingConfig, as_sampling
from workers.rollout.worker import RolloutWorker

if TYPE_CHECKING:
    from workers.group.pool import ResourcePool

ROLE = "rollout"


class RolloutError(WorkerGroupError):
    """A rollout engine call failed; the message names role 'rollout', the engine's rank, node and pid."""


class RolloutDiedError(RolloutError, WorkerDiedError):
    """A rollout engine's actor process died (killed, crashed, out of memory)."""


class RolloutTimeoutError(RolloutError, WorkerTimeoutError):
    """A rollout engine call did not finish within its timeout."""


def prompt_cost(batch: Batch, i: int, sp: SamplingConfig) -> float:
    """Tokens prompt i of a generate call may put in flight: its length (token ids, or about 4 characters a
    token of text or chat messages) plus n x max_tokens to generate."""
    meta = batch.meta
    if "prompt_ids" in meta:
        length = len(meta["prompt_ids"][i])
    else:
        x = (meta.get("messages") or meta.get("prompt") or [""] * len(batch))[i]
        text = x if isinstance(x, str) else " ".join(str(m.get("content", "")) for m in x)
        length = len(text) // 4 + 1
    return float(length + sp.n * sp.max_tokens)


def split_by_load(costs: list[float], loads: list[float]) -> list[int]:
    """Bounds (len(loads) + 1 of them) of a contiguous split of prompts with `costs` over engines with
    `loads` tokens already in flight, filling the least loaded up to the level every engine would reach:
    an engine takes prompts while its load plus theirs stays under that level (at least one prompt if it
    is under it). Equal loads and costs give the even split."""
    engines, n = len(loads), len(costs)
    level = (sum(loads) + sum(costs)) / engines
    bounds, at = [0], 0
    for e in range(engines - 1):
        load = loads[e]
        while at < n and (load + costs[at] <= level + 1e-9 or (load < level and at == bounds[-1])):
            load += costs[at]
            at += 1
        bounds.append(at)
    bounds.append(n)
    return bounds


class RolloutGroup:
    """`num_engines` RolloutWorkers. Prompts are split across engines contiguously by load: each engine's
    share fills it up to an equal level of tokens in flight (`split_by_load`; a prompt's n samples stay on one
    engine, where its prefix is cached), and results are concatenated in order, so the output is the same
    Batch one engine would give.

    `in_process=True` keeps a single engine in this process (tests, `rlhf generate`); otherwise each
    engine is a Ray actor with the config's `num_cpus` / `num_gpus`, in bundle `rank` of a placement group of
    the group's own (spread over nodes by the config's `placement`) or of `resource_pool` (colocated), named
    `<name>/<rank>` (e.g. `rollout/0`; `rollout/0@10.0.0.3` in a cluster of several nodes) like the worker ranks. Without `name` the group gets a unique one (`rollout-1a2b3c`),
    so several groups can live in one Ray session; a `name` already taken there is refused. With
    `log_dir`, each engine actor writes its output to `log_dir/<name>/<rank>.log`, not to the console.
    """

    def __init__(self, config: EngineConfig | dict[str, Any], num_engines: int = 1, in_process: bool = False,
                 timeout_s: float = 600.0, actor_options: dict[str, Any] | None = None,
                 name: str | None = None, log_dir: str | Path | None = None,
                 resource_pool: ResourcePool | None = None) -> None:
        self.cfg = config if isinstance(config, EngineConfig) else EngineConfig(**config)
        if num_engines < 1 or (in_process and num_engines != 1):
            raise ValueError(f"num_engines={num_engines}: need >= 1 (exactly 1 in process)")
        self.in_process, self.timeout_s = in_process, timeout_s
        self.name = name or f"{ROLE}-{uuid.uuid4().hex[:6]}"
        self.names = [f"{self.name}/{i}" for i in range(num_engines)]
        self.infos: list[dict[str, Any]] = [{"rank": i} for i in range(num_engines)]
        self.engines: list[Any] = []
        self.log_paths: list[str | None] = [None] * num_engines
        self._endpoint: tuple[str, int] | None = None
        self._syncers: dict[int, Any] = {}
        self.pool, self._reserved, self._own_pool = resource_pool, 0, False
        self.in_flight = [0.0] * num_engines  # tokens of the generate calls started and not yet collected
        try:
            if in_process:
                self.engines = [RolloutWorker(self.cfg, 0, name=self.names[0])]
            else:
                if self.pool is None and self.cfg.num_cpus + self.cfg.num_gpus > 0:  # placed apart: a pool of their own
                    from workers.group.pool import ResourcePool

                    self.pool = ResourcePool(self.name, num_engines, self.cfg.num_cpus, self.cfg.num_gpus,
                                             placement=self.cfg.placement, timeout_s=min(timeout_s, 60.0))
                    self._own_pool = True
                if is_multi_node() and self.pool is not None:
                    self.names = [f"{n}@{self.pool.node_of(i)}" for i, n in enumerate(self.names)]
                refuse_taken_names(self.names, RolloutError, "rollout group")
                self.log_paths = [str(Path(log_dir) / self.name / f"{i}.log") if log_dir else None
                                  for i in range(num_engines)]
                self.engines = [RolloutWorker.start(self.cfg, i, self.log_paths[i],
                                                    **{**(actor_options or {}), **self._placement(i), "name": n})
                                for i, n in enumerate(self.names)]
            self.infos = self._all("info", timeout_s=max(timeout_s, 300.0))
        except BaseException:
            self.shutdown()
            raise
        register(self)
        self.dtype: str = self.infos[0]["dtype"]
        self.vocab_size: int = int(self.infos[0]["vocab_size"])

    def _placement(self, rank: int) -> dict[str, Any]:
        """Engine `rank` in bundle `rank` of the pool (its own, or the policy's when colocated), its CPUs / GPUs
        booked there."""
        if self.pool is None:  # an engine that asks for no resources goes wherever Ray puts it
            return {}
        self.pool.reserve(rank, self.cfg.num_cpus, self.cfg.num_gpus, who=f"{self.names[rank]}")
        self._reserved += 1
        return {"scheduling_strategy": self.pool.scheduling(rank)}

    @property
    def num_engines(self) -> int:
        return len(self.engines)

    # ---- calls -------------------------------------------------------------------------------
    def _submit(self, i: int, method: str, *args: Any) -> Any:
        eng = self.engines[i]
        return getattr(eng, method)(*args) if self.in_process else getattr(eng, method).remote(*args)

    def _wait(self, handles: list[Any], ranks: list[int], what: str, timeout_s: float | None = None,
              on_poll: Any = None, on_ready: Any = None) -> list[Any]:
        """Results of the engine calls `handles` (one per rank in `ranks`), polled like a worker group's;
        `on_poll()` may raise to stop waiting (e.g. when the sending side of a weight sync failed);
        `on_ready(i, result, running)` sees each result as it arrives (`workers.group.wait.wait_all`)."""
        if self.in_process:
            return handles if on_ready is None else [on_ready(i, h, 0) for i, h in enumerate(handles)]
        timeout_s = self.timeout_s if timeout_s is None else timeout_s

        def timed_out(pending: list[int]) -> BaseException:
            return RolloutTimeoutError(f"{self.name}.{what} did not finish within {timeout_s:g}s; still running on "
                                       + "; ".join(self._describe(ranks[i]) for i in pending))

        def failed(failures: list[Failure], pending: list[int]) -> BaseException:
            return self._failure([(ranks[i], e) for i, e in failures], what)

        return wait_all(handles, timeout_s, failed, timed_out, on_poll, on_ready=on_ready)

    def _failure(self, failures: list[Failure], what: str) -> BaseException:
        """The error for the most telling of `failures` ((rank, exception) pairs): a dead engine first;
        weight-sync errors (they name their ranks) and bad input (ValueError) pass as they are; anything
        else becomes a RolloutError naming the engine."""
        rank, exc = sorted(failures, key=lambda f: not is_death(f[1]))[0]
        head = f"{self.name}.{what} failed on {self._describe(rank)}"
        log = self.log_paths[rank] if rank < len(self.log_paths) else None
        tail = f"\n--- last log lines of {self.names[rank]} ({log}) ---\n{tail_file(log, 20)}" if log else ""
        cause = getattr(exc, "cause", None)
        lost = node_lost(self.infos[rank].get("node_id")) if is_death(exc) and rank < len(self.infos) else None
        if lost:
            err: BaseException = NodeLostError(f"{self.name}.{what} failed: {lost}\n(first failure: {head}: the "
                                               f"actor died ({type(exc).__name__}: {first_lines(str(exc), 6)})){tail}")
        elif is_death(exc):
            err = RolloutDiedError(
                f"{head}: the actor died ({type(exc).__name__}: {first_lines(str(exc), 6)}){oom_note()}{tail}")
        elif isinstance(cause, WorkerGroupError | ValueError):
            err = cause
        else:
            err = RolloutError(f"{head}: {type(cause or exc).__name__}: {first_lines(str(cause or exc), 60)}{tail}")
        err.__cause__ = exc
        return err

    def _describe(self, rank: int) -> str:
        return describe_rank(ROLE, rank, self.names[rank], self.infos[rank] if rank < len(self.infos) else {})

    def _all(self, method: str, *args: Any, timeout_s: float | None = None) -> list[Any]:
        ranks = list(range(self.num_engines))
        return self._wait([self._submit(i, method, *args) for i in ranks], ranks, method, timeout_s)

    # ---- rollout -----------------------------------------------------------------------------
    def generate(self, prompts: Batch | Sequence[Any], sampling: SamplingConfig | dict | None = None,
                 agent: AgentOptions | dict[str, Any] | None = None, score: Any = None) -> Batch:
        """See `RolloutWorker.generate` (with `agent`, `RolloutWorker.generate_agent`: multi-turn tool use);
        prompts are split across engines, `group_id` stays global; `score` as in `PendingGenerate.result`."""
        return self.start_generate(prompts, sampling, agent).result(score)

    def start_generate(self, prompts: Batch | Sequence[Any], sampling: SamplingConfig | dict | None = None,
                       agent: AgentOptions | dict[str, Any] | None = None) -> PendingGenerate:
        """`generate`, started: the engines work while the caller goes on; `.result()` waits (with the
        group's timeout) and gives the Batch. Each engine runs its calls in order, so a later call on the
        group (a weight sync) runs after this generation. In process, the generation runs here and now."""
        sp = as_sampling(sampling)
        batch = as_batch(prompts)
        method, extra = ("generate_agent", (agent,)) if agent else ("generate", ())
        n = len(batch)
        costs = [prompt_cost(batch, i, sp) for i in range(n)]
        bounds = split_by_load(costs, self.in_flight) if self.num_engines > 1 else [0, n]
        calls, starts, ranks, tokens = [], [], [], []
        for i in range(self.num_engines):
            lo, hi = bounds[i], bounds[i + 1]
            if hi > lo or (n == 0 and i == 0):
                seed = None if sp.seed is None else sp.seed + lo * sp.n
                part = batch if self.num_engines == 1 else batch.index(slice(lo, hi))
                calls.append(self._submit(i, method, part, sp.with_(seed=seed) if lo else sp, *extra))
                starts.append(lo)
                ranks.append(i)
                tokens.append(sum(costs[lo:hi]))
                self.in_flight[i] += tokens[-1]
        return PendingGenerate(self, method, calls, starts, ranks, tokens)

    def complete(self, requests: list[dict[str, Any]], sampling: SamplingConfig | dict | None = None
                 ) -> list[dict[str, Any]]:
        """See `RolloutWorker.complete`: the requests are split evenly across the engines, in order."""
        n, k = len(requests), self.num_engines
        bounds = [round(i * n / k) for i in range(k + 1)]
        ranks = [i for i in range(k) if bounds[i + 1] > bounds[i]]
        handles = [self._submit(i, "complete", requests[bounds[i]:bounds[i + 1]], sampling) for i in ranks]
        return [r for part in self._wait(handles, ranks, "complete") for r in part]

    def score_all(self, sequences: list[list[int]]) -> list[list[list[float]]]:
        """Every engine's logprobs of `sequences` (tokens after the first)."""
        return self._all("score", sequences)

    def next_token_logprobs(self, prompts: list[list[int]], candidates: list[list[int]]) -> list[list[float]]:
        """See `RolloutWorker.next_token_logprobs` (one engine answers)."""
        return self._wait([self._submit(0, "next_token_logprobs", prompts, candidates)], [0],
                          "next_token_logprobs")[0]

    # ---- weights -----------------------------------------------------------------------------
    def sync_endpoint(self) -> tuple[str, int]:
        if self._endpoint is None:
            self._endpoint = tuple(self._wait([self._submit(0, "open_sync_endpoint")], [0], "open_sync_endpoint")[0])
        return self._endpoint  # type: ignore[return-value]

    def receive_weights(self, session: Any, on_poll: Any = None) -> list[dict[str, Any]]:
        """Every engine's receive side of a sync (see weight_sync.py); `on_poll` may raise to stop waiting."""
        ranks = list(range(self.num_engines))
        handles = [self._submit(i, "receive_weights", session) for i in ranks]
        return self._wait(handles, ranks, "receive_weights", session.timeout_s + 30.0, on_poll)

    def sync_weights(self, policy_group: Any, config: Any = None, verify: bool | None = None,
                     **session_overrides: Any) -> dict[str, Any]:
        """Push `policy_group`'s weights into every engine (bucketed, timed out; see weight_sync.py).
        The first sync with a policy group is verified unless the SyncConfig says otherwise."""
        from workers.rollout.syncer import WeightSyncer

        key = id(policy_group)
        syncer = self._syncers.get(key)
        if syncer is None or (config is not None and syncer.cfg is not config):
            if syncer is not None:
                syncer.close()
            syncer = self._syncers[key] = WeightSyncer(policy_group, self, config)
        return syncer.sync(verify=verify, **session_overrides)

    def load_lora_adapter(self, adapter: dict[str, Any]) -> list[dict[str, Any]]:
        """Serve the policy's LoRA adapter (`gather_peft_adapter`'s result) on every engine (the adapter sync)."""
        return self._all("load_lora_adapter", adapter)

    def load_weights(self, weights: list[tuple[str, Any]]) -> None:
        """Load the same HF-named tensors into every engine (small models, tests)."""
        self._all("load_weights", weights)

    def sleep(self, level: int = 1) -> None:
        """GPU colocation: free engine memory during training. CPU: no-op."""
        self._all("sleep", level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        self._all("wake_up", tags)

    def info(self) -> list[dict[str, Any]]:
        return self._all("info")

    def shutdown(self) -> None:
        """Stop the engines (safe to call twice); remove the syncers' shared files."""
        for syncer in self._syncers.values():
            syncer.close()
        self._syncers.clear()
        if self.in_process:
            for e in self.engines:
                e.shutdown()
        else:
            import ray

            for e in self.engines:
                try:
                    ray.kill(e, no_restart=True)
                except Exception:  # noqa: BLE001 - already gone
                    pass
        for rank in range(self._reserved):
            self.pool.release(rank, self.cfg.num_cpus, self.cfg.num_gpus)  # type: ignore[union-attr]
        self._reserved = 0
        unregister(self)
        if self._own_pool and self.pool is not None:
            self.pool.shutdown()
            self.pool, self._own_pool = None, False
        self.engines = []


class PendingGenerate:
    """A generate call in flight on the engines (`RolloutGroup.start_generate`)."""

    def __init__(self, group: RolloutGroup, method: str, calls: list[Any], starts: list[int],
                 ranks: list[int], tokens: list[float] | None = None) -> None:
        self.group, self.method, self.calls, self.starts, self.ranks = group, method, calls, starts, ranks
        self.tokens = tokens or [0.0] * len(ranks)  # each call's share of the group's tokens in flight
        self._out: Batch | None = None

    def result(self, score: Callable[[Batch], Batch] | None = None) -> Batch:
        """The samples, as one engine would give them (waits on first call; later calls return the same).
        With `score` (the run's reward: Batch -> Batch with `scores`), each engine's samples are scored as
        they return, while the other engines still generate; info `rollout/scored_while_generating` is the
        fraction of engine parts scored before the last engine finished."""
        if self._out is not None:
            return self._out
        early: list[bool] = []

        def arrived(i: int, part: Batch, running: int) -> Batch:
            part.meta["group_id"] = [g + self.starts[i] for g in part.meta["group_id"]]
            if score is None:
                return part
            early.append(running > 0)
            return score(part)

        try:
            parts = self.group._wait(self.calls, self.ranks, self.method, on_ready=arrived)
        finally:  # collected (or failed): no longer in flight
            for rank, t in zip(self.ranks, self.tokens):
                self.group.in_flight[rank] -= t
            self.tokens = [0.0] * len(self.ranks)
        if len(parts) == 1:
            self._out = parts[0]
        else:
            info = _merge_info([p.info for p in parts], [len(p) for p in parts])
            self._out = concat_rollouts(parts)
            self._out.info.update(info)
        if score is not None:
            self._out.info["rollout/scored_while_generating"] = sum(early) / max(len(early), 1)
        return self._out


def _merge_info(infos: list[dict[str, Any]], rows: list[int]) -> dict[str, Any]:
    """The rollout info of a generate split across engines (`rows`: each engine's samples, i.e. trajectories)."""
    from workers.agent.metrics import merge_agent_metrics

    out: dict[str, Any] = merge_agent_metrics(list(zip(infos, rows)))
    for k in ("rollout/generate_s", "rollout/total_s"):
        out[k] = max(i.get(k, 0.0) for i in infos)
    out["rollout/response_tokens"] = sum(i.get("rollout/response_tokens", 0) for i in infos)
    out["rollout/tokens_per_s"] = out["rollout/response_tokens"] / max(out["rollout/generate_s"], 1e-9)
    return out
