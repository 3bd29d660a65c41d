"""The frozen config tree: :class:`RangeConfig` (engine-wide keys) holding one :class:`TierConfig` per tier, each
with its :class:`TierSecurity` and :class:`TierTesting` sub-tables. Field names and defaults are those declared in
:mod:`range_connector.config.keys`; :meth:`RangeConfig.from_extra_config` parses ``kv_connector_extra_config`` into it.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from range_connector.config.keys import (
    DEFAULT_CAPACITY_BYTES,
    DEFAULT_CHUNK_TOKENS,
    DEFAULT_EMBEDDED_MAXMEMORY_BYTES,
    DEFAULT_DEPLOYMENT,
    FLAT_CAPACITY_TYPES,
    FLAT_TIER_KEYS,
    MIN_EMBEDDED_MAXMEMORY_BYTES,
    embedded_budget_bytes,
)
from range_connector.config.parse import parse_extra_config
from range_connector.config.paths import default_runtime_dir
from range_connector.errors import ConfigError


@dataclass(frozen=True, slots=True)
class TierSecurity:
    """``tiers[i].security``: credentials and TLS files of a Valkey tier's servers ("": unset, the URL's applies).

    Attributes:
        username: ACL user sent with ``AUTH``.
        password_env: name of the environment variable holding the password (the password itself is never kept
            in the config: :meth:`password` reads it).
        tls_ca_file: PEM file of the servers' certificate authorities (valkeys:// only).
        tls_cert_file: PEM client certificate.
        tls_key_file: PEM private key of ``tls_cert_file``.
    """

    username: str = ""
    password_env: str = ""
    tls_ca_file: str = ""
    tls_cert_file: str = ""
    tls_key_file: str = ""

    def password(self, path: str = "tiers[0].security") -> str | None:
        """The password from ``password_env`` (``None`` when no variable is named).

        Raises:
            ConfigError: the named variable is not set or empty (names ``<path>.password_env``).
        """
        if not self.password_env:
            return None
        value = os.environ.get(self.password_env)
        if not value:
            raise ConfigError(f"{path}.password_env",
                              f"the environment variable {self.password_env!r} is not set (or empty)")
        return value


@dataclass(frozen=True, slots=True)
class TierTesting:
    """``tiers[i].testing``: knobs for benchmarks and tests (a latency-injecting wrapper around the tier).

    Attributes:
        delay_s: seconds added to every round trip.
        bandwidth_bytes_per_s: bandwidth cap per shard and direction (0: none).
        control_file: JSON file that changes the speed at run time ("": none).
    """

    delay_s: float = 0.0
    bandwidth_bytes_per_s: float = 0.0
    control_file: str = ""

    @property
    def slows_tier(self) -> bool:
        """Whether the tier is wrapped by the latency-injecting backend (any knob set)."""
        return bool(self.delay_s or self.bandwidth_bytes_per_s or self.control_file)


@dataclass(frozen=True, slots=True)
class TierConfig:
    """One tier (``tiers[i]``).

    Attributes:
        type: ``"valkey"``, ``"memory"`` or ``"file"``.
        servers: valkey: ``[num_shards]`` ``valkey://host:port`` URLs (empty: embedded servers).
        directory: file: root directory (``None``: ``runtime_dir/files``).
        capacity_bytes: byte budget per shard (memory: per worker); ``None``: the type's default
            (:attr:`budget_bytes`); 0: no budget.
        embedded_maxmemory_bytes: valkey with embedded servers: ``maxmemory`` per server (per shard); ``None``: the
            running servers' limit, else 1 GiB.
        timeout_s: deadline of every single call to the tier.
        retry_s: how long a failed tier counts as down.
        start_timeout_s: valkey: how long start-up waits for embedded servers.
        security: access settings.
        testing: benchmark and test knobs.
    """

    type: str = "valkey"
    servers: tuple[str, ...] = ()
    directory: str | None = None
    capacity_bytes: int | None = None
    timeout_s: float = 5.0
    retry_s: float = 10.0
    start_timeout_s: float = 10.0
    embedded_maxmemory_bytes: int | None = None
    security: TierSecurity = field(default_factory=TierSecurity)
    testing: TierTesting = field(default_factory=TierTesting)
    #: written as the flat one-tier shorthand (errors then name the flat keys the user wrote)
    shorthand: bool = field(default=False, compare=False)
    #: its place in ``tiers`` (0: the nearest), for error messages and metric labels
    index: int = field(default=0, compare=False)

    def key_name(self, name: str) -> str:
        """How the user spelled this tier's key ``name`` (``"servers"``, ``"testing.control_file"``...): the flat
        shorthand key, or its path in the tree (``tiers[0].servers``), for error messages."""
        if self.shorthand:
            for flat, target in FLAT_TIER_KEYS.items():
                if target == name and (flat not in FLAT_CAPACITY_TYPES or self.type in FLAT_CAPACITY_TYPES[flat]):
                    return flat
        return f"tiers[{self.index}].{name}"

    @property
    def embedded(self) -> bool:
        """Whether the tier uses embedded Valkey servers (a valkey tier that names no servers)."""
        return self.type == "valkey" and not self.servers

    @property
    def budget_bytes(self) -> int:
        """The byte budget in force per shard (0: none); embedded servers: see :meth:`budget_bytes_for`."""
        if self.embedded and self.capacity_bytes is None:
            return embedded_budget_bytes(self.embedded_maxmemory_bytes or DEFAULT_EMBEDDED_MAXMEMORY_BYTES)
        return DEFAULT_CAPACITY_BYTES[self.type] if self.capacity_bytes is None else self.capacity_bytes

    def budget_bytes_for(self, maxmemory_bytes: int) -> int:
        """The byte budget per shard on embedded servers whose limit is ``maxmemory_bytes``: ``capacity_bytes`` if
        set, else :func:`~range_connector.config.keys.embedded_budget_bytes`.

        Raises:
            ConfigError: ``capacity_bytes`` is above ``maxmemory_bytes`` (names both keys).
        """
        if self.capacity_bytes is None:
            return embedded_budget_bytes(maxmemory_bytes)
        if self.capacity_bytes > maxmemory_bytes:
            raise ConfigError(self.key_name("capacity_bytes"),
                              f"{self.capacity_bytes} is above the embedded servers' memory limit "
                              f"{self.key_name('embedded_maxmemory_bytes')} = {maxmemory_bytes}: the server would "
                              "refuse saves before Range evicts anything; lower it, or leave it out (default: just "
                              "under the limit)")
        return self.capacity_bytes

    def check(self) -> None:
        """Check the settings that depend on each other.

        Raises:
            ConfigError: ``embedded_maxmemory_bytes`` below 32 MiB, or ``capacity_bytes`` above it.
        """
        limit = self.embedded_maxmemory_bytes
        if limit is not None and limit < MIN_EMBEDDED_MAXMEMORY_BYTES:
            raise ConfigError(self.key_name("embedded_maxmemory_bytes"),
                              f"{limit} is below the minimum {MIN_EMBEDDED_MAXMEMORY_BYTES} (32 MiB)")
        if self.embedded and limit is not None:
            self.budget_bytes_for(limit)


@dataclass(frozen=True, slots=True)
class RangeConfig:
    """User configuration of the connector (immutable).

    Attributes are the engine-wide keys of :data:`~range_connector.config.keys.ENGINE_KEYS` plus ``tiers``;
    ``chunk_tokens`` is ``None`` until :meth:`resolve` fills it from the engine block size.
    """

    tiers: tuple[TierConfig, ...] = (TierConfig(),)
    num_shards: int = 1
    chunk_tokens: int | None = None
    runtime_dir: str | None = None
    load_mode: str = "pipelined"
    save_mode: str = "async"
    save_backlog_bytes: int = 256 << 20
    load_deadline_s: float = 30.0
    min_load_deadline_s: float = 0.25
    remote_wait_s: float = 10.0
    lookup_wait_s: float = 5.0
    calibration_file: str | None = None
    verify_checksums: bool = True
    lease_ttl_s: float = 60.0
    write_policy: str = "write-through"
    promote_after_hits: int = 2
    num_banks: int = 4
    bank_bytes: int = 64 << 20
    deployment: str = DEFAULT_DEPLOYMENT
    namespace_salt: str = ""

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any] | None) -> RangeConfig:
        """Parse ``kv_connector_extra_config`` (the tree, or the flat one-tier shorthand with a warning).

        Args:
            extra: the user's mapping (JSON-decoded by vLLM).

        Returns:
            The frozen config, with ``chunk_tokens`` possibly still ``None``.

        Raises:
            ConfigError: an unknown key, a value of the wrong type or out of range, or two settings that contradict
                each other; the message names the key (and the other key).
        """
        engine, tiers = parse_extra_config(extra)
        shorthand = not (extra and "tiers" in extra)
        built = tuple(TierConfig(**{k: v for k, v in tier.items() if k not in ("security", "testing")},
                                 security=TierSecurity(**tier.get("security", {})),
                                 testing=TierTesting(**tier.get("testing", {})), shorthand=shorthand, index=i)
                      for i, tier in enumerate(tiers))
        for tier in built:
            tier.check()
        if engine.get("write_policy") == "write-back" and built[0].type != "memory":
            raise ConfigError("write_policy", "'write-back' demotes what the DRAM tier evicts: tiers[0].type must be "
                                              f"'memory' and another tier follow it (tiers[0].type is {built[0].type!r})")
        if engine.get("write_policy") == "write-back" and len(built) < 2:
            raise ConfigError("write_policy", "'write-back' needs a tier after tiers[0] to demote to")
        return cls(tiers=built, **engine)

    @property
    def tier(self) -> TierConfig:
        """The nearest tier (``tiers[0]``); with several tiers, :meth:`for_tier` gives each its own view."""
        return self.tiers[0]

    def for_tier(self, index: int) -> RangeConfig:
        """This config as if ``tiers[index]`` were its only tier (what one tier's backends, lookup and gate read:
        its ``timeout_s``, ``retry_s``, budget...); the tier keeps its index for messages."""
        return dataclasses.replace(self, tiers=(self.tiers[index],))

    @property
    def has_memory_tier(self) -> bool:
        """Whether the in-process DRAM tier is one of the tiers (then it is ``tiers[0]``)."""
        return self.tiers[0].type == "memory"

    def with_tier(self, **changes: Any) -> RangeConfig:
        """A copy whose tier has ``changes`` (``dataclasses.replace`` on :attr:`tier`)."""
        return dataclasses.replace(self, tiers=(dataclasses.replace(self.tier, **changes), *self.tiers[1:]))

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
    def resolved_runtime_dir(self) -> str:
        """``runtime_dir`` or its default (see :func:`range_connector.config.paths.default_runtime_dir`)."""
        if self.runtime_dir:
            return os.path.expanduser(self.runtime_dir)
        return str(default_runtime_dir())
