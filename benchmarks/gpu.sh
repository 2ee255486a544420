#!/usr/bin/env bash
# The one device check: the script to run on a CUDA machine (written for one H200, Python 3.12, torch 2.11 +
# CUDA 13, no network, mixprec installed with `pip install --no-deps -e .`). The whole run fits a budget
# of GPU_SH_BUDGET seconds (default 450). Steps, cheapest and most telling first, with their limits (s):
#   env              25  benchmarks/gpu_env.py: device, capability, versions, which optional packages import
#   numerics         60  benchmarks/gemm_numerics.py: every lowbit recipe's fprop/dgrad/wgrad on the path
#                        lowbit_mm takes (tensor cores where there is a kernel) against the emulation
#   lowbit_lm        80  benchmarks/lowbit_lm.py --task lm: each lowbit recipe's step time and loss vs bf16
#   plan_cost        60  benchmarks/plan_cost.py: the planner's measured GEMM cost per format and shape
#   bench            75  mixprec bench --size large --workload lm --steps 150: fp32, torch.amp, mixprec, O2,
#                        bf16-true(+kahan) and the fp8 modes interleaved (no --plot without matplotlib; the
#                        cnn / tabular workloads, when asked for in WORKLOADS, need scikit-learn)
#   tests            60  pytest tests/test_cuda.py, and the tests marked `cuda` (-m cuda) in their files
#   precision_paths  40  benchmarks/precision_paths.py --device cuda --in-process: each precision path's
#                        step time and memory (skips torch-optimi's rows when it is missing)
# then writes RESULTS_DIR/gpu.json (everything, one file) and RESULTS_DIR/gpu.md (the Markdown tables).
# Each step's limit is clamped to what is left of the budget (5 s kept for the summary); a step with
# under 10 s left, or whose package is missing, is recorded as skipped with why. A step that fails or runs
# out of time is recorded and the script goes on. Exit code: 0 when every step that ran passed.
#
#   bash benchmarks/gpu.sh [RESULTS_DIR]              # default RESULTS_DIR: ./gpu-results
#   bash benchmarks/gpu.sh --plan                     # print each step, its limit and command, and the sum
#   bash benchmarks/gpu.sh --dry-run DIR              # no GPU: every step on the CPU at toy size (CI);
#                                                     # GPU_SH_DRY_RUN=1 is the same; tests are skipped
#   ONLY=env,numerics bash benchmarks/gpu.sh DIR      # only these steps
#   GPU_SH_BUDGET=300 bash benchmarks/gpu.sh DIR      # a smaller budget (clamps the limits)
# Overrides: LIMIT_<STEP> (e.g. LIMIT_BENCH=90), MODES, WORKLOADS, BENCH_STEPS, SIZE (the bench's --size).
set -uo pipefail

STEPS=(env numerics lowbit_lm plan_cost bench tests precision_paths)
declare -A LIMIT=([env]=25 [numerics]=60 [lowbit_lm]=80 [plan_cost]=60 [bench]=75 [tests]=60 [precision_paths]=40)
MIN_LEFT=10 SUMMARY_S=5

die() { echo "gpu.sh: $*" >&2; exit 2; }
dry="${GPU_SH_DRY_RUN:-0}" plan=0 results=""
for arg in "$@"; do
    case $arg in
        --dry-run) dry=1 ;;
        --plan) plan=1 ;;
        -h | --help) sed -n '2,/^set -uo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
        -*) die "unknown option $arg (accepted: --dry-run, --plan, -h, and RESULTS_DIR)" ;;
        *) [ -z "$results" ] || die "one RESULTS_DIR, got '$results' and '$arg'"; results=$arg ;;
    esac
done
budget="${GPU_SH_BUDGET:-450}"
[[ $budget =~ ^[0-9]+$ ]] || die "GPU_SH_BUDGET must be a whole number of seconds, got '$budget'"
[[ $dry =~ ^[01]$ ]] || die "GPU_SH_DRY_RUN must be 0 or 1, got '$dry'"
selected="${ONLY:-$(IFS=,; echo "${STEPS[*]}")}"
only=",$selected,"
for name in ${selected//,/ }; do
    [[ " ${STEPS[*]} " == *" $name "* ]] || die "ONLY: unknown step '$name'; steps: ${STEPS[*]}"
done
for name in "${STEPS[@]}"; do
    var="LIMIT_${name^^}"
    LIMIT[$name]="${!var:-${LIMIT[$name]}}"
    [[ ${LIMIT[$name]} =~ ^[0-9]+$ ]] || die "$var must be a whole number of seconds, got '${LIMIT[$name]}'"
done

root="$(cd "$(dirname "$0")/.." && pwd)"
results="${results:-./gpu-results}"
if [ "$plan" = 1 ]; then
    out="<RESULTS_DIR>"
else
    out="$(mkdir -p "$results" && cd "$results" && pwd)" || die "cannot create RESULTS_DIR '$results'"
fi
cd "$root"
export PYTHONPATH="$root/src${PYTHONPATH:+:$PYTHONPATH}" MPLBACKEND=Agg PIP_DISABLE_PIP_VERSION_CHECK=1
start=$(date +%s)

if [ "$plan" = 0 ]; then
    : > "$out/steps.tsv"  # one line per step: name, exit code or "skipped: why", seconds, limit
    GPU_SH_DRY_RUN=$dry python - <<'EOF' || exit 2
import os, sys, torch
if not torch.cuda.is_available() and os.environ["GPU_SH_DRY_RUN"] != "1":
    sys.exit(f"benchmarks/gpu.sh needs a CUDA device; torch {torch.__version__} sees none "
             "(--dry-run checks the script on a CPU)")
EOF
fi

missing=""  # the optional imports that fail, read once from env.json (or probed) when a step asks
missing_known=0
need() {  # need IMPORT_NAME: true when it imports on this machine
    if [ "$missing_known" = 0 ]; then
        missing=$(python -c 'import json, sys
print(" ".join(k for k, v in json.load(open(sys.argv[1]))["packages"].items() if not v["ok"]))' \
            "$out/env.json" 2>/dev/null) ||
            missing=$(python benchmarks/gpu_env.py --missing matplotlib,sklearn,pytest 2>/dev/null)
        missing_known=1
    fi
    [[ " $missing " != *" $1 "* ]]
}

# step_command NAME: sets cmd (the step's command line) or why (the reason it cannot run here)
step_command() {
    local name=$1
    cmd=() why=""
    case $name in
        env) cmd=(python benchmarks/gpu_env.py --json "$out/env.json") ;;
        numerics)
            cmd=(python benchmarks/gemm_numerics.py --device "$device" --json "$out/numerics.json") ;;
        lowbit_lm)
            if [ "$dry" = 1 ]; then
                cmd=(python benchmarks/lowbit_lm.py --task lm --device cpu --steps 3 --modes fp8_rowwise,nvfp4)
            else
                cmd=(python benchmarks/lowbit_lm.py --task lm --device cuda --steps 100)
            fi
            cmd+=(--json "$out/lowbit_lm.json") ;;
        plan_cost)
            if [ "$dry" = 1 ]; then
                cmd=(python benchmarks/plan_cost.py --device cpu --threads 1 --formats fp8_rowwise,bf16 --repeats 1)
            else
                cmd=(python benchmarks/plan_cost.py --device cuda --shape 4096,4096,4096 --shape 8192,8192,8192)
            fi
            cmd+=(--json "$out/plan_cost.json") ;;
        bench) bench_command ;;
        tests)
            if [ "$dry" = 1 ]; then
                why="dry run: the CUDA tests need a GPU"
            elif [ "$plan" = 0 ] && ! need pytest; then
                why="pytest is not installed"
            else
                cmd=(bash -c 'python -m pytest -q -p no:cacheprovider tests/test_cuda.py || exit; marked=$(grep -rlE "pytest\.mark\.cuda" tests --include="*.py"); [ -z "$marked" ] || python -m pytest -q -p no:cacheprovider -m cuda $marked; rc=$?; [ $rc -eq 0 ] || [ $rc -eq 5 ]')
            fi ;;
        precision_paths)
            if [ "$dry" = 1 ]; then
                cmd=(python benchmarks/precision_paths.py --device cpu --in-process --widths 32 --depth 2
                    --steps 2 --warmup 1 --rounds 1)
            else
                cmd=(python benchmarks/precision_paths.py --device cuda --in-process --widths 1024,4096 --rounds 3)
            fi
            cmd+=(--json "$out/precision_paths.json") ;;
    esac
}

bench_command() {  # the bench: large on the GPU, tiny in the dry run; drops what a missing package needs
    local size workloads modes steps plot=1 kept="" w
    if [ "$dry" = 1 ]; then
        size="${SIZE:-tiny}" workloads="${WORKLOADS:-lm}" modes="${MODES:-fp32,torch-amp-bf16,mixprec-bf16}"
    else
        size="${SIZE:-large}" workloads="${WORKLOADS:-lm}"
        if [ -z "${MODES:-}" ]; then
            fp8=$(python -c "from mixprec.bench.modes import MODES; print(','.join(m for m in MODES if m.startswith('fp8')))")
            modes="fp32,torch-amp-fp16,torch-amp-bf16,mixprec-fp16,mixprec-bf16,O2-fp16,O2-bf16,bf16-true"
            modes+=",bf16-true-kahan${fp8:+,$fp8}"
        else
            modes=$MODES
        fi
    fi
    if [ "$plan" = 0 ]; then
        need matplotlib || plot=0
        if ! need sklearn; then  # cnn and tabular-regression load scikit-learn's bundled data
            for w in ${workloads//,/ }; do [[ $w == cnn || $w == tabular-regression ]] || kept+="${kept:+,}$w"; done
            [ -n "$kept" ] || { why="scikit-learn is not installed (workloads $workloads need it)"; return; }
            workloads=$kept
        fi
    fi
    cmd=(python -m mixprec bench --device "$device" --size "$size" --workload "$workloads" --modes "$modes")
    [ "$dry" = 1 ] && steps="${BENCH_STEPS:-}" || steps="${BENCH_STEPS:-150}"  # 150: fits the limit on an H200
    [ -z "$steps" ] || cmd+=(--steps "$steps")
    cmd+=(--json "$out/bench-$size.json" --log "$out/bench-$size-steps.jsonl")
    [ "$plot" = 0 ] || cmd+=(--plot "$out/plots-$size")
}

record() { printf '%s\t%s\t%s\t%s\n' "$@" >> "$out/steps.tsv"; }

run_step() {  # run_step NAME LIMIT: run cmd with a time limit, log to $out/NAME.log, record the outcome
    local name=$1 limit=$2 begin rc
    echo "== $name (limit ${limit} s): ${cmd[*]}" >&2
    begin=$(date +%s)
    timeout --kill-after=3 "$limit" "${cmd[@]}" > >(tee "$out/$name.log") 2> >(tee "$out/$name.err" >&2)
    rc=$?
    record "$name" "$rc" "$(( $(date +%s) - begin ))" "$limit"
}

[ "$dry" = 1 ] && device=cpu || device=cuda
planned=0 total=0
[ "$plan" = 0 ] || printf '%-16s %6s  %s\n' step "limit" command
for name in "${STEPS[@]}"; do
    [[ $only == *",$name,"* ]] || continue
    limit=${LIMIT[$name]}
    step_command "$name"  # may probe packages or list the bench's modes: before the clock is read
    # what is left of the budget: measured when running, the earlier steps' full limits in a plan
    used=$(( plan ? planned : $(date +%s) - start ))
    left=$(( budget - SUMMARY_S - used ))
    if [ -z "$why" ] && (( left < MIN_LEFT )); then
        why="budget: $(( left > 0 ? left : 0 )) s of ${budget} left, under ${MIN_LEFT} s"
    fi
    if [ -n "$why" ]; then
        if [ "$plan" = 1 ]; then printf '%-16s %6s  skipped: %s\n' "$name" - "$why"; continue; fi
        echo "== $name: skipped ($why)" >&2
        record "$name" "skipped: $why" 0 "$limit"
        continue
    fi
    note=""
    if (( limit > left )); then note=" (clamped from $limit to the budget)"; limit=$left; fi
    planned=$(( planned + limit )) total=$(( total + limit ))
    if [ "$plan" = 1 ]; then printf '%-16s %6s  %s%s\n' "$name" "$limit" "${cmd[*]}" "$note"; continue; fi
    run_step "$name" "$limit"
done

if [ "$plan" = 1 ]; then
    printf '%-16s %6s  (budget %s s, %s s kept for the summary)\n' total "$total" "$budget" "$SUMMARY_S"
    exit 0
fi
python benchmarks/gpu_summary.py "$out" "$(( $(date +%s) - start ))" "$budget"
status=$?
echo "gpu.sh: $(( $(date +%s) - start )) s of a ${budget} s budget; results: $out/gpu.json, $out/gpu.md" >&2
exit "$status"
