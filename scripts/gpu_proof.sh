#!/usr/bin/env bash
# The first-GPU proof in one command (issue 33): figures.json and proof.log under $OUT.
#
#   bash scripts/gpu_proof.sh              # on the GPU machine, at most 8 minutes
#   bash scripts/gpu_proof.sh --rehearse   # on the CPU: tiny shapes, GPU-only steps skipped
#
# The device has torch, transformers and peft but no package index: the wheels it lacks travel
# in `.whl/` (built here by scripts/device_wheels.sh; the device call carries `.whl`) and are
# installed into /tmp/site first. The repo runs from source (PYTHONPATH), nothing is built there.
# Each step runs with a time cap and a failing step does not stop the others (scripts/gpu_proof.py).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
OUT=${OUT:-$(mktemp -d /tmp/gpu-proof-out.XXXX)}
PYTHON=${PYTHON:-python3}
rehearse=()
[ "${1:-}" = "--rehearse" ] && rehearse=(--rehearse) && shift
if [ ${#rehearse[@]} -eq 0 ] && [ -d .whl ]; then
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl > "$OUT/wheels.log" 2>&1 \
        || echo "gpu_proof: installing .whl failed (see wheels.log); going on" >&2
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
echo "gpu_proof: figures and logs in $OUT"
exec "$PYTHON" scripts/gpu_proof.py --out "$OUT" "${rehearse[@]}" "$@"
