#!/usr/bin/env bash
# Serves the e2e tier's tiny Qwen2.5-VL on a real vLLM (CPU), with the scale-out endpoints, the hermes tool parser
# and the project's qwen2.5-vl template (the official VL template drops tools). usage: scripts/serve_vllm_vl.sh PORT
set -euo pipefail
cd "$(dirname "$0")/.."
PORT=${1:-8012}
VENV=${TITO_VLLM_VL_VENV:-.venv-vllm-vl}
MODEL=${TITO_VLLM_VL_MODEL_DIR:-.cache/tiny-qwen2.5-vl}
export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1} HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1
exec "$VENV/bin/python" -m vllm.entrypoints.openai.api_server --model "$MODEL" --served-model-name tiny-qwen2.5-vl \
    --host 127.0.0.1 --port "$PORT" --dtype float32 --max-model-len 4096 --enforce-eager --enable-scale-out \
    --chat-template tito_addon/engine/chat_templates/qwen2_5_vl_tools.jinja \
    --enable-auto-tool-choice --tool-call-parser hermes --mm-processor-cache-gb 0
