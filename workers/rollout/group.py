"""`RolloutGroup`: the driver's handle on one or more rollout engines (Ray actors, or one in-process)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from workers.batch import Batch
from workers.rollout.config import EngineConfig
from workers.rollout.prompts import as_batch
from workers.rollout.sampling import SamplingConfig
from workers.rollout.worker import RolloutWorker, _sampling


class RolloutError(RuntimeError):
    """A rollout engine call failed or timed out; the message names the engine's rank."""


class RolloutGroup:
    """`num_engines` RolloutWorkers. Prompts are split across engines (contiguously) and results are
    concatenated in order, so the output is the same Batch one engine would give.

    `in_process=True` keeps a single engine in this process (tests, `rlhf generate`); otherwise each
    engine is a Ray actor with the config's `num_cpus` / `num_gpus`.
    """

    def __init__(self, config: EngineConfig | dict[str, Any], num_engines: int = 1, in_process: bool = False,
                 timeout_s: float = 600.0, actor_options: dict[str, Any] | None = None) -> None:
        self.cfg = config if isinstance(config, EngineConfig) else EngineConfig(**config)
        if num_engines < 1 or (in_process and num_engines != 1):
            raise ValueError(f"num_engines={num_engines}: need >= 1 (exactly 1 in process)")
        self.in_process, self.timeout_s = in_process, timeout_s
        if in_process:
            self.engines: list[Any] = [RolloutWorker(self.cfg, 0)]
        else:
            self.engines = [RolloutWorker.remote(self.cfg, i, **(actor_options or {})) for i in range(num_engines)]
        infos = self._all("info", timeout_s=max(timeout_s, 300.0))
        self.infos = infos
        self.dtype: str = infos[0]["dtype"]
        self.vocab_size: int = int(infos[0]["vocab_size"])
        self._endpoint: tuple[str, int] | None = None
        self._syncers: dict[int, Any] = {}

    @property
    def num_engines(self) -> int:
        return len(self.engines)

    # ---- calls -------------------------------------------------------------------------------
    def _submit(self, i: int, method: str, *args: Any) -> Any:
        eng = self.engines[i]
        return getattr(eng, method)(*args) if self.in_process else getattr(eng, method).remote(*args)

    def _wait(self, handles: list[Any], what: str, timeout_s: float | None = None,
              on_poll: Any = None) -> list[Any]:
        """Results of actor calls, polled (so `on_poll()` can raise, e.g. when the sending side failed)."""
        if self.in_process:
            return handles
        import ray

        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout_s
        out: list[Any] = [None] * len(handles)
        index = {h: i for i, h in enumerate(handles)}
        pending = list(handles)
        while pending:
            left = deadline - time.monotonic()
            if left <= 0:
                ranks = sorted(index[h] for h in pending)
                raise RolloutError(f"rollout.{what} did not finish within {timeout_s:g}s on rollout ranks {ranks}")
            ready, pending = ray.wait(pending, num_returns=len(pending), timeout=min(left, 0.5))
            if on_poll is not None and pending:
                on_poll()
            for h in ready:
                try:
                    out[index[h]] = ray.get(h)
                except Exception as exc:
                    raise _unwrap(exc, index[h], what) from exc
        return out

    def _all(self, method: str, *args: Any, timeout_s: float | None = None) -> list[Any]:
        return self._wait([self._submit(i, method, *args) for i in range(self.num_engines)], method, timeout_s)

    # ---- rollout -----------------------------------------------------------------------------
    def generate(self, prompts: Batch | Sequence[Any], sampling: SamplingConfig | dict | None = None) -> Batch:
        """See `RolloutWorker.generate`; prompts are split across engines, `group_id` stays global."""
        sp = _sampling(sampling)
        batch = as_batch(prompts)
        if self.num_engines == 1:
            return self._wait([self._submit(0, "generate", batch, sp)], "generate")[0]
        n = len(batch)
        bounds = [round(i * n / self.num_engines) for i in range(self.num_engines + 1)]
        calls, starts = [], []
        for i in range(self.num_engines):
            lo, hi = bounds[i], bounds[i + 1]
            if hi > lo:
                seed = None if sp.seed is None else sp.seed + lo * sp.n
                calls.append(self._submit(i, "generate", batch.index(slice(lo, hi)), sp.with_(seed=seed)))
                starts.append(lo)
        parts = self._wait(calls, "generate")
        for lo, part in zip(starts, parts):
            part.meta["group_id"] = [g + lo for g in part.meta["group_id"]]
        info = _merge_info([p.info for p in parts])
        out = Batch.concat(parts)
        out.info.update(info)
        return out

    def score_all(self, sequences: list[list[int]]) -> list[list[list[float]]]:
        """Every engine's logprobs of `sequences` (tokens after the first)."""
        return self._all("score", sequences)

    # ---- weights -----------------------------------------------------------------------------
    def sync_endpoint(self) -> tuple[str, int]:
        if self._endpoint is None:
            self._endpoint = tuple(self._wait([self._submit(0, "open_sync_endpoint")], "open_sync_endpoint")[0])
        return self._endpoint  # type: ignore[return-value]

    def receive_weights(self, session: Any, on_poll: Any = None) -> list[dict[str, Any]]:
        """Every engine's receive side of a sync (see weight_sync.py); `on_poll` may raise to stop waiting."""
        handles = [self._submit(i, "receive_weights", session) for i in range(self.num_engines)]
        return self._wait(handles, "receive_weights", session.timeout_s + 30.0, on_poll)

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
        self.engines = []


def _unwrap(exc: Exception, rank: int, what: str) -> Exception:
    """The engine's own exception (weight-sync errors already name their ranks), else a RolloutError."""
    from workers.rollout.transport import WeightSyncError

    cause = getattr(exc, "cause", None)
    if isinstance(cause, WeightSyncError):
        return cause
    if isinstance(cause, ValueError):
        return cause
    import ray

    if isinstance(exc, ray.exceptions.RayActorError):
        return RolloutError(f"rollout rank {rank}: the engine actor died during {what}: {exc}")
    return RolloutError(f"rollout rank {rank}: {what} failed: {type(cause or exc).__name__}: {cause or exc}")


def _merge_info(infos: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k in ("rollout/generate_s", "rollout/total_s"):
        out[k] = max(i.get(k, 0.0) for i in infos)
    out["rollout/response_tokens"] = sum(i.get("rollout/response_tokens", 0) for i in infos)
    out["rollout/tokens_per_s"] = out["rollout/response_tokens"] / max(out["rollout/generate_s"], 1e-9)
    return out
