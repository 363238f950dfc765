"""The committed ``kvgate/__init__.pyi`` is what ``gen_stubs.py`` renders from the schema now."""

from __future__ import annotations

import sys
from pathlib import Path

import kvgate

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import gen_stubs  # noqa: E402


def test_committed_stubs_are_generated_from_the_schema() -> None:
    assert gen_stubs.STUBS.read_text() == gen_stubs.render(), "stale stubs: run python bindings/python/gen_stubs.py"


def test_stubs_name_every_option_with_its_command_line_default() -> None:
    stubs = gen_stubs.STUBS.read_text()
    assert "        port: int = 30000,\n" in stubs
    assert "        policy: Literal[" in stubs and "] = 'cache_aware',\n" in stubs
    assert "        kv_inflight_correction: bool = True,\n" in stubs
    assert "        max_concurrent_requests: int | None = None,\n" in stubs
    assert "    trace: str | os.PathLike[str],\n" in stubs
    for name in ("Gateway", "simulate"):
        assert hasattr(kvgate, name)
