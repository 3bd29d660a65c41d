"""Open the configured tier: one backend per shard."""

from __future__ import annotations

import logging
from collections.abc import Sequence

from range_connector.backends.base import Backend
from range_connector.backends.memory import MemoryBackend
from range_connector.config import RangeConfig
from range_connector.errors import BackendError, ConfigError

logger = logging.getLogger("vllm." + __name__)


def resolve_valkey_urls(config: RangeConfig) -> list[str]:
    """The configured URLs, or those of embedded servers (started if needed, shared through ``runtime_dir``).

    Raises:
        ConfigError: embedded servers cannot be started (names ``runtime_dir``).
    """
    tier = config.tier
    if tier.servers:
        return list(tier.servers)
    from pathlib import Path

    from range_connector.backends.valkey.servers import ensure_servers

    try:
        return ensure_servers(config.num_shards, Path(config.resolved_runtime_dir),
                              start_timeout_s=tier.start_timeout_s)
    except (BackendError, OSError) as exc:
        raise ConfigError("runtime_dir", f"cannot start embedded Valkey servers in {config.resolved_runtime_dir}: "
                                         f"{exc}") from exc


def open_shard_backends(config: RangeConfig, shard_idxs: Sequence[int] | None = None) -> list[Backend]:
    """Open one backend per shard of the tier, slowed down by the latency wrapper when its ``testing`` table asks.


    Args:
        config: the resolved config.
        shard_idxs: open only these shards (a context-parallel rank opens its own: ``r, r + W, ...``); default all.

    Returns:
        ``[len(shard_idxs)]`` (default ``[num_shards]``) backends, in ``shard_idxs`` order; for a ``"memory"``
        tier the same in-process instance for every shard.

    Raises:
        ConfigError: a server does not answer at start-up (names the tier's ``servers`` key and the URL), the
            directory cannot be created, or the testing ``control_file`` is invalid.
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


def _open_backends(config: RangeConfig, shard_idxs: list[int]) -> list[Backend]:
    tier = config.tier
    if tier.type == "memory":
        return [MemoryBackend(tier.budget_bytes or None)] * len(shard_idxs)
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

    backends: list[Backend] = []
    urls = resolve_valkey_urls(config)
    for url in (urls[s] for s in shard_idxs):
        try:
            backends.append(ValkeyBackend(url, timeout_s=tier.timeout_s, capacity_bytes=tier.budget_bytes or None,
                                          deployment=config.deployment))
        except BackendError as exc:
            for b in backends:
                b.close()
            raise ConfigError(tier.key_name("servers"), str(exc)) from exc
    return backends
