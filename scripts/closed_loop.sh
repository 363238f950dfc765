#!/usr/bin/env bash
# The closed loop on a trace: `kvgate mock` engines publishing KV events (their default, current
# format) behind a cache_aware `kvgate launch` gateway on the exact index (the engines' own
# tokenizer, or a wrong chat template with TEMPLATE=wrong), `kvgate replay` of the first REQUESTS
# trace requests through it, then the gateway's predicted vs engine-reported cached tokens
# (kvgate_prefix_*_tokens_total) and /workers' index_accuracy. Loopback only.
#
#   scripts/closed_loop.sh [TRACE]   (default ../shared/traces/conversation_trace.jsonl)
#   env: KVGATE (binary, default target/release/kvgate), WORKERS (4), REQUESTS (500),
#        RATE_SCALE (10, also the engines' --time-scale), TEMPLATE (right|wrong), PORT (23600, below the ephemeral range),
#        OUT (/tmp/closed_loop)
set -euo pipefail
cd "$(dirname "$0")/.."
trace=${1:-../shared/traces/conversation_trace.jsonl}
kvgate=${KVGATE:-target/release/kvgate}
workers=${WORKERS:-4}
requests=${REQUESTS:-500}
scale=${RATE_SCALE:-10}
port=${PORT:-23600}
out=${OUT:-/tmp/closed_loop}
mkdir -p "$out"

pids=()
cleanup() { kill "${pids[@]}" 2>/dev/null || true; wait 2>/dev/null || true; }
trap cleanup EXIT

"$kvgate" mock --workers "$workers" --base-port $((port + 10)) --time-scale "$scale" \
  --kv-events-base-port $((port + 30)) --kv-events-replay-base-port $((port + 50)) > "$out/mock.log" 2>&1 &
pids+=($!)
urls=(); events=(); replays=()
for i in $(seq 0 $((workers - 1))); do
  urls+=("http://127.0.0.1:$((port + 10 + i))")
  events+=("tcp://127.0.0.1:$((port + 30 + i))")
  replays+=("tcp://127.0.0.1:$((port + 50 + i))")
done
template=()
if [ "${TEMPLATE:-right}" = wrong ]; then
  printf '{%% for m in messages %%}### {{ m.role }}: {{ m.content }}\n{%% endfor %%}### assistant:' > "$out/wrong.jinja"
  template=(--chat-template "$out/wrong.jinja")
fi
for _ in $(seq 1 100); do
  curl -sf "${urls[-1]}/health" > /dev/null 2>&1 && break
  sleep 0.1
done
"$kvgate" launch --port "$port" --policy cache_aware --mock-tokenizer "${template[@]}" \
  --worker-urls "${urls[@]}" --kv-events-endpoints "${events[@]}" \
  --kv-events-replay-endpoints "${replays[@]}" > "$out/gateway.log" 2>&1 &
pids+=($!)
for _ in $(seq 1 100); do
  curl -sf "http://127.0.0.1:$port/readiness" > /dev/null 2>&1 && break
  sleep 0.1
done
endpoint=chat
"$kvgate" replay --trace "$trace" --url "http://127.0.0.1:$port" --max-requests "$requests" --model mock-model \
  --rate-scale "$scale" --endpoint "$endpoint" --deadline-secs 600 > "$out/replay.md"
curl -s "http://127.0.0.1:$port/metrics" > "$out/metrics.txt"
curl -s "http://127.0.0.1:$((port + 1))/workers" > "$out/workers.json"   # the admin listener
sum() { awk -v name="$1" 'index($0, name "{") == 1 { s += $NF } END { printf "%d", s }' "$out/metrics.txt"; }
predicted=$(sum kvgate_prefix_predicted_tokens_total)
cached=$(sum kvgate_prefix_engine_cached_tokens_total)
answered=$(sum kvgate_prefix_cached_tokens_difference_ratio_count)
error=$(python3 - "$out/workers.json" <<'EOF'
import json, sys
workers = json.load(open(sys.argv[1]))["workers"]
for w in workers:
    a = w.get("index_accuracy") or {}
    d = a.get("disagreement") or {}
    print(f"{w['url']}: window {a.get('requests', 0)}, error {a.get('error_share', 0):.4f}, "
          f"missed {a.get('missed_share', 0):.4f}, "
          f"disagreement {d.get('cause', 'none')}")
EOF
)
echo "template: ${TEMPLATE:-right}; requests compared: $answered"
echo "predicted cached tokens: $predicted; engine-reported: $cached"
prompt=$(head -n "$requests" "$trace" | python3 -c 'import json, sys; print(sum(json.loads(l)["input_length"] for l in sys.stdin))')
awk -v p="$predicted" -v c="$cached" -v t="$prompt" 'BEGIN { if (c > 0) printf "difference: %.3f%% of the engine-reported, %.3f%% of the %d prompt tokens\n", 100 * (p - c) / c, 100 * (p - c) / t, t }'
awk 'index($0, "kvgate_prefix_cached_tokens_difference_ratio_bucket{") == 1 { split($1, a, "le=\""); split(a[2], b, "\""); n[b[1]] += $NF }
     END { printf "requests with a difference in (-1%%, 1%%] of the prompt: %d of %d\n", n["0.01"] - n["-0.01"], n["+Inf"] }' "$out/metrics.txt"
echo "$error"
python3 - "$out/workers.json" <<'EOF2'
import json, sys
for model, entry in json.load(open(sys.argv[1])).get("models", {}).items():
    a = entry.get("index_accuracy") or {}
    d = a.get("disagreement") or {}
    print(f"model {model}: window {a.get('requests', 0)}, error {a.get('error_share', 0):.4f}, "
          f"missed {a.get('missed_share', 0):.4f}, disagreement {d.get('cause', 'none')}")
EOF2
echo "warnings logged: $(grep -c "disagrees with the engine" "$out/gateway.log" || true)"
