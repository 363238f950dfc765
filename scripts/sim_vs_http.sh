#!/usr/bin/env bash
# The simulator against the real thing: replays a scenario's trace as streaming HTTP requests
# through `kvgate launch` (one gateway per policy, KV events on) onto 8 `kvgate mock` engines
# running TIME_SCALE times faster than wall time, then runs `kvgate sim` on the same requests,
# and prints both reports. Loopback only.
#
#   scripts/sim_vs_http.sh S1|S4 [MAX_REQUESTS] [POLICY ...]
#   env: KVGATE (binary, default target/release/kvgate), TRACE, TIME_SCALE (10), OUT (/tmp/sim_vs_http)
set -euo pipefail
cd "$(dirname "$0")/.."
scenario=${1:?S1 or S4}; shift
max=${1:-}; [ $# -gt 0 ] && shift
policies=("$@"); [ ${#policies[@]} -gt 0 ] || policies=(round_robin cache_aware kv_aware)
kvgate=${KVGATE:-target/release/kvgate}
trace=${TRACE:-../shared/traces/conversation_trace.jsonl}
scale=${TIME_SCALE:-10}
out=${OUT:-/tmp/sim_vs_http}/$scenario
mkdir -p "$out"
case $scenario in
  S1) rate=1; kv=262144 ;;
  S4) rate=1.5; kv=1048576 ;;
  *) echo "unknown scenario $scenario" >&2; exit 2 ;;
esac
speedup=$(python3 -c "print($rate * $scale)")
limit=(); [ -n "$max" ] && limit=(--max-requests "$max")

pids=()
cleanup() { kill "${pids[@]}" 2>/dev/null || true; wait 2>/dev/null || true; }
trap cleanup EXIT

"$kvgate" mock --workers 8 --time-scale "$scale" --base-port 31000 --kv-events-base-port 31100 \
  --kv-events-replay-base-port 31200 --kv-capacity-tokens "$kv" --force-max-tokens > "$out/mock.log" 2>&1 &
pids+=($!)
sleep 2
workers=(); events=(); replays=()
for i in 0 1 2 3 4 5 6 7; do
  workers+=("http://127.0.0.1:$((31000 + i))")
  events+=("tcp://127.0.0.1:$((31100 + i))")
  replays+=("tcp://127.0.0.1:$((31200 + i))")
done
urls=(); labels=()
port=30100
for policy in "${policies[@]}"; do
  "$kvgate" launch --port $port --policy "$policy" --worker-urls "${workers[@]}" \
    --kv-events-endpoints "${events[@]}" --kv-events-replay-endpoints "${replays[@]}" \
    --mock-tokenizer --log-level warn > "$out/gateway-$policy.log" 2>&1 &
  pids+=($!)
  urls+=("http://127.0.0.1:$port"); labels+=("$policy")
  port=$((port + 1))
done
sleep 3
"$kvgate" replay --trace "$trace" --url "${urls[@]}" --label "${labels[@]}" --speedup "$speedup" \
  "${limit[@]}" --flush-cache-urls "${workers[@]}" --pause-secs 5 --fleet-kv-tokens $((8 * kv)) \
  --json "$out/http.json" | tee "$out/http.md"
"$kvgate" sim --trace "$trace" --rate-scale "$rate" --kv-capacity-tokens "$kv" "${limit[@]}" \
  --policies "$(IFS=,; echo "${policies[*]}")" --json "$out/sim.json" | tee "$out/sim.md"
# Per-percentile ratios, HTTP (wall time x TIME_SCALE = model time) over the simulator.
python3 - "$out/http.json" "$out/sim.json" "$scale" <<'PY' | tee "$out/ratios.md"
import json, sys
http, sim, scale = json.load(open(sys.argv[1])), json.load(open(sys.argv[2])), float(sys.argv[3])
http = http if isinstance(http, list) else [http]
runs = {r["label"]: r["metrics"] for r in sim["runs"]}
keys = ["ttft_mean_ms", "ttft_p50_ms", "ttft_p90_ms", "ttft_p99_ms", "e2e_p50_ms", "e2e_p99_ms"]
print("| policy | " + " | ".join(f"{k[:-3]} HTTP / sim" for k in keys) + " | hit rate HTTP / sim |")
print("| --- |" + " ---: |" * (len(keys) + 1))
for report in http:
    label, m = report["label"], report
    s = runs[label]
    cells = [f"{m[k] * scale:,.0f} / {s[k]:,.0f} = {m[k] * scale / s[k]:.2f}" for k in keys]
    cells.append(f"{100 * m['cache_hit_rate']:.1f}% / {100 * s['cache_hit_rate']:.1f}%")
    print(f"| {label} | " + " | ".join(cells) + " |")
PY
