"""kvgate.simulate: the same report as ``kvgate sim --json`` on the same trace, options checked
as on the command line."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest

import kvgate
from conftest import run_cli


@pytest.fixture()
def trace(tmp_path: Path) -> Path:
    """A small Mooncake trace: conversations sharing a system prompt, growing turn by turn."""
    rng = random.Random(7)
    lines = []
    next_block = 1
    conversations: list[list[int]] = []
    for index in range(240):
        if not conversations or rng.random() < 0.3:
            conversations.append([0])
        history = rng.choice(conversations)
        history.extend(range(next_block, next_block + 2))
        next_block += 2
        line = {
            "timestamp": index * 40,
            "input_length": 512 * len(history) - rng.randrange(0, 256),
            "output_length": rng.randrange(4, 64),
            "hash_ids": list(history),
        }
        lines.append(json.dumps(line))
    path = tmp_path / "trace.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def test_simulate_returns_the_command_lines_report(trace: Path, tmp_path: Path) -> None:
    report = kvgate.simulate(
        trace=trace,
        policies=["round_robin", "cache_aware:cache_threshold=0.5@tuned"],
        workers=3,
        seed=5,
        rate_scale=2.0,
        kv_capacity_tokens=20000,
    )
    output = tmp_path / "cli.json"
    cli = run_cli(
        "sim", "--trace", str(trace), "--policies", "round_robin,cache_aware:cache_threshold=0.5@tuned",
        "--workers", "3", "--seed", "5", "--rate-scale", "2", "--kv-capacity-tokens", "20000",
        "--json", str(output),
    )
    assert cli.returncode == 0, cli.stderr
    assert report == json.loads(output.read_text())
    assert [run["label"] for run in report["runs"]] == ["round_robin", "tuned"]
    assert report["trace"]["requests"] == 240
    assert report["setup"]["workers"] == 3


def test_simulate_checks_keywords_and_values(trace: Path) -> None:
    with pytest.raises(TypeError, match="unexpected keyword argument 'worker'; did you mean 'workers'"):
        kvgate.simulate(trace=trace, worker=4)
    with pytest.raises(ValueError, match=r"invalid rate_scale \(--rate-scale\): must be a finite number > 0, got NaN"):
        kvgate.simulate(trace=trace, rate_scale=math.nan)
    with pytest.raises(ValueError, match="invalid value 'many' for '--workers"):
        kvgate.simulate(trace=trace, workers="many")
    with pytest.raises(ValueError, match="no_such_policy"):
        kvgate.simulate(trace=trace, policies=["no_such_policy"])
    with pytest.raises(FileNotFoundError, match="missing.jsonl"):
        kvgate.simulate(trace=trace.parent / "missing.jsonl")
