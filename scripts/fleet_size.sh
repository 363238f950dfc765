#!/usr/bin/env bash
# Fleet size: one `kvgate mock` process with N simulated engines behind one `kvgate launch`
# gateway (default health-check and load-poll intervals), for N = 10, 100, 1000 and each policy
# given. Once every worker is healthy, it measures the idle gateway's CPU (utime + stime from
# /proc/PID/stat over IDLE_SECS) and its resident memory (VmRSS), then sends REQUESTS requests
# to check that it routes. Loopback only. Prints a markdown table.
#
#   scripts/fleet_size.sh [POLICY ...]        (default: cache_aware kv_aware)
#   env: KVGATE (binary, default target/release/kvgate), SIZES ("10 100 1000"), IDLE_SECS (30),
#        REQUESTS (200), PORT (39500), OUT (/tmp/fleet_size)
set -euo pipefail
cd "$(dirname "$0")/.."
policies=("$@"); [ ${#policies[@]} -gt 0 ] || policies=(cache_aware kv_aware)
kvgate=${KVGATE:-target/release/kvgate}
sizes=${SIZES:-10 100 1000}
idle=${IDLE_SECS:-30}
requests=${REQUESTS:-200}
port=${PORT:-39500}
out=${OUT:-/tmp/fleet_size}
mkdir -p "$out"
ticks=$(getconf CLK_TCK)

pids=()
cleanup() { kill "${pids[@]}" 2>/dev/null || true; wait 2>/dev/null || true; pids=(); }
trap cleanup EXIT

cpu_ticks() { awk '{print $14 + $15}' "/proc/$1/stat"; }
rss_mib() { awk '/VmRSS/ {printf "%.1f", $2 / 1024}' "/proc/$1/status"; }

echo "| policy | workers | idle gateway CPU | gateway RSS | mock RSS | requests ok |"
echo "|---|---:|---:|---:|---:|---:|"
for policy in "${policies[@]}"; do
  for n in $sizes; do
    "$kvgate" mock --workers "$n" --engine canned > "$out/mock-$n.log" 2>&1 &
    mock=$!; pids+=($mock)
    for _ in $(seq 1 300); do
      [ "$(grep -c '^mock engine [0-9]*: http' "$out/mock-$n.log" || true)" -ge "$n" ] && break
      sleep 0.2
    done
    mapfile -t urls < <(grep -o 'http://127.0.0.1:[0-9]*' "$out/mock-$n.log")
    "$kvgate" launch --port "$port" --policy "$policy" --log-level warn --worker-urls "${urls[@]}" \
      > "$out/gateway-$policy-$n.log" 2>&1 &
    gateway=$!; pids+=($gateway)
    healthy=0
    for _ in $(seq 1 600); do
      healthy=$(curl -s --noproxy '*' "http://127.0.0.1:$port/readiness" \
        | python3 -c 'import json,sys; print(json.load(sys.stdin).get("healthy_workers", 0))' 2>/dev/null || echo 0)
      [ "$healthy" -ge "$n" ] && break
      sleep 0.2
    done
    sleep 5 # the first load polls and health rounds settle
    before=$(cpu_ticks "$gateway")
    sleep "$idle"
    after=$(cpu_ticks "$gateway")
    cpu=$(python3 -c "print(f'{100 * ($after - $before) / $ticks / $idle:.2f} %')")
    rss=$(rss_mib "$gateway"); mock_rss=$(rss_mib "$mock")
    ok=0
    for i in $(seq 1 "$requests"); do
      code=$(curl -s --noproxy '*' -o /dev/null -w '%{http_code}' "http://127.0.0.1:$port/v1/chat/completions" \
        -H 'content-type: application/json' \
        -d "{\"model\":\"mock-model\",\"messages\":[{\"role\":\"user\",\"content\":\"conversation $((i % 50)) hello\"}]}")
      [ "$code" = 200 ] && ok=$((ok + 1))
    done
    echo "| $policy | $n ($healthy healthy) | $cpu | $rss MiB | $mock_rss MiB | $ok/$requests |"
    cleanup
    sleep 1
  done
done
