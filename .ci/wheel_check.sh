#!/usr/bin/env bash
# Packaging: build the sdist and wheel, check their metadata, then install the wheel into a fresh venv with
# torch and the declared dependencies only, and run the quickstart loop there from outside the checkout.
set -euo pipefail
cd "$(dirname "$0")/.."
DIST=.ci/dist
rm -rf "$DIST"
python -m build -q --outdir "$DIST" . >/dev/null
twine check --strict "$DIST"/*
WHEEL_VENV="$PWD/.ci/.venv-wheel"
rm -rf "$WHEEL_VENV"
python -m venv "$WHEEL_VENV"
TORCH=$(python -c 'import torch; print(torch.__version__.split("+")[0])')
"$WHEEL_VENV/bin/pip" install -q "torch==$TORCH" "$DIST"/mixprec-*.whl
SMOKE="$PWD/.ci/wheel_smoke.py"
(cd /tmp && "$WHEEL_VENV/bin/python" "$SMOKE")
