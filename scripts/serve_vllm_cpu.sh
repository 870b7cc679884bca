#!/usr/bin/env bash
# Serves the e2e tier's tiny Qwen3 model on a real vLLM (CPU), with the scale-out endpoints and the
# Qwen3 tool and reasoning parsers. usage: scripts/serve_vllm_cpu.sh PORT   (foreground; SIGTERM stops it)
set -euo pipefail
cd "$(dirname "$0")/.."
PORT=${1:-8011}
VENV=${TITO_VLLM_VENV:-.venv-vllm}
MODEL=${TITO_VLLM_MODEL_DIR:-.cache/tiny-qwen3}
# VLLM_SERVER_DEV_MODE=1: the weight-update routes (/pause, /resume, /update_weight_version) a trainer calls.
export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1} HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 VLLM_SERVER_DEV_MODE=1
# `vllm serve` looks up the distribution "vllm", which vllm-cpu is not; the module entry point works.
exec "$VENV/bin/python" -m vllm.entrypoints.openai.api_server --model "$MODEL" --served-model-name tiny-qwen3 \
    --host 127.0.0.1 --port "$PORT" --dtype bfloat16 --max-model-len 4096 --enforce-eager --enable-scale-out \
    --enable-auto-tool-choice --tool-call-parser hermes --reasoning-parser qwen3
