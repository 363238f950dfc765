#!/usr/bin/env bash
# Issue 26 over HTTP: one `kvgate replay` run of a tenants trace through a gateway with the
# concurrency cap and the fair queue, on four fresh `kvgate mock` engines (the engine model in
# real time). Loopback only.
#
#   scripts/tenants_replay.sh NAME TRACE TENANT_HEADER LOCALITY_BOUND
#
# TENANT_HEADER x-kvgate-tenant sends each line's tenant as the gateway reads it; any other
# name (e.g. x-no-tenant) leaves the gateway without tenants (one queue in arrival order).
# Writes NAME.md and NAME.json (the replay's report, per tenant) in the current directory.
# Optional environment: TENANTS=FILE, a gateway config file (its `tenants:` section: classes,
# weights, reserved concurrency); ENGINE_PRIORITY=1, engines serving by priority (`kvgate mock
# --priority-scheduling`) and the gateway telling them each request's class
# (`--forward-priority vllm`); ENGINE_MIXED=1, engines carrying their running decodes in every
# prefill step (`kvgate mock --mixed-batching`, vLLM v1's and SGLang's mixed-chunk batches);
# KV_EVENTS=1, engines publishing their KV events and the gateway routing on them (the exact
# index, tokenized as the engines do), whose `GET /v1/fleet` is saved as NAME-fleet.json at the
# end (the tenants' cached-token and KV shares, issue 44); MOCK_ARGS, more `kvgate mock` flags
# (e.g. `--kv-capacity-tokens 1048576`).
set -euo pipefail
KVGATE=${KVGATE:-target/debug/kvgate}
name=$1 trace=$2 header=$3 bound=$4
mock_extra=() gateway_extra=()
if [[ -n "${TENANTS:-}" ]]; then gateway_extra+=(--config "$TENANTS"); fi
if [[ "${ENGINE_PRIORITY:-0}" == 1 ]]; then
  mock_extra+=(--priority-scheduling)
  gateway_extra+=(--forward-priority vllm)
fi
if [[ "${ENGINE_MIXED:-0}" == 1 ]]; then mock_extra+=(--mixed-batching); fi
if [[ -n "${MOCK_ARGS:-}" ]]; then read -r -a more <<< "$MOCK_ARGS"; mock_extra+=("${more[@]}"); fi
if [[ "${KV_EVENTS:-0}" == 1 ]]; then
  mock_extra+=(--kv-events-base-port 39200 --kv-events-replay-base-port 39300)
  gateway_extra+=(--mock-tokenizer
    --kv-events-endpoints tcp://127.0.0.1:39200 tcp://127.0.0.1:39201 tcp://127.0.0.1:39202 tcp://127.0.0.1:39203
    --kv-events-replay-endpoints tcp://127.0.0.1:39300 tcp://127.0.0.1:39301 tcp://127.0.0.1:39302 tcp://127.0.0.1:39303)
fi
"$KVGATE" mock --workers 4 --base-port 39100 --host 127.0.0.1 "${mock_extra[@]}" > "mock-$name.log" 2>&1 &
mock=$!
trap 'kill $mock ${gateway:-} 2>/dev/null || true' EXIT
"$KVGATE" launch --host 127.0.0.1 --port 39090 --policy cache_aware \
  --worker-urls http://127.0.0.1:39100 http://127.0.0.1:39101 http://127.0.0.1:39102 http://127.0.0.1:39103 \
  --max-concurrent-requests 16 --queue-size 100000 --queue-timeout-secs 900 \
  --fairness-locality-bound "$bound" "${gateway_extra[@]}" > "gateway-$name.log" 2>&1 &
gateway=$!
for _ in $(seq 1 100); do
  curl -sf http://127.0.0.1:39090/readiness > /dev/null && break
  sleep 0.2
done
"$KVGATE" replay --trace "$trace" --url http://127.0.0.1:39090 --label "$name" \
  --tenant-header "$header" --json "$name.json" > "$name.md"
if [[ "${KV_EVENTS:-0}" == 1 ]]; then
  sleep 6  # the next census of the exact index (every 5 s)
  curl -sf http://127.0.0.1:39091/v1/fleet > "$name-fleet.json"
  curl -sf http://127.0.0.1:39090/metrics | grep '^kvgate_tenant_cached_tokens_total' > "$name-cached.txt" || true
fi
