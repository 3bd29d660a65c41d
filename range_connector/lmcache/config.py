"""The Range L2 adapter's parameters: LMCache's ``adapter_params`` mapping, checked into a frozen tree.

Unknown keys and bad values raise :class:`~range_connector.errors.ConfigError` naming the key
(``adapter_params.<key>``), so an LMCache MP server with a wrong configuration stops at start-up.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from range_connector.config.keys import DEPLOYMENT_PATTERN
from range_connector.errors import ConfigError

TIER_TYPES = ("valkey", "file", "memory")
#: the adapter's default deployment: not Range's own default (``"default"``), so that LMCache's objects and a vLLM
#: engine's Range chunks on the same servers stay apart (their own tickets, LRU, budget and reset)
DEFAULT_LMCACHE_DEPLOYMENT = "lmcache"
_PREFIX = "adapter_params"


@dataclass(frozen=True, slots=True)
class RangeL2Config:
    """Where and how the adapter stores LMCache objects.

    Attributes:
        type: ``"valkey"`` (one server per shard), ``"file"`` (one directory per shard) or ``"memory"`` (in the
            MP server's own process; one shard).
        servers: valkey: ``[num_shards]`` ``valkey://[:password@]host:port`` URLs.
        directory: file: root directory; shard ``s`` is ``directory/<deployment>/shard-<s>``.
        num_shards: shards (valkey: ``len(servers)``; memory: 1).
        deployment: Range's deployment name: every key and directory is under it (default ``"lmcache"``).
        capacity_bytes: Range's byte budget per shard (0: none); least-recently-used unleased stripes are evicted.
        timeout_s: deadline of one backend call, seconds.
        lease_ttl_s: lifetime of a lookup's lease that is never unlocked, seconds.
        num_workers: threads that run the adapter's tasks (stores, lookups, loads, unlocks).
    """

    type: str
    servers: tuple[str, ...] = ()
    directory: str = ""
    num_shards: int = 1
    deployment: str = DEFAULT_LMCACHE_DEPLOYMENT
    capacity_bytes: int = 0
    timeout_s: float = 5.0
    lease_ttl_s: float = 60.0
    num_workers: int = 4

    @classmethod
    def from_params(cls, params: Mapping[str, Any]) -> RangeL2Config:
        """Check LMCache's ``adapter_params``.

        Raises:
            ConfigError: an unknown key, a value of the wrong type or range, or a combination that does not fit
                (``servers`` without ``type`` ``"valkey"``, a file tier without ``directory``); the message names
                the key.
        """
        if not isinstance(params, Mapping):
            raise ConfigError(_PREFIX, f"must be a mapping, not {type(params).__name__}")
        known = {"type", "servers", "directory", "num_shards", "deployment", "capacity_bytes", "timeout_s",
                 "lease_ttl_s", "num_workers"}
        for key in params:
            if key not in known:
                raise ConfigError(f"{_PREFIX}.{key}", f"unknown key (known: {', '.join(sorted(known))})")
        tier = params.get("type", "valkey")
        if tier not in TIER_TYPES:
            raise ConfigError(f"{_PREFIX}.type", f"{tier!r} is not one of {TIER_TYPES}")
        servers = params.get("servers", [])
        if not isinstance(servers, list) or not all(isinstance(u, str) and u for u in servers):
            raise ConfigError(f"{_PREFIX}.servers", "must be a list of valkey:// URLs, one per shard")
        if tier == "valkey" and not servers:
            raise ConfigError(f"{_PREFIX}.servers", "the valkey tier needs one server URL per shard")
        if tier != "valkey" and servers:
            raise ConfigError(f"{_PREFIX}.servers", f"only for type 'valkey', not {tier!r}")
        directory = params.get("directory", "")
        if not isinstance(directory, str) or (tier == "file") != bool(directory):
            raise ConfigError(f"{_PREFIX}.directory", "a non-empty path for type 'file', and only for it")
        num_shards = _int(params, "num_shards", len(servers) if servers else 1, minimum=1)
        if tier == "valkey" and num_shards != len(servers):
            raise ConfigError(f"{_PREFIX}.num_shards", f"{num_shards} but {len(servers)} servers (one per shard)")
        if tier == "memory" and num_shards != 1:
            raise ConfigError(f"{_PREFIX}.num_shards", "the memory tier has one shard")
        deployment = params.get("deployment", DEFAULT_LMCACHE_DEPLOYMENT)
        if not isinstance(deployment, str) or not re.fullmatch(DEPLOYMENT_PATTERN, deployment):
            raise ConfigError(f"{_PREFIX}.deployment", f"{deployment!r} does not match {DEPLOYMENT_PATTERN}")
        return cls(type=tier, servers=tuple(servers), directory=directory, num_shards=num_shards,
                   deployment=deployment, capacity_bytes=_int(params, "capacity_bytes", 0, minimum=0),
                   timeout_s=_float(params, "timeout_s", 5.0), lease_ttl_s=_float(params, "lease_ttl_s", 60.0),
                   num_workers=_int(params, "num_workers", 4, minimum=1))


def _int(params: Mapping[str, Any], key: str, default: int, *, minimum: int) -> int:
    value = params.get(key, default)
    if type(value) is not int or value < minimum:
        raise ConfigError(f"{_PREFIX}.{key}", f"{value!r} is not an integer >= {minimum}")
    return value


def _float(params: Mapping[str, Any], key: str, default: float) -> float:
    value = params.get(key, default)
    if type(value) not in (int, float) or not value > 0:
        raise ConfigError(f"{_PREFIX}.{key}", f"{value!r} is not a number of seconds > 0")
    return float(value)
