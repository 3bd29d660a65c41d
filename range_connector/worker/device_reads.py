"""File-tier loads straight into device memory (kvikio ``CuFile``: GPUDirect Storage), and the start-up check that
decides whether they happen.

When the KV cache is in device memory (the device seam's ``reads_device``: :class:`~range_connector.worker.device.
CudaDevice`), :func:`prepare_device_reads` runs once, in ``register_kv_caches``: it probes every file-tier shard
(:func:`~range_connector.backends.file.gds.probe_gds`: kvikio, the cuFile driver, a probe read compared byte for byte)
and logs the outcome, one line per outcome (a failure as a warning, with the reason: the tier then reads with POSIX
into pinned banks, as without kvikio). A shard whose probe passed in GPUDirect Storage mode
(``FileBackend.serves_device_reads``) is then read into *device banks*: staging buffers in device memory, one batched
``read_ranges_device`` per shard and layer group (:func:`device_bank_reads`), on the bank reader thread as a host bank
would be.

Nothing reaches attention unverified. The stripes' xxh3-64 checksums have no device implementation here, so with
``verify_checksums`` (the default) the bank reader brings each filled device bank back to a pinned host mirror
(``device.read_back``: one device-to-host copy and a host wait, on the reader thread, never the forward's) and the
consumer checks the mirror exactly as it checks a host bank, before the device-to-device copies into the KV cache.
What this costs, and when the path is worth it: docs/tiers.md, "Files into GPU memory".
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

import torch

from range_connector.backends.base import Backend
from range_connector.backends.file.stripes import DeviceRead
from range_connector.backends.tiered import leaf_backends
from range_connector.config import RangeConfig
from range_connector.worker.banks import BankPool
from range_connector.worker.device import CopyDevice

logger = logging.getLogger("vllm." + __name__)


def prepare_device_reads(backends: Sequence[Backend], device: CopyDevice, config: RangeConfig, *,
                         allow_compat: bool = False) -> BankPool | None:
    """Probe the file tier's shards for reads into device memory, log what was found, and return the device bank
    pool when some shard takes them (``None``: every load stages through host banks).

    Args:
        backends: the worker's backends (tier hierarchies included: their file tier is probed and reported, but
            only a file tier alone takes device loads).
        device: the device seam (probing happens only where ``device.reads_device``).
        config: the worker's config (``num_banks``).
        allow_compat: read into device memory in kvikio's compatibility mode too (benchmarks and ``gpu`` tests; by
            default that mode keeps the POSIX bank path, docs/tiers.md).
    """
    if not device.reads_device:
        return None
    from range_connector.backends.file.backend import FileBackend
    from range_connector.backends.file.gds import probe_gds

    files = [b for b in leaf_backends(backends) if isinstance(b, FileBackend)]
    said: set[str] = set()
    for b in files:
        b.gds = probe_gds(b.root, empty=device.empty_device, read_back=device.read_back, allow_compat=allow_compat)
        line = b.gds.describe()
        if line not in said:
            said.add(line)
            (logger.warning if b.gds.io_path == "posix" else logger.info)("Range file tier %s: %s", b.name, line)
    if not any(b.serves_device_reads("") for b in backends):
        return None
    return BankPool(config.num_banks, device=device, on_device=True)


def device_bank_reads(job: Any, group: range, buffer: torch.Tensor) -> dict[int, list[DeviceRead]]:
    """The reads of one layer group into a device bank, by shard: for every segment, layer and plane one range of
    the stripe's layer value into its place in the bank (laid out as a host bank:
    ``[layers of the group, planes, rows of the segments, row_bytes]``).

    Args:
        job: the :class:`~range_connector.worker.loads.LoadJob` (its segments and geometry; counts
            ``device_read_groups``).
        group: the layer indices of the group.
        buffer: ``[len(group) * planes * region_bytes]`` uint8 device memory.
    """
    job.w.stats.add("device_read_groups")
    by_shard: dict[int, list[DeviceRead]] = defaultdict(list)
    num_planes, row_bytes, region_bytes = job.num_planes, job.row_bytes, job.region_bytes
    for seg in job.segments:
        t = seg.ticket
        length = seg.num_blocks * row_bytes
        for layer_idx in group:
            for p in range(num_planes):
                start = ((layer_idx - group.start) * num_planes + p) * region_bytes + seg.bank_row * row_bytes
                by_shard[seg.shard_idx].append(DeviceRead(
                    t.stripe_id, layer_idx, (p * t.stripe_blocks + seg.first_block) * row_bytes, length,
                    t.layer_bytes, buffer[start:start + length]))
    return by_shard


def checked_bytes(job: Any, buffer: torch.Tensor) -> torch.Tensor | None:
    """After a device bank was filled (bank reader thread): the host copy its checksums are verified on, or
    ``None`` when checksums are off (``verify_checksums`` false: the bytes go to the KV cache unchecked, as on
    every path)."""
    if not job.w.config.verify_checksums:
        return None
    return job.w.device.read_back(buffer)
