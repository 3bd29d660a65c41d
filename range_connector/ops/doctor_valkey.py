"""The doctor's Valkey tier check (:mod:`range_connector.ops.doctor_tiers` has the contract): per shard, reached
with the tier's access settings, latency, a bandwidth probe under a throw-away deployment, the server's limits, and
the tickets stored under the config's deployment."""

from __future__ import annotations

import time
from pathlib import Path

import valkey.exceptions as vex

from range_connector.config import RangeConfig
from range_connector.errors import BackendError, ConfigError
from range_connector.ops.checks import CheckResult, ModelView, Status
from range_connector.ops.doctor_tiers import (
    MAX_SCANNED_TICKETS,
    TierCheck,
    _median_s,
    _probe_deployment,
    _speed,
    fitting_tickets,
    probe_bandwidth,
    remove_deployment_keys,
)

__all__ = ["check_valkey_tier"]

#: bytes of a SET command besides its value, kept free under ``proto-max-bulk-len`` (as ValkeyBackend does)
_COMMAND_OVERHEAD_BYTES = 1024


def check_valkey_tier(config: RangeConfig, view: ModelView | None, probe_bytes: int) -> TierCheck:
    """Check every shard of the config's current Valkey tier.

    Never raises for what it checks: failures are rows of the result.
    """
    from range_connector.backends.factory import valkey_access
    from range_connector.backends.valkey.servers import embedded_urls

    tier = config.tier
    out = TierCheck(tier.index, tier.type)
    name = f"tiers[{tier.index}]"
    try:
        access = valkey_access(config)
    except ConfigError as exc:
        out.results.append(CheckResult(name, Status.FAIL, str(exc)))
        return out
    if tier.servers:
        urls = list(tier.servers)
    else:
        runtime_dir = Path(config.resolved_runtime_dir)
        try:
            urls = embedded_urls(runtime_dir)
        except BackendError as exc:
            out.results.append(CheckResult(name, Status.FAIL, f"runtime_dir: {exc}"))
            return out
        if not urls:
            out.results.append(CheckResult(name, Status.WARN, f"no embedded Valkey servers running in {runtime_dir}: "
                                           f"the first engine starts {config.num_shards} (nothing to probe now)"))
            return out
        if len(urls) != config.num_shards:
            out.results.append(CheckResult(name, Status.FAIL, f"num_shards: {config.num_shards}, but {len(urls)} "
                                           f"embedded servers are recorded in {runtime_dir}"))
            return out
    for shard_idx, url in enumerate(urls):
        _check_shard(config, f"{name} shard {shard_idx}", url, access, view, probe_bytes, out)
    return out


def _check_shard(config: RangeConfig, label: str, url: str, access, view: ModelView | None, probe_bytes: int,
                 out: TierCheck) -> None:
    from range_connector.backends.valkey.calls import clients_for
    from range_connector.backends.valkey.client import ValkeyBackend
    from range_connector.backends.valkey.urls import parse_server_url, redact_url

    tier = config.tier
    key = tier.key_name("servers") if tier.servers else "runtime_dir"
    shown = redact_url(url)
    probe = _probe_deployment()
    start = time.perf_counter()
    try:
        backend = ValkeyBackend(url, timeout_s=tier.timeout_s, access=access, deployment=probe)
    except BackendError as exc:
        hint = "" if tier.servers else " (an embedded server: the next engine restarts it, empty)"
        out.results.append(CheckResult(label, Status.FAIL if tier.servers else Status.WARN,
                                       f"{key}: {str(exc).replace(url, shown)}{hint}"))
        return
    connect_s = time.perf_counter() - start
    client = clients_for(parse_server_url(url), access, tier.timeout_s)[0]
    try:
        try:
            data = {"url": shown, "connect_s": connect_s, "latency_s": _median_s(backend.ping),
                    **probe_bandwidth(backend, probe_bytes)}
            out.results.append(CheckResult(label, Status.OK, f"{shown}: {_speed(data)}", data))
        except (BackendError, ValueError) as exc:
            out.results.append(CheckResult(label, Status.FAIL, f"{key}: {shown}: the probe failed: {exc}"))
        out.results.append(_limits(f"{label} limits", shown, client, backend.max_value_bytes + 1024, config, view))
        try:
            out.stored.append(_count_tickets(client, config, view, backend.max_value_bytes))
        except (vex.ValkeyError, OSError) as exc:
            out.results.append(CheckResult(f"{label} data", Status.WARN, f"{shown}: tickets not counted ({exc})"))
    finally:
        try:
            remove_deployment_keys(client, probe)
        except (vex.ValkeyError, OSError) as exc:
            out.results.append(CheckResult(f"{label} clean-up", Status.WARN, f"{shown}: the probe's keys "
                                           f"rc3:{probe}:* were not removed ({exc})"))
        backend.close()
        client.close()


def _config_get(client, name: str) -> str | None:
    """One server setting, ``None`` where the server or the ACL refuses ``CONFIG GET``."""
    try:
        return client.config_get(name).get(name)
    except vex.ResponseError:  # NOPERM (ACL), or CONFIG renamed or disabled on a managed server
        return None


def _limits(label: str, shown: str, client, max_bulk_bytes: int, config: RangeConfig,
            view: ModelView | None) -> CheckResult:
    """``proto-max-bulk-len`` against one block row, ``maxmemory`` against the budget, and the eviction policy."""
    tier = config.tier
    try:
        bulk, maxmemory, policy = (_config_get(client, n) for n in ("proto-max-bulk-len", "maxmemory",
                                                                    "maxmemory-policy"))
    except (vex.ValkeyError, OSError) as exc:
        return CheckResult(label, Status.FAIL, f"{shown}: CONFIG GET failed ({exc})")
    data: dict = {"proto_max_bulk_len_bytes": int(bulk) if bulk else None,
                  "maxmemory_bytes": int(maxmemory) if maxmemory else None, "maxmemory_policy": policy}
    if bulk is None and maxmemory is None and policy is None:
        return CheckResult(label, Status.WARN, f"{shown}: CONFIG GET refused (ACL or a managed server): limits not "
                           f"checked; values are assumed to fit in {max_bulk_bytes} bytes", data)
    notes, status = [], Status.OK
    bulk_bytes = int(bulk) if bulk else max_bulk_bytes
    if view is not None:
        max_value_bytes = bulk_bytes - _COMMAND_OVERHEAD_BYTES
        stripe_blocks = max_value_bytes // view.layer_block_bytes
        data["max_stripe_blocks"] = stripe_blocks
        if stripe_blocks < 1:
            need = view.layer_block_bytes + _COMMAND_OVERHEAD_BYTES
            return CheckResult(label, Status.FAIL, f"{shown}: proto-max-bulk-len {bulk_bytes} bytes is below one "
                               f"block row ({view.layer_block_bytes} bytes + {_COMMAND_OVERHEAD_BYTES} of the "
                               f"command): no stripe fits; raise it to at least {need} (CONFIG SET "
                               "proto-max-bulk-len)", data)
        notes.append(f"proto-max-bulk-len {bulk_bytes} bytes (stripes up to {stripe_blocks} blocks)")
    else:
        notes.append(f"proto-max-bulk-len {bulk_bytes} bytes")
    budget = tier.budget_bytes
    if maxmemory is None:
        notes.append("maxmemory not readable")
    elif int(maxmemory) == 0:
        if not budget:
            status = Status.WARN
            notes.append("no maxmemory and no capacity_bytes: the server grows without bound")
        else:
            notes.append("no maxmemory")
    else:
        notes.append(f"maxmemory {maxmemory} bytes")
        if budget > int(maxmemory):
            status = Status.WARN
            notes.append(f"capacity_bytes {budget} is above it: the server refuses saves before Range evicts")
        elif not budget:
            status = Status.WARN
            notes.append(f"no {tier.key_name('capacity_bytes')}: once full, saves are skipped instead of evicting")
    if policy is not None:
        notes.append(f"maxmemory-policy {policy}")
        if policy != "noeviction":
            status = Status.WARN
            notes.append("Range expects noeviction (the server may drop stripes that tickets still promise)")
    return CheckResult(label, status, f"{shown}: " + ", ".join(notes), data)


def _count_tickets(client, config: RangeConfig, view: ModelView | None,
                   max_value_bytes: int) -> tuple[int, int | None, bool]:
    """``(tickets read, tickets that fit the model or None, stopped at MAX_SCANNED_TICKETS)`` of the config's
    deployment on one server (SCAN ``rc3:<deployment>:t:*``, then MGET in batches)."""
    from range_connector.backends.base import deployment_key_prefix

    prefix = deployment_key_prefix(config.deployment).encode()
    keys: list[bytes] = []
    for k in client.scan_iter(match=prefix + b"t:*", count=1000):
        if len(keys) == MAX_SCANNED_TICKETS:
            break
        keys.append(k)
    items: list[tuple[bytes, bytes | None]] = []
    for i in range(0, len(keys), 1000):
        batch = keys[i:i + 1000]
        items += [(k[len(prefix):], raw) for k, raw in zip(batch, client.mget(batch))]
    truncated = len(keys) == MAX_SCANNED_TICKETS
    return len(items), fitting_tickets(items, config, view, max_value_bytes), truncated
