"""kvgate.Gateway with SMG 1.13's keyword names (same/mapped taken, the rest refused with the
command line's messages), and its logging through Python's ``logging`` (quiet by default)."""

from __future__ import annotations

import subprocess
import sys
import urllib.request

import pytest

import kvgate


def test_smg_keywords_become_kvgate_options() -> None:
    gateway = kvgate.Gateway(
        port=0,
        eviction_interval_secs=45,
        prometheus_host="127.0.0.1",
        prometheus_port=29000,
        model_path="/models/llama",
        idle_connection_timeout_secs=75,
        disable_worker_overload_protection=True,
        dp_aware=False,
    )
    config = gateway.config()
    assert config["routing"]["eviction_interval"] == 45
    assert config["prometheus_port"] == 29000
    assert config["tokenizer_path"] == "/models/llama"
    assert config["keep_alive_timeout_secs"] == 75
    assert config["dp_aware"] is False


def test_max_concurrent_requests_takes_smg_values_as_the_command_line_does() -> None:
    assert kvgate.Gateway(port=0, max_concurrent_requests=-1).config()["max_concurrent_requests"] is None
    assert kvgate.Gateway(port=0, max_concurrent_requests=32).config()["max_concurrent_requests"] == 32
    assert kvgate.Gateway(port=0, max_concurrent_requests=None).config()["max_concurrent_requests"] is None
    assert kvgate.Gateway(port=0, dp_aware=True).config()["dp_aware"] is True


def test_smg_keywords_kvgate_lacks_are_refused_with_the_reason() -> None:
    with pytest.raises(
        ValueError, match=r"--dp-minimum-tokens-scheduler \(SMG\) is not supported: kvgate lacks data-parallel rank"
    ):
        kvgate.Gateway(port=0, dp_minimum_tokens_scheduler=True)
    with pytest.raises(ValueError, match=r"--enable-mesh \(SMG\).*\n.*--history-backend \(SMG\) postgres"):
        kvgate.Gateway(port=0, enable_mesh=True, history_backend="postgres")
    with pytest.raises(TypeError, match="multiple values for 'eviction_interval'"):
        kvgate.Gateway(port=0, eviction_interval=30, eviction_interval_secs=45)


def test_the_smg_metrics_listener_serves_metrics() -> None:
    with kvgate.Gateway(port=0, mock_workers=1, prometheus_host="127.0.0.1", prometheus_port=0) as gateway:
        metrics_url = gateway.metrics_url
        assert metrics_url and metrics_url.startswith("http://127.0.0.1:"), metrics_url
        with urllib.request.urlopen(f"{metrics_url}/metrics", timeout=10) as response:
            assert response.status == 200
            assert b"kvgate_" in response.read()
    with kvgate.Gateway(port=0, mock_workers=1) as gateway:
        assert gateway.metrics_url is None


SCRIPT = """
import logging, sys
if sys.argv[1] == "info":
    logging.basicConfig(level=logging.INFO, format="%(name)s %(levelname)s %(message)s")
import kvgate
with kvgate.Gateway(port=0, mock_workers=1) as gateway:
    pass
print("done")
"""


def run_script(mode: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", SCRIPT, mode], capture_output=True, text=True, timeout=120, check=False
    )


def test_logging_is_quiet_by_default_and_goes_through_python_logging() -> None:
    quiet = run_script("default")
    assert quiet.returncode == 0 and "done" in quiet.stdout, quiet.stderr
    assert "INFO" not in quiet.stderr and "\x1b[" not in quiet.stderr, quiet.stderr
    verbose = run_script("info")
    assert verbose.returncode == 0, verbose.stderr
    lines = [line for line in verbose.stderr.splitlines() if "kvgate listening" in line]
    assert lines and lines[0].startswith("kvgate.kvgate_gateway") and " INFO " in lines[0], verbose.stderr
    assert "\x1b[" not in verbose.stderr
