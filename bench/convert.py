"""Bench: HF <-> megatron-core conversion of a ~100M-parameter model (preset base-qwen2), time and memory.

Runs `rlhf convert hf-to-mcore` (TP1 PP1) and `rlhf convert mcore-to-hf` as subprocesses and samples the
resident memory of the whole process tree (the CLI, its spawned rank, dist_checkpointing's forked writer
processes) every 100 ms. The tree's memory is the sum of PSS (proportional set size: each shared page
counted once across processes); a plain RSS sum would count the forked writers' copy-on-write pages
several times. Prints seconds and peak memory per direction, the peak as a ratio to the HF checkpoint's
bytes, and the same ratio after subtracting the baseline of the processes (CLI + bare rank with their
imports, no model). Ends with `RATIO convert_peak_rss_vs_ckpt <max over both directions>` (PSS based).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench._common import WORK, machine_line, ratio_line, table

PY = sys.executable


def _tree_pss(proc: psutil.Process) -> tuple[int, int]:
    """(PSS sum, RSS sum) over `proc` and its descendants."""
    pss = rss = 0
    for p in [proc, *proc.children(recursive=True)]:
        try:
            info = p.memory_full_info()
        except psutil.Error:
            continue
        pss += info.pss
        rss += info.rss
    return pss, rss


def run_measured(cmd: list[str]) -> tuple[float, int, int]:
    """Run `cmd`; return (seconds, peak PSS sum, peak RSS sum) of its process tree, in bytes."""
    t0 = time.monotonic()
    popen = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    proc = psutil.Process(popen.pid)
    peak = peak_rss = 0
    done = threading.Event()

    def sample() -> None:
        nonlocal peak, peak_rss
        while not done.is_set():
            pss, rss = _tree_pss(proc)
            peak, peak_rss = max(peak, pss), max(peak_rss, rss)
            time.sleep(0.1)

    th = threading.Thread(target=sample, daemon=True)
    th.start()
    out, _ = popen.communicate()
    done.set()
    th.join()
    seconds = time.monotonic() - t0
    if popen.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({popen.returncode}):\n{out[-4000:]}")
    return seconds, peak, peak_rss


def bare_pss(imports: str) -> int:
    """PSS of one process after `imports` (no model)."""
    code = f"import psutil; {imports}; print(psutil.Process().memory_full_info().pss)"
    return int(subprocess.check_output([PY, "-W", "ignore", "-c", code], text=True).strip().splitlines()[-1])


def main() -> None:
    from rlhf.tiny_models import create_tiny_model

    print(machine_line())
    root = WORK / "convert"
    hf = root / "base-qwen2"
    if not (hf / "model.safetensors").is_file():
        shutil.rmtree(hf, ignore_errors=True)
        create_tiny_model("base-qwen2", hf)
    ckpt_bytes = sum(f.stat().st_size for f in hf.glob("*.safetensors"))
    n_params = ckpt_bytes // 4
    mcore, back = root / "mcore", root / "back"
    cli = [PY, "-W", "ignore", "-m", "rlhf", "convert"]
    rows, ratios, measured = [], {}, {}
    for name, cmd in [
        ("hf-to-mcore", [*cli, "hf-to-mcore", "--hf", str(hf), "--out", str(mcore), "--force"]),
        ("mcore-to-hf", [*cli, "mcore-to-hf", "--mcore", str(mcore), "--out", str(back), "--force"]),
    ]:
        measured[name] = run_measured(cmd)
    base = bare_pss("import torch, transformers") + bare_pss(
        "import torch, transformers, megatron.core.models.gpt; from megatron.core import dist_checkpointing"
    )
    for name, (seconds, peak, peak_rss) in measured.items():
        ratios[name] = peak / ckpt_bytes
        rows.append([name, round(seconds, 1), round(peak / 2**20), round(peak_rss / 2**20), round(ratios[name], 3),
                     round((peak - base) / ckpt_bytes, 3)])
    print(f"model: base-qwen2, ~{n_params / 1e6:.0f}M parameters, fp32 checkpoint {ckpt_bytes / 2**20:.0f} MiB")
    print(f"baseline PSS of CLI + bare rank (imports only, no model): {base / 2**20:.0f} MiB")
    print(table(["direction", "seconds", "peak PSS MiB", "peak RSS sum MiB", "peak / ckpt", "(peak - baseline) / ckpt"],
                rows))
    print(ratio_line("convert_hf_to_mcore_peak_rss_vs_ckpt", ratios["hf-to-mcore"]))
    print(ratio_line("convert_mcore_to_hf_peak_rss_vs_ckpt", ratios["mcore-to-hf"]))
    print(ratio_line("convert_peak_rss_vs_ckpt", max(ratios.values())))


if __name__ == "__main__":
    main()
