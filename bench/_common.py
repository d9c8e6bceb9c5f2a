"""Shared helpers of the bench scripts (a helper: `make bench` runs only bench/[!_]*.py).

- `machine()`: cores, CPU model and load, for tables and bench/RESULTS.md.
- `prepare_arith(...)`: the arithmetic task files and a (cached) SFT warm start of a tiny model.
- `run_ours(...)`: `rlhf train ...` as a subprocess, read back from metrics.jsonl, optionally stopped after a
  wall-clock budget (SIGINT first, so the driver shuts its Ray instance down itself).
- `run_trl(...)`: bench/_trl_grpo.py as a subprocess.
- `table(...)`, `median(...)`, `ratio_line(...)`.
- `digit_fraction`: a reward with spread on a random-init model (used by the "small" scale), importable as
  `bench._common:digit_fraction` by our driver (PYTHONPATH is set to the repo root).
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

# Under CPU contention torch's OpenMP threads spin at barriers, and a 2-thread process ran 5-10x slower than a
# 1-thread one here (TRL tiny step 3-12 s against 0.8 s at load 8-10); a passive wait policy removes that
# (0.7 s with 2 threads at load 20). Both sides of every comparison (and this process) get the same setting.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

REPO = Path(__file__).resolve().parents[1]
PY = sys.executable
WORK = REPO / "runs" / "bench"
CACHE = WORK / "cache"


def digit_fraction(prompt, response, ground_truth) -> float:
    """The fraction of the response's characters that are digits (0 for an empty response)."""
    text = response if isinstance(response, str) else str(response or "")
    return sum(c.isdigit() for c in text) / len(text) if text else 0.0


def machine() -> dict:
    model = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    load = os.getloadavg() if hasattr(os, "getloadavg") else (0.0, 0.0, 0.0)
    return {"cores": os.cpu_count(), "cpu": model, "load1": round(load[0], 2)}


def machine_line() -> str:
    m = machine()
    return f"machine: {m['cores']} cores, {m['cpu']}, load average {m['load1']} at start"


def median(xs) -> float:
    xs = [float(x) for x in xs]
    return statistics.median(xs) if xs else float("nan")


def table(headers: list[str], rows: list[list]) -> str:
    def fmt(v) -> str:
        if isinstance(v, float):
            return f"{v:.4g}"
        return str(v)

    cells = [[fmt(v) for v in r] for r in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(headers)]
    line = "| " + " | ".join(h.ljust(w) for h, w in zip(headers, widths)) + " |"
    sep = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    body = ["| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |" for r in cells]
    return "\n".join([line, sep, *body])


def ratio_line(name: str, value: float) -> str:
    return f"RATIO {name} {value:.3f}"


# ---------------------------------------------------------------- the arithmetic task and its warm start


def arith_data(seed: int = 0, val_size: int = 200) -> dict[str, Path]:
    """rl_train/rl_val/sft_* jsonl files of the arithmetic task (rlhf.data.arithmetic), written once."""
    from rlhf.data.arithmetic import write_arithmetic_data

    out = CACHE / f"arith-data-s{seed}-v{val_size}"
    names = ("rl_train", "rl_val", "sft_train", "sft_val", "pretrain")
    if not all((out / f"{n}.jsonl").exists() for n in names):
        write_arithmetic_data(out, seed=seed, val_size=val_size)
    return {n: out / f"{n}.jsonl" for n in names}


def read_jsonl(path: str | Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def qa_pairs(path: str | Path) -> list[tuple[list, str]]:
    """(chat messages, answer) pairs of an rl_*.jsonl file: the prompts both sides see."""
    return [(r["messages"], str(r["answer"])) for r in read_jsonl(path)]


def widened_preset(base: str, width: int) -> str:
    """Register (in this process) `base` with hidden and FFN sizes times `width`; heads unchanged (head_dim grows)."""
    from rlhf import tiny_models

    if width == 1:
        return base
    name = f"{base}-w{width}"
    p = tiny_models.get_preset(base)
    tiny_models.PRESETS[name] = dataclasses.replace(
        p, hidden_size=p.hidden_size * width, intermediate_size=p.intermediate_size * width
    )
    return name


def model_dir(preset: str, width: int = 1, warm_steps: int = 0, warm_lr: float = 1e-3, seed: int = 0,
              data: dict[str, Path] | None = None, batch: int = 128) -> Path:
    """An HF model folder of `preset` (hidden width times `width`), SFT-warm-started for `warm_steps` steps on
    the arithmetic train pairs with rlhf.driver.warmstart.hf_sft.sft_warm_start. Cached under runs/bench/cache."""
    name = widened_preset(preset, width)
    base = CACHE / f"{name}-s{seed}"
    if not (base / "config.json").exists():
        from rlhf.tiny_models import create_tiny_model

        create_tiny_model(name, base, seed=seed)
    if warm_steps <= 0:
        return base
    warm = CACHE / f"{name}-s{seed}-warm{warm_steps}-lr{warm_lr:g}-b{batch}"
    if not (warm / "config.json").exists():
        from rlhf.driver.warmstart.hf_sft import sft_warm_start

        data = data or arith_data(seed)
        pairs = [(q, a) for q, a in qa_pairs(data["rl_train"])]
        t = time.perf_counter()
        sft_warm_start(base, pairs, warm, steps=warm_steps, batch_size=batch, lr=warm_lr, seed=seed)
        print(f"warm start {name}: {warm_steps} SFT steps in {time.perf_counter() - t:.1f} s -> {warm}", flush=True)
    return warm


def param_count(model_path: str | Path) -> int:
    from safetensors import safe_open

    n = 0
    for f in Path(model_path).glob("*.safetensors"):
        with safe_open(str(f), "pt") as st:
            for k in st.keys():  # noqa: SIM118 - a safetensors handle, not a dict
                shape = st.get_slice(k).get_shape()
                size = 1
                for d in shape:
                    size *= d
                n += size
    return n


# ---------------------------------------------------------------- running the two sides


def _env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("HF_DATASETS_OFFLINE", "1")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    return env


def _descendants(pid: int) -> list:
    try:
        import psutil

        return psutil.Process(pid).children(recursive=True)
    except Exception:  # noqa: BLE001 - gone or unreadable: nothing to stop
        return []


def _stop(proc: subprocess.Popen, grace_s: float = 120.0) -> None:
    """SIGINT the driver (its `finally` shuts Ray down), then SIGTERM/SIGKILL it and whatever it started."""
    kids = _descendants(proc.pid)
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            pass
    for sig in (signal.SIGTERM, signal.SIGKILL):
        alive = [k for k in kids if k.is_running()] + ([proc] if proc.poll() is None else [])
        if not alive:
            break
        for k in alive:
            try:
                k.send_signal(sig)
            except Exception:  # noqa: BLE001 - already gone
                pass
        time.sleep(5)
    if proc.poll() is None:
        proc.wait(10)


def run_ours(config: str, overrides: list[str], out_dir: Path, budget_s: float | None = None,
             timeout_s: float = 1800.0, poll_s: float = 0.25, env: dict[str, str] | None = None) -> dict:
    """Run `rlhf train config overrides` with trainer.output_dir=out_dir and read its metrics.jsonl.

    Every metrics row gets `arrival_s` (seconds since launch when the bench saw it) and `train_s` (the sum of
    step_time_s up to that step: the training clock, which leaves out start-up and validation). With
    `budget_s`, the run is stopped (SIGINT, then harder) once the training clock reaches it, and rows past
    the budget are dropped. `env`: more environment variables for the run. Returns rows, the setup time
    (launch to the first step start) and the exit code.
    """
    import shutil

    if out_dir.exists():
        shutil.rmtree(out_dir)
    out_dir.mkdir(parents=True)
    metrics = out_dir / "metrics.jsonl"
    cmd = [PY, "-m", "rlhf", "train", config, f"trainer.output_dir={out_dir}", *overrides]
    logp = out_dir.parent / f"{out_dir.name}.log"
    log = logp.open("w")
    log.write(" ".join(cmd) + "\n")
    log.flush()
    t_launch = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=REPO, env={**_env(), **(env or {})}, stdout=log, stderr=subprocess.STDOUT)
    rows: list[dict] = []
    seen = 0
    t_first: float | None = None
    train_s = 0.0
    stopped = False
    try:
        while True:
            done = proc.poll() is not None
            if metrics.exists():
                lines = metrics.read_text().splitlines()
                now = time.perf_counter() - t_launch
                for line in lines[seen:]:
                    if not line.endswith("}"):
                        break  # partly written
                    row = json.loads(line)
                    row["arrival_s"] = now
                    if row.get("step", 0) >= 1 and "step_time_s" in row:
                        train_s += float(row["step_time_s"])
                        if t_first is None:
                            t_first = now - float(row["step_time_s"])
                    row["train_s"] = train_s
                    rows.append(row)
                    seen += 1
            if done:
                break
            if budget_s is not None and train_s >= budget_s:
                stopped = True
                break
            if time.perf_counter() - t_launch > timeout_s:
                stopped = True
                print(f"run_ours: {out_dir.name} hit the {timeout_s:.0f} s timeout", flush=True)
                break
            time.sleep(poll_s)
    finally:
        if proc.poll() is None:
            _stop(proc)
        log.close()
    if budget_s is not None:
        # keep the step that crossed the budget and its validation, as TRL stops at the step that crosses it
        last = next((r["step"] for r in rows if r["train_s"] >= budget_s and r.get("step", 0) >= 1), None)
        rows = [r for r in rows if last is None or r.get("step", 0) <= last]
    rc = proc.returncode
    if not stopped and rc != 0:
        tail = logp.read_text().splitlines()[-30:]
        raise RuntimeError(f"rlhf train exited {rc}; log tail:\n" + "\n".join(tail))
    return {"rows": rows, "setup_s": t_first, "returncode": rc, "stopped": stopped, "log": str(logp)}


def run_trl(spec: dict, timeout_s: float = 1800.0) -> dict:
    """Run bench/_trl_grpo.py on `spec` (written to out_dir/spec.json) and return its result.json."""
    out = Path(spec["out_dir"])
    out.mkdir(parents=True, exist_ok=True)
    (out / "spec.json").write_text(json.dumps(spec, indent=1, default=str))
    logp = out.parent / f"{out.name}.log"
    with logp.open("w") as log:
        proc = subprocess.run([PY, str(REPO / "bench" / "_trl_grpo.py"), str(out / "spec.json")], cwd=REPO,
                              env=_env(), stdout=log, stderr=subprocess.STDOUT, timeout=timeout_s)
    if proc.returncode != 0:
        tail = logp.read_text().splitlines()[-30:]
        raise RuntimeError(f"TRL run exited {proc.returncode}; log tail:\n" + "\n".join(tail))
    res = json.loads((out / "result.json").read_text())
    res["log"] = str(logp)
    return res


def step_times(rows: list[dict], skip: int = 1) -> list[float]:
    """step_time_s of the training rows (step >= 1), without the first `skip` (warm-up) steps."""
    ts = [float(r["step_time_s"]) for r in rows if r.get("step", 0) >= 1 and "step_time_s" in r]
    return ts[skip:] if len(ts) > skip else ts
