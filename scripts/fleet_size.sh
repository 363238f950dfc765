#!/usr/bin/env bash
# Fleet size: N simulated engines (`kvgate mock` processes of at most PER_MOCK engines each)
# behind one `kvgate launch` gateway (default health-check and load-poll intervals), for
# N = 10, 100, 1000, 10000 and each policy given. It measures the registration time (gateway
# start to every worker healthy), then the idle gateway's CPU (utime + stime from
# /proc/PID/stat over IDLE_SECS: CPU time, not wall time, so a loaded machine does not inflate
# it) and its resident memory (VmRSS, and per worker over the smallest size's), then sends
# REQUESTS requests (default: one per worker, each its own conversation, 8 at a time) and counts
# the answers and the workers that served them, and the gateway's open descriptors idle and after
# the requests (one connection a worker is the aim). Loopback only. Prints a markdown table.
#
#   scripts/fleet_size.sh [POLICY ...]        (default: cache_aware kv_aware)
#   env: KVGATE (binary, default target/release/kvgate), SIZES ("10 100 1000 10000"),
#        IDLE_SECS (30), SETTLE_SECS (5: after the last worker turned healthy, before the idle
#        CPU is measured; the poll back-offs settle within 7 health intervals), REQUESTS (default
#        N), PER_MOCK (2500), PORT (19500: below the ephemeral
#        port range, where the engines' own ports come from), OUT (/tmp/fleet_size)
set -euo pipefail
cd "$(dirname "$0")/.."
policies=("$@"); [ ${#policies[@]} -gt 0 ] || policies=(cache_aware kv_aware)
kvgate=${KVGATE:-target/release/kvgate}
sizes=${SIZES:-10 100 1000 10000}
idle=${IDLE_SECS:-30}
settle=${SETTLE_SECS:-5}
per_mock=${PER_MOCK:-2500}
port=${PORT:-19500}
out=${OUT:-/tmp/fleet_size}
mkdir -p "$out"
ticks=$(getconf CLK_TCK)

pids=()
cleanup() { kill "${pids[@]}" 2>/dev/null || true; wait 2>/dev/null || true; pids=(); }
trap cleanup EXIT

cpu_ticks() { awk '{print $14 + $15}' "/proc/$1/stat"; }
rss_kib() { awk '/VmRSS/ {print $2}' "/proc/$1/status"; }
fds() { ls "/proc/$1/fd" | wc -l; }
healthy_workers() {
  curl -s --noproxy '*' "http://127.0.0.1:$port/readiness" \
    | python3 -c 'import json,sys; print(json.load(sys.stdin).get("healthy_workers", 0))' 2>/dev/null || echo 0
}

echo "| policy | workers | registered and healthy in | idle gateway CPU | gateway RSS | per worker | mock RSS | descriptors idle / after | requests ok | workers served |"
echo "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
for policy in "${policies[@]}"; do
  base_rss=""; base_n=""
  for n in $sizes; do
    requests=${REQUESTS:-$n}
    mocks=(); left=$n; m=0
    while [ "$left" -gt 0 ]; do
      k=$(( left < per_mock ? left : per_mock ))
      : > "$out/mock-$n-$m.log"
      "$kvgate" mock --workers "$k" --engine canned > "$out/mock-$n-$m.log" 2>&1 &
      mocks+=($!); pids+=($!)
      for _ in $(seq 1 600); do
        [ "$(grep -c '^mock engine [0-9]*: http' "$out/mock-$n-$m.log" || true)" -ge "$k" ] && break
        sleep 0.2
      done
      left=$((left - k)); m=$((m + 1))
    done
    mapfile -t urls < <(cat "$out"/mock-"$n"-*.log | grep -o 'http://127.0.0.1:[0-9]*')
    started=$(date +%s.%N)
    "$kvgate" launch --port "$port" --policy "$policy" --log-level warn --expose-routing-headers \
      --max-workers "$(( n > 4096 ? n : 4096 ))" \
      --worker-urls "${urls[@]}" > "$out/gateway-$policy-$n.log" 2>&1 &
    gateway=$!; pids+=($gateway)
    healthy=0
    for _ in $(seq 1 3000); do
      healthy=$(healthy_workers)
      [ "$healthy" -ge "$n" ] && break
      sleep 0.2
    done
    registered=$(python3 -c "print(f'{$(date +%s.%N) - $started:.1f} s')")
    sleep "$settle" # the first load polls and health rounds settle
    before=$(cpu_ticks "$gateway")
    sleep "$idle"
    after=$(cpu_ticks "$gateway")
    cpu=$(python3 -c "print(f'{100 * ($after - $before) / $ticks / $idle:.2f} %')")
    rss=$(rss_kib "$gateway")
    fds_idle=$(fds "$gateway")
    mock_rss=0; for mock in "${mocks[@]}"; do mock_rss=$((mock_rss + $(rss_kib "$mock"))); done
    [ -n "$base_rss" ] || { base_rss=$rss; base_n=$n; }
    per_worker=$(python3 -c "d = $n - $base_n; print(f'{($rss - $base_rss) / d:.0f} KiB' if d else '-')")
    # Each request its own conversation, opening with a word of its own (no shared prefix).
    python3 -c "import hashlib; [print(hashlib.sha1(str(i).encode()).hexdigest()[:16]) for i in range($requests)]" \
      | xargs -P 8 -I{} curl -s --noproxy '*' -o /dev/null -D - \
      "http://127.0.0.1:$port/v1/chat/completions" -H 'content-type: application/json' \
      -d '{"model":"mock-model","messages":[{"role":"user","content":"{} hello"}]}' \
      > "$out/answers-$policy-$n.txt" 2>/dev/null || true
    ok=$(grep -c '^HTTP/1.1 200' "$out/answers-$policy-$n.txt" || true)
    fds_after=$(fds "$gateway")
    served=$(grep -i '^x-kvgate-worker:' "$out/answers-$policy-$n.txt" | sort -u | wc -l)
    echo "| $policy | $n ($healthy healthy) | $registered | $cpu | $((rss / 1024)) MiB | $per_worker | $((mock_rss / 1024)) MiB | $fds_idle / $fds_after | $ok/$requests | $served |"
    cleanup
    sleep 1
  done
done
