"""Measures one running vLLM engine the way kvgate-engine models it, and prints the figures and
the engine parameters that reproduce them (the `vllm-cpu-tiny` profile was made from its output).

    python3 calibrate.py --url http://127.0.0.1:8001 [--json out.json] [--quick]

What it measures, each on requests of random token ids (nothing cached unless on purpose):
- prefill: the time to first token of a cold prompt of N tokens (max_tokens 1, streamed), for N
  up to twice the step budget, fitted as `overhead + steps x chunk_base + N / rate` (steps =
  ceil(N / budget)); the engine's own `vllm:request_prefill_time_seconds` beside it;
- a warm prompt (the same prompt again: all but its last block cached);
- 256 new tokens after a cached prefix of 0-6,144 tokens (whether a step's cost grows with the
  context its tokens attend to);
- decode: B streams at once (short prompts, 48 tokens each, ignore_eos), the step time as the
  median gap between a stream's tokens, fitted as `base + per_request x B`;
- preemptions (`vllm:num_preemptions_total`) over the run. The step budget is not measured
  here: it is `--budget`, vLLM's `max_num_batched_tokens`, 2,048 by default for the CPU build's
  API server (vllm/engine/arg_utils.py, `get_batch_defaults`: `OPENAI_API_SERVER: 2048 *
  world_size` on CPU, chunked prefill on). `vllm:iteration_tokens_total` cannot tell it: it is
  observed per batch of outputs the API server processes, and a prompt's computed tokens are
  counted there at once with its first token (vllm/v1/metrics/stats.py,
  `IterationStats.update_from_output`), so a 4,096-token prompt prefilled in two 2,048-token
  steps shows as one observation of 4,097 tokens;
- what the engine reports: its /metrics families and a usage object.

Only the standard library; talks to the given 127.0.0.1 URL only. Timing on a shared machine is
noisy: every figure is a median of --reps runs, and the load average is printed beside it.
"""

import argparse
import http.client
import json
import os
import random
import statistics
import threading
import time
import urllib.parse

MODEL = "tiny-llama"
VOCAB = 2900


def load_average():
    return os.getloadavg()[0]


class Engine:
    def __init__(self, url):
        parsed = urllib.parse.urlparse(url)
        assert parsed.hostname in ("127.0.0.1", "localhost"), "loopback only"
        self.host, self.port = parsed.hostname, parsed.port

    def connection(self):
        return http.client.HTTPConnection(self.host, self.port, timeout=600)

    def metrics(self):
        conn = self.connection()
        conn.request("GET", "/metrics")
        text = conn.getresponse().read().decode()
        conn.close()
        values = {}
        for line in text.splitlines():
            if not line or line.startswith("#"):
                continue
            name_labels, _, value = line.rpartition(" ")
            name = name_labels.split("{")[0]
            try:
                values[name] = values.get(name, 0.0) + float(value)
            except ValueError:
                pass
        return values, text

    def stream(self, prompt, max_tokens, ignore_eos=True):
        """Streams one completion: (seconds to each chunk carrying text, usage)."""
        body = {
            "model": MODEL,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "ignore_eos": ignore_eos,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        conn = self.connection()
        started = time.perf_counter()
        conn.request("POST", "/v1/completions", json.dumps(body), {"content-type": "application/json"})
        response = conn.getresponse()
        assert response.status == 200, response.read()
        times, usage, buffer = [], None, b""
        while True:
            chunk = response.read1(65536)
            if not chunk:
                break
            buffer += chunk
            while b"\n\n" in buffer:
                event, buffer = buffer.split(b"\n\n", 1)
                data = event.decode().removeprefix("data: ").strip()
                if data == "[DONE]" or not data:
                    continue
                message = json.loads(data)
                if message.get("usage"):
                    usage = message["usage"]
                if message.get("choices"):
                    times.append(time.perf_counter() - started)
        conn.close()
        return times, usage


def random_prompt(rng, n):
    return [rng.randrange(10, VOCAB) for _ in range(n)]


def delta(before, after, name):
    return after.get(name, 0.0) - before.get(name, 0.0)


def fit_line(xs, ys):
    """Least squares y = a + b x."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx else 0.0
    return my - b * mx, b


def fit_prefill(points, budget):
    """TTFT = overhead + steps x chunk + N / rate, least squares on (1, steps, N)."""
    rows = [(1.0, float(-(-n // budget)), float(n)) for n, _ in points]
    ys = [t for _, t in points]
    # Normal equations, 3x3, solved by Gaussian elimination.
    a = [[sum(r[i] * r[j] for r in rows) for j in range(3)] for i in range(3)]
    v = [sum(r[i] * y for r, y in zip(rows, ys)) for i in range(3)]
    for col in range(3):
        pivot = max(range(col, 3), key=lambda r: abs(a[r][col]))
        a[col], a[pivot], v[col], v[pivot] = a[pivot], a[col], v[pivot], v[col]
        if abs(a[col][col]) < 1e-12:
            return None
        for row in range(3):
            if row != col:
                f = a[row][col] / a[col][col]
                a[row] = [x - f * y for x, y in zip(a[row], a[col])]
                v[row] -= f * v[col]
    overhead, chunk, per_token = (v[i] / a[i][i] for i in range(3))
    return overhead, chunk, per_token


def measure_prefill(engine, rng, sizes, reps):
    points, rows = [], []
    for n in sizes:
        ttfts, engine_prefill = [], []
        for _ in range(reps):
            before, _ = engine.metrics()
            times, usage = engine.stream(random_prompt(rng, n), 1)
            after, _ = engine.metrics()
            ttfts.append(times[0])
            count = delta(before, after, "vllm:request_prefill_time_seconds_count")
            if count:
                engine_prefill.append(delta(before, after, "vllm:request_prefill_time_seconds_sum") / count)
            assert usage["prompt_tokens"] == n, usage
        ttft = statistics.median(ttfts)
        points.extend((n, t) for t in ttfts)
        rows.append({
            "prompt_tokens": n,
            "ttft_ms": round(ttft * 1e3, 1),
            "engine_prefill_ms": round(statistics.median(engine_prefill) * 1e3, 1) if engine_prefill else None,
            "load": round(load_average(), 2),
        })
        print(f"prefill {n:>5} tokens: TTFT {ttft * 1e3:7.1f} ms (engine's prefill "
              f"{rows[-1]['engine_prefill_ms']} ms), load {load_average():.2f}", flush=True)
    return points, rows


def measure_warm(engine, rng, n, reps):
    rows = []
    for _ in range(reps):
        prompt = random_prompt(rng, n)
        engine.stream(prompt, 1)
        times, usage = engine.stream(prompt, 1)
        rows.append((times[0], usage["prompt_tokens_details"]["cached_tokens"]))
    ttft = statistics.median(t for t, _ in rows)
    cached = rows[0][1]
    print(f"warm {n} tokens ({cached} cached): TTFT {ttft * 1e3:.1f} ms, load {load_average():.2f}", flush=True)
    return {"prompt_tokens": n, "cached_tokens": cached, "ttft_ms": round(ttft * 1e3, 1)}


def measure_context(engine, rng, contexts, new_tokens, reps):
    """The time to first token of `new_tokens` uncached tokens after a cached prefix of C
    tokens, for C in `contexts`: whether a prefill step's cost grows with the context its tokens
    attend to (a per-token rate alone says it does not)."""
    rows = []
    for context in contexts:
        ttfts = []
        for _ in range(reps):
            prefix = random_prompt(rng, context)
            if context:
                engine.stream(prefix, 1)
            times, usage = engine.stream(prefix + random_prompt(rng, new_tokens), 1)
            ttfts.append(times[0])
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
        ttft = statistics.median(ttfts)
        rows.append({"context_tokens": context, "cached_tokens": cached, "new_tokens": new_tokens,
                     "ttft_ms": round(ttft * 1e3, 1), "load": round(load_average(), 2)})
        print(f"context {context:>5} ({cached} cached) + {new_tokens} new: TTFT {ttft * 1e3:7.1f} ms, "
              f"load {load_average():.2f}", flush=True)
    return rows


def measure_decode(engine, rng, batches, tokens, reps):
    rows = []
    for batch in batches:
        steps, engine_steps = [], []
        for _ in range(reps):
            before, _ = engine.metrics()
            results = [None] * batch
            start = threading.Barrier(batch)

            def run(i):
                prompt = random_prompt(rng, 32)
                start.wait()
                results[i] = engine.stream(prompt, tokens)[0]

            threads = [threading.Thread(target=run, args=(i,)) for i in range(batch)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            after, _ = engine.metrics()
            # The engine's own inter-token latency over the run (the client may read several
            # tokens at once).
            count = delta(before, after, "vllm:inter_token_latency_seconds_count")
            engine_steps.append(delta(before, after, "vllm:inter_token_latency_seconds_sum") / count)
            # The client's: each stream's span over its tokens.
            steps.extend((times[-1] - times[0]) / (len(times) - 1) for times in results)
        step, engine_step = statistics.median(steps), statistics.median(engine_steps)
        rows.append({"batch": batch, "step_ms": round(step * 1e3, 2), "engine_step_ms": round(engine_step * 1e3, 2),
                     "load": round(load_average(), 2)})
        print(f"decode batch {batch:>3}: step {step * 1e3:6.2f} ms (engine's inter-token latency "
              f"{engine_step * 1e3:.2f} ms), load {load_average():.2f}", flush=True)
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default="http://127.0.0.1:8001")
    parser.add_argument("--json")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--budget", type=int, default=2048, help="the engine's max_num_batched_tokens (vLLM's CPU default for its API server: 2048)")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    engine = Engine(args.url)
    rng = random.Random(args.seed)
    started_metrics, _ = engine.metrics()
    engine.stream(random_prompt(rng, 64), 2)  # warm the engine's code paths
    sizes = [32, 256, 1024, 2048, 4096] if args.quick else [32, 128, 256, 512, 1024, 1536, 2048, 2560, 3072, 4096]
    points, prefill_rows = measure_prefill(engine, rng, sizes, args.reps)
    fit = fit_prefill(points, args.budget)
    overhead, chunk, per_token = fit
    print(f"prefill fit: overhead {overhead * 1e3:.1f} ms + {chunk * 1e3:.1f} ms per step + "
          f"{1 / per_token:.0f} tokens/s", flush=True)
    warm = measure_warm(engine, rng, 1024, args.reps)
    contexts = measure_context(engine, rng, [0, 1024, 2048, 4096, 6144], 256, args.reps)
    batches = [1, 2, 4, 8] if args.quick else [1, 2, 4, 8, 16, 32]
    decode_rows = measure_decode(engine, rng, batches, 48, args.reps)
    base, per_request = fit_line([r["batch"] for r in decode_rows], [r["step_ms"] for r in decode_rows])
    print(f"decode fit: {base:.2f} ms + {per_request:.3f} ms x batch", flush=True)
    final, text = engine.metrics()
    families = sorted({line.split("{")[0].split(" ")[0] for line in text.splitlines()
                       if line.startswith("vllm:")})
    report = {
        "url": args.url,
        "prefill": prefill_rows,
        "prefill_fit": {"overhead_ms": overhead * 1e3, "chunk_base_ms": chunk * 1e3,
                        "tokens_per_sec": 1 / per_token},
        "warm": warm,
        "budget": args.budget,
        "context": contexts,
        "decode": decode_rows,
        "decode_fit": {"base_ms": base, "per_request_ms": per_request},
        "preemptions": delta(started_metrics, final, "vllm:num_preemptions_total"),
        "metric_families": families,
    }
    if args.json:
        with open(args.json, "w") as out:
            json.dump(report, out, indent=1)


if __name__ == "__main__":
    main()
