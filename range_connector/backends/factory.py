"""Open the configured tiers: one backend per shard of each (a tier hierarchy: one composite per shard)."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

from range_connector.backends.base import Backend
from range_connector.backends.memory import MemoryBackend
from range_connector.backends.tiered import TieredBackend, leaf_backends
from range_connector.config import RangeConfig
from range_connector.kv.tickets import key_shard
from range_connector.errors import BackendError, ConfigError

if TYPE_CHECKING:
    from range_connector.backends.valkey.urls import ValkeyAccess

logger = logging.getLogger("vllm." + __name__)


def resolve_valkey_urls(config: RangeConfig) -> list[str]:
    """The configured URLs, or those of embedded servers (started if needed, shared through ``runtime_dir``).

    Returns:
        ``[num_shards]`` URLs; embedded servers' carry the runtime dir's password (redact before showing).

    Raises:
        ConfigError: embedded servers cannot be started (names ``runtime_dir``), or their settings contradict the
            config (names ``embedded_maxmemory_bytes`` or ``capacity_bytes``).
    """
    return resolve_valkey_tier(config)[0]


def resolve_valkey_tier(config: RangeConfig) -> tuple[list[str], int]:
    """The valkey tier's URLs and its byte budget per shard (0: none): embedded servers are started if needed, and
    their budget defaults to just under their memory limit (:func:`~range_connector.config.keys.embedded_budget_bytes`).

    Raises:
        ConfigError: as :func:`resolve_valkey_urls`.
    """
    tier = config.tier
    if tier.servers:
        return list(tier.servers), tier.budget_bytes
    from pathlib import Path

    from range_connector.backends.valkey.servers import start_embedded

    try:
        servers = start_embedded(config.num_shards, Path(config.resolved_runtime_dir),
                                 start_timeout_s=tier.start_timeout_s, maxmemory_bytes=tier.embedded_maxmemory_bytes)
    except (BackendError, OSError) as exc:
        raise ConfigError("runtime_dir", f"cannot start embedded Valkey servers in {config.resolved_runtime_dir}: "
                                         f"{exc}") from exc
    except ConfigError as exc:
        if exc.key == "embedded_maxmemory_bytes":  # (name it as the user wrote it)
            raise ConfigError(tier.key_name("embedded_maxmemory_bytes"), str(exc).split(": ", 1)[1]) from exc
        raise
    budget_bytes = tier.budget_bytes_for(servers.maxmemory_bytes)
    logger.info("embedded valkey in %s: %s; Range budget %s per shard (%s in all)", config.resolved_runtime_dir,
                describe_limits(len(servers.urls), servers.maxmemory_bytes), gib(budget_bytes),
                gib(budget_bytes * len(servers.urls)))
    return list(servers.urls), budget_bytes


def describe_limits(num_shards: int, maxmemory_bytes: int) -> str:
    """``"2 shards x 1 GiB maxmemory = 2 GiB"``: embedded servers' limits and their total."""
    return (f"{num_shards} shard{'s' if num_shards != 1 else ''} x {gib(maxmemory_bytes)} maxmemory = "
            f"{gib(num_shards * maxmemory_bytes)}")


def gib(num_bytes: int) -> str:
    """``num_bytes`` in GiB for messages, three significant digits (``1 GiB``, ``0.938 GiB``)."""
    return f"{num_bytes / (1 << 30):.3g} GiB"


def open_shard_backends(config: RangeConfig, shard_idxs: Sequence[int] | None = None) -> list[Backend]:
    """Open one backend per shard of the tier, slowed down by the latency wrapper when its ``testing`` table asks.


    Args:
        config: the resolved config.
        shard_idxs: open only these shards (a context-parallel rank opens its own: ``r, r + W, ...``); default all.

    Returns:
        ``[len(shard_idxs)]`` (default ``[num_shards]``) backends, in ``shard_idxs`` order; for a ``"memory"``
        tier the same in-process instance for every shard.

    Raises:
        ConfigError: a server does not answer at start-up, refuses the credentials or the TLS handshake (names
            the tier's ``servers`` key and the URL, redacted), ``security.password_env`` is not set, the directory
            cannot be created, or the testing ``control_file`` is invalid.
    """
    backends = _open_backends(config, list(range(config.num_shards)) if shard_idxs is None else list(shard_idxs))
    tier, testing = config.tier, config.tier.testing
    if not testing.slows_tier:
        return backends
    from range_connector.backends.latency import LatencyControl, TierLatency, slow_down

    try:
        control = LatencyControl(TierLatency(testing.delay_s, testing.bandwidth_bytes_per_s),
                                 testing.control_file or None)
    except ValueError as exc:
        for b in {id(b): b for b in backends}.values():
            b.close()
        raise ConfigError(tier.key_name("testing.control_file"), str(exc)) from exc
    logger.info("tier slowed down for benchmarks/tests: %s (control file: %s)", control.current(),
                testing.control_file or "none")
    return slow_down(backends, control, timeout_s=tier.timeout_s)


def open_tier_backends(config: RangeConfig, shard_idxs: Sequence[int] | None = None, *,
                       far_writes: str = "async", skip_memory: bool = False) -> list[list[Backend] | None]:
    """Open every tier's backends (:func:`open_shard_backends` of each tier, nearest first).

    Args:
        config: the resolved config.
        shard_idxs: as :func:`open_shard_backends`.
        skip_memory: leave the DRAM tier out (``None`` in its place): the scheduler's side, where it does not live.

    Returns:
        ``[num_tiers]`` lists of ``[len(shard_idxs)]`` backends (``None``: a skipped DRAM tier).

    Raises:
        ConfigError: as :func:`open_shard_backends`, naming the tier (``tiers[i]....``); the tiers opened before
            are closed.
    """
    opened: list[list[Backend] | None] = []
    try:
        for i, tier in enumerate(config.tiers):
            skip = skip_memory and tier.type == "memory"
            opened.append(None if skip else open_shard_backends(config.for_tier(i), shard_idxs))
    except ConfigError:
        for b in leaf_backends(b for tier in opened if tier for b in tier):
            b.close()
        raise
    return opened


def open_worker_backends(config: RangeConfig, shard_idxs: Sequence[int] | None = None, *,
                         far_writes: str = "async", write_back: bool = False) -> list[Backend]:
    """A worker's backends: :func:`open_shard_backends` of the one tier, or with several tiers one
    :class:`~range_connector.backends.tiered.TieredBackend` per shard over all of them (``write_back``: saves go to
    the DRAM tier, whose evictions are demoted to the next tier of their shard).

    Raises:
        ConfigError: as :func:`open_tier_backends`.
    """
    if len(config.tiers) == 1:
        return open_shard_backends(config, shard_idxs)
    tiers = open_tier_backends(config, shard_idxs)
    shards = list(range(config.num_shards)) if shard_idxs is None else list(shard_idxs)
    composites = [TieredBackend([t[k] for t in tiers if t is not None], far_writes=far_writes,  # type: ignore[index]
                                max_backlog_bytes=config.save_backlog_bytes, write_back=write_back)
                  for k in range(len(shards))]
    near = leaf_backends([composites[0].tiers[0]])[0] if composites else None
    if write_back and isinstance(near, MemoryBackend):
        by_shard = dict(zip(shards, composites))

        def demote(stripe_id: str, values: list[bytes], tickets: list[tuple[bytes, bytes]]) -> None:
            target = by_shard.get(key_shard(tickets[0][0]))  # (one stripe holds one shard's slice)
            if target is not None:
                target.demote(stripe_id, values, tickets)

        near.on_evict = demote
    return composites


def open_scheduler_backends(config: RangeConfig) -> list[Backend] | None:
    """The scheduler's backends, ``[num_shards]``: ``None`` for the DRAM tier alone (its index lives in the
    scheduler); with several tiers one :class:`~range_connector.backends.tiered.TieredBackend` per shard whose DRAM
    slot is ``None`` (leases and resets of the far tiers go through it).

    Raises:
        ConfigError: as :func:`open_tier_backends`.
    """
    if len(config.tiers) == 1:
        return open_shard_backends(config) if config.tier.type != "memory" else None
    tiers = open_tier_backends(config, skip_memory=True)
    far = next(t for t in tiers if t is not None)
    return [TieredBackend([t[k] if t is not None else None for t in tiers]) for k in range(len(far))]


def _open_backends(config: RangeConfig, shard_idxs: list[int]) -> list[Backend]:
    tier = config.tier
    if tier.type == "memory":
        # (only workers open it: evicted stripes stay readable until the scheduler has learnt of the eviction)
        return [MemoryBackend(tier.budget_bytes or None, retain_evicted=True)] * len(shard_idxs)
    if tier.type == "file":
        import os

        from range_connector.backends.file.backend import FileBackend

        root = tier.directory or os.path.join(config.resolved_runtime_dir, "files")
        try:
            return [FileBackend(os.path.join(os.path.expanduser(root), config.deployment, f"shard-{s}"),
                                tier.budget_bytes or None, timeout_s=tier.timeout_s)
                    for s in shard_idxs]
        except (OSError, BackendError) as exc:  # (FileBackend reports a directory it cannot create as BackendError)
            raise ConfigError(tier.key_name("directory") if tier.directory else "runtime_dir", f"{root}: {exc}") from exc
    from range_connector.backends.valkey.client import ValkeyBackend
    from range_connector.backends.valkey.urls import redact_url

    access = valkey_access(config)
    backends: list[Backend] = []
    urls, budget_bytes = resolve_valkey_tier(config)
    for url in (urls[s] for s in shard_idxs):
        try:
            backends.append(ValkeyBackend(url, timeout_s=tier.timeout_s, capacity_bytes=budget_bytes or None,
                                          access=access, deployment=config.deployment))
        except BackendError as exc:
            for b in backends:
                b.close()
            # (the backend's messages name the URL redacted already)
            raise ConfigError(tier.key_name("servers"), str(exc).replace(url, redact_url(url))) from None
    return backends


def valkey_access(config: RangeConfig) -> ValkeyAccess:
    """The tier's ``security`` table as the Valkey backend takes it (the password read from its variable now).

    Raises:
        ConfigError: ``security.password_env`` names a variable that is not set.
    """
    from range_connector.backends.valkey.urls import ValkeyAccess

    sec = config.tier.security
    return ValkeyAccess(username=sec.username or None, password=sec.password(f"tiers[{config.tier.index}].security"),
                        tls_ca_file=_path(sec.tls_ca_file), tls_cert_file=_path(sec.tls_cert_file),
                        tls_key_file=_path(sec.tls_key_file))


def _path(path: str) -> str | None:
    import os

    return os.path.expanduser(path) if path else None
