#!/usr/bin/env bash
# Gateway replicas on approximate routing (docs/BENCHMARKS.md "Replicas"): the first MAX requests
# of the conversation trace (S1 settings) replayed over HTTP onto 8 `kvgate mock` engines through
# 1 replica, 3 replicas without sync and 3 replicas synced through Redis, the requests spread
# round-robin over the replicas (`kvgate replay --spread-urls`), caches flushed between runs.
# Usage: scripts/replicas.sh [MAX]   (env: KVGATE, TRACE, TIME_SCALE, OUT)
set -euo pipefail
cd "$(dirname "$0")/.."
max=${1:-1000}
kvgate=${KVGATE:-target/release/kvgate}
trace=${TRACE:-../shared/traces/conversation_trace.jsonl}
scale=${TIME_SCALE:-10}
out=${OUT:-/tmp/kvgate_replicas}
kv=262144
mkdir -p "$out"

pids=()
cleanup() { kill "${pids[@]}" 2>/dev/null || true; wait 2>/dev/null || true; }
trap cleanup EXIT

redis-server --port 31399 --bind 127.0.0.1 --save "" --appendonly no > "$out/redis.log" 2>&1 &
pids+=($!)
"$kvgate" mock --workers 8 --time-scale "$scale" --base-port 31300 --kv-capacity-tokens "$kv" \
  --force-max-tokens > "$out/mock.log" 2>&1 &
pids+=($!)
sleep 2
workers=()
for i in 0 1 2 3 4 5 6 7; do workers+=("http://127.0.0.1:$((31300 + i))"); done

launch() { # port, extra flags...
  local port=$1; shift
  "$kvgate" launch --port "$port" --policy cache_aware --worker-urls "${workers[@]}" \
    --log-level warn "$@" > "$out/gateway-$port.log" 2>&1 &
  pids+=($!)
}
launch 31310
launch 31320; launch 31321; launch 31322
sync=(--replica-sync-redis-url redis://127.0.0.1:31399 --replica-sync-secret "bench-$(date +%s)-replica-secret")
launch 31330 "${sync[@]}"; launch 31331 "${sync[@]}"; launch 31332 "${sync[@]}"
sleep 3

replay() { # label, urls...
  local label=$1; shift
  "$kvgate" replay --trace "$trace" --url "$@" --spread-urls --label "$label" --rate-scale "$scale" \
    --max-requests "$max" --flush-cache-urls "${workers[@]}" --fleet-kv-tokens $((8 * kv)) \
    --deadline-secs 600 --json "$out/$label.json" > "$out/$label.md"
  for w in "${workers[@]}"; do # prompt tokens per engine: how the load spread
    curl -s "$w/metrics" | awk '/^vllm:prompt_tokens_total/ {printf "%d ", $2}'
  done > "$out/$label.spread"
  sleep 2
}
replay one http://127.0.0.1:31310
replay three-apart http://127.0.0.1:31320 http://127.0.0.1:31321 http://127.0.0.1:31322
replay three-synced http://127.0.0.1:31330 http://127.0.0.1:31331 http://127.0.0.1:31332
for port in 31330 31331 31332; do
  curl -s "http://127.0.0.1:$port/metrics" | grep '^kvgate_replica_sync' > "$out/sync-$port.txt" || true
done
python3 - "$out" <<'PY'
import json, sys
out = sys.argv[1]
runs = [("1 replica", "one"), ("3 replicas, no sync", "three-apart"), ("3 replicas, Redis sync", "three-synced")]
base = json.load(open(f"{out}/one.json"))["cache_hit_rate"]
print("| gateways | hit rate | vs 1 replica | TTFT mean (ms) | TTFT p90 (ms) | succeeded |")
print("| --- | ---: | ---: | ---: | ---: | ---: |")
for name, label in runs:
    r = json.load(open(f"{out}/{label}.json"))
    print(f"| {name} | {r['cache_hit_rate']:.1%} | {r['cache_hit_rate'] / base:.3f} | "
          f"{r['ttft_mean_ms']:,.0f} | {r['ttft_p90_ms']:,.0f} | {r['succeeded']} / {r['sent']} |")
PY
