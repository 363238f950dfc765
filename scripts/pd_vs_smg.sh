#!/usr/bin/env bash
# kvgate's PD mode against SMG 1.13's on the same simulated PD fleet, SGLang protocol: PREFILL
# `kvgate mock --role prefill` engines and DECODE `--role decode` engines running TIME_SCALE
# times faster than wall time, behind `smg launch --pd-disaggregation`, `kvgate launch
# --pd-disaggregation` (always a pair), `kvgate launch --pd-disaggregation --pd-conditional`
# (the thresholds, with POLICY on both sides) and the same with kv_aware on both sides (the
# predicted rule; its time-valued settings and --kv-transfer-gbps scaled to wall time), each
# replayed in turn by one `kvgate replay` (the engines' caches flushed in between). The decode
# engines report as cached what their prefill engine found cached (not the KV they received),
# so every gateway's hit rate is its prefill side's plus what in-place requests found.
# Loopback only.
#
#   scripts/pd_vs_smg.sh S1|S4 [MAX_REQUESTS]
#
#   env: KVGATE (default target/release/kvgate), SMG (default /work/notes/smg-venv/bin/smg),
#        TRACE, PREFILL (2), DECODE (6), POLICY (cache_aware, both sides, both gateways),
#        TIME_SCALE (10), OUT (/tmp/pd_vs_smg), PAUSE_SECS (5), RETRIES (every gateway's
#        --retry-max-retries; unset: each one's default), KVGATE_FLAGS (more flags for every
#        kvgate gateway, e.g. "--pd-fallback-in-place false")
#
# After the replay, each kvgate gateway's retries and PD fallbacks (`kvgate_retries_total`,
# `kvgate_pd_transfer_fallbacks_total`) are written to OUT/.../counters.txt.
set -euo pipefail
cd "$(dirname "$0")/.."
scenario=${1:?S1|S4}
max=${2:-}
kvgate=${KVGATE:-target/release/kvgate}
smg=${SMG:-/work/notes/smg-venv/bin/smg}
trace=${TRACE:-../shared/traces/conversation_trace.jsonl}
n_prefill=${PREFILL:-2}; n_decode=${DECODE:-6}
policy=${POLICY:-cache_aware}
scale=${TIME_SCALE:-10}
out=${OUT:-/tmp/pd_vs_smg}/$scenario-${n_prefill}p${n_decode}d
mkdir -p "$out"
case $scenario in
  S1) rate=1; kv=262144 ;;
  S4) rate=1.5; kv=1048576 ;;
  *) echo "unknown scenario $scenario" >&2; exit 2 ;;
esac
speedup=$(python3 -c "print($rate * $scale)")
limit=(); [ -n "$max" ] && limit=(--max-requests "$max")
retries=(); smg_retries=()
if [ -n "${RETRIES:-}" ]; then
  retries=(--retry-max-retries "$RETRIES")
  # SMG refuses --retry-max-retries 0: its way to none is --disable-retries.
  if [ "$RETRIES" = 0 ]; then smg_retries=(--disable-retries); else smg_retries=("${retries[@]}"); fi
fi

pids=()
cleanup() { for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done; wait 2>/dev/null || true; }
trap cleanup EXIT

"$kvgate" mock --workers "$n_prefill" --role prefill --time-scale "$scale" --base-port 32000 \
  --bootstrap-base-port 32100 --kv-capacity-tokens "$kv" --force-max-tokens > "$out/prefill.log" 2>&1 &
pids+=($!)
"$kvgate" mock --workers "$n_decode" --role decode --time-scale "$scale" --base-port 32200 \
  --kv-capacity-tokens "$kv" --force-max-tokens > "$out/decode.log" 2>&1 &
pids+=($!)
sleep 2
prefill=(); decode=(); workers=()
for ((i = 0; i < n_prefill; i++)); do
  prefill+=(--prefill "http://127.0.0.1:$((32000 + i))" "$((32100 + i))")
  workers+=("http://127.0.0.1:$((32000 + i))")
done
for ((i = 0; i < n_decode; i++)); do
  decode+=(--decode "http://127.0.0.1:$((32200 + i))")
  workers+=("http://127.0.0.1:$((32200 + i))")
done

# The same policy on both sides of both gateways; SMG's command line as its --help shows it.
"$smg" launch --pd-disaggregation "${prefill[@]}" "${decode[@]}" --policy "$policy" \
  --host 127.0.0.1 --port 32300 --prometheus-host 127.0.0.1 --prometheus-port 32310 \
  --shutdown-grace-period-secs 1 --log-level warn "${smg_retries[@]}" > "$out/smg.log" 2>&1 &
pids+=($!)
# shellcheck disable=SC2206 # KVGATE_FLAGS is a list of flags.
common=(--pd-disaggregation "${prefill[@]}" "${decode[@]}" --pd-protocol sglang "${retries[@]}" ${KVGATE_FLAGS:-}
  --mock-tokenizer --log-level warn --load-monitor-interval-ms "$(python3 -c "print(max(1, round(1000 / $scale)))")"
  --eviction-interval "$(python3 -c "print(120 / $scale)")")
"$kvgate" launch --port 32301 --admin-port 32401 "${common[@]}" --policy "$policy" > "$out/kvgate-pair.log" 2>&1 &
pids+=($!)
"$kvgate" launch --port 32302 --admin-port 32402 "${common[@]}" --policy "$policy" --pd-conditional > "$out/kvgate-conditional.log" 2>&1 &
pids+=($!)
# kv_aware on both sides: model-time defaults in wall time (as scripts/sim_vs_http.sh does).
predicted=$(python3 -c "
s = $scale
print(' '.join(['--policy', 'kv_aware', '--pd-conditional',
  '--kv-aware-prefill-tokens-per-sec', str(8000 * s), '--kv-aware-decode-ms-per-request', str(0.35 / s),
  '--kv-aware-kv-pressure-weight', str(0.15 / s), '--kv-aware-wait-slack-ms', str(1000 / s),
  '--kv-transfer-gbps', str(25 * s),
  # The mock decode engines wait 30 s (model time) for a pair's KV: no pair predicted past 80% of it.
  '--pd-kv-hold-secs', str(0.8 * 30 / s)]))")
# shellcheck disable=SC2086 # $predicted is a list of flags.
"$kvgate" launch --port 32303 --admin-port 32403 "${common[@]}" $predicted > "$out/kvgate-predicted.log" 2>&1 &
pids+=($!)
# Every gateway sees every worker before the replay starts.
for port in 32300 32301 32302 32303; do
  for _ in $(seq 100); do
    code=$(curl -s -o /dev/null -w '%{http_code}' -X POST "http://127.0.0.1:$port/v1/chat/completions" \
      -H 'content-type: application/json' \
      -d '{"model":"mock-model","max_tokens":1,"messages":[{"role":"user","content":"warm"}]}' || true)
    [ "$code" = 200 ] && break
    sleep 0.2
  done
done
echo "uptime before: $(uptime)" | tee "$out/uptime.txt"
# SMG last: after its run a mock prefill engine still counts requests running for some seconds
# (the engines refuse to flush their caches then).
"$kvgate" replay --trace "$trace" \
  --url http://127.0.0.1:32301 http://127.0.0.1:32302 http://127.0.0.1:32303 http://127.0.0.1:32300 \
  --label "kvgate PD (pair)" "kvgate PD (conditional)" "kvgate PD (conditional, kv_aware)" "SMG 1.13 PD" \
  --speedup "$speedup" "${limit[@]}" \
  --flush-cache-urls "${workers[@]}" --pause-secs "${PAUSE_SECS:-5}" \
  --fleet-kv-tokens $((n_prefill * kv)) --json "$out/http.json" | tee "$out/http.md"
echo "uptime after: $(uptime)" | tee -a "$out/uptime.txt"
for port in 32301 32302 32303; do
  echo "# kvgate on $port"
  curl -s "http://127.0.0.1:$port/metrics" | grep -E '^kvgate_(retries_total|pd_transfer_fallbacks_total)' || true
done | tee "$out/counters.txt"
