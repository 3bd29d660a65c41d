"""Worker side: load promised chunks into the destination blocks, save new full chunks, report load errors.

Runs in each vLLM worker process, next to the KV tensors. All copies go through the row views of
:mod:`range_connector.layout`: one batched index copy per (layer, plane) for a whole step's loads or saves, never a
loop of per-block copies. In this version loads complete inside ``start_load_kv`` (before the forward) and saves
inside ``wait_for_save`` (after it); nothing stays in flight across steps, so preemption and block reuse cannot
mix foreign KV into a stored value.
"""

from __future__ import annotations

import logging
import time
import warnings
from collections import defaultdict
from collections.abc import Mapping

import numpy as np
import torch

from range_connector.backends.base import Backend
from range_connector.backends.memory import MemoryBackend
from range_connector.config import RangeConfig
from range_connector.errors import BackendError, IntegrityError
from range_connector.layout import KVLayout, block_rows
from range_connector.metadata import RangeConnectorMetadata, RangeWorkerMetadata, RequestTransfer
from range_connector.namespace import ChunkHash
from range_connector.sharding import ShardPlan
from range_connector.tiers import value_key
from range_connector.values import decode_value, encode_value

logger = logging.getLogger("vllm." + __name__)


def _as_rows(payload: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    """View a read-only payload as a tensor without copying (it is only read: ``torch.cat`` copies it out)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return torch.from_numpy(payload).view(dtype)


class RangeWorker:
    """Worker half of the connector.

    Args:
        config: resolved config.
        block_size: engine block size in tokens.
        layer_names: attention layers served, in model order.
        num_blocks: blocks per layer tensor.
        backends: ``[num_shards]`` backends.
        tp_rank: tensor-parallel rank (part of every key).
    """

    def __init__(self, config: RangeConfig, block_size: int, layer_names: tuple[str, ...], num_blocks: int,
                 backends: list[Backend], tp_rank: int = 0) -> None:
        assert config.chunk_tokens is not None
        self.config = config
        self.block_size = block_size
        self.layer_names = layer_names
        self.num_blocks = num_blocks
        self.plan = ShardPlan(config.chunk_tokens // block_size, config.num_shards)
        self.backends = backends
        self.tp_rank = tp_rank
        self.layout: KVLayout | None = None
        self._rows: list[torch.Tensor] = []
        self._failed_block_ids: set[int] = set()
        self._save_down_until = [0.0] * len(backends)  # per shard: monotonic time before which saves are skipped
        self._saved: list[ChunkHash] = []
        self._dropped: list[ChunkHash] = []
        # req_id -> first chunk whose load failed in this step: the forward computes on top of it, so nothing from
        # there on may be saved in this step (vLLM recomputes those blocks and they are saved then).
        self._failed_from_chunk: dict[str, int] = {}
        self._failed_loads: list[tuple[str, int]] = []
        #: block ids written by the last step that loaded anything, in chain order (for inspection and tests).
        self.last_loaded_block_ids: list[int] = []
        self.last_loaded_keys: list[bytes] = []
        self.stats: dict[str, int] = defaultdict(int)

    def register_kv_caches(self, kv_caches: Mapping[str, torch.Tensor]) -> None:
        """View the engine's KV tensors as rows (see :func:`range_connector.layout.block_rows`)."""
        self.layout, self._rows = block_rows(kv_caches, self.layer_names, self.num_blocks)
        logger.info("Range worker: %d layers x %d planes, %d bytes per block row, %d blocks",
                    len(self.layer_names), self.layout.num_planes, self.layout.row_bytes, self.num_blocks)

    # ---------------------------------------------------------------- helpers
    def _value_payload_bytes(self) -> int:
        assert self.layout is not None
        return self.layout.num_row_groups * self.plan.blocks_per_shard * self.layout.row_bytes

    def _where(self, shard_idx: int, key: bytes) -> str:
        return f"{self.backends[shard_idx].name} key {key.decode(errors='replace')}"

    # ---------------------------------------------------------------- loads
    def start_load(self, meta: RangeConnectorMetadata) -> None:
        """Load every promised chunk of this step into its destination blocks, within ``load_deadline_s``.

        Blocks whose value is missing, corrupt, late or unreadable are reported through
        :meth:`take_failed_block_ids`; vLLM recomputes them. Never raises for a tier failure.
        """
        self._failed_from_chunk = {}
        if not meta.loads or self.layout is None:
            return
        deadline = time.monotonic() + self.config.load_deadline_s
        self.last_loaded_block_ids = []
        self.last_loaded_keys = []
        for req in meta.loads:
            self._load_request(req, deadline)

    def _load_request(self, req: RequestTransfer, deadline: float) -> None:
        layout = self.layout
        assert layout is not None
        if req.fail and req.chunks:
            self._fail_from(req, req.chunks[0].chunk_idx)
            return
        transient = False  # a backend error or the deadline, rather than a value that is missing or bad
        per_shard_keys: dict[int, list[bytes]] = defaultdict(list)
        for chunk in req.chunks:
            for s in range(self.plan.num_shards):
                per_shard_keys[s].append(value_key(chunk.chunk_hash, s, self.tp_rank))
        values: dict[bytes, bytes | None] = {}
        for s, keys in per_shard_keys.items():
            if time.monotonic() > deadline:
                break
            try:
                got = self.backends[s].get_many(keys)
            except BackendError as exc:
                logger.warning("Range load of request %s: %s", req.req_id, exc)
                self.stats["load_backend_errors"] += 1
                transient = True
                continue
            values.update(zip(keys, got))
            self.last_loaded_keys.extend(k for k, v in zip(keys, got) if v is not None)
        if time.monotonic() > deadline:
            logger.warning("Range load of request %s passed its %.1f s deadline", req.req_id,
                           self.config.load_deadline_s)
            values.clear()
            transient = True
            self.stats["load_deadline_misses"] += 1
        # Decode, then copy every good chunk with one index copy per (layer, plane).
        src_parts: list[torch.Tensor] = []  # each [num_row_groups, n, row_elems]
        dst_ids: list[int] = []
        failed_from_chunk: int | None = None
        payload_bytes = self._value_payload_bytes()
        groups, bps = layout.num_row_groups, self.plan.blocks_per_shard
        for chunk in req.chunks:
            shard_payloads: list[np.ndarray] = []
            for s in range(self.plan.num_shards):
                key = value_key(chunk.chunk_hash, s, self.tp_rank)
                value = values.get(key)
                if value is None:
                    break
                try:
                    shard_payloads.append(decode_value(value, num_row_groups=groups, payload_bytes=payload_bytes,
                                                       verify=self.config.verify_checksums,
                                                       where=self._where(s, key)))
                except IntegrityError as exc:
                    logger.warning("Range load: %s", exc)
                    self.stats["load_integrity_errors"] += 1
                    self._drop(chunk.chunk_hash)
                    break
            if len(shard_payloads) != self.plan.num_shards:
                failed_from_chunk = chunk.chunk_idx
                if not transient:
                    self._dropped.append(chunk.chunk_hash)
                break
            for pos, block_id in zip(chunk.block_positions, chunk.block_ids):
                s, slot = self.plan.shard_of_block(pos)
                rows = _as_rows(shard_payloads[s], layout.row_dtype).view(groups, bps, -1)
                src_parts.append(rows[:, slot:slot + 1])
                dst_ids.append(block_id)
        if src_parts:
            src = torch.cat(src_parts, dim=1)
            index = torch.tensor(dst_ids, dtype=torch.long)
            for g, rows in enumerate(self._rows):
                rows.index_copy_(0, index, src[g])
            self.last_loaded_block_ids.extend(dst_ids)
            self.stats["loaded_blocks"] += len(dst_ids)
            self.stats["loaded_tokens"] += len(dst_ids) * self.block_size
            self.stats["loaded_bytes"] += len(dst_ids) * layout.block_bytes
        if failed_from_chunk is not None:
            self._fail_from(req, failed_from_chunk)

    def _fail_from(self, req: RequestTransfer, chunk_idx: int) -> None:
        failed = [b for c in req.chunks if c.chunk_idx >= chunk_idx for b in c.block_ids]
        self._failed_block_ids.update(failed)
        self._failed_from_chunk[req.req_id] = chunk_idx
        self._failed_loads.append((req.req_id, chunk_idx))
        self.stats["failed_blocks"] += len(failed)

    def _drop(self, chunk_hash: ChunkHash) -> None:
        """Delete a chunk whose stored bytes proved bad, so its phantom is not offered again."""
        keys_by_shard = [(s, value_key(chunk_hash, s, self.tp_rank)) for s in range(self.plan.num_shards)]
        for s, key in keys_by_shard:
            try:
                self.backends[s].delete_many([key])
            except BackendError as exc:
                logger.warning("Range: could not delete bad value: %s", exc)

    def take_failed_block_ids(self) -> set[int]:
        """Return and forget the block ids that failed to load since the last call."""
        out, self._failed_block_ids = self._failed_block_ids, set()
        return out

    # ---------------------------------------------------------------- saves
    def save(self, meta: RangeConnectorMetadata) -> None:
        """Write this step's new full chunks: one value per (chunk, shard), one batched write per shard.

        A failed write is logged and counted, never raised: a lost save is only a future miss.
        """
        if not meta.saves or self.layout is None:
            return
        layout = self.layout
        for req in meta.saves:
            failed_from = self._failed_from_chunk.get(req.req_id)
            if failed_from is not None:
                kept = tuple(c for c in req.chunks if c.chunk_idx < failed_from)
                self.stats["saves_dropped_after_failed_load"] += len(req.chunks) - len(kept)
                if not kept:
                    continue
                req = RequestTransfer(req.req_id, kept, len(kept) * self.plan.blocks_per_chunk * self.block_size)
            block_ids = [b for c in req.chunks for b in c.block_ids]
            index = torch.tensor(block_ids, dtype=torch.long)
            # [num_row_groups, num_blocks_in_request, row_elems]: one gather per (layer, plane).
            gathered = torch.stack([rows.index_select(0, index) for rows in self._rows])
            items: dict[int, list[tuple[bytes, bytes]]] = defaultdict(list)
            for c_idx, chunk in enumerate(req.chunks):
                base = c_idx * self.plan.blocks_per_chunk
                for s in range(self.plan.num_shards):
                    positions = [base + p for p in self.plan.shard_blocks(s)]
                    part = gathered[:, positions].contiguous()
                    value = encode_value(part.view(torch.uint8).numpy().data, layout.num_row_groups)
                    items[s].append((value_key(chunk.chunk_hash, s, self.tp_rank), value))
            ok = True
            for s, shard_items in items.items():
                if time.monotonic() < self._save_down_until[s]:
                    ok = False
                    self.stats["saves_skipped"] += 1
                    continue
                try:
                    self.backends[s].put_many(shard_items)
                except (BackendError, ValueError) as exc:
                    ok = False
                    logger.warning("Range save of request %s failed: %s", req.req_id, exc)
                    self.stats["save_errors"] += 1
                    if isinstance(exc, BackendError):
                        self._save_down_until[s] = time.monotonic() + self.config.backend_retry_s
            if ok:
                self._saved.extend(c.chunk_hash for c in req.chunks)
                self.stats["saved_chunks"] += len(req.chunks)
                self.stats["saved_bytes"] += len(block_ids) * layout.block_bytes

    def build_worker_meta(self) -> RangeWorkerMetadata | None:
        """Saves completed and values dropped since the last call, for the scheduler's index."""
        dropped = list(self._dropped)
        for b in {id(b): b for b in self.backends}.values():
            if isinstance(b, MemoryBackend):
                evicted = b.take_evicted()
                dropped.extend(ChunkHash(bytes.fromhex(k.split(b":")[1].decode())) for k in evicted)
        if not self._saved and not dropped and not self._failed_loads:
            return None
        meta = RangeWorkerMetadata(saved=self._saved, dropped=dropped, failed_loads=self._failed_loads)
        self._saved, self._dropped, self._failed_loads = [], [], []
        return meta

    def close(self) -> None:
        """Release backend connections."""
        for b in {id(b): b for b in self.backends}.values():
            b.close()
