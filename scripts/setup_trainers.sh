#!/usr/bin/env bash
# Builds the trainer tier's environment (see README, "Training on the rows"): a Python 3.11 venv with the CPU torch
# build and verl from PyPI, where tito_addon/trainers' loaders are checked with the trainers' own code. Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${TITO_TRAINERS_VENV:-.venv-trainers}
VERL=${TITO_VERL_VERSION:-0.9.1}
# The torch wheel is cp311.
source scripts/python311.sh setup_trainers
if [ ! -x "$VENV/bin/python" ] || ! "$VENV/bin/python" -c "import verl, torch, cachetools, fastapi, uvicorn; assert verl.__version__ == '$VERL'" 2>/dev/null; then
    rm -rf "$VENV"
    "$PY311" -m venv "$VENV"
    # The CPU build when this machine has it beside pip's index (a CUDA build from PyPI runs on CPU too, only larger).
    CPU_TORCH=$(ls /opt/wheels/torch-*+cpu-cp311-*.whl 2>/dev/null | sort -V | tail -1 || true)
    if [ -n "$CPU_TORCH" ]; then
        TORCH="torch==$(basename "$CPU_TORCH" | cut -d- -f2)"
        "$VENV/bin/pip" install --quiet --find-links /opt/wheels "$TORCH"
    else
        TORCH=torch
        "$VENV/bin/pip" install --quiet torch
    fi
    # cachetools, fastapi, uvicorn: imported by verl's trainer (ray_trainer) but declared only in its verl-core extra.
    "$VENV/bin/pip" install --quiet "verl==$VERL" "$TORCH" cachetools fastapi uvicorn
fi
echo "trainers venv: $VENV ($("$VENV/bin/python" -c 'import verl, torch; print("verl", verl.__version__, "torch", torch.__version__)'))"
