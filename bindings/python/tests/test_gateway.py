"""kvgate.Gateway: started in the background in front of simulated engines, keyword and value
checking with the command line's messages, defaults identical to ``kvgate launch``."""

from __future__ import annotations

import math
import os
import re
import signal
import subprocess
import sys
import threading
import urllib.error
import urllib.request

import pytest

import kvgate
from conftest import chat, run_cli


def test_background_gateway_routes_to_simulated_engines_and_stops() -> None:
    gateway = kvgate.Gateway(port=0, mock_workers=2, policy="cache_aware", log_level="warn")
    gateway.start_background()
    try:
        url = gateway.url
        assert re.fullmatch(r"http://127\.0\.0\.1:\d+", url), url
        assert not url.endswith(":0"), "port 0 reports the port chosen"
        answer = chat(url)
        assert answer["choices"][0]["message"]["content"], answer
        admin = gateway.admin_url
        assert admin != url and admin.startswith("http://127.0.0.1:"), admin
        with urllib.request.urlopen(f"{admin}/workers", timeout=10) as response:
            assert response.status == 200
            assert len(response.read()) > 0
    finally:
        gateway.stop()
    assert not gateway.running
    with pytest.raises(RuntimeError, match="not running"):
        _ = gateway.url
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(f"{url}/health", timeout=5)
    gateway.stop()  # stopping twice is harmless


def test_context_manager_and_blocking_start() -> None:
    with kvgate.Gateway(port=0, mock_workers=1, log_level="warn") as gateway:
        assert chat(gateway.url)["choices"]
    assert not gateway.running
    blocking = kvgate.Gateway(port=0, mock_workers=1, log_level="warn")
    errors: list[BaseException] = []

    def serve() -> None:
        try:
            blocking.start()
        except BaseException as error:  # noqa: BLE001 - reported below
            errors.append(error)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    for _ in range(200):
        if blocking.running:
            break
        thread.join(0.05)
    assert blocking.running
    assert chat(blocking.url)["choices"]
    blocking.stop()
    thread.join(15)
    assert not thread.is_alive(), "start() returns after stop()"
    assert errors == []


def test_unknown_keyword_is_a_type_error_with_a_suggestion() -> None:
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'prot'; did you mean 'port'\?"):
        kvgate.Gateway(prot=8000)
    with pytest.raises(TypeError, match="unexpected routing option 'cache_treshold'; did you mean 'cache_threshold'"):
        kvgate.Gateway(routing={"cache_treshold": 0.5})
    with pytest.raises(TypeError, match="multiple values for 'policy'"):
        kvgate.Gateway(policy="random", routing={"policy": "round_robin"})


def test_wrong_type_is_a_value_error_naming_the_field() -> None:
    with pytest.raises(ValueError, match="invalid port: invalid type: string \"many\""):
        kvgate.Gateway(port="many")
    with pytest.raises(ValueError, match="invalid port"):
        kvgate.Gateway(port=70000)
    with pytest.raises(ValueError, match="invalid routing.policy"):
        kvgate.Gateway(policy="fastest")
    with pytest.raises(ValueError, match="invalid mock_workers"):
        kvgate.Gateway(mock_workers=-1)


def test_invalid_values_raise_every_problem_with_the_command_lines_messages() -> None:
    with pytest.raises(ValueError) as raised:
        kvgate.Gateway(cache_threshold=7, health_failure_threshold=0, request_timeout_secs=math.nan)
    message = str(raised.value)
    for line in (
        "invalid routing.cache_threshold (--cache-threshold): must be a finite number in (0, 1], got 7",
        "invalid request_timeout_secs (--request-timeout-secs): must be a finite number in (0, inf), got NaN",
        "invalid health_failure_threshold (--health-failure-threshold): must be at least 1, got 0",
    ):
        assert line in message, message
    assert message.startswith("invalid configuration (3 problems):"), message
    cli = run_cli("launch", "--cache-threshold", "7", "--health-failure-threshold", "0",
                  "--request-timeout-secs", "NaN", "--port", "0")
    assert cli.returncode != 0
    assert cli.stderr.strip() == f"kvgate: {message}", "the same messages as the command line"
    with pytest.raises(ValueError, match=r"invalid cb_timeout_duration_secs \(--cb-timeout-duration-secs\): must be a finite"):
        kvgate.Gateway(cb_timeout_duration_secs=math.inf)


def test_tenants_take_the_yaml_schema_and_its_checks() -> None:
    with pytest.raises(ValueError, match=r"invalid tenants\.named\.batch\.weight: must be a finite number in \(0, inf\), got 0"):
        kvgate.Gateway(tenants={"named": {"batch": {"weight": 0}}})
    with pytest.raises(ValueError, match="tenants"):
        kvgate.Gateway(tenants={"named": {"batch": {"wieght": 1}}})
    tenants = {"defaults": {"requests_per_minute": 1}}
    with kvgate.Gateway(port=0, mock_workers=1, tenants=tenants, log_level="warn") as gateway:
        chat(gateway.url)
        with pytest.raises(urllib.error.HTTPError) as refused:
            chat(gateway.url)
        assert refused.value.code == 429
        assert int(refused.value.headers["retry-after"]) >= 1
        assert gateway.config()["tenants"] == {"defaults": {"requests_per_minute": 1.0}}


def test_defaults_and_options_are_the_command_lines() -> None:
    cli = run_cli("launch", "--print-config")
    assert cli.returncode == 0, cli.stderr
    assert kvgate.Gateway().to_yaml() == cli.stdout
    given = kvgate.Gateway(
        port=31234,
        worker_urls=["http://127.0.0.1:8000", "http://127.0.0.1:8001"],
        policy="round_robin",
        routing={"cache_threshold": 0.5},
        expose_routing_headers=True,
        tokenizer_path=os.path.join("models", "m"),
    )
    cli = run_cli(
        "launch", "--port", "31234", "--worker-urls", "http://127.0.0.1:8000", "http://127.0.0.1:8001",
        "--policy", "round_robin", "--cache-threshold", "0.5", "--expose-routing-headers",
        "--tokenizer-path", os.path.join("models", "m"), "--print-config",
    )
    assert cli.returncode == 0, cli.stderr
    assert given.to_yaml() == cli.stdout
    config = given.config()
    assert config["port"] == 31234 and config["routing"]["cache_threshold"] == 0.5


@pytest.mark.skipif(sys.platform == "win32", reason="SIGINT")
def test_python_m_kvgate_launch_serves_and_stops_on_ctrl_c() -> None:
    process = subprocess.Popen(
        [sys.executable, "-m", "kvgate", "launch", "--mock-workers", "1", "--port", "0", "--log-level", "warn"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    # A hung process is killed, which ends the reads below.
    watchdog = threading.Timer(60, process.kill)
    watchdog.start()
    try:
        url = None
        assert process.stdout is not None
        for _ in range(20):
            line = process.stdout.readline()
            found = re.match(r"gateway: (http://\S+)", line)
            if found:
                url = found.group(1)
                break
        assert url, "the launch command prints the gateway's URL"
        assert chat(url)["choices"]
        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=60) == 0, process.stderr.read() if process.stderr else ""
    finally:
        watchdog.cancel()
        if process.poll() is None:
            process.kill()
            process.wait(timeout=10)


@pytest.mark.skipif(sys.platform == "win32", reason="SIGINT")
def test_ctrl_c_stops_a_blocking_start_and_raises_keyboard_interrupt() -> None:
    script = """
import os, signal, threading, time
import kvgate
# A shell that starts jobs in the background hands them SIGINT ignored; Python then installs
# no KeyboardInterrupt handler. Ctrl-C's behaviour is what is tested, so restore it.
signal.signal(signal.SIGINT, signal.default_int_handler)
gateway = kvgate.Gateway(port=0, mock_workers=1, log_level="warn")
def interrupt():
    for _ in range(200):
        if gateway.running:
            break
        time.sleep(0.05)
    os.kill(os.getpid(), signal.SIGINT)
threading.Thread(target=interrupt, daemon=True).start()
try:
    gateway.start()
except KeyboardInterrupt:
    print("interrupted; running:", gateway.running)
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "interrupted; running: False"
