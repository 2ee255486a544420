#!/usr/bin/env bash
# The one device check: the script to run on a CUDA machine (written for one H200, Python 3.12, torch 2.11 +
# CUDA 13, no network, mixprec installed with `pip install --no-deps -e .`). The whole run fits a budget
# of GPU_SH_BUDGET seconds (default 360: 6 minutes). Steps, cheapest and most telling first, with their
# limits (s), the sum within the budget (`--plan` prints it):
#   env              15  benchmarks/gpu_env.py: device, capability, versions, which optional packages import
#   numerics         20  benchmarks/gemm_numerics.py: every lowbit recipe's fprop/dgrad/wgrad on the path
#                        lowbit_mm takes (tensor cores where there is a kernel) against the emulation
#   tests            40  pytest tests/test_cuda.py, and the tests marked `cuda` (-m cuda) in their files
#   distributed      25  benchmarks/gpu_distributed.py: a 1-rank NCCL group; DDP (mixprec autocast + GradScaler
#                        against a twin, the fp8 comm hook) and FSDP2 with the fp8 all-gather train 8 steps
#   fp8             105  benchmarks/gpu_fp8.py --budget-s 90: 2-layer GPT d=4096, seq 2048, batch 4, step time
#                        and transient memory of bf16, torchao and mixprec float8 (tensorwise, rowwise), eager
#                        and compiled, interleaved rounds; quantize+GEMM fwd+bwd at 8192^3 per format;
#                        pure-torch vs fused (Triton) quantization at 8192x8192 per fp8 format, bitwise checked
#   bench            55  mixprec bench --size large --workload lm --time 38s: fp32, torch.amp and mixprec bf16,
#                        mixprec fp16, O2 bf16, bf16-true(+kahan) and the fp8 modes interleaved, cut by the
#                        bench to fit 38 s (at least 4 rounds of 20 steps); MODES=... for others, BENCH_STEPS=N
#                        for N steps (the cnn / tabular workloads, in WORKLOADS, need scikit-learn)
#   lowbit_lm        30  benchmarks/lowbit_lm.py --task lm --steps 40: each lowbit recipe's step time and loss
#   plan_cost        20  benchmarks/plan_cost.py: the planner's measured GEMM cost per format and shape
#   precision_paths  20  benchmarks/precision_paths.py --device cuda --in-process --widths 4096: each precision
#                        path's step time and memory (skips torch-optimi's rows when it is missing)
#   optim            25  benchmarks/optimizer_speed.py: one AdamW step on 403M bf16 parameters, torch fused,
#                        CompensatedOptimizer kahan/stochastic/int8, optimi Kahan, torchao AdamW8bit
# then writes RESULTS_DIR/gpu.json (everything, one file) and RESULTS_DIR/gpu.md (the Markdown tables).
# Each step's limit is clamped to what is left of the budget (5 s kept for the summary); a step with
# under 10 s left, or whose package is missing, is recorded as skipped with why. A step that fails or runs
# out of time is recorded and the script goes on; every step writes its JSON as it goes (and on the
# SIGTERM of its time limit), so a step cut short keeps what it measured and the summary marks it
# PARTIAL; the bench's step log (bench-SIZE-steps.jsonl) is rewritten after every round and stands in for
# its table when the bench is cut. Exit code: 0 when every step that ran passed.
#
#   bash benchmarks/gpu.sh [RESULTS_DIR]              # default RESULTS_DIR: ./gpu-results
#   bash benchmarks/gpu.sh --plan                     # print each step, its limit and command, and the sum
#   bash benchmarks/gpu.sh --dry-run DIR              # no GPU: every step on the CPU at toy size (CI);
#                                                     # GPU_SH_DRY_RUN=1 is the same; tests are skipped
#   ONLY=env,numerics bash benchmarks/gpu.sh DIR      # only these steps
#   GPU_SH_BUDGET=300 bash benchmarks/gpu.sh DIR      # a smaller budget (clamps the limits)
# Overrides: LIMIT_<STEP> (e.g. LIMIT_BENCH=90), MODES, WORKLOADS, BENCH_STEPS, BENCH_TIME, SIZE (the
# bench's --size), PLOT=1 (the bench's --plot pictures too; `mixprec report` draws them later otherwise),
# LOWBIT_STEPS.
set -uo pipefail

STEPS=(env numerics tests distributed fp8 bench lowbit_lm plan_cost precision_paths optim)
declare -A LIMIT=([env]=15 [numerics]=20 [tests]=40 [distributed]=25 [fp8]=105 [bench]=55 [lowbit_lm]=30
    [plan_cost]=20 [precision_paths]=20 [optim]=25)
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
budget="${GPU_SH_BUDGET:-360}"
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
        distributed)
            if [ "$dry" = 1 ]; then
                cmd=(python benchmarks/gpu_distributed.py --device cpu --steps 3)
            else
                cmd=(python benchmarks/gpu_distributed.py --device cuda --steps 8)
            fi
            cmd+=(--json "$out/distributed.json") ;;
        fp8)
            if [ "$dry" = 1 ]; then  # three configs of five, eager and aot_eager-compiled: seconds on a CPU
                cmd=(python benchmarks/gpu_fp8.py --device cpu --configs bf16,mixprec-tensorwise,torchao-rowwise
                    --warmup 1 --rounds 2)
            else  # the script stops starting compiles 15 s before the step's limit (its imports come first)
                cmd=(python benchmarks/gpu_fp8.py --device cuda --budget-s "$(( limit > 30 ? limit - 15 : limit / 2 ))")
            fi
            cmd+=(--json "$out/fp8.json") ;;
        lowbit_lm)
            if [ "$dry" = 1 ]; then
                cmd=(python benchmarks/lowbit_lm.py --task lm --device cpu --steps "${LOWBIT_STEPS:-3}"
                    --modes fp8_rowwise,nvfp4)
            else
                cmd=(python benchmarks/lowbit_lm.py --task lm --device cuda --steps "${LOWBIT_STEPS:-40}")
            fi
            cmd+=(--json "$out/lowbit_lm.json") ;;
        plan_cost)  # 8192^3 is the fp8 step's GEMM level
            if [ "$dry" = 1 ]; then
                cmd=(python benchmarks/plan_cost.py --device cpu --threads 1 --formats fp8_rowwise,bf16 --repeats 1)
            else
                cmd=(python benchmarks/plan_cost.py --device cuda --shape 4096,4096,4096)
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
                cmd=(python benchmarks/precision_paths.py --device cuda --in-process --widths 4096 --rounds 2)
            fi
            cmd+=(--json "$out/precision_paths.json") ;;
        optim)  # torchao's compile comes after the others' first round; the rounds stop 3 s before the limit
            if [ "$dry" = 1 ]; then
                cmd=(python benchmarks/optimizer_speed.py --device cpu --width 64 --layers 2 --warmup 1 --rounds 2
                    --steps 2 --configs torch-fused,mixprec-kahan,mixprec-stochastic,optimi-kahan,mixprec-int8)
            else
                cmd=(python benchmarks/optimizer_speed.py --device cuda --budget-s "$(( limit > 6 ? limit - 3 : limit ))")
            fi
            cmd+=(--json "$out/optim.json") ;;
    esac
}

bench_command() {  # the bench: large on the GPU, tiny in the dry run; drops what a missing package needs
    local size workloads modes plot="${PLOT:-0}" kept="" w
    if [ "$dry" = 1 ]; then
        size="${SIZE:-tiny}" workloads="${WORKLOADS:-lm}" modes="${MODES:-fp32,torch-amp-bf16,mixprec-bf16}"
    else
        size="${SIZE:-large}" workloads="${WORKLOADS:-lm}"
        if [ -z "${MODES:-}" ]; then
            fp8=$(python -c "from mixprec.bench.modes import MODES; print(','.join(m for m in MODES if m.startswith('fp8')))")
            # one fp16 mode (the scaler on CUDA): 10 runs with the A/A one, 4 rounds of 20 steps in ~70 s
            modes="fp32,torch-amp-bf16,mixprec-bf16,mixprec-fp16,O2-bf16,bf16-true,bf16-true-kahan${fp8:+,$fp8}"
        else
            modes=$MODES
        fi
    fi
    if [ "$plan" = 0 ]; then
        [ "$plot" = 0 ] || need matplotlib || plot=0
        if ! need sklearn; then  # cnn and tabular-regression load scikit-learn's bundled data
            for w in ${workloads//,/ }; do [[ $w == cnn || $w == tabular-regression ]] || kept+="${kept:+,}$w"; done
            [ -n "$kept" ] || { why="scikit-learn is not installed (workloads $workloads need it)"; return; }
            workloads=$kept
        fi
    fi
    cmd=(python -m mixprec bench --device "$device" --size "$size" --workload "$workloads" --modes "$modes")
    if [ -n "${BENCH_STEPS:-}" ]; then
        cmd+=(--steps "$BENCH_STEPS")
    elif [ "$dry" = 0 ]; then  # the bench cuts its rounds to fit (10 modes took ~110 s for 150 steps)
        cmd+=(--time "${BENCH_TIME:-38s}")
    fi
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
    if (( limit > left )); then
        note=" (clamped from $limit to the budget)" limit=$left
        [[ $name != fp8 && $name != optim ]] || step_command "$name"  # --budget-s follows the clamped limit
    fi
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
