"""Frozen configuration parsed once from ``kv_connector_extra_config``.

Every key, its unit and its default is listed in :data:`CONFIG_KEYS` (the README's table is generated from the same
text). Unknown keys and bad values raise :class:`~range_connector.errors.ConfigError` naming the key, at start-up,
in every vLLM process that builds a connector.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from range_connector.config.paths import default_runtime_dir
from range_connector.errors import ConfigError

BACKEND_NAMES = ("valkey", "memory", "file")
#: how a hit is loaded (see range_connector.worker.loads)
LOAD_MODES = ("pipelined", "async", "sync", "auto")
SAVE_MODES = ("sync", "async")

#: key -> (unit, default shown to users, description). Order is the README's order.
CONFIG_KEYS: dict[str, tuple[str, str, str]] = {
    "backend": (
        "-",
        '"valkey"',
        'Storage tier: "valkey" (one server per shard), "memory" (in-process DRAM) or "file" (stripe files, one '
        "directory per shard).",
    ),
    "file_dir": (
        "path",
        "runtime_dir/files",
        'Root of the "file" tier; shard s keeps its stripes, ticket log and leases in file_dir/shard-s.',
    ),
    "valkey_urls": (
        "-",
        "[] (embedded servers)",
        "One `valkey://host:port` URL per shard. Empty: embedded servers are started and shared through "
        "`runtime_dir`.",
    ),
    "num_shards": ("shards", "len(valkey_urls), else the context-parallel size, else 1",
                   "Number of disjoint slices of every chunk, one backend each."),
    "chunk_tokens": (
        "tokens",
        "256 rounded up to block_size x num_shards",
        "Reuse granularity; a multiple of the engine block size and of block_size x num_shards.",
    ),
    "runtime_dir": (
        "path",
        "$RANGE_CONNECTOR_RUNTIME_DIR, else ($XDG_RUNTIME_DIR or /tmp)/range-connector-UID",
        "Where embedded Valkey servers are recorded (servers.json) and keep their data and logs.",
    ),
    "backend_timeout_s": ("s", "5.0", "Deadline of every single backend call (the whole call, not one socket read)."),
    "load_deadline_s": ("s", "30.0", "Longest deadline of one load; past it the blocks are recomputed."),
    "min_load_deadline_s": (
        "s",
        "0.25",
        "Shortest deadline the cost model gives a load (each load's deadline is twice its expected time, at most what "
        "recomputing its tokens would cost, within [min_load_deadline_s, load_deadline_s]).",
    ),
    "remote_wait_s": (
        "s",
        "10.0",
        "How long a decode engine waits for KV that a prefill engine announced (kv_transfer_params) before it "
        "recomputes what is missing.",
    ),
    "load_mode": (
        "-",
        "pipelined",
        'How hits are loaded: "pipelined" (in the step, attention of layer l waits for layer l only), "async" (the '
        'request waits while other requests run), "sync" (all before the forward; for comparison only) or "auto" '
        "(the cost model takes, shortens or refuses each hit and picks pipelined or async).",
    ),
    "save_mode": (
        "-",
        "sync",
        '"sync": a step\'s new chunks are written to the tier before the step ends (bounded by backend_timeout_s). '
        '"async": the step copies them out of the KV cache and a background thread writes them, so a slow tier '
        "does not slow the engine's steps (a prefill engine, kv_producer, always saves synchronously: its answer "
        "promises stored KV).",
    ),
    "save_backlog_bytes": (
        "bytes",
        "268435456",
        'With save_mode "async": bytes copied out and not yet written, at most; saves past it are skipped (a future '
        "miss, counted).",
    ),
    "lookup_wait_s": (
        "s",
        "5.0",
        "How long the scheduler waits for a lookup before it lets the engine run other requests (the request is "
        "asked again at the next step, its lookup still running); small values keep a slow tier from stalling "
        "scheduling.",
    ),
    "calibration_file": (
        "path",
        "none",
        'With load_mode "auto": the file written by `range-connector calibrate` that seeds R, B and T0.',
    ),
    "start_timeout_s": ("s", "10.0", "How long start-up waits for embedded Valkey servers to start (a configured "
                                     "server must answer within `backend_timeout_s`)."),
    "verify_checksums": ("-", "true", "Verify each loaded value's checksum before it reaches attention."),
    "memory_capacity_bytes": ("bytes", "1073741824", 'Byte budget of the "memory" backend (per worker).'),
    "shard_capacity_bytes": (
        "bytes",
        "0 (no budget)",
        "Byte budget of stripes on each Valkey shard, enforced by Range (least-recently-used unleased stripes are "
        "evicted with their tickets). 0: no budget; the server's own memory limit then refuses saves.",
    ),
    "lease_ttl_s": ("s", "60.0", "Lifetime of a lease taken on promised stripes if it is never released."),
    "num_banks": ("banks", "4", "Transfer banks (staging buffers) per worker; a load uses them layer group by layer group."),
    "bank_bytes": (
        "bytes",
        "67108864",
        "Target size of one transfer bank: a bank holds as many whole layers of a step's load as fit (at least one).",
    ),
    "backend_retry_s": (
        "s",
        "10.0",
        "After a backend call fails, the tier counts as down for this long: lookups miss and saves are skipped "
        "without waiting, then it is tried again.",
    ),
    "tier_delay_s": (
        "s",
        "0.0",
        "Benchmarks and tests: seconds added to every round trip to the tier (a latency-injecting wrapper around "
        "the backend; range_connector/backends/latency.py).",
    ),
    "tier_bandwidth_bytes_per_s": (
        "bytes/s",
        "0 (no cap)",
        "Benchmarks and tests: bandwidth cap of the tier's link, per shard and direction (reads, writes).",
    ),
    "tier_control_file": (
        "path",
        '"" (none)',
        'Benchmarks and tests: JSON file ({"delay_s": s, "bandwidth_bytes_per_s": n, "frozen": bool}, any subset) '
        "re-read at most every 100 ms that changes the tier's speed at run time; frozen calls time out after "
        "backend_timeout_s.",
    ),
    "namespace_salt": (
        "-",
        '""',
        "Extra text mixed into the namespace (model revision, adapter, anything that changes KV bytes and "
        "that vLLM's config does not show).",
    ),
}

DEFAULT_CHUNK_TOKENS = 256


@dataclass(frozen=True, slots=True)
class RangeConfig:
    """User configuration of the connector (immutable).

    Attributes mirror :data:`CONFIG_KEYS`; ``chunk_tokens`` is ``None`` until :meth:`resolve` fills it from the
    engine block size.
    """

    backend: str = "valkey"
    valkey_urls: tuple[str, ...] = ()
    num_shards: int = 1
    chunk_tokens: int | None = None
    runtime_dir: str | None = None
    file_dir: str | None = None
    backend_timeout_s: float = 5.0
    load_deadline_s: float = 30.0
    min_load_deadline_s: float = 0.25
    load_mode: str = "pipelined"
    remote_wait_s: float = 10.0
    save_mode: str = "sync"
    save_backlog_bytes: int = 256 << 20
    lookup_wait_s: float = 5.0
    calibration_file: str | None = None
    start_timeout_s: float = 10.0
    verify_checksums: bool = True
    memory_capacity_bytes: int = 1 << 30
    shard_capacity_bytes: int = 0
    lease_ttl_s: float = 60.0
    num_banks: int = 4
    bank_bytes: int = 64 << 20
    backend_retry_s: float = 10.0
    tier_delay_s: float = 0.0
    tier_bandwidth_bytes_per_s: float = 0.0
    tier_control_file: str = ""
    namespace_salt: str = ""

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any] | None) -> RangeConfig:
        """Parse ``kv_connector_extra_config``.

        Args:
            extra: the user's mapping (JSON-decoded by vLLM).

        Returns:
            The frozen config, with ``chunk_tokens`` possibly still ``None``.

        Raises:
            ConfigError: an unknown key, a value of the wrong type, or a value out of range; the message names the
                key.
        """
        extra = dict(extra or {})
        unknown = sorted(set(extra) - set(CONFIG_KEYS))
        if unknown:
            raise ConfigError(unknown[0], f"unknown key (known keys: {', '.join(CONFIG_KEYS)})")
        values: dict[str, Any] = {}
        if "backend" in extra:
            backend = extra["backend"]
            if backend not in BACKEND_NAMES:
                raise ConfigError("backend", f"{backend!r} is not one of {', '.join(BACKEND_NAMES)}")
            values["backend"] = backend
        if "calibration_file" in extra:
            path = extra["calibration_file"]
            if not isinstance(path, str) or not path:
                raise ConfigError("calibration_file", f"{path!r} is not a file path")
            values["calibration_file"] = path
        if "load_mode" in extra:
            mode = extra["load_mode"]
            if mode not in LOAD_MODES:
                raise ConfigError("load_mode", f"{mode!r} is not one of {', '.join(LOAD_MODES)}")
            values["load_mode"] = mode
        if "save_mode" in extra:
            if extra["save_mode"] not in SAVE_MODES:
                raise ConfigError("save_mode", f"{extra['save_mode']!r} is not one of {', '.join(SAVE_MODES)}")
            values["save_mode"] = extra["save_mode"]
        if "valkey_urls" in extra:
            urls = extra["valkey_urls"]
            if isinstance(urls, str):
                urls = [urls]
            if not isinstance(urls, (list, tuple)) or not all(isinstance(u, str) for u in urls):
                raise ConfigError("valkey_urls", f"{urls!r} is not a list of URL strings")
            for url in urls:
                _check_url(url)
            values["valkey_urls"] = tuple(urls)
        for key in ("num_shards", "chunk_tokens", "memory_capacity_bytes", "shard_capacity_bytes", "num_banks",
                    "bank_bytes", "save_backlog_bytes"):
            if key in extra:
                values[key] = _positive_int(key, extra[key], allow_zero=key.endswith("capacity_bytes"))
        for key in ("backend_timeout_s", "load_deadline_s", "min_load_deadline_s", "start_timeout_s",
                    "backend_retry_s", "lease_ttl_s"):
            if key in extra:
                values[key] = _positive_float(key, extra[key])
        for key in ("tier_delay_s", "tier_bandwidth_bytes_per_s", "remote_wait_s", "lookup_wait_s"):
            if key in extra:
                values[key] = _positive_float(key, extra[key], allow_zero=True)
        if "verify_checksums" in extra:
            if not isinstance(extra["verify_checksums"], bool):
                raise ConfigError("verify_checksums", f"{extra['verify_checksums']!r} is not true or false")
            values["verify_checksums"] = extra["verify_checksums"]
        for key in ("runtime_dir", "namespace_salt", "file_dir", "tier_control_file"):
            if key in extra:
                if not isinstance(extra[key], str):
                    raise ConfigError(key, f"{extra[key]!r} is not a string")
                values[key] = extra[key]
        urls = values.get("valkey_urls", ())
        if urls:
            if "num_shards" in values and values["num_shards"] != len(urls):
                raise ConfigError(
                    "num_shards", f"{values['num_shards']} does not match the {len(urls)} entries of valkey_urls"
                )
            values["num_shards"] = len(urls)
        return cls(**values)

    def resolve(self, block_size: int) -> RangeConfig:
        """Fill engine-dependent defaults and check the config against the engine block size.

        Args:
            block_size: vLLM's KV-cache block size in tokens.

        Returns:
            A config whose ``chunk_tokens`` is set.

        Raises:
            ConfigError: ``chunk_tokens`` is not a multiple of ``block_size`` x ``num_shards`` (a chunk must be
                whole engine blocks, split evenly over the shards).
        """
        unit = block_size * self.num_shards
        if self.chunk_tokens is None:
            return dataclasses.replace(self, chunk_tokens=max(1, math.ceil(DEFAULT_CHUNK_TOKENS / unit)) * unit)
        if self.chunk_tokens % block_size:
            raise ConfigError(
                "chunk_tokens", f"{self.chunk_tokens} is not a multiple of the engine block size {block_size}"
            )
        if self.chunk_tokens % unit:
            raise ConfigError(
                "chunk_tokens",
                f"{self.chunk_tokens} is not a multiple of block_size x num_shards = {block_size} x "
                f"{self.num_shards}: each shard holds whole blocks of every chunk",
            )
        return self

    @property
    def slows_tier(self) -> bool:
        """Whether the tier is wrapped by the latency-injecting backend (any ``tier_*`` key set)."""
        return bool(self.tier_delay_s or self.tier_bandwidth_bytes_per_s or self.tier_control_file)

    @property
    def resolved_runtime_dir(self) -> str:
        """``runtime_dir`` or its default (see :func:`range_connector.config.paths.default_runtime_dir`)."""
        if self.runtime_dir:
            return os.path.expanduser(self.runtime_dir)
        return str(default_runtime_dir())


def _check_url(url: str) -> None:
    from urllib.parse import urlsplit

    bad = ConfigError("valkey_urls", f"{url!r} is not a valkey://host:port URL")
    parts = urlsplit(url)
    if parts.scheme not in ("valkey", "redis", "unix"):
        raise bad
    if parts.scheme == "unix":
        if not parts.path:
            raise bad
        return
    try:
        port = parts.port
    except ValueError:
        raise bad from None
    if not parts.hostname or (port is not None and not 0 < port < 65536):
        raise bad


def _positive_int(key: str, value: Any, *, allow_zero: bool = False) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(key, f"{value!r} is not an integer")
    if value < 0 or (value == 0 and not allow_zero):
        raise ConfigError(key, f"{value} must be {'>= 0' if allow_zero else '> 0'}")
    return value


def _positive_float(key: str, value: Any, *, allow_zero: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        unit = "bytes per second" if key.endswith("_per_s") else "seconds" if key.endswith("_s") else "units"
        raise ConfigError(key, f"{value!r} is not a number of {unit}")
    if value < 0 or (value == 0 and not allow_zero):
        raise ConfigError(key, f"{value} must be {'>= 0' if allow_zero else '> 0'}")
    return float(value)
