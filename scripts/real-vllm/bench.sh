#!/usr/bin/env bash
# Routing gains on two real vLLM engines (the CPU build, the tiny Llama of install.sh, vLLM's
# default flags: no --chat-template-content-format, so vLLM's `auto` picks `openai` for the
# ChatML template) and the engine model beside them: for each workload and run, each target in
# turn in front of the same two engines, caches reset in between, the same trace replayed by
# `kvgate replay --endpoint chat` (closed-loop sessions, streamed); then `kvgate sim` with
# `--engine-profile vllm-cpu-tiny` on the same traces, prompts counted in the engines' tokens.
#
#   scripts/real-vllm/bench.sh [OUT_DIR]
#
# Targets: kvgate round_robin, least_load, cache_aware, kv_aware (each `kvgate launch` on the
# engines' KV events and tokenizer, as the README says), and SMG 1.13's cache_aware (`pip install
# smg==1.13.0` in its own venv under $KVGATE_VLLM_HOME, launched as its users do).
# Workloads (kvgate trace gen, fixed seeds, scaled to two tiny CPU engines: one trace word is
# about 6.5 of the model's tokens):
#   conversation: issue 39's shape, 20 chats x 10 turns carried on by 4 closed-loop clients
#     (`--shape conversations`: 4 requests in flight at most, every chat live to its last turn),
#     each chat its own system prompt; its working set (the chats' final prompts, ~80,000 model
#     tokens) is more than one engine's cache and about the fleet's (KV_BLOCKS below);
#   agentic: agents' tool loops (agentic shape), applications' tool prompts shared.
# Writes OUT_DIR/<workload>/run<i>/<target>.json (replay reports, with the load average before
# and after), OUT_DIR/<workload>/sim.json, and OUT_DIR/summary.md (bench_summary.py).
#
# Environment: RUNS (3), TARGETS (round_robin least_load cache_aware kv_aware smg), WORKLOADS
# (conversation agentic), KVGATE_BIN (target/release/kvgate, built if missing), DURATION_SECS
# (agentic: trace seconds of arrivals, 60), KV_BLOCKS (each engine's KV cache in 32-token blocks,
# vLLM's `--num-gpu-blocks-override`: 1152, i.e. 36,864 tokens; empty: the whole 1 GiB, 262,144
# tokens), SIM (1: run kvgate sim too). Loopback only; the engines and gateways it starts are
# stopped on exit (by process group).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../.." && pwd)"
. "$here/env.sh"
out="$(mkdir -p "${1:-/tmp/kvgate-real-bench}" && cd "${1:-/tmp/kvgate-real-bench}" && pwd)"
runs=${RUNS:-3}
read -r -a targets <<<"${TARGETS:-round_robin least_load cache_aware kv_aware smg}"
read -r -a workloads <<<"${WORKLOADS:-conversation agentic}"
duration=${DURATION_SECS:-60}
kv_blocks=${KV_BLOCKS-1152}
block_size=32
kv_tokens=$(( ${kv_blocks:-8192} * block_size ))
engine_flags=()
[ -n "$kv_blocks" ] && engine_flags=(--num-gpu-blocks-override "$kv_blocks")
kvgate="${KVGATE_BIN:-$root/target/release/kvgate}"
if [ ! -x "$kvgate" ]; then
  (cd "$root" && cargo build --release --bin kvgate)
fi
"$here/install.sh" >/dev/null
model_dir="$KVGATE_VLLM_MODELS/tiny-llama-chatml"
smg="$KVGATE_VLLM_HOME/smg-venv/bin/smg"
if [[ " ${targets[*]} " == *" smg "* ]] && [ ! -x "$smg" ]; then
  python3 -m venv "$KVGATE_VLLM_HOME/smg-venv"
  "$KVGATE_VLLM_HOME/smg-venv/bin/python" -m pip install --quiet smg==1.13.0
fi

engine_ports=(18001 18002) event_ports=(18011 18012) replay_ports=(18021 18022)
gateway_port=18100 admin_port=18101 smg_metrics_port=18201
groups=()
stop_group() { kill -TERM -- "-$1" 2>/dev/null || true; for _ in $(seq 1 50); do kill -0 -- "-$1" 2>/dev/null || return 0; sleep 0.2; done; kill -KILL -- "-$1" 2>/dev/null || true; }
stop_all() { for group in "${groups[@]}"; do stop_group "$group"; done; }
trap stop_all EXIT
trap 'echo "bench.sh: a command failed at line $LINENO" >&2' ERR
trap 'exit 130' INT TERM
wait_http() { # URL SECONDS
  for _ in $(seq 1 $(($2 * 5))); do curl -sf -o /dev/null "$1" && return 0; sleep 0.2; done
  echo "$1 did not answer in $2 s" >&2; return 1
}
load() { cut -d' ' -f1 /proc/loadavg; }

# The traces (seeded; trace words, ~6.5 model tokens each).
mkdir -p "$out/traces"
"$kvgate" trace gen --shape conversations --seed 1 --conversations 20 --session-max-turns 10 --clients 4 \
  --system-prompt-tokens 128 --user-min-tokens 16 --user-max-tokens 48 --output-min-tokens 8 --output-max-tokens 24 \
  --think-secs 0.5 --out "$out/traces/conversation.jsonl"
"$kvgate" trace gen --shape agentic --seed 1 --duration-secs "$duration" --load 0.5 \
  --capacity-tokens-per-sec 4000 --apps 4 --tool-prompt-min-tokens 512 --tool-prompt-max-tokens 512 \
  --calls-min 2 --calls-max 6 --user-min-tokens 16 --user-max-tokens 48 --context-max-tokens 900 \
  --tool-result-min-tokens 8 --tool-result-max-tokens 48 \
  --tool-min-secs 0.2 --tool-max-secs 1 --output-min-tokens 8 --output-max-tokens 32 \
  --out "$out/traces/agentic.jsonl"

# Two engines with vLLM's default flags (serve.sh adds only the harness's: loopback, block 32,
# prefix caching, cached-token details, KV events; and the cache size). Dev mode serves
# /reset_prefix_cache.
for i in 0 1; do
  VLLM_SERVER_DEV_MODE=1 setsid "$here/serve.sh" "$model_dir" "${engine_ports[$i]}" "${event_ports[$i]}" "${replay_ports[$i]}" \
    "${engine_flags[@]}" >"$out/engine-$i.log" 2>&1 &
  groups+=($!)
done
for port in "${engine_ports[@]}"; do wait_http "http://127.0.0.1:$port/health" 300; done
workers=(http://127.0.0.1:${engine_ports[0]} http://127.0.0.1:${engine_ports[1]})
echo "engines up, KV $kv_tokens tokens each (load $(load))" >&2

reset_caches() {
  for url in "${workers[@]}"; do
    curl -sf -X POST "$url/reset_prefix_cache" -o /dev/null
    # vLLM publishes AllBlocksCleared at its next step: give it one.
    curl -sf "$url/v1/completions" -H 'content-type: application/json' \
      -d '{"model": "tiny-llama", "prompt": "reset", "max_tokens": 1}' -o /dev/null
  done
}

start_target() { # TARGET LOG
  local target=$1 log=$2
  if [ "$target" = smg ]; then
    setsid "$smg" launch --worker-urls "${workers[@]}" --policy cache_aware --host 127.0.0.1 \
      --port "$gateway_port" --prometheus-host 127.0.0.1 --prometheus-port "$smg_metrics_port" \
      --shutdown-grace-period-secs 1 >"$log" 2>&1 &
  else
    setsid "$kvgate" launch --host 127.0.0.1 --port "$gateway_port" --admin-port "$admin_port" \
      --worker-urls "${workers[@]}" --policy "$target" \
      --kv-events-endpoints "tcp://127.0.0.1:${event_ports[0]}" "tcp://127.0.0.1:${event_ports[1]}" \
      --kv-events-replay-endpoints "tcp://127.0.0.1:${replay_ports[0]}" "tcp://127.0.0.1:${replay_ports[1]}" \
      --tokenizer-path "$model_dir" --log-level warn >"$log" 2>&1 &
  fi
  target_group=$!
  groups+=("$target_group")
  wait_http "http://127.0.0.1:$gateway_port/v1/models" 60
  if [ "$target" != smg ]; then
    # Every worker's KV events flowing before the first request.
    for _ in $(seq 1 150); do
      curl -sf "http://127.0.0.1:$admin_port/workers" | python3 -c '
import json, sys
workers = json.load(sys.stdin)["workers"]
sys.exit(0 if workers and all(w["kv_events"]["flowing"] for w in workers) else 1)' && return 0
      sleep 0.2
    done
    echo "the gateway's KV events did not flow" >&2
    return 1
  fi
}

for workload in "${workloads[@]}"; do
  trace="$out/traces/$workload.jsonl"
  for run in $(seq 1 "$runs"); do
    dir="$out/$workload/run$run"
    mkdir -p "$dir"
    for target in "${targets[@]}"; do
      reset_caches
      start_target "$target" "$dir/$target.log"
      before=$(load)
      "$kvgate" replay --trace "$trace" --url "http://127.0.0.1:$gateway_port" --label "$target" \
        --endpoint chat --model tiny-llama --fleet-kv-tokens $((2 * kv_tokens)) --json "$dir/$target.replay.json" \
        >"$dir/$target.txt"
      after=$(load)
      if [ "$target" != smg ]; then
        # kv_aware's predicted time to first token beside the measured one (bench_summary.py).
        curl -sf "http://127.0.0.1:$gateway_port/metrics" -o "$dir/$target.metrics" || true
      fi
      python3 - "$dir/$target.replay.json" "$dir/$target.json" "$before" "$after" <<'PY'
import json, sys
report = json.load(open(sys.argv[1]))
report = report[0] if isinstance(report, list) else report
report["load_before"], report["load_after"] = float(sys.argv[3]), float(sys.argv[4])
json.dump(report, open(sys.argv[2], "w"), indent=1)
PY
      stop_group "$target_group"
      echo "$workload run $run $target: $(python3 -c "
import json; r = json.load(open('$dir/$target.json'))
print(f\"TTFT mean {r['ttft_mean_ms']:.1f} ms p50 {r['ttft_p50_ms']:.1f} p99 {r['ttft_p99_ms']:.1f}, cached {r['cache_hit_rate']:.3f}, errors {r['errors']}, load {r['load_before']}-{r['load_after']}\")")" >&2
    done
  done
  if [ "${SIM:-1}" = 1 ]; then
    sim_policies=$(printf '%s\n' "${targets[@]}" | grep -v '^smg$' | paste -sd, -)
    "$kvgate" sim --trace "$trace" --workers 2 --engine-profile vllm-cpu-tiny \
      --kv-capacity-tokens "$kv_tokens" --tokenizer-path "$model_dir" --endpoint chat --policies "$sim_policies" \
      --json "$out/$workload/sim.json" >"$out/$workload/sim.md"
  fi
done
stop_all
groups=()
python3 "$here/bench_summary.py" "$out" | tee "$out/summary.md"
