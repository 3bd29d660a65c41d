"""The engines behind the disaggregated-prefill proxy: health, load, choice and Range settings.

An :class:`EnginePool` holds every prefill and decode engine the proxy was given, with its health (learned from
periodic ``GET /health`` and from failed requests), its in-flight count and its error counts, and ranks the healthy
engines of one kind in the order a request should try them (round robin, or fewest in flight first). It also
learns each decode engine's Range settings through the describe probe (see :mod:`range_connector.serving.proxy` for the
contract) and compares them with the settings a prefill engine returned.

Everything here runs on the proxy's one event loop; nothing is shared with other threads.
"""

from __future__ import annotations

import asyncio
import enum
import itertools
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from range_connector.serving.prefix_routing import PrefixRecord

__all__ = [
    "DESCRIBE_KEY",
    "RANGE_KEY",
    "SETTINGS_KEY",
    "Engine",
    "EngineKind",
    "EnginePool",
    "EngineUnavailableError",
    "Policy",
    "describe_body",
    "mismatched_settings",
    "settings_of",
]

logger = logging.getLogger(__name__)

RANGE_KEY = "range"
"""Key of Range's own part of ``kv_transfer_params`` (in responses)."""
SETTINGS_KEY = "settings"
"""Key, under :data:`RANGE_KEY`, of the flat dict of settings that producer and consumer must share."""
DESCRIBE_KEY = "range_describe"
"""Request marker in ``kv_transfer_params``: answer with this engine's settings (the describe probe)."""


class EngineKind(str, enum.Enum):
    """Which phase an engine serves (``engine``: both, a ``kv_both`` engine of a fleet)."""

    PREFILL = "prefill"
    DECODE = "decode"
    ENGINE = "engine"


class Policy(str, enum.Enum):
    """How a request picks among the healthy engines of one kind."""

    ROUND_ROBIN = "round_robin"
    LEAST_LOADED = "least_loaded"
    PREFIX_AWARE = "prefix_aware"
    """The engine the proxy sent the longest prefix of the prompt to, unless it has ``prefix_imbalance_requests``
    more in flight than the least loaded; without a prefix, least loaded (see :mod:`.prefix_routing`)."""


class _SettingsState(enum.Enum):
    UNKNOWN = "unknown"  # not probed since the engine (re)appeared, or the last probe failed
    KNOWN = "known"
    ABSENT = "absent"  # the engine answered without Range settings (not a Range connector): no check


class EngineUnavailableError(Exception):
    """An engine could not be reached (connection refused or reset, or no answer in time)."""


@dataclass(eq=False)
class Engine:
    """One engine as the proxy sees it (mutable runtime state, owned by the proxy's event loop).

    Attributes:
        kind: Prefill or decode.
        url: Base URL without a trailing slash, e.g. ``http://10.0.0.5:8000``.
        healthy: Whether requests may be sent to it. ``False`` until the first health check answers 200.
        num_in_flight: Requests the proxy has sent to it and not finished (streams count until they end).
        num_requests: Requests sent to it, in all.
        num_errors: Requests it failed (5xx, broken connection, timeout) and failed health checks.
        last_error: One line on its latest failure, or ``None``.
    """

    kind: EngineKind
    url: str
    healthy: bool = False
    num_in_flight: int = 0
    num_requests: int = 0
    num_errors: int = 0
    last_error: str | None = None
    settings: dict[str, Any] | None = None
    settings_state: _SettingsState = _SettingsState.UNKNOWN
    said_no_settings: bool = False
    checked: bool = False  # whether a health check or a request has told anything yet
    probe_lock: asyncio.Lock = field(default_factory=asyncio.Lock, repr=False)
    record: PrefixRecord = field(default_factory=PrefixRecord, repr=False)  # prefixes sent here (prefix_aware)
    num_prefix_routed: int = 0  # requests sent here because it had a prefix of theirs

    def record_error(self, message: str) -> None:
        """Count one failure and remember its one-line description."""
        self.num_errors += 1
        self.last_error = message

    def status(self) -> dict[str, Any]:
        """This engine's state for ``/proxy/status`` (JSON-ready)."""
        return {
            "kind": self.kind.value,
            "url": self.url,
            "healthy": self.healthy,
            "num_in_flight": self.num_in_flight,
            "num_requests": self.num_requests,
            "num_errors": self.num_errors,
            "last_error": self.last_error,
            "settings": self.settings,
            "num_prefix_routed": self.num_prefix_routed,
            "num_recorded_blocks": len(self.record),
        }


def settings_of(kv_transfer_params: Any) -> dict[str, Any] | None:
    """Return the Range settings in ``kv_transfer_params`` (``{"range": {"settings": {...}}}``), or ``None``."""
    if not isinstance(kv_transfer_params, Mapping):
        return None
    range_part = kv_transfer_params.get(RANGE_KEY)
    settings = range_part.get(SETTINGS_KEY) if isinstance(range_part, Mapping) else None
    return dict(settings) if isinstance(settings, Mapping) else None


def mismatched_settings(prefill: Mapping[str, Any], decode: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """Compare two flat settings dicts.

    Args:
        prefill: The producer's settings (from the prefill response).
        decode: The consumer's settings (from the describe probe).

    Returns:
        ``{key: {"prefill": value, "decode": value}}`` for every key whose values differ, a key missing on one side
        counting as ``None`` there; empty when the settings match. Keys sorted.
    """
    return {
        key: {"prefill": prefill.get(key), "decode": decode.get(key)}
        for key in sorted(set(prefill) | set(decode))
        if prefill.get(key) != decode.get(key)
    }


def describe_body(model: str | None) -> dict[str, Any]:
    """Body of the describe probe sent to ``POST /v1/completions``: one prompt token, one output token.

    Args:
        model: The ``model`` field of the client's request (the engine's only model when ``None``).
    """
    body: dict[str, Any] = {
        "prompt": [0],
        "max_tokens": 1,
        "stream": False,
        "kv_transfer_params": {DESCRIBE_KEY: True},
    }
    if model is not None:
        body["model"] = model
    return body


class EnginePool:
    """The prefill and decode engines, their health, and the order in which a request tries them.

    Args:
        prefill_urls: Base URLs of the prefill engines.
        decode_urls: Base URLs of the decode engines.
        policy: Round robin, fewest in flight first (ties broken round robin), or prefix aware.
        engine_urls: Base URLs of ``kv_both`` engines (a fleet: each request goes whole to one of them).
        prefix_imbalance_requests: Prefix aware: the most requests in flight an engine with the prefix may have
            above the least loaded engine and still be chosen.
    """

    def __init__(self, prefill_urls: tuple[str, ...], decode_urls: tuple[str, ...], policy: Policy,
                 engine_urls: tuple[str, ...] = (), prefix_imbalance_requests: int = 4) -> None:
        self.policy = policy
        self.prefix_imbalance_requests = prefix_imbalance_requests
        self.engines: dict[EngineKind, list[Engine]] = {
            kind: [Engine(kind, url.rstrip("/")) for url in urls]
            for kind, urls in ((EngineKind.PREFILL, prefill_urls), (EngineKind.DECODE, decode_urls),
                               (EngineKind.ENGINE, engine_urls))
        }
        self._turns = {kind: itertools.count() for kind in EngineKind}

    def all_engines(self) -> list[Engine]:
        """Every engine: prefill, decode, then fleet engines."""
        return [engine for kind in EngineKind for engine in self.engines[kind]]

    def ranked(self, kind: EngineKind, prefix_hashes: list[int] | None = None) -> list[Engine]:
        """The healthy engines of ``kind`` in the order a request should try them (empty when none is healthy).

        Each call advances the round-robin turn, so consecutive requests start at consecutive engines. Under
        :attr:`Policy.PREFIX_AWARE` the engine whose record matches most leading blocks of ``prefix_hashes`` comes
        first, unless it has more than ``prefix_imbalance_requests`` requests in flight above the least loaded;
        then (and without a match) the order is least loaded first. The caller records the prompt on the engine
        that took it (:meth:`record_sent`).
        """
        healthy = [engine for engine in self.engines[kind] if engine.healthy]
        if not healthy:
            return []
        start = next(self._turns[kind]) % len(healthy)
        rotated = healthy[start:] + healthy[:start]
        if self.policy is Policy.ROUND_ROBIN:
            return rotated
        rotated.sort(key=lambda engine: engine.num_in_flight)  # stable: ties stay in round-robin order
        if self.policy is Policy.PREFIX_AWARE and prefix_hashes:
            least_in_flight = rotated[0].num_in_flight
            matched = [(engine.record.matched_blocks(prefix_hashes), engine) for engine in rotated]
            best_blocks, best = max(matched, key=lambda pair: pair[0])  # max keeps the first of equals
            if best_blocks and best.num_in_flight <= least_in_flight + self.prefix_imbalance_requests:
                best.num_prefix_routed += 1
                rotated.remove(best)
                rotated.insert(0, best)
        return rotated

    def record_sent(self, engine: Engine, prefix_hashes: list[int]) -> None:
        """Remember that ``engine`` took a prompt (prefix aware only; a no-op under the other policies)."""
        if self.policy is Policy.PREFIX_AWARE and prefix_hashes:
            engine.record.add(prefix_hashes)

    def mark_down(self, engine: Engine, reason: str) -> None:
        """Stop sending requests to ``engine`` until a health check answers 200 again."""
        engine.record_error(reason)
        if engine.healthy or not engine.checked:
            logger.warning("%s engine %s is down: %s", engine.kind.value, engine.url, reason)
        engine.healthy, engine.checked = False, True

    def mark_up(self, engine: Engine) -> None:
        """Send requests to ``engine`` again; its settings are probed anew (it may have restarted)."""
        if not engine.healthy:
            logger.info("%s engine %s is up", engine.kind.value, engine.url)
            engine.settings = None
            engine.settings_state = _SettingsState.UNKNOWN
            engine.said_no_settings = False
        engine.healthy, engine.checked = True, True

    async def check_health(self, session: aiohttp.ClientSession, timeout_s: float) -> None:
        """``GET /health`` on every engine at once; 200 marks it up, anything else (or no answer) down."""
        await asyncio.gather(*(self._check_one(session, engine, timeout_s) for engine in self.all_engines()))

    async def run_health_checks(self, session: aiohttp.ClientSession, interval_s: float, timeout_s: float) -> None:
        """Check every engine's health every ``interval_s`` seconds, until cancelled."""
        while True:
            await asyncio.sleep(interval_s)
            await self.check_health(session, timeout_s)

    async def _check_one(self, session: aiohttp.ClientSession, engine: Engine, timeout_s: float) -> None:
        try:
            async with session.get(
                f"{engine.url}/health", timeout=aiohttp.ClientTimeout(total=timeout_s)
            ) as response:
                await response.read()
                status = response.status
        except (TimeoutError, aiohttp.ClientError) as exc:
            self.mark_down(engine, f"health check failed: {type(exc).__name__}: {exc}")
            return
        if status == 200:
            self.mark_up(engine)
        else:
            self.mark_down(engine, f"health check answered HTTP {status}")

    async def describe(
        self,
        session: aiohttp.ClientSession,
        engine: Engine,
        *,
        model: str | None,
        headers: Mapping[str, str],
        timeout_s: float,
    ) -> dict[str, Any] | None:
        """Return ``engine``'s Range settings, probing it once per up-period (concurrent callers share the probe).

        Args:
            session: The proxy's HTTP client session.
            engine: A decode engine.
            model: ``model`` field for the probe (the client request's).
            headers: Headers to send with the probe (the client's ``Authorization``, if any).
            timeout_s: Deadline of the probe in seconds.

        Returns:
            The flat settings dict, or ``None`` when the engine gave none (not a Range connector: the check is
            skipped, logged once) or the probe got an error answer (skipped for this request, probed again later).

        Raises:
            EngineUnavailableError: The probe got no answer (the engine is then marked down).
        """
        if engine.settings_state is not _SettingsState.UNKNOWN:
            return engine.settings
        async with engine.probe_lock:
            if engine.settings_state is not _SettingsState.UNKNOWN:
                return engine.settings
            try:
                async with session.post(
                    f"{engine.url}/v1/completions",
                    json=describe_body(model),
                    headers=dict(headers),
                    timeout=aiohttp.ClientTimeout(total=timeout_s),
                ) as response:
                    status = response.status
                    doc = await response.json(content_type=None) if status == 200 else None
            except (TimeoutError, aiohttp.ClientError, ValueError) as exc:
                reason = f"settings probe failed: {type(exc).__name__}: {exc}"
                if isinstance(exc, ValueError):  # an answer that is not JSON: the engine is up but odd
                    engine.record_error(reason)
                    return None
                self.mark_down(engine, reason)
                raise EngineUnavailableError(reason) from exc
            if doc is None:
                logger.warning("settings probe of decode engine %s answered HTTP %d; compatibility not checked",
                               engine.url, status)
                return None
            engine.settings = settings_of(doc.get("kv_transfer_params") if isinstance(doc, dict) else None)
            if engine.settings is None:
                engine.settings_state = _SettingsState.ABSENT
                logger.warning("decode engine %s returned no Range settings (not a Range connector?); "
                               "prefill/decode compatibility is not checked for it", engine.url)
            else:
                engine.settings_state = _SettingsState.KNOWN
            return engine.settings
