#!/usr/bin/env bash
# The GPU check: one prepared script for a single-GPU CUDA machine, meant to finish in under 8 minutes.
#
#   bash bench/gpu_check.sh            # from the repository root; the log goes to $OUT/gpu_check.log if OUT
#                                      # is set, else runs/bench/gpu_check.log
#
# Steps (each bounded by a timeout taken from an overall deadline, each reported, none fatal):
#   1. environment: nvidia-smi, the Python picked, versions of torch / vllm / transformer-engine / megatron-core.
#   2. install: if something the check needs is missing, pip-install it (the `gpu` extra's vllm and
#      transformer-engine, plus the project's base dependencies) into a venv that sees the system packages,
#      with torch pinned to the torch already there, so a working CUDA torch is never replaced. Skipped when
#      everything imports, or with GPU_CHECK_NO_INSTALL=1. The project itself is used from this checkout
#      through PYTHONPATH (no editable install, which would pin torch==2.13.0).
#   3. tests: `pytest -m gpu` (the test subset marked gpu).
#   4. policy train_step MFU of a ~0.5B-parameter Qwen2-shaped model (random weights) through our
#      MegatronEngine (bf16, Megatron DDP + optimizer, a clipped policy-gradient loss over vocab-parallel
#      logprobs): achieved FLOP/s from 6*N + 12*L*H*S per token, over the GPU's dense bf16 peak (a table
#      by device name; set PEAK_TFLOPS to override).
#   5. vLLM rollout tokens/s of the same model through our RolloutWorker (bf16, 256 prompts x 256 tokens,
#      ignore_eos).
# The Python parts live in bench/_gpu_sections.py (checked by ruff with the rest of the repo). Sections 4-5
# each run in their own process and report `[section] {json}`; a missing piece is reported, not fatal. The
# last line is `GPU_CHECK_SUMMARY {json}`.
#
# Knobs (environment): OUT, PYBIN (the Python to use), GPU_CHECK_NO_INSTALL=1, GPU_CHECK_DEADLINE_S (470),
# GPU_CHECK_TESTS (the test paths for step 3, default `tests`: on a machine without Ray or vLLM, name the files
# whose imports it has, since one module that fails to import stops the whole collection),
# PEAK_TFLOPS, GPU_CHECK_PRESET (default gpu-0.5b; e.g. arith-qwen2 to rehearse the script on a CPU box with
# GPU_CHECK_ALLOW_CPU=1, which runs sections 4-5 on CPU at toy sizes).
#
# Written on a CPU-only machine: sections 4-5 were rehearsed there on CPU with a tiny preset
# (GPU_CHECK_ALLOW_CPU=1 GPU_CHECK_PRESET=arith-qwen2). It ran once on an H200 without vLLM or TE (no
# network there: megatron-core carried on PYTHONPATH); bench/RESULTS.md has what that run gave.

set -u
cd "$(dirname "$0")/.." || exit 1
REPO=$(pwd)
LOG_DIR=${OUT:-$REPO/runs/bench}
mkdir -p "$LOG_DIR"
LOG=$LOG_DIR/gpu_check.log
: >"$LOG"
exec > >(tee -a "$LOG") 2>&1
START=$(date +%s)
DEADLINE=${GPU_CHECK_DEADLINE_S:-470}
WORK=${TMPDIR:-/tmp}/rlhf-gpu-check-$$
mkdir -p "$WORK"
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export GPU_CHECK_WORK=$WORK
declare -A STATUS

left() { echo $((DEADLINE - ($(date +%s) - START))); }
# cap SECONDS: min(SECONDS, time left - reserve), at least 5
cap() { local l; l=$(($(left) - ${2:-0})); [ "$l" -lt "$1" ] && echo $((l > 5 ? l : 5)) || echo "$1"; }
banner() { echo; echo "=== $* (t=$(($(date +%s) - START)) s, $(left) s left)"; }

banner "gpu_check on $(hostname) at $(date -u +%Y-%m-%dT%H:%M:%SZ), commit $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
nvidia-smi 2>&1 | head -20 || echo "nvidia-smi: not found"

# ---- 1. pick a Python: one whose torch sees CUDA, else the first that exists ----------------------------
pick_python() {
    local c first=""
    for c in ${PYBIN:-} "$REPO/.venv/bin/python" python3.11 python3.12 python3 python; do
        command -v "$c" >/dev/null 2>&1 || [ -x "$c" ] || continue
        [ -z "$first" ] && first=$c
        if "$c" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" >/dev/null 2>&1; then
            echo "$c"; return
        fi
    done
    echo "${first:-python3}"
}
PY=$(pick_python)
banner "1. environment: python $PY"
"$PY" "$REPO/bench/_gpu_sections.py" environment

# ---- 2. install what is missing -------------------------------------------------------------------------
missing() {
    "$PY" "$REPO/bench/_gpu_sections.py" missing
}
banner "2. install"
MISSING=$(missing)
STATUS[install]="nothing missing"
if [ -n "$MISSING" ]; then
    echo "missing: $MISSING"
    if [ "${GPU_CHECK_NO_INSTALL:-0}" = 1 ]; then
        STATUS[install]="skipped (GPU_CHECK_NO_INSTALL=1); missing: $MISSING"
    else
        TORCH_V=$("$PY" -c "import torch; print(torch.__version__.split('+')[0])" 2>/dev/null || echo "")
        if ! "$PY" -m pip --version >/dev/null 2>&1 || \
           ! "$PY" -c "import sys, sysconfig, os; sys.exit(0 if os.access(sysconfig.get_paths()['purelib'], os.W_OK) else 1)"; then
            echo "site-packages not writable: making a venv with --system-site-packages"
            "$PY" -m venv --system-site-packages "$REPO/runs/gpu-venv" && PY=$REPO/runs/gpu-venv/bin/python
        fi
        : >"$WORK/constraints.txt"
        [ -n "$TORCH_V" ] && echo "torch==$TORCH_V" >"$WORK/constraints.txt"
        T=$(cap 200 240)
        echo "pip install (timeout ${T}s, torch held at ${TORCH_V:-<none>}): $MISSING"
        # shellcheck disable=SC2086
        if eval timeout "$T" "$PY" -m pip install -q -c "$WORK/constraints.txt" $MISSING; then
            STATUS[install]="installed: $MISSING"
        else
            echo "pip install of everything failed or timed out; trying one by one"
            STATUS[install]="partial"
            for req in $MISSING; do
                [ "$(left)" -lt 250 ] && { echo "no time left for installs"; break; }
                eval timeout "$(cap 60 250)" "$PY" -m pip install -q -c "$WORK/constraints.txt" "$req" \
                    || echo "  could not install $req"
            done
        fi
        echo "still missing: $(missing)"
    fi
fi

# ---- 3. tests marked gpu -----------------------------------------------------------------------------
banner "3. pytest -m gpu"
T=$(cap 150 200)
# shellcheck disable=SC2086
timeout "$T" "$PY" -m pytest -m gpu -q -rs -p no:cacheprovider ${GPU_CHECK_TESTS:-tests} 2>&1 | tail -40
RC=${PIPESTATUS[0]}
case $RC in
    0) STATUS[tests]="passed" ;;
    5) STATUS[tests]="no tests collected (rc 5)" ;;
    124) STATUS[tests]="timed out after ${T}s" ;;
    *) STATUS[tests]="failed (rc $RC)" ;;
esac

# ---- 4-5. the Python sections --------------------------------------------------------------------------

run_section() {  # name, max seconds, seconds to keep for later steps
    local T; T=$(cap "$2" "$3")
    banner "$1 (timeout ${T}s)"
    timeout "$T" "$PY" "$REPO/bench/_gpu_sections.py" "$1"
    local rc=$?
    [ $rc -eq 124 ] && echo "[$1] {\"ok\": false, \"error\": \"timed out after ${T}s\"}" \
        && echo "{\"ok\": false, \"error\": \"timed out after ${T}s\"}" >"$WORK/$1.json"
    [ -f "$WORK/$1.json" ] || echo "{\"ok\": false, \"error\": \"exited $rc without a result\"}" >"$WORK/$1.json"
}
run_section model 120 150
run_section mfu 150 100
run_section rollout 200 5

# ---- summary -----------------------------------------------------------------------------------------
banner "summary"
STATUS_INSTALL=${STATUS[install]} STATUS_TESTS=${STATUS[tests]} ELAPSED=$(($(date +%s) - START)) \
    "$PY" "$REPO/bench/_gpu_sections.py" summary
echo "log: $LOG"
rm -rf "$WORK"
