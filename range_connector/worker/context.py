"""What a load job may use of its worker, frozen when the KV cache is registered.

:class:`LoadContext` is built once by :meth:`range_connector.worker.facade.RangeWorker.register_kv_caches` and
handed to every :class:`~range_connector.worker.loads.LoadJob`; the job reaches nothing else of the worker. It holds
the KV cache's row views and the device seam (:mod:`range_connector.worker.device`: on CUDA, the copy stream), so
reads of the layout, ticket checks and batched copies into the KV cache live here. The mutable parts it shares with
the worker are the counters (``stats``), the per-layer copy events and the callback that forgets a bad chunk.
"""

from __future__ import annotations

from collections.abc import Callable, MutableMapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from range_connector.backends.base import Backend
from range_connector.config import RangeConfig
from range_connector.kv.layout import KVLayout
from range_connector.kv.namespace import ChunkHash
from range_connector.kv.sharding import ShardPlan
from range_connector.kv.tickets import MAX_LAYER_BYTES, Ticket
from range_connector.worker.banks import BankPool, BankReader
from range_connector.worker.counters import Counters
from range_connector.worker.device import CopyDevice, HostDevice


@dataclass(frozen=True, eq=False)
class LoadContext:
    """The worker's KV cache, backends, threads and counters, as load jobs use them.

    Attributes:
        config: the worker's config (``verify_checksums``, ``bank_bytes``, ``num_banks``, the tier's ``timeout_s``).
        layout: the registered KV layout (planes per layer, bytes per block row, row dtype).
        layer_names: ``[num_layers]`` in forward order.
        plan: the shard plan of this worker's chunks.
        backends: ``[num_shards]`` this worker's backends.
        rows: ``[num_layers * num_planes]`` views ``[num_blocks, row_bytes / itemsize]`` of the KV cache, layer-major.
        banks: the transfer banks.
        reader: the thread that fills banks (and direct receives) in order.
        verifier: the thread that checks lent stripes' checksums.
        shard_readers: reads the shards of one layer group in parallel (one server each).
        stats: the worker's counters (shared, added to by jobs on several threads: :meth:`Counters.add`).
        layer_events: ``layer_name -> event`` of the last copy into that layer by the step's load (shared, filled by
            jobs; empty on host memory, whose copies have no events).
        drop: forgets a chunk whose bytes proved bad or gone on a shard: ``drop(chunk_hash, shard_idx)``.
        device: the device seam (the copy stream and its events on CUDA).
        heads: ``(head_start, num_heads)``: the KV heads this rank's cache holds.
        device_banks: staging buffers in device memory, for file-tier loads with GPUDirect reads
            (:mod:`range_connector.worker.device_reads`); ``None`` where no tier takes them.
    """

    config: RangeConfig
    layout: KVLayout
    layer_names: tuple[str, ...]
    plan: ShardPlan
    backends: Sequence[Backend]
    rows: Sequence[torch.Tensor]
    banks: BankPool
    reader: BankReader
    verifier: ThreadPoolExecutor
    shard_readers: ThreadPoolExecutor
    stats: Counters
    layer_events: MutableMapping[str, object]
    drop: Callable[[ChunkHash, int], None]
    device: CopyDevice = field(default_factory=HostDevice)
    heads: tuple[int, int] = (0, 1)
    device_banks: BankPool | None = None

    def kv_rows(self, layer_idx: int, plane_idx: int) -> torch.Tensor:
        """``[num_blocks, row]`` view of one plane of one layer of the KV cache."""
        return self.rows[layer_idx * self.layout.num_planes + plane_idx]

    def ticket_fits(self, t: Ticket) -> bool:
        """The ticket describes stripes of the registered layout and this rank's KV heads (pieces of other head
        slices do not fit: :mod:`range_connector.worker.reassembly` loads them), and its stripe is no larger than
        :attr:`max_stripe_blocks`."""
        if not isinstance(t, Ticket):
            return False
        layout = self.layout
        return (t.num_planes, t.row_bytes, t.num_layers, t.num_blocks, (t.head_start, t.num_heads)) == (
            layout.num_planes, layout.row_bytes, len(self.layer_names), self.plan.blocks_per_shard, self.heads
        ) and 0 <= t.block_offset and t.block_offset + t.num_blocks <= t.stripe_blocks <= self.max_stripe_blocks

    @property
    def max_stripe_blocks(self) -> int:
        """The most blocks a stripe of a ticket that fits may hold: one save batch is at most the registered KV
        pool's blocks (a ticket claiming more comes from a poisoned or foreign store: the load would size its
        staging from it), and its layer value at most the tier's limit (:data:`~range_connector.kv.tickets.
        MAX_LAYER_BYTES` where the tier allows more)."""
        layer_block_bytes = max(1, self.layout.num_planes * self.layout.row_bytes)
        max_value_bytes = min([MAX_LAYER_BYTES, *(b.max_value_bytes for b in self.backends)])
        return min(self.layout.num_blocks, max_value_bytes // layer_block_bytes)

    def copy_rows(self, dst_rows: torch.Tensor, dst: torch.Tensor, src_rows: torch.Tensor,
                  src: slice | torch.Tensor) -> object | None:
        """``dst_rows[dst] = src_rows[src]`` as one batched index copy through the device seam; returns the copy's
        event (``None`` on host memory). Shapes: :meth:`~range_connector.worker.device.CopyDevice.copy_rows`.

        When the source rows are one run (the usual case: a chunk's blocks are consecutive in its stripe, and a
        bank holds segments back to back) the source is a view and the copy is the only pass over the bytes;
        otherwise the rows are gathered first."""
        return self.device.copy_rows(dst_rows, dst, src_rows, src)
