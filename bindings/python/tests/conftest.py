"""Shared helpers of the kvgate Python tests: the command line as a subprocess, HTTP requests."""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.request
from typing import Any

CLI_TIMEOUT_SECS = 120


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    """``python -m kvgate ARGS`` (the kvgate command line of the installed package)."""
    return subprocess.run(
        [sys.executable, "-m", "kvgate", *args],
        capture_output=True,
        text=True,
        timeout=CLI_TIMEOUT_SECS,
        check=False,
    )


def chat(url: str, content: str = "Hello there") -> dict[str, Any]:
    """One non-streaming chat completion; returns the parsed answer."""
    body = {"model": "mock-model", "messages": [{"role": "user", "content": content}], "max_tokens": 4}
    request = urllib.request.Request(
        f"{url}/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"content-type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=30) as response:
        assert response.status == 200
        answer: dict[str, Any] = json.load(response)
        return answer
