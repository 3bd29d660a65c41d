"""Small dataclasses that cross the scheduler/worker process boundary (no tensors).

Scheduler -> worker: :class:`RangeConnectorMetadata` (what to load into which blocks, what to save from which
blocks). Worker -> scheduler: :class:`RangeWorkerMetadata` (saves that completed, values that proved missing or
corrupt, values the worker's DRAM tier evicted), aggregated across workers by vLLM.

Plain dataclasses, no vLLM import: the connector hands them to vLLM inside its own carriers
(:mod:`range_connector.connector`), so the halves and their tests run without vLLM.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from range_connector.kv.namespace import ChunkHash
from range_connector.kv.tickets import Ticket


@dataclass(frozen=True, slots=True)
class ChunkTransfer:
    """One chunk of one request to load or save.

    Attributes:
        chunk_idx: position of the chunk in the request's chain.
        chunk_hash: its prefix hash.
        block_positions: positions (within the chunk, ``0 <= p < blocks_per_chunk``) of the blocks to move.
        block_ids: engine block ids, one per position.
        tickets: for loads, where each shard's slice lives: ``[num_groups * num_shards]`` tickets, group-major, as
            the scheduler sends them (one group per head slice: :mod:`range_connector.kv.heads`), ``[num_shards]``
            once cut to one rank's group (:func:`~range_connector.kv.heads.group_view`); empty for saves.
    """

    chunk_idx: int
    chunk_hash: ChunkHash
    block_positions: tuple[int, ...]
    block_ids: tuple[int, ...]
    tickets: tuple[Ticket, ...] = ()


@dataclass(frozen=True, slots=True)
class RequestTransfer:
    """All chunks of one request to load (or save) in this step.

    Attributes:
        req_id: vLLM's request id.
        chunks: chunk transfers in chain order.
        num_tokens: tokens covered (for loads: the promised external tokens).
        fail: report every block of this load as failed without reading (the scheduler could not plan it).
        mode: for loads, who delivers them: ``"pipelined"`` (layer by layer as attention asks, in this step),
            ``"async"`` (in the background; the request waits in ``WAITING_FOR_REMOTE_KVS``) or ``"sync"``
            (all before the forward; for comparison only).
        deadline_s: for loads the cost model planned, seconds the load may take: derived from its predicted time
            and bounded by what recomputing the tokens would cost (``None``: the config's ``load_deadline_s``).
        confirm: for saves, report the outcome of every chunk of this request (``RangeWorkerMetadata.save_results``):
            a disaggregated hand-off announces only the chunks every saving rank reported stored.
        failures_learnt_through: for saves, the latest step (:attr:`RangeConnectorMetadata.step_idx`) whose load
            failures of this request the scheduler had learnt when it planned the save (-1: none). A worker whose
            load of the request failed in a later step skips the chunks from the failed one on: they were computed
            on top of KV that never landed (with asynchronous scheduling, vLLM schedules and runs the next step
            before it processes the output that reports the failure).
        prefix_block_ids: for saves, the request's blocks before the first chunk saved (its KV was computed on
            top of them): a worker skips the save if one of them failed to load in a step whose report the
            scheduler had not processed (:attr:`RangeConnectorMetadata.reports_learnt_through`), so that a request
            that shares another's failed blocks through vLLM's prefix cache stores nothing computed on them.
        tiers: for saves in a tier hierarchy, the tiers to write (``None``: all; ``(0,)``: a promotion into DRAM of
            chunks loaded from a farther tier).
        computed_block_ids: for loads, blocks of the load that vLLM also writes into: the block that holds the
            first token it computes, when the hit ends inside that block (a stored tail: the whole prompt but its
            last token). vLLM writes that token's KV of layer ``l`` before attention asks for layer ``l``
            (``unified_kv_cache_update`` runs before ``wait_for_layer_load``), so a load must not verify such a
            block from the KV cache: it is staged, verified there, and copied in
            (:mod:`range_connector.worker.direct_receive`).
    """

    req_id: str
    chunks: tuple[ChunkTransfer, ...]
    num_tokens: int
    fail: bool = False
    mode: str = "pipelined"
    deadline_s: float | None = None
    confirm: bool = False
    failures_learnt_through: int = -1
    prefix_block_ids: tuple[int, ...] = ()
    tiers: tuple[int, ...] | None = None
    computed_block_ids: tuple[int, ...] = ()


@dataclass
class RangeConnectorMetadata:
    """Scheduler -> worker metadata of one engine step (``step_idx``: its place among the steps this scheduler
    built, from 0; ``reports_learnt_through``: the latest step whose worker report the scheduler had processed when
    it built this one, -1 for none; ``reset_generation``: how many times the connector's cache was reset, so that
    workers clear their in-process tier and drop the saves planned before a reset, before this step's work)."""

    loads: list[RequestTransfer] = field(default_factory=list)
    saves: list[RequestTransfer] = field(default_factory=list)
    #: ``[num_groups * num_shards]`` tickets of one stored chunk per probe of a refused tier
    #: (:mod:`range_connector.worker.probes`)
    probes: list[tuple[Ticket, ...]] = field(default_factory=list)
    step_idx: int = 0
    reports_learnt_through: int = -1
    reset_generation: int = 0


@dataclass
class RangeWorkerMetadata:
    """Worker -> scheduler metadata of one engine step.

    Attributes:
        saved: ``(chunk hash, ticket group, [num_shards] tickets)`` of chunks whose every shard was written by this
            worker (the group tells the DRAM tier's index whose stripes they are: :mod:`range_connector.kv.heads`).
        unsaved: with ``save_mode`` ``"async"``, chunk hashes whose background save by this worker ended without
            storing them on every shard (skipped, dropped or failed): the scheduler stops waiting for them
            (:mod:`range_connector.scheduler.saves_in_flight`). One entry per chunk per worker.
        dropped: chunk hashes found corrupt on load, or evicted from a worker's DRAM tier.
        loaded: requests whose load of this step finished (loaded or failed): their leases can go.
        failed_loads: ``(req_id, chunk_idx)``: the request's load failed from that chunk on; those chunks are
            recomputed and must be saved again.
        load_timings: ``(req_ids, bytes per shard, seconds, complete)`` of each finished load job: from its start
            until its last byte was in reach (``complete``), or until it ran out of its deadline with the planned
            bytes (not ``complete``: a lower bound on the tier's time), for the cost model's estimates of ``B`` and
            ``T0``.
        probe_timings: ``(bytes per shard, seconds, complete)`` of each background probe of a refused tier.
        save_results: ``(req_id, chunk_idx, stored)`` for every chunk of a save the scheduler asked to confirm
            (``RequestTransfer.confirm``), once this worker's write of it ended: ``stored`` is whether every shard
            of this worker holds the chunk. One entry per chunk per worker; aggregating keeps every worker's entries,
            so the scheduler can count the ranks that reported a chunk stored (a rank's ``False`` makes it unstored).
        step_idx: the step (:attr:`RangeConnectorMetadata.step_idx`) this report ends (-1: unknown): its
            ``failed_loads`` happened in it.
    """

    saved: list[tuple[ChunkHash, int, tuple[Ticket, ...]]] = field(default_factory=list)
    unsaved: list[ChunkHash] = field(default_factory=list)
    dropped: list[ChunkHash] = field(default_factory=list)
    failed_loads: list[tuple[str, int]] = field(default_factory=list)
    loaded: list[str] = field(default_factory=list)
    load_timings: list[tuple[tuple[str, ...], int, float, bool]] = field(default_factory=list)
    probe_timings: list[tuple[int, float, bool]] = field(default_factory=list)
    save_results: list[tuple[str, int, bool]] = field(default_factory=list)
    step_idx: int = -1

    def aggregate(self, other: RangeWorkerMetadata) -> RangeWorkerMetadata:
        """This worker's report merged with another worker's (vLLM aggregates them across workers).

        Raises:
            TypeError: ``other`` is not a :class:`RangeWorkerMetadata`.
        """
        if not isinstance(other, RangeWorkerMetadata):
            raise TypeError(f"cannot aggregate RangeWorkerMetadata with {type(other).__name__}")
        return RangeWorkerMetadata(saved=self.saved + other.saved, unsaved=self.unsaved + other.unsaved,
                                   dropped=self.dropped + other.dropped,
                                   failed_loads=self.failed_loads + other.failed_loads,
                                   loaded=sorted(set(self.loaded) | set(other.loaded)),
                                   load_timings=self.load_timings + other.load_timings,
                                   probe_timings=self.probe_timings + other.probe_timings,
                                   save_results=self.save_results + other.save_results,
                                   step_idx=max(self.step_idx, other.step_idx))
