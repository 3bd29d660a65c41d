"""The doctor's tier checks (:mod:`range_connector.ops.doctor`): one tier of a config, without starting anything
(Valkey's in :mod:`range_connector.ops.doctor_valkey`).

* Valkey, per shard: the server is reached with the tier's credentials and TLS files (the backend's own
  constructor: ``PING``, ``AUTH``, the TLS handshake, both client paths); round-trip latency (median of a few
  ``PING``); a bandwidth probe; the server's limits from ``CONFIG GET`` (``proto-max-bulk-len`` against one block
  row, ``maxmemory``, ``maxmemory-policy``), a refusal by the server or its ACL being a warning. Embedded servers
  are found in ``runtime_dir`` (never started: when none runs, the first engine starts them).
* File: the directory (or the nearest existing parent), the free space of its file system (a full one fails),
  ``O_DIRECT`` support, a bandwidth probe.
* DRAM: the budget, and a bandwidth probe of an instance of its own.

Every probe writes one stripe of ``probe_bytes`` (no tickets) under a throw-away deployment ``doctor-<random>``,
reads it back whole (checking the bytes), drops it and then removes everything of that deployment (Valkey keys
``rc3:doctor-...:*``, the file tier's ``<directory>/doctor-...``): the config's own deployment is only read.
Latency and bandwidth are reported, never judged. The data stored under the config's deployment is counted by
:func:`count_stored_tickets`.
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
import shutil
import statistics
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from range_connector.backends.base import Backend, RangeRead, StripeWrite, deployment_key_prefix
from range_connector.config import RangeConfig
from range_connector.errors import BackendError, ConfigError
from range_connector.kv.tickets import Ticket
from range_connector.ops.checks import CheckResult, ModelView, Status

__all__ = [
    "MAX_SCANNED_TICKETS", "TierCheck", "check_file_tier", "check_memory_tier", "check_stored_data", "fitting_tickets",
    "odirect_refusal", "probe_bandwidth", "remove_deployment_keys",
]

#: the stored-data count reads at most this many tickets per shard
MAX_SCANNED_TICKETS = 100_000
_PROBE_LAYERS = 4
_PAGE_BYTES = 4096
_PINGS = 5


@dataclass(slots=True)
class TierCheck:
    """What the checks of one tier found.

    Attributes:
        index: the tier's index in ``tiers``.
        type: its type.
        results: its rows.
        stored: per shard reached, ``(tickets read, tickets that fit the model's layout or None without one,
            whether the count stopped at MAX_SCANNED_TICKETS)``; empty for a tier that keeps nothing outside an engine.
        keeps_data: the tier outlives an engine (Valkey, files).
    """

    index: int
    type: str
    results: list[CheckResult] = field(default_factory=list)
    stored: list[tuple[int, int | None, bool]] = field(default_factory=list)
    keeps_data: bool = True


def _probe_deployment() -> str:
    return f"doctor-{uuid.uuid4().hex[:16]}"


def _median_s(fn, repeats: int = _PINGS) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def probe_bandwidth(backend: Backend, probe_bytes: int) -> dict[str, float]:
    """Write one stripe of ``probe_bytes`` (``_PROBE_LAYERS`` layer values, no tickets), read it back whole in one
    ``read_ranges`` call, compare the bytes, and drop it.

    Returns:
        ``{"probe_bytes", "write_bytes_per_s", "read_bytes_per_s"}``.

    Raises:
        BackendError: the tier failed, refused the stripe (full) or returned other bytes (the message says which).
    """
    layer_bytes = max(1, min(probe_bytes // _PROBE_LAYERS, backend.max_value_bytes))
    payload = os.urandom(layer_bytes * _PROBE_LAYERS)
    values = [memoryview(payload)[i * layer_bytes:(i + 1) * layer_bytes] for i in range(_PROBE_LAYERS)]
    sid = uuid.uuid4().hex
    start = time.perf_counter()
    stored = backend.write_stripe(StripeWrite(sid, values, ()))
    write_s = time.perf_counter() - start
    try:
        if not stored:
            raise BackendError(f"no room for a {len(payload)}-byte probe stripe (the tier's storage is full)")
        dest = bytearray(len(payload))
        view = memoryview(dest)
        reads = [RangeRead(sid, i, 0, layer_bytes, layer_bytes, view[i * layer_bytes:(i + 1) * layer_bytes])
                 for i in range(_PROBE_LAYERS)]
        start = time.perf_counter()
        ok = backend.read_ranges(reads)
        read_s = time.perf_counter() - start
        if not all(ok) or dest != payload:
            raise BackendError(f"the {len(payload)}-byte probe stripe did not read back as written")
    finally:
        backend.drop_stripes([sid])
    return {"probe_bytes": len(payload), "write_bytes_per_s": len(payload) / max(write_s, 1e-9),
            "read_bytes_per_s": len(payload) / max(read_s, 1e-9)}


def _speed(data: dict[str, float]) -> str:
    return (f"latency {data['latency_s'] * 1e3:.2f} ms, {data['probe_bytes'] / (1 << 20):.1f} MiB probe: write "
            f"{data['write_bytes_per_s'] / 1e9:.2f} GB/s, read {data['read_bytes_per_s'] / 1e9:.2f} GB/s")


def fitting_tickets(items: Sequence[tuple[bytes, bytes | None]], config: RangeConfig, view: ModelView | None,
                    max_value_bytes: int) -> int | None:
    """How many ``(ticket key without the deployment prefix, raw ticket)`` fit the model's KV layout (layers, rows
    of its heads, blocks per shard of the config's chunk): what an engine of this model could load. ``None``
    without a model."""
    if view is None:
        return None
    try:
        chunk_tokens = config.resolve(view.block_size).chunk_tokens or view.block_size
    except ConfigError:
        return 0
    num_blocks = chunk_tokens // view.block_size // config.num_shards
    count = 0
    for key, raw in items:
        parts = key.split(b":")
        head = int(parts[3][1:]) if len(parts) == 4 and parts[3][1:].isdigit() else -1
        count += Ticket.decode_covering(raw, num_layers=view.num_layers, head_block_bytes=view.head_block_bytes,
                                        num_blocks=num_blocks, head=head, max_layer_bytes=max_value_bytes) is not None
    return count


def check_memory_tier(config: RangeConfig, probe_bytes: int) -> TierCheck:
    """The DRAM tier: its budget, and the probe on an instance of its own (nothing runs outside an engine)."""
    from range_connector.backends.memory import MemoryBackend

    tier = config.tier
    out = TierCheck(tier.index, tier.type, keeps_data=False)
    backend = MemoryBackend(None)
    try:
        data = {"latency_s": 0.0, **probe_bandwidth(backend, probe_bytes)}
    finally:
        backend.close()
    out.results.append(CheckResult(f"tiers[{tier.index}] memory", Status.OK,
                                   f"in-process DRAM of each worker, budget {tier.budget_bytes} bytes per worker "
                                   f"(empty until an engine runs); {_speed(data)}", data))
    return out


def odirect_refusal(directory: Path) -> str | None:
    """Why the file system under ``directory`` refuses an aligned ``O_DIRECT`` read (``None``: it accepts one).
    Writes and removes one two-page file there.

    Raises:
        OSError: the file cannot be written, or the read fails otherwise than with ``EINVAL``.
    """
    if not hasattr(os, "O_DIRECT"):
        return "no O_DIRECT on this platform"
    probe = directory / f".odirect-probe-{uuid.uuid4().hex[:8]}"
    probe.write_bytes(bytes(2 * _PAGE_BYTES))
    try:
        fd = os.open(probe, os.O_RDONLY | os.O_DIRECT)
        try:
            os.preadv(fd, [mmap.mmap(-1, _PAGE_BYTES)], 0)
        finally:
            os.close(fd)
    except OSError as exc:
        if exc.errno != errno.EINVAL:
            raise
        return f"refused ({exc.strerror})"
    finally:
        probe.unlink(missing_ok=True)
    return None


def _existing_parent(path: Path) -> Path:
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def _remove_created(path: Path, stop: Path) -> None:
    """Remove ``path`` (a directory tree this check made) and its empty parents up to and including ``stop``."""
    shutil.rmtree(path, ignore_errors=True)
    for parent in path.parents:
        if not parent.is_relative_to(stop):
            break
        with contextlib.suppress(OSError):
            parent.rmdir()  # (only empty ones: someone else's files stay)
        if parent == stop:
            break


def check_file_tier(config: RangeConfig, view: ModelView | None, probe_bytes: int) -> TierCheck:
    """The file tier: directory, free space, ``O_DIRECT``, the probe, and the tickets of the config's deployment
    (module docstring). Never raises for what it checks."""
    from range_connector.backends.file.backend import FileBackend
    from range_connector.backends.file.gds import gds_report
    from range_connector.backends.file.ticket_log import TicketLog

    tier = config.tier
    out = TierCheck(tier.index, tier.type)
    name = f"tiers[{tier.index}] file"
    key = tier.key_name("directory") if tier.directory else "runtime_dir"
    root = Path(os.path.expanduser(tier.directory or os.path.join(config.resolved_runtime_dir, "files")))
    existing = _existing_parent(root)
    if not existing.is_dir():
        out.results.append(CheckResult(name, Status.FAIL, f"{key}: {existing} is not a directory"))
        return out
    usage = shutil.disk_usage(existing)
    data: dict = {"directory": str(root), "free_bytes": usage.free, "total_bytes": usage.total}
    need_bytes = max(probe_bytes, view.layer_block_bytes * view.num_layers if view else 0)
    if usage.free < need_bytes:
        out.results.append(CheckResult(name, Status.FAIL, f"{key}: the file system under {existing} is full "
                                       f"({usage.free} bytes free of {usage.total}): saves would all be skipped",
                                       data))
        return out
    probe_root = root / _probe_deployment()
    # (what this check creates and removes again: the probe's directory, or the first missing parent of the root)
    created = probe_root if existing == root else next(p for p in [root, *root.parents] if p.parent == existing)
    try:
        probe_root.mkdir(parents=True)
        refusal = odirect_refusal(probe_root)
        backend = FileBackend(probe_root / "shard-0", timeout_s=tier.timeout_s, use_odirect=refusal is None)
        try:
            latency_s = _median_s(backend.ping)
            data.update(latency_s=latency_s, odirect=refusal is None, **probe_bandwidth(backend, probe_bytes),
                        gds=gds_report(probe_root))
        finally:
            backend.close()
    except (OSError, BackendError) as exc:
        out.results.append(CheckResult(name, Status.FAIL, f"{key}: {root}: cannot write and read a probe stripe "
                                       f"({exc})", data))
        return out
    finally:
        _remove_created(probe_root, created)
    status, notes = Status.OK, []
    budget = tier.budget_bytes
    if budget and budget > usage.free:
        status = Status.WARN
        notes.append(f"capacity_bytes {budget} per shard is above the {usage.free} bytes free: saves are skipped "
                     "once the disk fills")
    out.results.append(CheckResult(name, status, f"{root}: {usage.free / (1 << 30):.1f} GiB free of "
                                   f"{usage.total / (1 << 30):.1f} GiB; O_DIRECT "
                                   f"{'supported' if refusal is None else refusal}; {_speed(data)}; "
                                   f"GPUDirect reads: {data['gds']['line']}"
                                   + "".join(f"; {n}" for n in notes), data))
    for shard_idx in range(config.num_shards):
        shard_dir = root / config.deployment / f"shard-{shard_idx}"
        if not (shard_dir / "tickets").is_dir():
            out.stored.append((0, 0 if view else None, False))
            continue
        log = TicketLog(shard_dir, f"file://{shard_dir}", lambda **_: None, False)
        try:
            log.lookup([])  # (replays the log)
            items = [(k, raw) for k, (_, raw) in list(log.tickets.items())[:MAX_SCANNED_TICKETS]]
            out.stored.append((len(items), fitting_tickets(items, config, view, 1 << 40),
                               len(log.tickets) > MAX_SCANNED_TICKETS))
        finally:
            log.close(tier.timeout_s)
    return out


def check_stored_data(config: RangeConfig, view: ModelView | None, tiers: Sequence[TierCheck]) -> CheckResult:
    """Whether the config's deployment holds tickets an engine of this model could load (on any tier that keeps
    data). With a model, none fails (every lookup would miss; expected only before the first engine saved);
    without one, the tickets are counted and none is a warning."""
    name = f"stored data ({config.deployment})"
    far = [t for t in tiers if t.keeps_data]
    if not far:
        return CheckResult(name, Status.OK, "DRAM tier only: nothing is kept outside an engine")
    parts, data, total_fit, total = [], {}, 0, 0
    if not any(t.stored for t in far):
        return CheckResult(name, Status.WARN, "not counted: no shard of a tier that keeps data answered")
    for t in far:
        if not t.stored:
            parts.append(f"tiers[{t.index}] {t.type}: not counted (no shard answered)")
            continue
        read = sum(n for n, _, _ in t.stored)
        fit = sum(f or 0 for _, f, _ in t.stored)
        more = "+" if any(c for _, _, c in t.stored) else ""
        total, total_fit = total + read, total_fit + fit
        data[f"tiers[{t.index}]"] = {"tickets": read, "fitting_tickets": fit if view else None,
                                     "shards_counted": len(t.stored)}
        parts.append(f"tiers[{t.index}] {t.type}: {read}{more} ticket keys"
                     + (f", {fit} fit this model's KV layout" if view else "")
                     + (f" ({len(t.stored)} shard(s) counted)" if len(t.stored) != config.num_shards else ""))
    detail = "; ".join(parts)
    if view is None:
        return CheckResult(name, Status.OK if total else Status.WARN, detail + ("" if total else
                           " (give --model to check them against its layout)"), data)
    if total_fit == 0:
        return CheckResult(name, Status.FAIL, f"no stored data for this model under deployment "
                           f"{config.deployment!r}: {detail}; every lookup misses until an engine saves", data)
    return CheckResult(name, Status.OK, detail, data)


def remove_deployment_keys(client, deployment: str) -> int:
    """Delete every key of ``deployment`` on one server through a valkey-py ``client`` (the probe's own
    deployment only; names cannot hold glob characters). Returns the keys removed.

    Raises:
        valkey.exceptions.ValkeyError: the server refused.
    """
    keys = list(client.scan_iter(match=f"{deployment_key_prefix(deployment)}*", count=1000))
    for i in range(0, len(keys), 1000):
        client.delete(*keys[i:i + 1000])
    return len(keys)
