#!/usr/bin/env bash
# Two real vLLM engines (the CPU build, a tiny random-weight Llama) behind `kvgate launch`, ready
# for curl on http://127.0.0.1:30000 (admin API on 30001). Installs vLLM once (install.sh), starts
# the engines on 127.0.0.1 with KV events, waits for them, runs the gateway in the foreground;
# Ctrl-C stops the gateway and both engines (by their process group ids; nothing is left running).
#
#   scripts/real-vllm/up.sh [more kvgate launch flags...]
#
# Environment: KVGATE_VLLM_MODEL (tiny-llama-chatml, or tiny-llama-plain), KVGATE_BIN (a kvgate
# binary; default: cargo run --release), and serve.sh's.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
. "$here/env.sh"
"$here/install.sh" >/dev/null
model="$KVGATE_VLLM_MODELS/${KVGATE_VLLM_MODEL:-tiny-llama-chatml}"
logs="$(mktemp -d)"
groups=()
stop() {
  for group in "${groups[@]}"; do kill -TERM -- "-$group" 2>/dev/null || true; done
  sleep 2
  for group in "${groups[@]}"; do kill -KILL -- "-$group" 2>/dev/null || true; done
}
trap stop EXIT
trap 'exit 130' INT TERM
for i in 0 1; do
  port=$((8001 + i)) events=$((5557 + 10 * i)) replay=$((5558 + 10 * i))
  setsid "$here/serve.sh" "$model" "$port" "$events" "$replay" >"$logs/engine-$port.log" 2>&1 &
  groups+=($!)
done
echo "starting two vLLM engines (logs in $logs)..." >&2
for port in 8001 8002; do
  for _ in $(seq 1 300); do
    curl -sf "http://127.0.0.1:$port/health" >/dev/null && break
    sleep 1
  done
  curl -sf "http://127.0.0.1:$port/health" >/dev/null || { echo "engine $port did not start: see $logs" >&2; exit 1; }
done
echo "engines up; gateway on http://127.0.0.1:30000 (model tiny-llama)" >&2
kvgate=(cargo run --release --manifest-path "$here/../../Cargo.toml" --)
[ -n "${KVGATE_BIN:-}" ] && kvgate=("$KVGATE_BIN")
"${kvgate[@]}" launch --host 127.0.0.1 --port 30000 \
  --worker-urls http://127.0.0.1:8001 http://127.0.0.1:8002 \
  --kv-events-endpoints tcp://127.0.0.1:5557 tcp://127.0.0.1:5567 \
  --kv-events-replay-endpoints tcp://127.0.0.1:5558 tcp://127.0.0.1:5568 \
  --tokenizer-path "$model" "$@"
