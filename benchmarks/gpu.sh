#!/usr/bin/env bash
# The one script to run on a CUDA machine (written for one H200, Python 3.12, torch 2.11 + CUDA 13, no
# network; under 8 minutes). It runs mixprec from this checkout's src/ (no install, no downloads) and does:
#   1. the CUDA tests (tests/test_cuda.py and any test marked `cuda`), if pytest is installed;
#   2. `mixprec bench` on CUDA, size large (sized for a GPU): fp32, torch.amp fp16/bf16, mixprec fp16/bf16,
#      O2 fp16/bf16, bf16-true(+kahan), and every registered fp8 mode, modes interleaved round by round;
#   3. benchmarks/precision_paths.py, benchmarks/fp8_lm.py and benchmarks/lowbit_lm.py (every lowbit recipe's
#      step time and loss against bf16) with --device cuda, where those scripts exist;
#   4. benchmarks/plan_cost.py --device cuda: the planner's measured GEMM cost per format (cost="measured")
#      on the bench's lm and teacher-MLP layer shapes and two large ones, beside the b200/h100 rooflines;
# then writes RESULTS_DIR/gpu.json (everything, one file) and RESULTS_DIR/gpu.md (the Markdown tables).
#
#   bash benchmarks/gpu.sh [RESULTS_DIR]        # default RESULTS_DIR: ./gpu-results
#   SIZES="default large" bash benchmarks/gpu.sh  # also the default (CPU-sized) bench; adds ~2 min
#   GPU_SH_DRY_RUN=1 bash benchmarks/gpu.sh DIR   # no GPU: the bench on the CPU at size tiny, GPU-only
#                                                 # steps printed instead of run (checks the plumbing)
# Each step has a time limit (seconds; env LIMIT_TESTS, LIMIT_BENCH, LIMIT_EXTRA); a step that fails or
# runs out of time is recorded in gpu.json and the script goes on. Exit code: 0 when every step passed.
set -uo pipefail

root="$(cd "$(dirname "$0")/.." && pwd)"
out="$(mkdir -p "${1:-./gpu-results}" && cd "${1:-./gpu-results}" && pwd)"
cd "$root"
export PYTHONPATH="$root/src${PYTHONPATH:+:$PYTHONPATH}" MPLBACKEND=Agg PIP_DISABLE_PIP_VERSION_CHECK=1
dry="${GPU_SH_DRY_RUN:-0}"
start=$(date +%s)
: > "$out/steps.tsv"  # one line per step: name, exit code, seconds

step() {  # step NAME LIMIT_S COMMAND...: run with a time limit, log to $out/NAME.log, record the outcome
    local name=$1 limit=$2 begin rc
    shift 2
    echo "== $name (limit ${limit} s): $*" >&2
    begin=$(date +%s)
    timeout "$limit" "$@" > >(tee "$out/$name.log") 2> >(tee "$out/$name.err" >&2)
    rc=$?
    printf '%s\t%s\t%s\n' "$name" "$rc" "$(( $(date +%s) - begin ))" >> "$out/steps.tsv"
    return 0
}

skip() {  # skip NAME WHY: record a step that did not run
    echo "== $1: skipped ($2)" >&2
    printf '%s\tskipped: %s\t0\n' "$1" "$2" >> "$out/steps.tsv"
}

python - <<'EOF' || exit 2
import os, sys, torch
dry = os.environ.get("GPU_SH_DRY_RUN", "0") == "1"
if not torch.cuda.is_available() and not dry:
    sys.exit(f"benchmarks/gpu.sh needs a CUDA device; torch {torch.__version__} sees none "
             "(GPU_SH_DRY_RUN=1 checks the script on a CPU)")
where = torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU (dry run)"
print(f"{where} | torch {torch.__version__} | CUDA {torch.version.cuda} | Python {sys.version.split()[0]}",
      file=sys.stderr)
EOF

if [ "$dry" = 1 ]; then
    device=cpu sizes="${SIZES:-tiny}" modes="${MODES:-fp32,torch-amp-bf16,mixprec-bf16}"
else
    device=cuda sizes="${SIZES:-large}"
    fp8=$(python -c "from mixprec.bench.modes import MODES; print(','.join(m for m in MODES if m.startswith('fp8')))")
    base="fp32,torch-amp-fp16,torch-amp-bf16,mixprec-fp16,mixprec-bf16,O2-fp16,O2-bf16,bf16-true,bf16-true-kahan"
    modes="${MODES:-$base${fp8:+,$fp8}}"
fi

# 1. CUDA tests
if [ "$dry" = 1 ]; then
    skip tests "dry run: would run python -m pytest -q tests/test_cuda.py and -m cuda"
elif python -c "import pytest" 2>/dev/null; then
    step tests "${LIMIT_TESTS:-120}" bash -c \
        'python -m pytest -q -p no:cacheprovider tests/test_cuda.py && \
         { python -m pytest -q -p no:cacheprovider -m cuda tests; rc=$?; [ $rc -eq 0 ] || [ $rc -eq 5 ]; }'
else
    skip tests "pytest is not installed on this machine"
fi

# 2. the bench on the GPU
for size in $sizes; do
    step "bench-$size" "${LIMIT_BENCH:-180}" python -m mixprec bench --device "$device" --size "$size" \
        --modes "$modes" ${WORKLOADS:+--workload "$WORKLOADS"} \
        --json "$out/bench-$size.json" --log "$out/bench-$size-steps.jsonl" --plot "$out/plots-$size"
done

# 3. the other GPU benchmarks, where this checkout has them
if [ -f benchmarks/precision_paths.py ]; then
    if [ "$dry" = 1 ]; then
        skip precision_paths "dry run: would run python benchmarks/precision_paths.py --json DIR/precision_paths.json"
    else
        step precision_paths "${LIMIT_EXTRA:-90}" python benchmarks/precision_paths.py --json "$out/precision_paths.json"
    fi
fi
if [ -f benchmarks/fp8_lm.py ]; then
    if [ "$dry" = 1 ]; then
        skip fp8_lm "dry run: would run python benchmarks/fp8_lm.py --device cuda --size large --json DIR/fp8_lm.json"
    else
        step fp8_lm "${LIMIT_EXTRA:-90}" python benchmarks/fp8_lm.py --device cuda --size large --steps 200 \
            --json "$out/fp8_lm.json"
    fi
fi
if [ -f benchmarks/lowbit_lm.py ]; then
    if [ "$dry" = 1 ]; then
        skip lowbit_lm "dry run: would run python benchmarks/lowbit_lm.py --task lm --device cuda --json DIR/lowbit_lm.json"
    else
        step lowbit_lm "${LIMIT_EXTRA:-90}" python benchmarks/lowbit_lm.py --task lm --device cuda --steps 100 \
            --json "$out/lowbit_lm.json"
    fi
fi

# 4. the planner's measured cost per format and layer shape (the dry run times two formats on the CPU)
if [ -f benchmarks/plan_cost.py ]; then
    if [ "$dry" = 1 ]; then
        step plan_cost "${LIMIT_EXTRA:-90}" python benchmarks/plan_cost.py --device cpu --threads 1 \
            --formats fp8_rowwise,bf16 --repeats 1 --json "$out/plan_cost.json"
    else
        step plan_cost 60 python benchmarks/plan_cost.py --device cuda --shape 4096,4096,4096 \
            --shape 8192,8192,8192 --json "$out/plan_cost.json"
    fi
fi

python benchmarks/gpu_summary.py "$out" "$(( $(date +%s) - start ))"
status=$?
echo "gpu.sh: $(( $(date +%s) - start )) s; results: $out/gpu.json, $out/gpu.md" >&2
exit "$status"
