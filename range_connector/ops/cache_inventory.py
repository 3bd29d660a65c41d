"""What the shared tiers hold, per tier, shard and deployment, and how to remove one deployment's entries.

:func:`cache_stats` reads, without changing anything: on Valkey one ``SCAN`` over the ``rc3:*`` keys of each shard
server (tickets and leases counted by kind) and, per deployment, its ``lru`` sorted set (stripes, and the oldest and
newest last-use times: its scores are the wall-clock seconds of each stripe's last write, read or lease) and its
``used`` byte count; on the file tier each ``<directory>/<deployment>/shard-<s>`` directory (stripe files and their
mtimes, the file tier's LRU clock; the replayed ticket log; live lease files). The DRAM tier lives inside the engine
and is reported as not visible (its bytes: the engine's ``vllm:range_tier_*`` metrics).

:func:`clear_cache` calls each backend's own :meth:`~range_connector.backends.base.Backend.clear` (it fences writes in
flight through the deployment's reset epoch); other deployments on the same servers or directories are untouched.
"""

from __future__ import annotations

import os
import re
from dataclasses import asdict, dataclass
from pathlib import Path

from range_connector.backends.base import STORAGE_FORMAT, deployment_key_prefix
from range_connector.config import RangeConfig, TierConfig
from range_connector.config.keys import DEPLOYMENT_PATTERN
from range_connector.errors import BackendError, ConfigError
from range_connector.ops.offline_spec import offline_tiers

__all__ = ["ClearResult", "ShardUsage", "TierNote", "cache_stats", "clear_cache", "file_tier_root", "select_tiers"]

#: what the DRAM tier's rows say: it lives inside each engine's workers
DRAM_NOTE = ("in-process DRAM tier: lives inside the engine, not visible from here (see its vllm:range_tier_* "
             "metrics; cleared by POST /reset_prefix_cache?reset_external=true)")


@dataclass(frozen=True, slots=True)
class ShardUsage:
    """One deployment's entries on one shard of one tier.

    Attributes:
        tier_idx: the tier's place in ``tiers`` (0: the nearest).
        tier_type: ``"valkey"`` or ``"file"``.
        shard_idx: the shard.
        deployment: the deployment the entries belong to.
        location: the shard's server (URL, credentials redacted) or directory.
        num_tickets: ticket records (one per chunk, shard and KV head).
        num_stripes: stripes (byte objects holding many chunks' layers).
        num_leases: live leases (loads in progress).
        used_bytes: stripe bytes accounted against the budget.
        budget_bytes: the config's byte budget per shard (0: none), for the config's own deployment; ``None`` for
            other deployments (their engines' configs set theirs).
        oldest_use_unix_s: the least recent last use of a stripe (write, read or lease), seconds since the epoch;
            ``None`` without stripes.
        newest_use_unix_s: the most recent one.
    """

    tier_idx: int
    tier_type: str
    shard_idx: int
    deployment: str
    location: str
    num_tickets: int
    num_stripes: int
    num_leases: int
    used_bytes: int
    budget_bytes: int | None
    oldest_use_unix_s: float | None
    newest_use_unix_s: float | None

    def as_dict(self) -> dict:
        """JSON-safe fields."""
        return asdict(self)


@dataclass(frozen=True, slots=True)
class TierNote:
    """A tier (or one shard of it) that could not be read, or is not visible from outside the engine."""

    tier_idx: int
    tier_type: str
    message: str
    shard_idx: int | None = None

    def as_dict(self) -> dict:
        """JSON-safe fields."""
        return asdict(self)


@dataclass(frozen=True, slots=True)
class ClearResult:
    """What :func:`clear_cache` did on one shard of one tier.

    Attributes:
        cleared: the backend's ``clear()`` returned; ``False`` with ``message`` saying why not (nothing stored
            there, the DRAM tier, or a failure).
    """

    tier_idx: int
    tier_type: str
    shard_idx: int | None
    deployment: str
    location: str
    cleared: bool
    message: str = ""

    def as_dict(self) -> dict:
        """JSON-safe fields."""
        return asdict(self)


def select_tiers(config: RangeConfig, tier: str | None) -> list[int]:
    """The tier indices ``tier`` names: an index (``"1"``), a type (``"valkey"``: every tier of that type), or
    ``None`` for every tier.

    Raises:
        ConfigError: no tier of the config matches (names ``--tier``).
    """
    if tier is None:
        return list(range(len(config.tiers)))
    if tier.isdigit():
        if int(tier) < len(config.tiers):
            return [int(tier)]
    else:
        found = [i for i, t in enumerate(config.tiers) if t.type == tier]
        if found:
            return found
    listed = ", ".join(f"{i} ({t.type})" for i, t in enumerate(config.tiers))
    raise ConfigError("--tier", f"{tier!r} is not a tier of the config; its tiers are {listed}")


def file_tier_root(config: RangeConfig, tier: TierConfig) -> Path:
    """The directory a file tier keeps its deployments in (``directory``, else ``runtime_dir/files``)."""
    return Path(os.path.expanduser(tier.directory or os.path.join(config.resolved_runtime_dir, "files")))


def cache_stats(config: RangeConfig, *, deployment: str | None = None,
                tier_idxs: list[int] | None = None) -> tuple[list[ShardUsage], list[TierNote]]:
    """Every deployment's (or one ``deployment``'s) entries on every shard of the config's tiers.

    Args:
        config: the parsed config (its servers, directories, runtime dir, security and budget are used).
        deployment: only this deployment (``None``: every deployment found).
        tier_idxs: only these tiers (``None``: all).

    Returns:
        ``(rows, notes)``: one row per (tier, shard, deployment) holding anything, in that order, and a note per
        tier or shard that could not be read (or the DRAM tier, which cannot be read from outside the engine).

    Raises:
        ConfigError: as :func:`~range_connector.ops.offline_spec.offline_tiers` (no embedded servers recorded).
    """
    resolved = offline_tiers(config)
    rows: list[ShardUsage] = []
    notes: list[TierNote] = []
    for i in tier_idxs if tier_idxs is not None else range(len(resolved.tiers)):
        tier = resolved.tiers[i]
        if tier.type == "memory":
            notes.append(TierNote(i, tier.type, DRAM_NOTE))
        elif tier.type == "valkey":
            for s, url in enumerate(tier.servers):
                try:
                    rows += _valkey_usage(resolved.for_tier(i), i, s, url, deployment)
                except BackendError as exc:
                    notes.append(TierNote(i, tier.type, str(exc), s))
        else:
            rows += _file_usage(resolved, i, deployment)
    return rows, notes


def _budget(config: RangeConfig, tier: TierConfig, deployment: str) -> int | None:
    return tier.budget_bytes if deployment == config.deployment else None


def _valkey_usage(config: RangeConfig, tier_idx: int, shard_idx: int, url: str,
                  deployment: str | None) -> list[ShardUsage]:
    import valkey.exceptions as vex

    from range_connector.backends.factory import valkey_access
    from range_connector.backends.valkey.calls import clients_for
    from range_connector.backends.valkey.urls import parse_server_url, redact_url

    tier = config.tier
    shown = redact_url(url)
    try:
        client, _ = clients_for(parse_server_url(url), valkey_access(config), tier.timeout_s)
    except ValueError as exc:
        raise BackendError(f"{shown}: {exc}") from None
    counts: dict[str, list[int]] = {}  # deployment -> [tickets, leases]
    pattern = deployment_key_prefix(deployment) + "*" if deployment else f"{STORAGE_FORMAT}:*"
    try:
        for key in client.scan_iter(match=pattern, count=1000):
            parts = key.split(b":", 3)
            if len(parts) < 3:
                continue
            name = parts[1].decode(errors="replace")
            entry = counts.setdefault(name, [0, 0])
            entry[0] += parts[2] == b"t"
            entry[1] += parts[2] == b"l"
        rows = []
        for name in sorted(counts):
            if not re.fullmatch(DEPLOYMENT_PATTERN, name):
                continue
            p = deployment_key_prefix(name)
            pipe = client.pipeline(transaction=False)
            pipe.zcard(f"{p}lru").get(f"{p}used")
            pipe.zrange(f"{p}lru", 0, 0, withscores=True).zrange(f"{p}lru", -1, -1, withscores=True)
            num_stripes, used, oldest, newest = pipe.execute()
            rows.append(ShardUsage(tier_idx, "valkey", shard_idx, name, shown, counts[name][0], int(num_stripes),
                                   counts[name][1], int(used or 0), _budget(config, tier, name),
                                   oldest[0][1] if oldest else None, newest[0][1] if newest else None))
        return rows
    except vex.AuthenticationError as exc:
        raise BackendError(f"{shown}: the server refused the credentials ({exc})") from None
    except (vex.ValkeyError, OSError) as exc:
        raise BackendError(f"{shown}: {type(exc).__name__}: {exc}") from None
    finally:
        client.close()


def _deployment_dirs(root: Path, deployment: str | None) -> list[Path]:
    if deployment is not None:
        return [root / deployment] if (root / deployment).is_dir() else []
    try:
        names = sorted(os.listdir(root))
    except FileNotFoundError:
        return []
    return [root / n for n in names if re.fullmatch(DEPLOYMENT_PATTERN, n) and (root / n).is_dir()]


def _file_usage(config: RangeConfig, tier_idx: int, deployment: str | None) -> list[ShardUsage]:
    from range_connector.backends.file.capacity import num_live_leases, scan
    from range_connector.backends.file.ticket_log import TicketLog

    tier = config.tiers[tier_idx]
    rows = []
    for directory in _deployment_dirs(file_tier_root(config, tier), deployment):
        for s in range(config.num_shards):
            root = directory / f"shard-{s}"
            if not (root / "stripes").is_dir():
                continue
            used, stripes, _ = scan(root)
            log = TicketLog(root, str(root), lambda **_: None, fsync=False)
            try:
                log.lookup([])  # (replays the log)
                num_tickets = len(log.tickets)
            finally:
                log.close(tier.timeout_s)
            mtimes = [mtime_ns / 1e9 for mtime_ns, _ in stripes.values()]
            rows.append(ShardUsage(tier_idx, "file", s, directory.name, str(root), num_tickets, len(stripes),
                                   num_live_leases(root), used, _budget(config, tier, directory.name),
                                   min(mtimes, default=None), max(mtimes, default=None)))
    return rows


def clear_cache(config: RangeConfig, *, deployment: str, tier_idxs: list[int]) -> list[ClearResult]:
    """Remove ``deployment``'s entries from the given tiers, every shard (the backends' ``clear()``).

    Args:
        config: the parsed config.
        deployment: the deployment to clear (others stay intact).
        tier_idxs: the tiers to clear (:func:`select_tiers`).

    Returns:
        One result per shard of each tier (one for the DRAM tier, which cannot be cleared from here); a shard that
        fails is reported, and the others are still cleared.

    Raises:
        ConfigError: as :func:`~range_connector.ops.offline_spec.offline_tiers`.
    """
    from range_connector.backends.factory import valkey_access
    from range_connector.backends.file.backend import FileBackend
    from range_connector.backends.valkey.client import ValkeyBackend
    from range_connector.backends.valkey.urls import redact_url

    resolved = offline_tiers(config)
    out: list[ClearResult] = []
    for i in tier_idxs:
        tier = resolved.tiers[i]
        if tier.type == "memory":
            out.append(ClearResult(i, tier.type, None, deployment, "", False, DRAM_NOTE))
            continue
        if tier.type == "valkey":
            targets = [(s, redact_url(url), url) for s, url in enumerate(tier.servers)]
        else:
            root = file_tier_root(resolved, tier) / deployment
            targets = [(s, str(root / f"shard-{s}"), root / f"shard-{s}") for s in range(resolved.num_shards)]
        for s, shown, where in targets:
            if tier.type == "file" and not (Path(where) / "stripes").is_dir():
                out.append(ClearResult(i, tier.type, s, deployment, shown, False, "nothing stored"))
                continue
            try:
                backend = (ValkeyBackend(str(where), tier.timeout_s, access=valkey_access(resolved.for_tier(i)),
                                         deployment=deployment) if tier.type == "valkey"
                           else FileBackend(where, timeout_s=tier.timeout_s))
                try:
                    backend.clear()
                finally:
                    backend.close()
            except BackendError as exc:
                out.append(ClearResult(i, tier.type, s, deployment, shown, False, str(exc)))
                continue
            out.append(ClearResult(i, tier.type, s, deployment, shown, True))
    return out
