"""Settings of the proxy (:class:`ProxyConfig`), checked on construction; the proxy is :mod:`.proxy`."""

from __future__ import annotations

from dataclasses import dataclass

from yarl import URL

from range_connector.errors import ConfigError
from range_connector.serving.engines import Policy

__all__ = ["DEFAULT_MAX_BODY_BYTES", "ProxyConfig"]

#: the default cap on a client's request body (bytes); larger bodies are answered 413 before they are read whole
DEFAULT_MAX_BODY_BYTES = 64 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class ProxyConfig:
    """Settings of one proxy; checked on construction.

    The proxy runs in one of two modes: disaggregated (``prefill_urls`` and ``decode_urls``: each request is
    prefilled on one engine and decoded on another) or fleet (``engine_urls``: ``kv_both`` engines, each request
    goes whole to one of them; with Range on a shared tier, a prefix computed on one is loaded by the others).

    Attributes:
        prefill_urls: Base URLs (``http://host:port``) of the prefill engines; at least one, unless a fleet.
        decode_urls: Base URLs of the decode engines; at least one, unless a fleet.
        engine_urls: Base URLs of a fleet's ``kv_both`` engines; given alone.
        host: Interface to listen on.
        port: TCP port to listen on (0: any free port, see :attr:`ProxyServer.port`).
        policy: Round robin, least loaded (fewest in flight), or prefix aware (the engine that was sent the
            longest prefix of the prompt, see :mod:`range_connector.serving.prefix_routing`).
        prefix_imbalance_requests: Prefix aware: the most requests an engine with the prefix may have in flight
            above the least loaded one and still be chosen (>= 0).
        prefill_timeout_s: Deadline of the whole prefill call (and of a describe probe), seconds.
        decode_timeout_s: Longest silence of a decode (or fleet) engine (before its answer starts, between
            chunks), seconds.
        connect_timeout_s: Deadline of one connection attempt, seconds.
        health_interval_s: Seconds between two health checks of every engine.
        health_timeout_s: Deadline of one health check (and of the describe probes ``/health`` sends), seconds.
        max_body_bytes: Largest client request body, bytes (larger: 413, not read whole).

    Raises:
        ConfigError: The URLs name neither a fleet nor prefill and decode engines (or both), a URL is bad or
            repeated, a timeout is not positive, the imbalance is negative, or the port is out of range; the
            message starts with the field name.
    """

    prefill_urls: tuple[str, ...] = ()
    decode_urls: tuple[str, ...] = ()
    engine_urls: tuple[str, ...] = ()
    host: str = "127.0.0.1"
    port: int = 8000
    policy: Policy = Policy.ROUND_ROBIN
    prefix_imbalance_requests: int = 4
    prefill_timeout_s: float = 300.0
    decode_timeout_s: float = 300.0
    connect_timeout_s: float = 5.0
    health_interval_s: float = 5.0
    health_timeout_s: float = 2.0
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES

    @property
    def is_fleet(self) -> bool:
        """Whether requests go whole to ``kv_both`` engines (no prefill hop)."""
        return bool(self.engine_urls)

    def __post_init__(self) -> None:
        if self.engine_urls and (self.prefill_urls or self.decode_urls):
            raise ConfigError("engine_urls", "give either fleet engines or prefill and decode engines, not both")
        for key in (("engine_urls",) if self.engine_urls else ("prefill_urls", "decode_urls")):
            urls = getattr(self, key)
            if not urls:
                raise ConfigError(key, "give at least one engine URL")
            for url in urls:
                parsed = URL(url) if isinstance(url, str) else None
                if parsed is None or parsed.scheme not in ("http", "https") or not parsed.host:
                    raise ConfigError(key, f"{url!r} is not an http://host:port URL")
            if len({url.rstrip("/") for url in urls}) != len(urls):
                raise ConfigError(key, f"an engine URL is given twice: {list(urls)}")
        if not 0 <= self.port <= 65535:
            raise ConfigError("port", f"{self.port} is not a TCP port (0-65535)")
        if isinstance(self.prefix_imbalance_requests, bool) or not isinstance(self.prefix_imbalance_requests, int) \
                or self.prefix_imbalance_requests < 0:
            raise ConfigError("prefix_imbalance_requests",
                              f"{self.prefix_imbalance_requests!r} is not a number of requests >= 0")
        for key in ("prefill_timeout_s", "decode_timeout_s", "connect_timeout_s", "health_interval_s",
                    "health_timeout_s"):
            if not getattr(self, key) > 0:
                raise ConfigError(key, f"{getattr(self, key)} is not a positive number of seconds")
        if isinstance(self.max_body_bytes, bool) or not isinstance(self.max_body_bytes, int) \
                or self.max_body_bytes < 1024:
            raise ConfigError("max_body_bytes", f"{self.max_body_bytes!r} is not a number of bytes >= 1024")
