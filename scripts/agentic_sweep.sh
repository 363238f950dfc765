#!/usr/bin/env bash
# kv_aware on agentic workloads it was not tuned on (issue 41 item 3): a grid of `kvgate trace gen
# --shape agentic` variants that are not S9 (docs/SCENARIOS.md), each replayed in `kvgate sim`
# under round_robin, least_load, power_of_two, cache_aware and kv_aware, then a table of kv_aware
# over the best other policy (TTFT mean, TTFT p99, session makespan p99 where the trace has
# sessions) and the hit rates.
#
# The variants start from the shape issue 41 first measured (tool prompts 6K-16K tokens, 4-30
# calls, 0.3-3 s of tool time, answers of 30-300 tokens, tool results of 0.5K-6K, contexts up to
# 120K) and cross: fewer / more applications (--apps 3 / 12), a lighter / heavier load (--load 1 /
# 3), closed loop (sessions) / open loop (the same trace written without session fields, as the
# issue first measured it), KV of 262,144 / 1,048,576 tokens per engine; 8 reference engines.
#
#   scripts/agentic_sweep.sh                       # the grid, seeds 0 and 1, into /tmp/agentic_sweep
#   scripts/agentic_sweep.sh --seeds "0 1 2" --duration-secs 600 --jobs 2 --out DIR
#   scripts/agentic_sweep.sh --table-only --out DIR    # only the table of an earlier run
#
# Each run is `kvgate trace gen ... --seed N -o trace` then `kvgate sim --trace trace --seed N
# --kv-capacity-tokens K --policies ... --json FILE`. By default both steps run in one process,
# the release build of kvgate-sim's `scenario` example (S9's generator flags replaced by the
# variant's: the same trace and the same figures, the simulator being deterministic); with
# KVGATE=path/to/kvgate they run through the CLI instead, writing the traces into the output
# directory. The simulator is deterministic: the same commit gives the same table. A run whose
# JSON is already in the output directory is not run again (an interrupted sweep resumes; give
# another --out for other options). Seeds 0 and 1 take about 4 minutes on 2 cores (32 runs of
# 5 policies, 566-2,402 requests each).
set -euo pipefail
cd "$(dirname "$0")/.."

seeds="0 1"
duration_secs=600
jobs=2
out=/tmp/agentic_sweep
table_only=0
policies=round_robin,least_load,power_of_two,cache_aware,kv_aware
while [ $# -gt 0 ]; do
  case "$1" in
    --seeds) seeds="$2"; shift 2 ;;
    --duration-secs) duration_secs="$2"; shift 2 ;;
    --jobs) jobs="$2"; shift 2 ;;
    --out) out="$2"; shift 2 ;;
    --policies) policies="$2"; shift 2 ;;
    --table-only) table_only=1; shift ;;
    -h|--help) sed -n '2,26p' "$0"; exit 0 ;;
    *) echo "agentic_sweep.sh: unknown option $1 (--help lists them)" >&2; exit 2 ;;
  esac
done
case "$duration_secs" in ''|*[!0-9]*) echo "agentic_sweep.sh: --duration-secs must be a whole number of seconds" >&2; exit 2 ;; esac
case "$jobs" in ''|*[!0-9]*|0) echo "agentic_sweep.sh: --jobs must be a positive whole number" >&2; exit 2 ;; esac
mkdir -p "$out"

# The issue's shape (every flag of the agentic generator that S9 sets otherwise).
issue_shape="--shape agentic --tool-prompt-min-tokens 6000 --tool-prompt-max-tokens 16000 \
--calls-min 4 --calls-max 30 --tool-min-secs 0.3 --tool-max-secs 3 --output-min-tokens 30 \
--output-max-tokens 300 --tool-result-min-tokens 500 --tool-result-max-tokens 6000 \
--context-max-tokens 120000 --duration-secs $duration_secs"

# name|generator flags|sim flags
variants=()
for apps in 3 12; do
  for load in 1 3; do
    for loop in closed open; do
      for kv in 262144 1048576; do
        gen="$issue_shape --apps $apps --load $load"
        [ "$loop" = open ] && gen="$gen --open-loop"
        variants+=("a${apps}-l${load}-${loop}-kv$((kv / 1024))k|$gen|--kv-capacity-tokens $kv")
      done
    done
  done
done

run_one() { # name gen sim seed
  local name=$1 gen=$2 sim=$3 seed=$4 base="$out/$1.s$4"
  [ -s "$base.json" ] && return 0
  if [ -n "${KVGATE:-}" ]; then
    # shellcheck disable=SC2086
    "$KVGATE" trace gen $gen --seed "$seed" -o "$base.jsonl"
    # shellcheck disable=SC2086
    "$KVGATE" sim --trace "$base.jsonl" $sim --seed "$seed" --policies "$policies" \
      --json "$base.json.part" > "$base.md"
  else
    "$scenario_bin" S9 --seed "$seed" --policies "$policies" --gen "$gen" --sim "$sim" \
      --json "$base.json.part" > "$base.md"
  fi
  mv "$base.json.part" "$base.json"
  echo "done $name seed $seed"
}

if [ "$table_only" = 0 ]; then
  if [ -z "${KVGATE:-}" ]; then
    cargo build --quiet --release -p kvgate-sim --example scenario
    scenario_bin="${CARGO_TARGET_DIR:-target}/release/examples/scenario"
  fi
  running=0
  for seed in $seeds; do
    for v in "${variants[@]}"; do
      IFS='|' read -r name gen sim <<< "$v"
      run_one "$name" "$gen" "$sim" "$seed" &
      running=$((running + 1))
      if [ "$running" -ge "$jobs" ]; then wait -n; running=$((running - 1)); fi
    done
  done
  wait
fi

python3 - "$out" "$seeds" <<'EOF'
import json, os, sys
out, seeds = sys.argv[1], sys.argv[2].split()
others = ["round_robin", "least_load", "power_of_two", "cache_aware"]
names = sorted({f.rsplit(".s", 1)[0] for f in os.listdir(out) if f.endswith(".json")},
               key=lambda n: (int(n.split("-")[0][1:]), n))
print("kv_aware over the best other (TTFT mean, p99, session makespan p99; `*`: mean > 1.00 or "
      "p99 / session p99 > 1.05), its hit rate and the best other's (by mean), per seed\n")
print("| variant | requests | " + " | ".join(f"seed {s}: mean, p99, session p99 | hit kv / best" for s in seeds) + " |")
print("| --- | ---: | " + " | ".join("---" for _ in seeds for _ in (0, 1)) + " |")
worst = []
for name in names:
    cells, requests = [], []
    for seed in seeds:
        path = f"{out}/{name}.s{seed}.json"
        if not os.path.exists(path):
            cells += ["", ""]; continue
        runs = {r["label"].split(":")[0].split("@")[0]: r for r in json.load(open(path))["runs"]}
        requests.append(str(json.load(open(path))["trace"]["requests"]))
        kv = runs["kv_aware"]["metrics"]
        rest = [runs[o]["metrics"] for o in others if o in runs]
        def ratio(key, limit):
            best = min(m[key] for m in rest)
            r = kv[key] / best if best > 0 else float("nan")
            worst.append((r - limit, name, seed, key, r))
            return f"{'*' if r > limit else ''}{r:.3f}"
        cell = f"{ratio('ttft_mean_ms', 1.0)}, {ratio('ttft_p99_ms', 1.05)}"
        if kv.get("sessions") and all(m.get("sessions") for m in rest):
            best = min(m["sessions"]["makespan_p99_ms"] for m in rest)
            r = kv["sessions"]["makespan_p99_ms"] / best
            worst.append((r - 1.05, name, seed, "session_p99", r))
            cell += f", {'*' if r > 1.05 else ''}{r:.3f}"
        else:
            cell += ", -"
        best_by_mean = min(rest, key=lambda m: m["ttft_mean_ms"])
        cells += [cell, f"{100 * kv['cache_hit_rate']:.1f}% / {100 * best_by_mean['cache_hit_rate']:.1f}%"]
    print(f"| {name} | {' / '.join(requests)} | " + " | ".join(cells) + " |")
worst.sort(reverse=True)
print("\nclosest to (or past) its bound: " + ", ".join(f"{n} s{s} {k} {r:.3f}" for _, n, s, k, r in worst[:5]))
EOF
