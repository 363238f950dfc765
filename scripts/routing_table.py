#!/usr/bin/env python3
"""The routing guard's baseline (bench-baseline/routing.json) as the one-page table of
docs/BENCHMARKS.md: per scenario, the main policies' TTFT mean and p99 as ratios of
round_robin's and their hit rates, and the policy with the lowest TTFT mean.

Usage: scripts/routing_table.py [bench-baseline/routing.json]
"""
import json
import sys

POLICIES = ["cache_aware", "kv_aware", "least_load", "power_of_two"]


def main(path: str) -> None:
    baseline = json.load(open(path))
    head = "| scenario | round_robin TTFT mean / p99 (ms) |"
    rule = "| --- | ---: |"
    for policy in POLICIES:
        head += f" {policy}: mean, p99 (x rr), hit |"
        rule += " --- |"
    print(head + " lowest mean |")
    print(rule + " --- |")
    for scenario in baseline["scenarios"]:
        runs = scenario["policies"]
        rr = runs["round_robin"]
        row = f"| {scenario['id']} | {rr['ttft_mean_ms']:,.0f} / {rr['ttft_p99_ms']:,.0f} |"
        for policy in POLICIES:
            run = runs[policy]
            mean = run["ttft_mean_ms"] / rr["ttft_mean_ms"]
            p99 = run["ttft_p99_ms"] / rr["ttft_p99_ms"]
            row += f" {mean:.2f}, {p99:.2f}, {100 * run['cache_hit_rate']:.1f}% |"
        best = min(runs, key=lambda name: runs[name]["ttft_mean_ms"])
        print(row + f" {best} |")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "bench-baseline/routing.json")
