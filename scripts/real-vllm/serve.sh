#!/usr/bin/env bash
# Runs one vLLM engine (the CPU build install.sh put in $KVGATE_VLLM_HOME) in the foreground on
# 127.0.0.1, with prefix caching, cached-token counts in usage, and KV events: the PUB socket on
# tcp://*:EVENTS_PORT (vLLM binds its publisher only for `*`, `[::]` or ipc endpoints; on
# tcp://127.0.0.1:PORT it would connect out instead and nobody would hear it) and the replay
# ROUTER on 127.0.0.1:REPLAY_PORT.
#
#   serve.sh MODEL_DIR PORT EVENTS_PORT REPLAY_PORT [more vllm serve flags...]
#
# Environment: KVGATE_VLLM_KV_GIB (KV cache, GiB; 1), KVGATE_VLLM_BLOCK_SIZE (32: the CPU
# attention backend takes multiples of 32 only), KVGATE_VLLM_MAX_MODEL_LEN (8192).
# It never downloads anything (offline, no usage statistics).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
. "$here/env.sh"
if [ $# -lt 4 ]; then
  echo "usage: $0 MODEL_DIR PORT EVENTS_PORT REPLAY_PORT [vllm serve flags...]" >&2
  exit 2
fi
model="$1" port="$2" events="$3" replay="$4"
shift 4
if [ ! -e "$KVGATE_VLLM_READY" ]; then
  echo "vLLM is not installed in $KVGATE_VLLM_VENV: run $here/install.sh" >&2
  exit 1
fi
export VLLM_TARGET_DEVICE=cpu
export VLLM_CPU_KVCACHE_SPACE="${KVGATE_VLLM_KV_GIB:-1}"
export VLLM_CPU_OMP_THREADS_BIND=nobind OMP_NUM_THREADS=1
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1
kv_events="{\"enable_kv_cache_events\": true, \"publisher\": \"zmq\", \"endpoint\": \"tcp://*:$events\", \"replay_endpoint\": \"tcp://127.0.0.1:$replay\", \"topic\": \"\"}"
exec "$KVGATE_VLLM_VENV/bin/vllm" serve "$model" --host 127.0.0.1 --port "$port" \
  --served-model-name "${KVGATE_VLLM_MODEL_NAME:-tiny-llama}" \
  --enforce-eager --max-model-len "${KVGATE_VLLM_MAX_MODEL_LEN:-8192}" \
  --block-size "${KVGATE_VLLM_BLOCK_SIZE:-32}" --enable-prefix-caching --enable-prompt-tokens-details \
  --kv-events-config "$kv_events" "$@"
