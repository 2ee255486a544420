#!/usr/bin/env bash
# mixprec bench on one CUDA GPU: fp32, torch.amp (fp16 and bf16), mixprec fp16/bf16 and O2 (fp16 model + fp32
# master weights) on every workload, at the default size (sized for a 2-core CPU, so on a big GPU it mostly
# shows per-step overhead) and at the large size (sized for a GPU, where 16-bit math pays). About 5 minutes
# on an H200; each run is its own process.
#
#   bash benchmarks/gpu.sh [RESULTS_DIR] [extra mixprec bench options...]
#
# RESULTS_DIR (default ./gpu-results) gets, per size: SIZE.txt (the table), SIZE.json (one record per
# workload x mode), SIZE-steps.jsonl (per-step log for `mixprec report`), plots-SIZE/ and SIZE-stderr.log.
# SIZES="default" (or "large") runs one size only.
set -euo pipefail

out="${1:-./gpu-results}"
shift || true
mkdir -p "$out"
modes="fp32,torch-amp-fp16,torch-amp-bf16,mixprec-fp16,mixprec-bf16,O2-fp16"

python - <<'EOF'
import sys, torch
if not torch.cuda.is_available():
    sys.exit(f"benchmarks/gpu.sh needs a CUDA device; torch {torch.__version__} sees none")
print(f"{torch.cuda.get_device_name()} | torch {torch.__version__} | CUDA {torch.version.cuda}", file=sys.stderr)
EOF

start=$(date +%s)
status=0
for size in ${SIZES:-default large}; do
    echo "== size $size" >&2
    python -m mixprec bench --device cuda --size "$size" --modes "$modes" \
        --json "$out/$size.json" --log "$out/$size-steps.jsonl" --plot "$out/plots-$size" "$@" \
        2> >(tee "$out/$size-stderr.log" >&2) | tee "$out/$size.txt" || status=$?
done
echo "gpu.sh: $(( $(date +%s) - start )) s, exit $status; results in $out" >&2
exit "$status"
