"""kvgate: an LLM inference gateway with KV-cache-aware routing, from Python.

- ``Gateway(**options)``: the gateway, configured with the keyword arguments of its configuration
  schema (the YAML keys of ``kvgate launch --config``; routing options given flat or as
  ``routing={...}``), run in the background (``start_background()`` / ``stop()`` or a ``with``
  block) or in the foreground (``start()``).
- ``simulate(trace=..., policies=[...], **options)``: ``kvgate sim`` on a trace, its report as a
  dict (the JSON of ``kvgate sim --json``).
- ``python -m kvgate launch ...``: the command line, with the same flags.
"""

from __future__ import annotations

import difflib
import json
import os
from collections.abc import Iterable, Mapping
from typing import Any

from . import _kvgate

__all__ = ["Gateway", "simulate", "__version__"]
__version__: str = _kvgate.__version__

_GATEWAY_OPTIONS = {option["name"]: option for option in _kvgate._options("gateway")}
_ROUTING_OPTIONS = {name for name, option in _GATEWAY_OPTIONS.items() if option["group"] == "routing"}
_SIM_OPTIONS = {option["name"]: option for option in _kvgate._options("sim")}
# Keywords of Gateway beyond the flat options: nested maps of the YAML file, and the demo fleet.
_GATEWAY_EXTRA = ("routing", "models", "tenants", "mock_workers")
# SMG 1.13's keyword names (its RouterArgs fields, named as its flags): taken where kvgate has
# the option (same or mapped, docs/SMG.md), refused with the command line's messages otherwise.
_SMG_KEYWORDS = {option["keyword"]: option for option in _kvgate._smg_keywords()}


def _unexpected(function: str, name: str, known: Iterable[str], what: str = "keyword argument") -> TypeError:
    message = f"{function}() got an unexpected {what} {name!r}"
    close = difflib.get_close_matches(name, list(known), n=1)
    if close:
        message += f"; did you mean {close[0]!r}?"
    return TypeError(message)


def _smg_flags(name: str, value: Any) -> list[str]:
    """An SMG keyword as SMG's command line spells it (``None`` and ``False``: not given)."""
    option = _SMG_KEYWORDS[name]
    flag = option["flag"]
    if value is None or value is False:
        return []
    if option["arity"] == "0":
        if value is not True:
            raise ValueError(f"invalid {name}: must be True or False, got {value!r}")
        return [flag]
    if option["arity"] in ("*", "+") and isinstance(value, (list, tuple)):
        return [flag, *(_flag_value(item) for item in value)]
    return [flag, _flag_value(value)]


def _plain(value: Any) -> Any:
    """Paths as strings, tuples and other iterables as lists, mappings as dicts, recursively."""
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    if isinstance(value, Mapping):
        return {key: _plain(item) for key, item in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [_plain(item) for item in value]
    return value


class Gateway:
    """An LLM inference gateway, configured with keyword arguments only.

    Every option of ``kvgate launch`` is a keyword argument named as its YAML key (e.g.
    ``port=0``, ``worker_urls=[...]``); routing options may be given flat (``policy=...``,
    ``cache_threshold=0.5``) or as ``routing={...}``; ``models={name: {...}}`` gives per-model
    routing; ``mock_workers=N`` also starts N simulated engines in-process and routes to them.
    SMG 1.13's keyword names (``eviction_interval_secs=60``, ``prometheus_port=29000``,
    ``model_path=...``) are taken where kvgate has the option, and refused with ``ValueError``
    naming the missing feature where it has not (docs/SMG.md).
    An unknown keyword raises ``TypeError``; a wrong type or an invalid value raises
    ``ValueError`` naming every problem, with the command line's messages.

    Logs go through Python's ``logging``, to the loggers under ``kvgate`` (e.g.
    ``logging.getLogger("kvgate").setLevel(logging.INFO)``; the levels are read at each start);
    by default only warnings and errors show.
    """

    def __init__(self, **options: Any) -> None:
        mock_workers = options.pop("mock_workers", None)
        if mock_workers is None:
            mock_workers = 0
        if isinstance(mock_workers, bool) or not isinstance(mock_workers, int) or mock_workers < 0:
            raise ValueError(f"invalid mock_workers: must be a whole number >= 0, got {mock_workers!r}")
        routing = options.pop("routing", None)
        if routing is None:
            routing = {}
        if not isinstance(routing, Mapping):
            raise ValueError(f"invalid routing: must be a mapping of routing options, got {routing!r}")
        routing = dict(routing)
        for name in routing:
            if name not in _ROUTING_OPTIONS:
                raise _unexpected("Gateway", str(name), _ROUTING_OPTIONS, "routing option")
        config: dict[str, Any] = {}
        smg_argv: list[str] = []
        for name, value in options.items():
            if name in ("models", "tenants"):
                config[name] = value
            elif name in _SMG_KEYWORDS and (
                name not in _GATEWAY_OPTIONS or _SMG_KEYWORDS[name]["class"] == "mapped"
            ):
                # SMG's keyword, or kvgate's of the same name whose SMG values kvgate translates
                # (max_concurrent_requests=-1: SMG's "no limit"), as the command line does.
                smg_argv += _smg_flags(name, value)
            elif name not in _GATEWAY_OPTIONS:
                raise _unexpected("Gateway", name, [*_GATEWAY_OPTIONS, *_GATEWAY_EXTRA])
            elif name in _ROUTING_OPTIONS:
                if name in routing:
                    raise TypeError(f"Gateway() got multiple values for {name!r} (flat and in routing=)")
                routing[name] = value
            else:
                config[name] = value
        for name, value in (_kvgate._smg_settings(smg_argv) if smg_argv else {}).items():
            target = routing if name in _ROUTING_OPTIONS else config
            if name in target:
                raise TypeError(f"Gateway() got multiple values for {name!r} (an SMG keyword and kvgate's)")
            target[name] = value
        if routing:
            config["routing"] = routing
        self._gateway = _kvgate._Gateway(_plain(config), mock_workers)

    def start(self) -> None:
        """Run until ``stop()`` is called from another thread, or Ctrl-C (which stops gracefully
        and raises ``KeyboardInterrupt``)."""
        self._gateway.start()

    def start_background(self) -> Gateway:
        """Start serving on background threads; returns once the gateway listens."""
        self._gateway.start_background()
        return self

    def stop(self) -> None:
        """Stop gracefully: no new connections, in-flight requests finish (up to
        ``shutdown_grace_period_secs``). Does nothing when not running."""
        self._gateway.stop()

    @property
    def url(self) -> str:
        """The URL the gateway serves on, e.g. ``http://127.0.0.1:30000`` (with ``port=0``, the
        port chosen). ``RuntimeError`` when not running."""
        return self._gateway.url

    @property
    def admin_url(self) -> str:
        """Where the admin API (``/workers``, ``/v1/route``) is served: the admin listener
        (``admin_host``/``admin_port``, loopback by default), or the main one with
        ``admin_api_key``. ``RuntimeError`` when not running."""
        return self._gateway.admin_url

    @property
    def metrics_url(self) -> str | None:
        """Where the metrics listener (``prometheus_host``/``prometheus_port``, SMG's names) serves
        ``/metrics``, e.g. ``http://127.0.0.1:29000``; ``None`` without ``prometheus_port``.
        ``RuntimeError`` when not running."""
        return self._gateway.metrics_url

    @property
    def running(self) -> bool:
        """Whether the gateway is serving."""
        return self._gateway.running

    def config(self) -> dict[str, Any]:
        """The effective configuration (the YAML keys; secrets shown as ``<set>``)."""
        return self._gateway.config()

    def to_yaml(self) -> str:
        """The effective configuration as YAML, as ``kvgate launch --print-config`` prints it."""
        return self._gateway.to_yaml()

    def __enter__(self) -> Gateway:
        return self.start_background()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def __repr__(self) -> str:
        state = f"running at {self.url}" if self.running else "stopped"
        return f"<kvgate.Gateway {state}>"


def _flag_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    return str(value)


def _sim_flags(name: str, value: Any) -> list[str]:
    option = _SIM_OPTIONS[name]
    flag = option["flag"]
    if value is None:
        return []
    if not option["takes_value"]:
        if not isinstance(value, bool):
            raise ValueError(f"invalid {name}: must be True or False, got {value!r}")
        return [flag] if value else []
    if option["list"] and isinstance(value, (list, tuple)):
        return [f"{flag}={_flag_value(item)}" for item in value]
    return [f"{flag}={_flag_value(value)}"]


def simulate(*, trace: str | os.PathLike[str], policies: str | Iterable[str] | None = None, **options: Any) -> dict[str, Any]:
    """Replay ``trace`` through routing ``policies`` onto simulated engines, in virtual time, and
    return the report (the JSON ``kvgate sim --json`` writes, as a dict).

    Every ``kvgate sim`` flag is a keyword (``_`` for ``-``): engine options such as
    ``workers=8`` or ``kv_capacity_tokens=...``, the policy flags, ``sweep=["NAME=V1,V2"]``,
    ``seed``, ``max_requests``. ``policies`` entries take overrides as on the command line
    (``"cache_aware:balance_token_usage_threshold=0.2@tuned"``). Unknown keywords raise
    ``TypeError``, invalid values ``ValueError``.
    """
    argv = ["kvgate sim", f"--trace={os.fspath(trace)}"]
    if policies is not None:
        options["policies"] = [policies] if isinstance(policies, str) else list(policies)
    for name, value in options.items():
        if name not in _SIM_OPTIONS or name == "trace":
            raise _unexpected("simulate", name, _SIM_OPTIONS)
        argv += _sim_flags(name, value)
    report: dict[str, Any] = json.loads(_kvgate._simulate(argv))
    return report
