"""`WeightSyncer`: the driver side of weight sync (launch, wait with a timeout, verify)."""

from __future__ import annotations

import itertools
import logging
import secrets
import time
import uuid
from typing import Any

import torch

from workers.batch import Batch
from workers.rollout.config import SyncConfig
from workers.rollout.cpu.shm import ShmTransport, one_host_nodes
from workers.rollout.digest import DIGEST_METRICS, HeldDigests, Sent, compare
from workers.rollout.registry import choose_transport
from workers.rollout.transport import SyncSession, Transport, WeightSyncError, is_timeout, sync_error

log = logging.getLogger(__name__)
_IDS = itertools.count(1)
# of a sync's stats when the log-prob canary ran (`canary_due`): the largest and the mean |engine - policy|
# log-prob over the canary batch's tokens (all engines), and the tolerance they were held to
CANARY_METRICS = ("mismatch/canary_max_abs_diff", "mismatch/canary_mean_abs_diff", "mismatch/canary_tolerance")
SYNC_METRICS = (*DIGEST_METRICS, *CANARY_METRICS)  # of a sync's stats, logged with the step that synced


class WeightSyncer:
    """Syncs one policy WorkerGroup into the engines of a RolloutGroup over the transport `choose_transport`
    picks (transport.py: the interface; weight_sync.py, cpu/shm.py: the transports)."""

    def __init__(self, policy_group: Any, rollout: Any, config: SyncConfig | None = None) -> None:
        self.policy, self.rollout = policy_group, rollout
        self.cfg = config or SyncConfig()
        self.num_syncs = 0
        self.channel = _new_channel()
        self.secret = secrets.token_hex(32)  # signs this syncer's control messages (wire.py)
        infos = getattr(policy_group, "infos", None) or [{"rank": 0, "dp_rank": 0, "tp_rank": 0, "pp_rank": 0}]
        self.infos = infos
        pp = max(i["pp_rank"] for i in infos) + 1
        self.source_ranks = [next(i["rank"] for i in infos if i["tp_rank"] == 0 and i["dp_rank"] == 0
                                  and i.get("cp_rank", 0) == 0 and i["pp_rank"] == s) for s in range(pp)]
        workers = {i["node_ip"] for i in [*infos, *getattr(rollout, "infos", [])] if i.get("node_ip")}
        cls = choose_transport(torch.cuda.is_available(), self.cfg.colocated, self.cfg.sync_transport,
                               same_host=lambda strict: ShmTransport.usable(infos, rollout, strict),
                               nodes=len(workers) or 1)
        self.transport: Transport = cls()  # the driver side of the transport (its session fields, its file)
        self.nodes = one_host_nodes(infos, getattr(rollout, "infos", []))
        log.info("weight sync: transport %s (%s)", cls.name, "; ".join(f"{who} on {ip}" for ip, who in self.nodes.items()))
        self.transport.check(self.cfg)
        self._verify_seqs: list[list[int]] | None = None

    def close(self) -> None:
        """Release what the transport holds for this syncer (shm: remove the shared file)."""
        self.transport.close()

    def session(self, **overrides: Any) -> SyncSession:
        host, port = self.rollout.sync_endpoint()
        fields = dict(sync_id=next(_IDS), transport=type(self.transport), host=host, port=port,
                      num_receivers=self.rollout.num_engines, source_ranks=list(self.source_ranks),
                      channel=self.channel, bucket_bytes=int(self.cfg.sync_bucket_mb * (1 << 20)),
                      dtype=self.rollout.dtype, timeout_s=self.cfg.timeout_s, secret=self.secret,
                      digest=self.cfg.verify_digest)
        return SyncSession(**{**fields, **self.transport.session_fields(self), **overrides})

    def canary_due(self) -> bool:
        """Whether the sync just counted runs the log-prob canary: the first, then every `verify_every`-th."""
        every = self.cfg.verify_every
        return every > 0 and (self.num_syncs - 1) % every == 0

    def sync(self, verify: bool | None = None, **session_overrides: Any) -> dict[str, Any]:
        """Push the policy's current weights into every engine; run the log-prob canary when asked (default:
        when `canary_due`)."""
        if self.cfg.sync_lora_adapter:
            return self._finish(self.sync_adapter(), verify)
        t0 = time.perf_counter()
        session = self.session(**session_overrides)
        fut = self.policy.send_weights_to_rollout.remote(session)

        def policy_failed_fast() -> None:  # a policy-side failure ends the wait at once
            if fut.done():
                fut.get()

        try:
            recv = self.rollout.receive_weights(session, on_poll=policy_failed_fast)
        except Exception as exc:
            self.channel = _new_channel()
            self._drain_policy(fut, session)
            raise _as_sync_error(exc, session) from exc
        try:
            sent = fut.get(timeout_s=session.timeout_s + 30.0)
        except Exception as exc:
            self.channel = _new_channel()
            raise _as_sync_error(exc, session) from exc
        elapsed = time.perf_counter() - t0
        self.num_syncs += 1
        src = [s for s in sent if s and s.get("source")]
        stats = {
            "sync/time_s": elapsed,
            "sync/bytes": float(sum(s["bytes"] for s in src)),
            "sync/receive_s": max(r["time_s"] for r in recv),
            # where the time went: the policy's TP/PP gather + HF mapping (shm: the slowest rank writing its
            # shards into the shared file), the source's sends incl. waiting for the engines (shm: setting
            # the done keys), the engines' waits for data; the rest of receive_s is vLLM's reload.
            "sync/gather_s": max((s.get("gather_s", 0.0) for s in src), default=0.0),
            "sync/send_s": max((s.get("send_s", 0.0) for s in src), default=0.0),
            "sync/engine_wait_s": max(r.get("recv_s", 0.0) for r in recv),
            "sync/direct_load": float(all(r.get("load") == "direct" for r in recv)),  # shm: load_direct used
            "sync/zero_copy": float(all(r.get("load") == "shared" for r in recv)),  # shm: share_weights used
        }
        if any("buckets" in s for s in src):  # bucketed transports (shm moves one file, no buckets)
            stats["sync/buckets"] = float(sum(s["buckets"] for s in src))
            stats["sync/max_bucket_mb"] = max(s["max_bucket_bytes"] for s in src) / (1 << 20)
        if session.digest:
            stats.update(check_digests(src, recv))
        return self._finish(stats, verify)

    def _finish(self, stats: dict[str, Any], verify: bool | None) -> dict[str, Any]:
        if verify is None:
            verify = self.canary_due()
        if verify:
            stats.update(self.canary())
        how = "lora adapter" if self.cfg.sync_lora_adapter else self.transport.name
        log.info("weight sync %d (%s): %.3fs, %.1f MB", self.num_syncs, how, stats["sync/time_s"],
                 stats["sync/bytes"] / 1e6)
        return stats

    def sync_adapter(self) -> dict[str, Any]:
        """rollout.sync_lora_adapter: the policy's LoRA adapters (gathered to its rank 0, a few MB) go through
        Ray to every engine, which serves them with vLLM's LoRA support on its unchanged base weights."""
        t0 = time.perf_counter()
        try:
            adapter = self.policy.lora_adapter()
            t1 = time.perf_counter()
            recv = self.rollout.load_lora_adapter(adapter)
        except Exception as exc:
            raise sync_error(exc, f"rollout ranks 0..{self.rollout.num_engines - 1} <- policy rank 0 (LoRA "
                                  f"adapter)") from exc
        self.num_syncs += 1
        nbytes = sum(t.numel() * t.element_size() for t in adapter["tensors"].values())
        return {"sync/time_s": time.perf_counter() - t0, "sync/bytes": float(nbytes), "sync/gather_s": t1 - t0,
                "sync/receive_s": max(r["time_s"] for r in recv), "sync/lora_adapter": 1.0}

    def _drain_policy(self, fut: Any, session: SyncSession) -> None:
        """After a receive failure, let the policy's send finish (it drains and raises); never hang."""
        try:
            fut.get(timeout_s=session.timeout_s + 30.0)
        except Exception as exc:  # noqa: BLE001 - the receive error is the one reported
            log.warning("policy side of the failed weight sync: %s", str(exc).splitlines()[0])

    # ---- verification ------------------------------------------------------------------------
    def verification_sequences(self) -> list[list[int]]:
        """Fixed token sequences (seeded; same for every sync) over the engine's vocabulary."""
        if self._verify_seqs is None:
            g = torch.Generator().manual_seed(1234)
            vocab = self.rollout.vocab_size
            self._verify_seqs = torch.randint(0, vocab, (self.cfg.verify_num_seqs, self.cfg.verify_seq_len),
                                              generator=g).tolist()
        return self._verify_seqs

    def tolerance(self) -> float:
        """The canary's tolerance: `verify_tolerance`, or `verify_tolerance_16bit` when either side computes in 16 bits."""
        full = self.rollout.dtype == self.cfg.policy_dtype == "float32"
        return self.cfg.verify_tolerance if full else self.cfg.verify_tolerance_16bit

    def canary(self) -> dict[str, float]:
        """The log-prob canary: every engine's and the policy's log-probs of the fixed canary batch
        (`verification_sequences`); returns `CANARY_METRICS`, raises WeightSyncError above the tolerance."""
        seqs = self.verification_sequences()
        worst, mean = logprob_gaps(self.policy, self.rollout, seqs)
        tol = self.tolerance()
        if not worst <= tol:
            raise WeightSyncError(
                f"weight sync verification failed: the rollout engines' logprobs differ from the policy's "
                f"compute_logprobs by up to {worst:.3g} (tolerance {tol:g}, engine dtype {self.rollout.dtype}, "
                f"policy dtype {self.cfg.policy_dtype}) on {len(seqs)} fixed sequences after sync {self.num_syncs}")
        return dict(zip(CANARY_METRICS, (worst, mean, tol)))

    def verify(self) -> float:
        """The canary's max |engine - policy| logprob; raises WeightSyncError above tolerance."""
        return self.canary()["mismatch/canary_max_abs_diff"]


def check_digests(sent: list[dict[str, Any]], recv: list[dict[str, Any]]) -> dict[str, float]:
    """Compare the engines' digests of what they hold with the senders' (digest.py); raises
    DigestMismatchError naming the parameter, the engine and the first differing index. Returns the stats:
    tensors compared, engine parameters not digested, and the digests' time (the slowest sender's plus the
    slowest engine's, as if they ran one after the other)."""
    digests: dict[str, Sent] = {}
    names: dict[str, str] = {}
    for s in sent:
        digests.update(s.pop("digests", {}))
        names.update(s.pop("policy_names", {}))
    held: list[HeldDigests] = [r.pop("digests") for r in recv if "digests" in r]
    t = time.perf_counter()
    n = compare(digests, held, names)
    send_s = max((s.get("digest_s", 0.0) for s in sent), default=0.0)
    engine_s = max((h.time_s for h in held), default=0.0)
    skipped = {x for h in held for x in h.skipped}
    compared = {x.engine_name for h in held for x in h.held if all(name in digests for name in x.hf_names)}
    uncompared = {x.engine_name for h in held for x in h.held} - compared
    if skipped or uncompared:
        log.debug("weight sync digest: not compared: %s", ", ".join(sorted(skipped | uncompared)))
    return {"sync/digest_s": send_s + engine_s + time.perf_counter() - t, "sync/digest_send_s": send_s,
            "sync/digest_engine_s": engine_s, "sync/digest_tensors": float(n),
            "sync/digest_skipped": float(len(skipped | uncompared))}


def compare_logprobs(policy_group: Any, rollout: Any, seqs: list[list[int]], prompt_len: int = 4) -> float:
    """Max abs difference between every engine's and the policy's logprobs of the tokens after `prompt_len`."""
    return logprob_gaps(policy_group, rollout, seqs, prompt_len)[0]


def logprob_gaps(policy_group: Any, rollout: Any, seqs: list[list[int]], prompt_len: int = 4) -> tuple[float, float]:
    """(max, mean) |engine - policy| logprob of the tokens after `prompt_len`, over every engine."""
    ids = torch.tensor(seqs, dtype=torch.long)
    batch = Batch({"input_ids": ids, "attention_mask": torch.ones_like(ids),
                   "responses": ids[:, prompt_len:].clone(), "response_mask": torch.ones_like(ids[:, prompt_len:])})
    pol = policy_group.compute_logprobs(batch)["logprobs"].float()
    gaps = [(torch.tensor(eng, dtype=torch.float32)[:, prompt_len - 1:] - pol).abs() for eng in rollout.score_all(seqs)]
    every = torch.cat([g.flatten() for g in gaps])
    return float(every.max()), float(every.mean())


def _new_channel() -> str:
    """A fresh process-group name: two policies syncing into the same engines never share one."""
    return uuid.uuid4().hex[:12]


def _as_sync_error(exc: BaseException, session: SyncSession) -> WeightSyncError:
    if isinstance(exc, WeightSyncError):
        return exc
    where = (f"rollout ranks 0..{session.num_receivers - 1} <- policy ranks {session.source_ranks} "
             f"({session.transport.name}, timeout {session.timeout_s:g}s)")
    return sync_error(exc, where, timed_out=is_timeout(exc) or "WeightSyncTimeout" in str(exc))
