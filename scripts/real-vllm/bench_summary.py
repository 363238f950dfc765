"""Summarises scripts/real-vllm/bench.sh's output folder as markdown: per workload and target,
the median over runs (and the range) of the cached share of prompt tokens and of TTFT
mean/p50/p99, the load average during the runs; cache_aware's ratios to round_robin run by run
(the issue's bar: cached share >= 1.5x, mean TTFT <= 0.65x, median of the runs); and `kvgate sim`
with the calibrated profile beside the real engines (TTFT mean and p90, hit rate).

    python3 bench_summary.py OUT_DIR
"""

import json
import statistics
import sys
from pathlib import Path


def median_range(values, fmt):
    if not values:
        return "-"
    return f"{fmt(statistics.median(values))} ({fmt(min(values))}-{fmt(max(values))})"


def ms(value):
    return f"{value:.0f}"


def share(value):
    return f"{value * 100:.1f}%"


def predicted_vs_measured(path):
    """The mean predicted total and the mean measured time to first byte of chat answers, from a
    gateway's /metrics text (None when absent)."""
    if not path.exists():
        return None
    values = {}
    for line in path.read_text().splitlines():
        for key, prefix in (
            ("predicted_sum", 'kvgate_predicted_ttft_seconds_sum{'),
            ("predicted_count", 'kvgate_predicted_ttft_seconds_count{'),
            ("ttfb_sum", 'kvgate_request_ttfb_seconds_sum{endpoint="chat_completions"}'),
            ("ttfb_count", 'kvgate_request_ttfb_seconds_count{endpoint="chat_completions"}'),
        ):
            if line.startswith(prefix) and (key.startswith("ttfb") or 'term="total"' in line):
                values[key] = float(line.rsplit(" ", 1)[1])
    if len(values) < 4 or not values["predicted_count"] or not values["ttfb_count"]:
        return None
    return values["predicted_sum"] / values["predicted_count"], values["ttfb_sum"] / values["ttfb_count"]


def main():
    out = Path(sys.argv[1])
    for workload_dir in sorted(p for p in out.iterdir() if p.is_dir() and p.name != "traces"):
        runs = sorted(workload_dir.glob("run*"))
        reports = {}
        for run in runs:
            for path in sorted(run.glob("*.json")):
                if path.name.endswith(".replay.json"):
                    continue
                reports.setdefault(path.stem, []).append((run.name, json.loads(path.read_text())))
        if not reports:
            continue
        print(f"### {workload_dir.name}: {len(runs)} runs, two real vLLM engines\n")
        print("| target | cached share | TTFT mean ms | TTFT p50 ms | TTFT p99 ms | errors | load avg |")
        print("| --- | --- | --- | --- | --- | --- | --- |")
        for target, items in reports.items():
            rs = [r for _, r in items]
            loads = [r.get("load_before", 0) for r in rs] + [r.get("load_after", 0) for r in rs]
            print(
                f"| {target} | {median_range([r['cache_hit_rate'] for r in rs], share)} "
                f"| {median_range([r['ttft_mean_ms'] for r in rs], ms)} "
                f"| {median_range([r['ttft_p50_ms'] for r in rs], ms)} "
                f"| {median_range([r['ttft_p99_ms'] for r in rs], ms)} "
                f"| {sum(r['errors'] for r in rs)} | {min(loads):.1f}-{max(loads):.1f} |"
            )
        if "cache_aware" in reports and "round_robin" in reports:
            rr = dict(reports["round_robin"])
            hits, ttfts = [], []
            for run, r in reports["cache_aware"]:
                if run in rr:
                    hits.append(r["cache_hit_rate"] / max(rr[run]["cache_hit_rate"], 1e-9))
                    ttfts.append(r["ttft_mean_ms"] / max(rr[run]["ttft_mean_ms"], 1e-9))
            print(
                f"\ncache_aware / round_robin, run by run: cached share "
                f"{', '.join(f'{h:.2f}x' for h in hits)} (median {statistics.median(hits):.2f}x); "
                f"mean TTFT {', '.join(f'{t:.2f}x' for t in ttfts)} (median {statistics.median(ttfts):.2f}x)\n"
            )
        predicted = []
        for run in runs:
            got = predicted_vs_measured(run / "kv_aware.metrics")
            if got:
                predicted.append(got)
        if predicted:
            print(
                "kv_aware's predicted time to first token (`kvgate_predicted_ttft_seconds{term=\"total\"}`) "
                "against the gateway's measured time to first byte, mean over each run's requests: "
                + ", ".join(f"{p * 1e3:.0f} / {m * 1e3:.0f} ms ({p / m:.2f}x)" for p, m in predicted)
                + "\n"
            )
        sim_path = workload_dir / "sim.json"
        if sim_path.exists():
            sim = json.loads(sim_path.read_text())
            print("`kvgate sim --engine-profile vllm-cpu-tiny` (same trace, prompts in the engines' tokens) "
                  "beside the real engines (median of the runs):\n")
            print("| policy | TTFT mean ms sim / real | TTFT p90 ms sim / real | hit rate sim / real |")
            print("| --- | --- | --- | --- |")
            for run in sim["runs"]:
                label, m = run["label"], run["metrics"]
                real = [r for _, r in reports.get(label, [])]
                if not real:
                    continue
                mean = statistics.median(r["ttft_mean_ms"] for r in real)
                p90 = statistics.median(r["ttft_p90_ms"] for r in real)
                hit = statistics.median(r["cache_hit_rate"] for r in real)
                print(
                    f"| {label} | {m['ttft_mean_ms']:.0f} / {mean:.0f} ({m['ttft_mean_ms'] / mean:.2f}x) "
                    f"| {m['ttft_p90_ms']:.0f} / {p90:.0f} ({m['ttft_p90_ms'] / p90:.2f}x) "
                    f"| {share(m['cache_hit_rate'])} / {share(hit)} ({(m['cache_hit_rate'] - hit) * 100:+.1f} pt) |"
                )
            print()


if __name__ == "__main__":
    main()
