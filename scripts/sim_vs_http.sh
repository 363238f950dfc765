#!/usr/bin/env bash
# The simulator against the real thing: replays a scenario's trace as streaming HTTP requests
# through `kvgate launch` (one gateway per policy, KV events on) onto 8 `kvgate mock` engines
# running TIME_SCALE times faster than wall time, then runs `kvgate sim` on the same requests,
# and prints both reports and their per-percentile ratios. Loopback only.
#
#   scripts/sim_vs_http.sh S1|S2|S3|S4|S4T|S5|S6|S7|S8|S9|S10|S11 [MAX_REQUESTS|-] [ENTRY ...]
#
# An ENTRY is a policy as `kvgate sim --policies` takes it: NAME[:flag=value...][@LABEL], e.g.
# `cache_aware:balance_token_usage_threshold=0.2:overload_token_usage_threshold=0.9@triggers`
# (default: round_robin cache_aware kv_aware). S5, S7-S11 are generated (kvgate trace gen,
# seed 0) into OUT (S9's sessions replayed closed loop by both); S6 is the unequal fleet (docs/SCENARIOS.md); S4T is S4 with its KV split into
# GPU and a host-memory offload tier.
#
# The gateway runs in wall time and the engines TIME_SCALE times faster, so every time-valued
# policy setting is given to the gateway scaled (load polls every 1000 / TIME_SCALE ms, prefill
# rates x TIME_SCALE, ...) so that it sees what the simulator's policy sees in model time.
#
# Above a speedup of about 10 (rate x TIME_SCALE), or with 100K-token prompts, the rig itself
# (8 mocks, the gateway and the replayer on 2 cores) adds a wall-time floor that the scale
# multiplies: use TIME_SCALE=2 there (docs/BENCHMARKS.md, "S5 and S6").
#
#   env: KVGATE (binary, default target/release/kvgate), TRACE, TIME_SCALE (10),
#        OUT (/tmp/sim_vs_http), PAUSE_SECS (5), GATEWAY_FLAGS (more `kvgate launch` flags for
#        every gateway, e.g. `--index-repair warn`: gateway-only settings the simulator has not)
set -euo pipefail
cd "$(dirname "$0")/.."
scenario=${1:?S1..S11}; shift
max=${1:-}; [ $# -gt 0 ] && shift
[ "$max" = "-" ] && max=
entries=("$@"); [ ${#entries[@]} -gt 0 ] || entries=(round_robin cache_aware kv_aware)
kvgate=${KVGATE:-target/release/kvgate}
trace=${TRACE:-../shared/traces/conversation_trace.jsonl}
scale=${TIME_SCALE:-10}
out=${OUT:-/tmp/sim_vs_http}/$scenario
mkdir -p "$out"
kv=262144; rate=1; fleet=(); fleet_kv=; tier=()
case $scenario in
  S1) ;;
  S2) rate=2 ;;
  S3) rate=2; kv=131072 ;;
  S4) rate=1.5; kv=1048576 ;;
  # S4's KV per engine split: 262,144 tokens of GPU and a 786,432-token host-memory tier.
  S4T) rate=1.5; tier=(--cpu-offload-tokens 786432); fleet_kv=$((8 * 1048576)) ;;
  S5) kv=1048576; trace=$out/s5.jsonl; "$kvgate" trace gen --shape hot-docs --open-loop -o "$trace" ;;
  S6) rate=2; fleet_kv=$((7 * 262144 + 131072))
      fleet=(--worker-speeds 2,2,2,2,1,1,1,1
        --worker-kv-capacity-tokens 262144,262144,262144,262144,262144,262144,262144,131072) ;;
  S7) trace=$out/s7.jsonl; "$kvgate" trace gen --shape bursts --open-loop -o "$trace" ;;
  S8) trace=$out/s8.jsonl
      "$kvgate" trace gen --shape long-prompts --doc-min-tokens 8000 --doc-max-tokens 100000 --load 0.6 -o "$trace" ;;
  S9) trace=$out/s9.jsonl
      "$kvgate" trace gen --shape agentic --output-min-tokens 30 --output-max-tokens 400 --load 2 -o "$trace" ;;
  S10) trace=$out/s10.jsonl; "$kvgate" trace gen --shape rollouts -o "$trace" ;;
  S11) trace=$out/s11.jsonl
      "$kvgate" trace gen --shape reasoning --docs 8 --doc-min-tokens 12000 --doc-max-tokens 40000 \
        --popularity-skew 1.2 --load 1.5 --reasoning-median-tokens 2000 --reasoning-sigma 1.0 \
        --reasoning-max-tokens 16000 -o "$trace" ;;
  *) echo "unknown scenario $scenario" >&2; exit 2 ;;
esac
speedup=$(python3 -c "print($rate * $scale)")
limit=(); [ -n "$max" ] && limit=(--max-requests "$max")
[ -n "$fleet_kv" ] || fleet_kv=$((8 * kv))

# Time-valued policy settings in wall time: model-time defaults scaled by TIME_SCALE.
scaled=$(python3 -c "
s = $scale
print(' '.join([
  '--load-monitor-interval-ms', str(max(1, round(1000 / s))),
  '--kv-aware-prefill-tokens-per-sec', str(8000 * s),
  '--kv-aware-decode-ms-per-request', str(0.35 / s),
  '--kv-aware-kv-pressure-weight', str(0.15 / s),
  '--kv-aware-wait-slack-ms', str(1000 / s),
  '--least-load-default-throughput', str(2000 * s),
  '--least-load-kv-pressure-weight', str(0.15 / s),
  '--eviction-interval', str(120 / s),
  # The simulator routes on the whole prompt; the gateway on its first --max-tokenize-chars
  # characters (262,144 by default: about 26K tokens of the traces' words, where S9's agent
  # contexts reach 110K). Whole prompts here, as in the simulator (docs/BENCHMARKS.md, S9
  # and S10 over HTTP).
  '--max-tokenize-chars', str(4 << 20),
]))")

pids=()
cleanup() { for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done; wait 2>/dev/null || true; }
trap cleanup EXIT

"$kvgate" mock --workers 8 --time-scale "$scale" --base-port 31000 --kv-events-base-port 31100 \
  --kv-events-replay-base-port 31200 --kv-capacity-tokens "$kv" "${tier[@]}" "${fleet[@]}" --force-max-tokens \
  > "$out/mock.log" 2>&1 &
pids+=($!)
sleep 2
workers=(); events=(); replays=()
for i in 0 1 2 3 4 5 6 7; do
  workers+=("http://127.0.0.1:$((31000 + i))")
  events+=("tcp://127.0.0.1:$((31100 + i))")
  replays+=("tcp://127.0.0.1:$((31200 + i))")
done
# One gateway at a time: an idle gateway subscribed to the same engines would spend the
# machine's CPU on their KV events while another is measured.
echo "uptime before: $(uptime)" | tee "$out/uptime.txt"
: > "$out/http.md"; jsons=()
port=30100
for entry in "${entries[@]}"; do
  spec=${entry%%@*}
  # The label `kvgate sim` gives the entry: its @LABEL, else the name and overrides.
  label=${entry#*@}; [ "$label" = "$entry" ] && label=${spec//:/ }
  IFS=: read -r -a parts <<< "$spec"
  flags=(--policy "${parts[0]}")
  for override in "${parts[@]:1}"; do
    name=${override%%=*}
    flags+=("--${name//_/-}" "${override#*=}")
  done
  # shellcheck disable=SC2086 # $scaled and GATEWAY_FLAGS are lists of flags; later flags (the entry's) win.
  "$kvgate" launch --port $port --worker-urls "${workers[@]}" \
    --kv-events-endpoints "${events[@]}" --kv-events-replay-endpoints "${replays[@]}" \
    --mock-tokenizer --log-level warn $scaled ${GATEWAY_FLAGS:-} "${flags[@]}" > "$out/gateway-${label// /_}.log" 2>&1 &
  gateway=$!; pids+=($gateway)
  sleep 3
  json="$out/http-${#jsons[@]}.json"; jsons+=("$json")
  "$kvgate" replay --trace "$trace" --url "http://127.0.0.1:$port" --label "$label" --speedup "$speedup" \
    "${limit[@]}" --flush-cache-urls "${workers[@]}" --pause-secs "${PAUSE_SECS:-5}" \
    --fleet-kv-tokens "$fleet_kv" --json "$json" | tee -a "$out/http.md"
  # What each side saw, for reading a gap: the gateway's decisions (route reasons) and each
  # engine's counters (prefix-cache queries and hits: where the prompt tokens were computed).
  curl -s "http://127.0.0.1:$port/metrics" > "$out/gateway-${label// /_}.metrics" || true
  for url in "${workers[@]}"; do
    curl -s "$url/metrics" | sed "s|^|$url |"
  done > "$out/engines-${label// /_}.metrics" || true
  kill "$gateway" 2>/dev/null || true; wait "$gateway" 2>/dev/null || true
  port=$((port + 2)) # the port after each --port is its admin listener
done
python3 -c "
import json, sys
runs = []
for f in sys.argv[2:]:
    r = json.load(open(f)); runs += r if isinstance(r, list) else [r]
json.dump(runs, open(sys.argv[1], 'w'))" "$out/http.json" "${jsons[@]}"
echo "uptime after: $(uptime)" | tee -a "$out/uptime.txt"
"$kvgate" sim --trace "$trace" --rate-scale "$rate" --kv-capacity-tokens "$kv" "${tier[@]}" "${fleet[@]}" "${limit[@]}" \
  --policies "$(IFS=,; echo "${entries[*]}")" --json "$out/sim.json" | tee "$out/sim.md"
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
# Closed-loop traces: the sessions' makespans (first send to last answer), same scaling.
sessions = [(r["label"], r.get("sessions"), runs[r["label"]].get("sessions")) for r in http]
if any(h and s for _, h, s in sessions):
    keys = ["makespan_mean_ms", "makespan_p50_ms", "makespan_p99_ms"]
    print()
    print("| policy | sessions HTTP / sim | " + " | ".join(f"session {k[:-3]} HTTP / sim" for k in keys) + " |")
    print("| --- |" + " ---: |" * (len(keys) + 1))
    for label, h, s in sessions:
        if h and s:
            cells = [f"{h['sessions']} / {s['sessions']}"]
            cells += [f"{h[k] * scale:,.0f} / {s[k]:,.0f} = {h[k] * scale / s[k]:.2f}" for k in keys]
            print(f"| {label} | " + " | ".join(cells) + " |")
PY
