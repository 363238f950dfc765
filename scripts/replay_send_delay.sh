#!/usr/bin/env bash
# How well `kvgate replay` keeps time while the engines stream hundreds of answers at once: the
# replayer alone (no gateway) sends a scenario's first N requests round robin over 8
# `kvgate mock` engines at time scale 1 and reports its mean send delay (how late each request
# began behind its due time). S10's rollouts are the hard case: bursts of 8-16 samples of one
# 8K-token prompt, each answer streaming hundreds to thousands of tokens. Loopback only.
#
#   scripts/replay_send_delay.sh [N (400)] [SHAPE (rollouts)]
#
#   env: KVGATE (binary, default target/release/kvgate), OUT (/tmp/replay_send_delay)
set -euo pipefail
cd "$(dirname "$0")/.."
n=${1:-400}; shape=${2:-rollouts}
kvgate=${KVGATE:-target/release/kvgate}
out=${OUT:-/tmp/replay_send_delay}
mkdir -p "$out"
"$kvgate" trace gen --shape "$shape" -o "$out/trace.jsonl" > /dev/null
"$kvgate" mock --workers 8 --time-scale 1 --base-port 32000 --kv-capacity-tokens 262144 --force-max-tokens \
  > "$out/mock.log" 2>&1 &
mock=$!
trap 'kill $mock 2>/dev/null || true; wait 2>/dev/null || true' EXIT
sleep 2
urls=(); for i in 0 1 2 3 4 5 6 7; do urls+=("http://127.0.0.1:$((32000 + i))"); done
echo "uptime before: $(uptime)"
"$kvgate" replay --trace "$out/trace.jsonl" --url "${urls[@]}" --spread-urls --label "$shape" \
  --max-requests "$n" --json "$out/replay.json" 2> "$out/replay.err" | grep -E "send delay|TTFT mean|succeeded|errors"
echo "uptime after: $(uptime)"
