#!/usr/bin/env python3
"""One tenant floods at 10x beside interactive tenants: their time to first byte, per tenant.

Starts `kvgate mock` (canned engines answering after --gen-ms, so capacity is the gateway's
--max-concurrent-requests slots over the service time) and, per scenario, a `kvgate launch` in
front of it with an admission queue; then sends open-loop requests (each at its scheduled time,
on its own thread) for --secs seconds and reports, per tenant, TTFB p50/p99 and what was served.

Scenarios, side by side in one run (the machine is noisy: compare ratios):
  alone      interactive tenants only (the baseline)
  fifo       + the flood, no tenant named on requests (one queue in arrival order)
  tenants    + the flood, each request naming its tenant (weighted fair queuing, equal weights)
  priority   + the flood, interactive tenants in class high
  reserve    + the flood, which may hold every slot but one (its excess gets 429)

Usage: scripts/tenants_flood.py [--kvgate target/release/kvgate] [--secs 10]
Only 127.0.0.1 is used.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_ready(url: str, deadline_secs: float = 60.0) -> None:
    deadline = time.monotonic() + deadline_secs
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"{url}/readiness", timeout=2) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.05)
    raise SystemExit(f"{url} not ready within {deadline_secs} s")


def percentile(values: list[float], p: float) -> float:
    """Nearest rank, as kvgate_trace::percentile."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    rank = max(1, -(-len(ordered) * p // 100))
    return ordered[int(rank) - 1]


def send(url: str, body: bytes, headers: dict[str, str], results: list, tenant: str) -> None:
    request = urllib.request.Request(f"{url}/v1/chat/completions", data=body, headers=headers)
    started = time.monotonic()
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            ttfb = time.monotonic() - started
            response.read()
            results.append((tenant, ttfb, response.status))
    except urllib.error.HTTPError as error:
        results.append((tenant, time.monotonic() - started, error.code))
    except (urllib.error.URLError, OSError):
        results.append((tenant, time.monotonic() - started, 0))


def run(kvgate: str, workers: list[str], scenario: str, args: argparse.Namespace) -> dict:
    port = free_port()
    config = {
        "max_concurrent_requests": args.slots,
        "queue_size": 100000,
        "queue_timeout_secs": 600,
        "worker_urls": workers,
        "routing": {"policy": "round_robin"},
    }
    interactive = [f"interactive-{i}" for i in range(args.interactive)]
    if scenario == "priority":
        config["tenants"] = {"named": {name: {"class": "high"} for name in interactive}}
    elif scenario == "tenants":
        config["tenants"] = {"named": {name: {} for name in [*interactive, "flood"]}}
    elif scenario == "reserve":
        # The flood may hold all slots but one: its excess is refused (429) instead of queued.
        config["tenants"] = {"named": {**{name: {} for name in interactive},
                                       "flood": {"max_concurrent": args.slots - 1}}}
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as file:
        json.dump(config, file)  # JSON is YAML
    gateway = subprocess.Popen(
        [kvgate, "launch", "--config", file.name, "--port", str(port), "--log-level", "warn"],
        stdout=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url)
        # The schedule: interactive tenants at --rate each, the flood at 10x their total.
        schedule: list[tuple[float, str]] = []
        for name in interactive:
            step = 1.0 / args.rate
            schedule += [(i * step + step * interactive.index(name) / len(interactive), name)
                         for i in range(int(args.secs * args.rate))]
        if scenario != "alone":
            flood_rate = 10 * args.rate * len(interactive)
            schedule += [(i / flood_rate, "flood") for i in range(int(args.secs * flood_rate))]
        schedule.sort()
        short = json.dumps({"model": "mock-model", "max_tokens": 8,
                            "messages": [{"role": "user", "content": "hello there"}]}).encode()
        long = json.dumps({"model": "mock-model", "max_tokens": 64,
                           "messages": [{"role": "user", "content": "word " * 2000}]}).encode()
        results: list = []
        threads = []
        start = time.monotonic()
        for at, tenant in schedule:
            delay = start + at - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            headers = {"content-type": "application/json"}
            if scenario != "fifo":
                headers["x-kvgate-tenant"] = tenant
            body = long if tenant == "flood" else short
            thread = threading.Thread(target=send, args=(url, body, headers, results, tenant), daemon=True)
            thread.start()
            threads.append(thread)
        for thread in threads:
            thread.join(300)
        elapsed = time.monotonic() - start
    finally:
        gateway.terminate()
        gateway.wait(30)
        os.unlink(file.name)
    report: dict = {"scenario": scenario, "elapsed_secs": round(elapsed, 1)}
    for group in ["interactive", "flood"]:
        mine = [r for r in results if r[0].startswith(group)]
        if not mine:
            continue
        ok = [ttfb for _, ttfb, status in mine if status == 200]
        report[group] = {
            "requests": len(mine),
            "ok": len(ok),
            "refused_429": sum(1 for _, _, status in mine if status == 429),
            "ttfb_p50_ms": round(percentile(ok, 50) * 1e3, 1),
            "ttfb_p99_ms": round(percentile(ok, 99) * 1e3, 1),
            "served_per_sec": round(len(ok) / elapsed, 1),
        }
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kvgate", default="target/release/kvgate")
    parser.add_argument("--secs", type=float, default=10.0, help="seconds of arrivals per scenario")
    parser.add_argument("--interactive", type=int, default=3, help="interactive tenants")
    parser.add_argument("--rate", type=float, default=2.0, help="requests per second of each interactive tenant")
    parser.add_argument("--slots", type=int, default=4, help="--max-concurrent-requests")
    parser.add_argument("--gen-ms", type=int, default=100, help="the canned engines' service time")
    parser.add_argument("--scenarios", default="alone,fifo,tenants,priority")
    args = parser.parse_args()
    mock = subprocess.Popen(
        [args.kvgate, "mock", "--workers", "2", "--engine", "canned", "--gen-ms", str(args.gen_ms),
         "--base-port", "0"],
        stdout=subprocess.PIPE, text=True,
    )
    try:
        workers = []
        assert mock.stdout is not None
        while len(workers) < 2:
            line = mock.stdout.readline()
            if not line:
                raise SystemExit("kvgate mock exited")
            if line.startswith("mock engine"):
                workers.append(line.split()[-1])
        load = os.getloadavg()
        print(json.dumps({"uptime_load": [round(x, 2) for x in load], "args": vars(args)}))
        for scenario in args.scenarios.split(","):
            print(json.dumps(run(args.kvgate, workers, scenario, args)), flush=True)
    finally:
        mock.terminate()
        mock.wait(30)


if __name__ == "__main__":
    sys.exit(main())
