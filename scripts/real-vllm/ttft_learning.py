"""Does kv_aware's predicted time to first token converge to the real engines'? Sends streamed
chat requests through a kvgate gateway running `--policy kv_aware --expose-routing-headers`
(e.g. scripts/real-vllm/up.sh), new conversations of varied lengths and follow-up turns of
earlier ones (their prefix cached), and compares each answer's `x-kvgate-predicted-ttft` total
with the time to its first streamed byte as measured here. Prints one line per request and, per
window of requests, the median of predicted / measured and the share within 20%.

    python3 ttft_learning.py --url http://127.0.0.1:30000 [--requests 64] [--concurrency 1]
        [--spread 8] [--json out.json]

Then per phase (requests 1-8 at the configured rates, 9-32, 33-64 learned): the median of
predicted / measured, the median of predicted over the median of measured, the mean over the
mean, the share within 20%. With --spread N, N more requests of near-identical cold prompts (the
same length, new text) and N of one fully cached prompt, one at a time: the share of each group
within 20% of its own median is what a per-request prediction can reach on this machine.

Only the standard library; talks to the given 127.0.0.1 URL only. Bounded: --requests requests,
each with a 120 s timeout.
"""

import argparse
import http.client
import json
import random
import statistics
import threading
import time
import urllib.parse

MODEL = "tiny-llama"
SYLLABLES = ["ka", "lo", "mi", "ner", "tu", "sa", "vel", "do", "ri", "pan", "qu", "zen", "fo", "bi"]


def words(rng, n):
    return " ".join("".join(rng.choice(SYLLABLES) for _ in range(rng.randint(1, 3))) for _ in range(n))


def send(url, messages):
    parsed = urllib.parse.urlparse(url)
    assert parsed.hostname in ("127.0.0.1", "localhost"), "loopback only"
    conn = http.client.HTTPConnection(parsed.hostname, parsed.port, timeout=120)
    body = json.dumps({
        "model": MODEL, "messages": messages, "max_tokens": 8, "stream": True,
        "stream_options": {"include_usage": True},
    })
    sent = time.perf_counter()
    conn.request("POST", "/v1/chat/completions", body, {"content-type": "application/json"})
    response = conn.getresponse()
    header = response.getheader("x-kvgate-predicted-ttft") or ""
    first = response.read1(65536)
    ttft = time.perf_counter() - sent
    rest = first + response.read()
    conn.close()
    usage = {}
    for line in rest.decode(errors="replace").splitlines():
        if line.startswith("data: {") and '"usage"' in line:
            usage = json.loads(line[6:]).get("usage") or usage
    terms = dict(t.split("=", 1) for t in header.split("; ") if "=" in t)
    predicted = float(terms["total"].rstrip("ms")) / 1e3 if "total" in terms else None
    return {
        "status": response.status, "predicted_s": predicted, "measured_s": ttft,
        "prompt_tokens": usage.get("prompt_tokens"),
        "cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens"),
        "terms": terms,
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="http://127.0.0.1:30000")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=1)
    parser.add_argument("--window", type=int, default=8)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--spread", type=int, default=0)
    parser.add_argument("--json")
    args = parser.parse_args()
    rng = random.Random(args.seed)
    conversations = []
    plans = []
    for _ in range(args.requests):
        if conversations and rng.random() < 0.4:
            conv = rng.choice(conversations)
            conv.append({"role": "assistant", "content": words(rng, 8)})
            conv.append({"role": "user", "content": words(rng, rng.randint(10, 60))})
        else:
            conv = [{"role": "system", "content": words(rng, rng.randint(20, 900))},
                    {"role": "user", "content": words(rng, rng.randint(10, 60))}]
            conversations.append(conv)
        plans.append([dict(m) for m in conv])
    results = [None] * len(plans)
    lock = threading.Lock()
    next_index = [0]

    def worker():
        while True:
            with lock:
                i = next_index[0]
                next_index[0] += 1
            if i >= len(plans):
                return
            results[i] = send(args.url, plans[i])
            r = results[i]
            ratio = r["predicted_s"] / r["measured_s"] if r["predicted_s"] else float("nan")
            print(f"{i:3d} prompt {r['prompt_tokens']} cached {r['cached_tokens']} predicted "
                  f"{(r['predicted_s'] or 0) * 1e3:7.1f} ms measured {r['measured_s'] * 1e3:7.1f} ms "
                  f"ratio {ratio:.2f}", flush=True)

    threads = [threading.Thread(target=worker) for _ in range(args.concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    print("\nwindow | median predicted/measured | within 20%")
    summary = []
    for start in range(0, len(results), args.window):
        chunk = [r for r in results[start:start + args.window] if r and r["predicted_s"]]
        ratios = [r["predicted_s"] / r["measured_s"] for r in chunk]
        if not ratios:
            continue
        within = sum(abs(x - 1) <= 0.2 for x in ratios) / len(ratios)
        summary.append({"first": start, "median_ratio": statistics.median(ratios), "within_20": within})
        print(f"{start:3d}-{start + len(ratios) - 1:3d} | {statistics.median(ratios):.2f} | {within * 100:.0f}%")
    print("\nrequests | median predicted/measured | median pred / median meas | mean / mean | within 20%")
    phases = []
    for first, last in [(1, 8), (9, 32), (33, 64)]:
        chunk = [r for r in results[first - 1:last] if r and r["predicted_s"]]
        if not chunk:
            continue
        pred = [r["predicted_s"] for r in chunk]
        meas = [r["measured_s"] for r in chunk]
        ratios = [p / m for p, m in zip(pred, meas)]
        row = {"first": first, "last": last, "median_ratio": statistics.median(ratios),
               "ratio_of_medians": statistics.median(pred) / statistics.median(meas),
               "mean_over_mean": statistics.mean(pred) / statistics.mean(meas),
               "within_20": sum(abs(x - 1) <= 0.2 for x in ratios) / len(ratios)}
        phases.append(row)
        print(f"{first}-{last} | {row['median_ratio']:.2f} | {row['ratio_of_medians']:.2f} | "
              f"{row['mean_over_mean']:.2f} | {row['within_20'] * 100:.0f}%")
    spread = {}
    if args.spread:
        cached = plans[0]
        groups = {"cold": [], "cached": []}
        for _ in range(args.spread):
            cold = [{"role": "system", "content": words(rng, 600)},
                    {"role": "user", "content": words(rng, 30)}]
            groups["cold"].append(send(args.url, cold))
            groups["cached"].append(send(args.url, cached))
        print("\nspread of near-identical answers | prompt tokens | measured ms min / median / max | "
              "within 20% of their median")
        for name, rs in groups.items():
            meas = [r["measured_s"] for r in rs]
            median = statistics.median(meas)
            within = sum(abs(m / median - 1) <= 0.2 for m in meas) / len(meas)
            tokens = sorted(r["prompt_tokens"] or 0 for r in rs)
            spread[name] = {"measured_s": meas, "within_20_of_median": within,
                            "prompt_tokens": tokens, "cached_tokens": [r["cached_tokens"] for r in rs]}
            print(f"{name} | {tokens[0]}-{tokens[-1]} | {min(meas) * 1e3:.0f} / {median * 1e3:.0f} / "
                  f"{max(meas) * 1e3:.0f} | {within * 100:.0f}%")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"requests": results, "windows": summary, "phases": phases, "spread": spread},
                      f, indent=1)


if __name__ == "__main__":
    main()
