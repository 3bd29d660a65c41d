"""Worker side of one context-parallel rank: what :class:`~range_connector.connector.RangeConnector` runs in each
worker hook when the engine has several writer ranks (PCP size P > 1, or DCP size D > 1).

:class:`PcpWorkerRouter` owns the rank's :class:`~range_connector.worker.facade.RangeWorker` (over the rank's
:class:`~range_connector.kv.sharding.RankSlice`: its own shards ``r, r + W, ...``, each on its own server) and its
:class:`~range_connector.worker.pcp.PcpExchange`, and routes each hook as the protocol in
:mod:`range_connector.worker.pcp` prescribes. The multi-process harness (``tests/pcp/rank_process.py``) drives this same
class, so the harness tests what the product runs. With one writer rank the connector does not build it (the plain
worker path is unchanged).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Mapping
from typing import Any

import torch

from range_connector.backends.base import Backend
from range_connector.config import RangeConfig
from range_connector.kv.metadata import RangeConnectorMetadata, RangeWorkerMetadata
from range_connector.kv.sharding import RankSlice, ShardPlan
from range_connector.worker.facade import RangeWorker
from range_connector.worker.pcp import LoadAgreement, PcpExchange

logger = logging.getLogger("vllm." + __name__)


def rank_view_config(view: RankSlice, config: RangeConfig, block_size: int) -> RangeConfig:
    """The config a rank's own worker runs with: ``S / W`` shards, chunks of the rank's blocks (``block_size``:
    physical), and the servers of the rank's shards only."""
    servers = config.tier.servers
    return dataclasses.replace(config, num_shards=view.plan.shards_per_writer,
                               chunk_tokens=view.local_plan.blocks_per_chunk * block_size).with_tier(
        servers=tuple(servers[s] for s in view.shard_idxs) if servers else ())


class PcpWorkerRouter:
    """One writer rank's worker hooks (module docstring). One owner: the rank's worker thread.

    Args:
        config: the resolved deployment config (all ``num_shards`` shards; ``chunk_tokens`` set).
        plan: the deployment's shard plan (``plan.num_writers`` > 1 in the product; 1 works too).
        rank: this rank's index among the writers (PCP rank, or DCP rank under DCP).
        group: the writers' ``torch.distributed`` process group (vLLM's ``cpu_group``): the collectives run on a
            gloo group of Range's own over its ranks, created here (:func:`range_connector.worker.pcp.range_group`,
            timeout: ``load_deadline_s`` plus ``collective_timeout_s``).
        block_size: tokens per physical engine block.
        layer_names: attention layers, in model order.
        num_blocks: blocks per layer tensor.
        backends: ``[S / W]`` this rank's backends, in :attr:`RankSlice.shard_idxs` order.
        tp_rank: tensor-parallel rank.
        collective_timeout_s: the most one collective waits (default the tier's ``timeout_s``); the
            agreement waits the time left to the load deadline plus this.
        heads: the rank's ``head_slice``, ``ticket_group`` and ``is_writer``, passed to its
            :class:`~range_connector.worker.facade.RangeWorker`.

    Raises:
        ValueError: the group does not match the plan, or ``backends`` is not one per shard of this rank.
    """

    def __init__(self, config: RangeConfig, plan: ShardPlan, rank: int, group: Any, block_size: int,
                 layer_names: tuple[str, ...], num_blocks: int, backends: list[Backend], *, tp_rank: int = 0,
                 collective_timeout_s: float | None = None, **heads: Any) -> None:
        self.rank = rank
        self.slice = RankSlice(plan, rank)
        if len(backends) != len(self.slice.shard_idxs):
            raise ValueError(f"rank {rank} serves shards {self.slice.shard_idxs}, got {len(backends)} backends")
        # The ranks agree on failures in start_load_kv, before the forward: the local load completes there.
        rank_config = dataclasses.replace(rank_view_config(self.slice, config, block_size), load_mode="sync")
        self.worker = RangeWorker(rank_config, block_size, layer_names, num_blocks, backends, tp_rank=tp_rank,
                                  shard_idxs=self.slice.shard_idxs, **heads)
        self.collective_timeout_s = config.tier.timeout_s if collective_timeout_s is None else collective_timeout_s
        self.load_deadline_s = config.load_deadline_s
        self.exchange = PcpExchange(plan, rank, group, self.collective_timeout_s,
                                    group_timeout_s=self.load_deadline_s + self.collective_timeout_s)
        self.num_blocks = num_blocks
        self._kv: dict[str, torch.Tensor] = {}
        #: set by start_load_kv, cleared by build_connector_worker_meta (the step's last hook): a forward that runs
        #: before this step's start_load_kv (vLLM starts non-synchronous loads after it) exchanges nothing
        self._agreed_this_step = False
        #: the last step's agreement, local failures and local load time (seconds), for inspection and tests
        self.last_agreement: LoadAgreement | None = None
        self.last_local_failed: set[int] = set()
        self.last_load_s = 0.0

    def register_kv_caches(self, kv_caches: Mapping[str, torch.Tensor]) -> None:
        """The engine's KV tensors (shapes: :func:`range_connector.kv.layout.block_rows`)."""
        self.worker.register_kv_caches(kv_caches)
        self._kv = dict(kv_caches)

    def start_load_kv(self, meta: RangeConnectorMetadata) -> LoadAgreement:
        """Load this rank's shards of the step's loads (synchronously, within ``load_deadline_s``), then agree with
        every rank on what failed (collective; issued on every step, with no collective when nothing loads)."""
        t0 = time.monotonic()
        try:
            self.worker.start_load(self.slice.metadata(meta))
            self.last_local_failed = self.worker.take_failed_block_ids()
        except Exception:  # every rank must still agree (a rank that skipped the collectives would stall the rest)
            logger.exception("Range PCP rank %d: the local load failed; its blocks are reported failed", self.rank)
            self.last_local_failed = {b for r in meta.loads for c in r.chunks for b in c.block_ids}
        self.last_load_s = time.monotonic() - t0
        # Wait for a rank still inside its deadline-bounded load, then one collective timeout more.
        agree_s = max(0.0, self.load_deadline_s - (time.monotonic() - t0)) + self.collective_timeout_s
        self.last_agreement = self.exchange.agree(meta.loads, self.last_local_failed, timeout_s=agree_s)
        self._agreed_this_step = True
        return self.last_agreement

    def wait_for_layer_load(self, layer_name: str) -> int:
        """Exchange the agreed slices of this layer (collective on every rank when the step loads; returns the
        blocks written here)."""
        self.worker.wait_for_layer(layer_name)
        kv = self._kv.get(layer_name)
        if not self._agreed_this_step or kv is None:
            return 0
        return self.exchange.exchange_layer(kv, self.num_blocks)

    def wait_for_save(self, meta: RangeConnectorMetadata) -> None:
        """Save this rank's shards of the step's new chunks, except those computed on top of an agreed failure."""
        self.worker.save(self.exchange.without_failed_saves(self.slice.metadata(meta)))

    def get_finished(self, finished_req_ids: set[str]) -> set[str]:
        return self.worker.get_finished(finished_req_ids)

    def get_block_ids_with_load_errors(self) -> set[int]:
        """The agreed failed blocks (the same on every rank unless a collective failed)."""
        late = self.worker.take_failed_block_ids()  # empty with synchronous loads: they failed before agreeing
        return (self.exchange.failed_block_ids() if self._agreed_this_step else set()) | late

    def build_connector_worker_meta(self) -> RangeWorkerMetadata | None:
        """The worker's metadata with the agreed failed loads; ends the step."""
        meta = self.worker.build_worker_meta()
        if self._agreed_this_step:
            meta = self.exchange.worker_metadata(meta)
            if meta is not None and meta.step_idx < 0:  # (a report made of the other ranks' failures only)
                meta = dataclasses.replace(meta, step_idx=self.worker.step_idx)
        self._agreed_this_step = False
        return meta

    def close(self) -> None:
        self.worker.close()
