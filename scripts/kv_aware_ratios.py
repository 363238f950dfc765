#!/usr/bin/env python3
"""kv_aware's TTFT mean and p99 over the best of round_robin, least_load, power_of_two and
cache_aware, per scenario, from routing-guard baseline files (one column per file; `*`: over
the target, mean > 1.00 or p99 > 1.05; then kv_aware's mean and p99 in ms, and `s`: its session
makespan p99 over the best other's).

Usage:
  routing-guard --seed N --jobs 1 --policies round_robin,least_load,power_of_two,cache_aware,kv_aware \
      --update --baseline /tmp/seedN.json
  scripts/kv_aware_ratios.py /tmp/seed0.json /tmp/seed1.json
"""
import json, sys
OTHERS = ["round_robin", "least_load", "power_of_two", "cache_aware"]
def ratios(path):
    d = json.load(open(path))
    out = {}
    for s in d["scenarios"]:
        p = s["policies"]
        if "kv_aware" not in p: continue
        kv = p["kv_aware"]
        row = {}
        for key in ["ttft_mean_ms", "ttft_p99_ms"]:
            best = min(p[o][key] for o in OTHERS if o in p)
            row[key] = kv[key] / best
        if "session_p99_ms" in kv or "session_makespan_p99_ms" in kv:
            k = "session_p99_ms" if "session_p99_ms" in kv else "session_makespan_p99_ms"
            row["sess"] = kv[k] / min(p[o][k] for o in OTHERS if o in p and k in p[o])
        row["kv_mean"] = kv["ttft_mean_ms"]; row["kv_p99"] = kv["ttft_p99_ms"]; row["hit"] = kv.get("cache_hit_rate")
        out[s["id"]] = row
    return out
files = sys.argv[1:]
rs = [ratios(f) for f in files]
ids = sorted(set().union(*[r.keys() for r in rs]), key=lambda x: int(x[1:]) if x[1:].isdigit() else 99)
print("scen " + " | ".join(f"{f.split('/')[-1]:>34}" for f in files))
for i in ids:
    cells = []
    for r in rs:
        if i not in r: cells.append(" " * 34); continue
        x = r[i]
        m = lambda v, lim: (f"*{v:.3f}" if v > lim else f" {v:.3f}")
        extra = f" s{x['sess']:.3f}" if "sess" in x else ""
        cells.append(f"{m(x['ttft_mean_ms'],1.0)} {m(x['ttft_p99_ms'],1.05)} {x['kv_mean']:>9.0f} {x['kv_p99']:>8.0f}{extra}")
    print(f"{i:4} " + " | ".join(cells))
