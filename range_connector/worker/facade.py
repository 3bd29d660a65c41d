"""Worker side: load promised chunks into the destination blocks, save new full chunks, report load errors.

Runs in each vLLM worker process, next to the KV tensors. Loads are load jobs (:mod:`range_connector.worker.loads`):
layer group by layer group through the transfer banks (:mod:`range_connector.worker.banks`), or straight from stripes
that the in-process DRAM tier lends. The step's pipelined loads are delivered layer by layer as attention asks
(``wait_for_layer_load``); asynchronous loads by a background thread while the engine runs other requests, and
reported through ``get_finished``. A step's saves become, per shard, one stripe write, inside ``wait_for_save``
(after the forward, from blocks the step owns: preemption and block reuse cannot mix foreign KV into a stripe).
The number of round trips, reads and copies follows shards, stripes, layers and bytes, never chunks
(docs/architecture.md, principle 1).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait

import torch

from range_connector.backends.base import Backend
from range_connector.backends.tiered import TieredBackend, leaf_backends
from range_connector.metrics import tier_key
from range_connector.config import RangeConfig
from range_connector.errors import BackendError
from range_connector.kv.heads import HeadSlice
from range_connector.kv.layout import KVLayout, block_rows
from range_connector.kv.metadata import RangeConnectorMetadata, RangeWorkerMetadata, RequestTransfer
from range_connector.kv.namespace import ChunkHash
from range_connector.kv.sharding import ShardPlan
from range_connector.kv.tickets import Ticket, head_keys, key_chunk_hash, ticket_key
from range_connector.worker.banks import BankPool, BankReader
from range_connector.worker.context import LoadContext
from range_connector.worker.counters import Counters
from range_connector.worker.device import CopyDevice, HostDevice, device_for
from range_connector.worker.device_reads import prepare_device_reads
from range_connector.worker.loads import ASYNC, PIPELINED, SYNC, LoadJob
from range_connector.worker.observe import count_tier_bytes, observe_first_layer
from range_connector.worker.probes import probe_chunk
from range_connector.worker.reassembly import has_pieces, reassemble
from range_connector.worker.saves import StripeSaver, follow_tier_reset

logger = logging.getLogger("vllm." + __name__)

#: how long ``get_finished`` lets asynchronous loads run before it looks at them (seconds, once per step)
_ASYNC_POLL_S = 0.002


class RangeWorker:
    """Worker half of the connector.

    Args:
        config: resolved config.
        block_size: engine block size in tokens.
        layer_names: attention layers served, in model order.
        num_blocks: blocks per layer tensor.
        backends: ``[num_shards]`` backends.
        tp_rank: tensor-parallel rank (rank 0 runs the background probes of a refused tier).
        shard_idxs: ``[len(backends)]`` the global shard index of each backend, used in ticket keys (a PCP rank's
            worker serves shards ``r, r + P, ...``: :class:`~range_connector.kv.sharding.RankSlice`); default
            ``0 .. len(backends) - 1``.
        head_slice: the KV heads this rank's cache holds (:mod:`range_connector.kv.heads`): its tickets cover them
            and are published under one key per head; a ticket for other heads does not fit.
        ticket_group: this rank's ticket group (reported with its saves, so that the DRAM tier's index knows which
            rank's stripes it learns).
        is_writer: the rank saves (false on a rank whose heads another rank of its ticket group writes: vLLM
            replicates KV heads when the tensor-parallel size exceeds them, and MLA's latent row on every rank).
    """

    def __init__(self, config: RangeConfig, block_size: int, layer_names: tuple[str, ...], num_blocks: int,
                 backends: list[Backend], tp_rank: int = 0, shard_idxs: tuple[int, ...] | None = None, *,
                 head_slice: HeadSlice = HeadSlice(0, 1), ticket_group: int = 0, is_writer: bool = True) -> None:
        assert config.chunk_tokens is not None
        self.config = config
        self.block_size = block_size
        self.layer_names = layer_names
        self.num_blocks = num_blocks
        self.plan = ShardPlan(config.chunk_tokens // block_size, config.num_shards)
        self.backends = backends
        #: DRAM tiers that keep evicted stripes readable until the scheduler has learnt of the eviction
        self._dram_tiers = [b for b in {id(b): b for b in leaf_backends(backends)}.values()
                            if hasattr(b, "free_retired")]
        self.tp_rank = tp_rank
        self.head_slice = head_slice
        self.ticket_group = ticket_group
        self.is_writer = is_writer
        self.shard_idxs = tuple(range(len(backends))) if shard_idxs is None else tuple(shard_idxs)
        if len(self.shard_idxs) != len(backends):
            raise ValueError(f"shard_idxs {self.shard_idxs} does not name one shard per backend ({len(backends)})")
        self.layout: KVLayout | None = None
        #: what load jobs use of this worker (built by register_kv_caches)
        self.load_context: LoadContext | None = None
        self._rows: list[torch.Tensor] = []
        self._layer_index = {name: i for i, name in enumerate(layer_names)}
        #: transfer banks, their reader thread, and the helper thread that verifies lent stripes (used by LoadJob)
        self.banks = BankPool(config.num_banks)
        self.reader = BankReader()
        self.verifier = ThreadPoolExecutor(max_workers=1, thread_name_prefix="range-verify")
        self._async_loader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="range-async-load")
        #: reads the shards of one bank fill at the same time (each shard is its own server)
        self.shard_readers = ThreadPoolExecutor(max_workers=max(1, len(backends)), thread_name_prefix="range-shard")
        #: background probes of a refused tier (:mod:`range_connector.worker.probes`), one at a time
        self._prober = ThreadPoolExecutor(max_workers=1, thread_name_prefix="range-probe")
        self._probe_timings: list[tuple[int, float, bool]] = []  # appended by the prober thread
        self.device: CopyDevice = HostDevice()  # the device seam (CUDA: copy stream, events): register_kv_caches
        #: layer -> event of the step load's last copy into it (CUDA; attention's stream waits on it)
        self.layer_events: dict[str, object] = {}
        #: deliver pipelined loads before the forward (attention does not call wait_for_layer_load)
        self.deliver_before_forward = False
        self._warned_unwaited = False
        self._step_job: LoadJob | None = None
        self._async_jobs: dict[str, tuple[LoadJob, Future]] = {}
        self._reassembled_async: set[str] = set()
        #: per finished load job: mode and per-layer timestamps (ready, delivered, waited for by attention)
        self.load_timelines: list[dict] = []
        self._failed_block_ids: set[int] = set()
        self._dropped: list[ChunkHash] = []  # appended by load jobs on the step and asynchronous-load threads
        self._dropped_lock = threading.Lock()
        self._loaded_reqs: list[str] = []
        #: req_id -> ``(step, chunk_idx)`` of each load of it that failed here: a save planned before the scheduler
        #: learnt of a failure (RequestTransfer.failures_learnt_through) skips the chunks from the failed one on
        self._failures: dict[str, list[tuple[int, int]]] = {}
        #: block id -> the step in which a load into it failed here, until the scheduler has processed that step's
        #: report (RangeConnectorMetadata.reports_learnt_through): a save computed on top of it is skipped
        self._failed_blocks_at: dict[int, int] = {}
        #: the step of the metadata last started (RangeConnectorMetadata.step_idx)
        self.step_idx = -1
        self._failed_loads: list[tuple[str, int]] = []
        self._load_timings: list[tuple[tuple[str, ...], int, float, bool]] = []
        #: block ids written by loads since :meth:`take_loaded_block_log` last ran (for inspection and tests).
        self.loaded_block_log: list[int] = []
        #: ``(shard_idx, ticket key)`` of the chunks that step read.
        self.last_loaded_tickets: list[tuple[int, bytes]] = []
        self.stats = Counters()
        #: writes this worker's saves (:mod:`range_connector.worker.saves`)
        self.saver = StripeSaver(config, self.plan, backends, self.shard_idxs, self.stats, head_slice=head_slice,
                                 ticket_group=ticket_group)
        #: the scheduler's resets this worker followed (RangeConnectorMetadata.reset_generation)
        self.reset_generation = 0

    def follow_reset(self, meta: RangeConnectorMetadata) -> None:
        """Before a step's work: if the scheduler reset the connector's cache since the last step, clear the
        in-process tier (the scheduler cleared the shared ones and its own index of this one) and drop the saves
        gathered before the reset. Never raises."""
        if meta.reset_generation <= self.reset_generation:
            return
        self.reset_generation = meta.reset_generation
        self.saver.reset(meta.reset_generation)
        follow_tier_reset(self.backends)
        self.stats.add("resets")

    def register_kv_caches(self, kv_caches: Mapping[str, torch.Tensor], *, device: CopyDevice | None = None,
                           compat_device_reads: bool = False) -> None:
        """View the engine's KV tensors as rows (see :func:`range_connector.kv.layout.block_rows`) and build the
        device seam once (``device``, default :func:`~range_connector.worker.device.device_for` the tensors: on
        CUDA a copy stream of its own and pinned banks); on CUDA, probe the file tier's GPUDirect reads and log the
        outcome (:func:`~range_connector.worker.device_reads.prepare_device_reads`; ``compat_device_reads``: read
        into device memory in kvikio's compatibility mode too)."""
        self.layout, self._rows = block_rows(kv_caches, self.layer_names, self.num_blocks, self.head_slice.count)
        self.device = device_for(self._rows) if device is None else device
        self.banks = BankPool(self.config.num_banks, device=self.device)
        device_banks = prepare_device_reads(self.backends, self.device, self.config, allow_compat=compat_device_reads)
        self.load_context = LoadContext(
            config=self.config, layout=self.layout, layer_names=self.layer_names, plan=self.plan,
            backends=self.backends, rows=self._rows, banks=self.banks, reader=self.reader, verifier=self.verifier,
            shard_readers=self.shard_readers, stats=self.stats, layer_events=self.layer_events, drop=self.drop,
            device=self.device, heads=(self.head_slice.start, self.head_slice.count), device_banks=device_banks)
        logger.info("Range worker: %d layers x %d planes, %d bytes per block row, %d blocks",
                    len(self.layer_names), self.layout.num_planes, self.layout.row_bytes, self.num_blocks)

    # ---------------------------------------------------------------- loads
    def start_load(self, meta: RangeConnectorMetadata) -> None:
        """Start this step's loads, within ``load_deadline_s`` (each request's ``mode`` says who delivers).

        Pipelined and synchronous loads form the step's job: synchronous ones (and every load when layers cannot
        be handed to attention one by one) are delivered here, pipelined ones by :meth:`wait_for_layer`.
        Asynchronous loads get a job each, delivered by a background thread and reported by
        :meth:`get_finished`. Blocks whose bytes are missing, corrupt, late or unreadable are reported through
        :meth:`take_failed_block_ids` (vLLM recomputes them). Never raises for a tier failure.
        """
        self._finish_step_job()
        self.follow_reset(meta)
        self.step_idx = meta.step_idx
        for b in self._dram_tiers:  # evictions the scheduler has learnt: no load planned from now on reads them
            b.free_retired(meta.reports_learnt_through)
        if meta.probes and self.tp_rank == 0:  # (one rank probes: the timing is the tier's)
            for tickets in meta.probes:
                self._prober.submit(self._probe, tickets)
        if not meta.loads or self.layout is None:
            return
        now = time.monotonic()
        self.last_loaded_tickets = []
        loads = [r for r in meta.loads if not has_pieces(r)]
        pieces = [r for r in meta.loads if has_pieces(r)]
        if pieces:  # stored by writers of other head slices: assembled head by head, before the forward
            failed_from, done = reassemble(self.load_context, pieces, now + self._deadline_s(pieces))
            self._finish_load(pieces, failed_from, done)
            self._loaded_reqs.extend(r.req_id for r in pieces)
            self._reassembled_async.update(r.req_id for r in pieces if r.mode == ASYNC)
        step = [r for r in loads if r.mode != ASYNC]
        for req in loads:
            if req.mode == ASYNC:
                job = LoadJob(self.load_context, [req], now + self._deadline_s([req]), ASYNC)
                job.start()
                self._async_jobs[req.req_id] = (job, self._async_loader.submit(self._deliver_async, job))
        if step:
            sync = any(r.mode == SYNC for r in step) or self.deliver_before_forward or self.config.load_mode == SYNC
            job = LoadJob(self.load_context, step, now + self._deadline_s(step), SYNC if sync else PIPELINED)
            job.start()
            self._step_job = job
            if sync:  # (attention's stream then waits for every layer's copies: no host synchronisation)
                job.deliver_through(len(self.layer_names) - 1)
                self.device.wait_current([self.layer_events.pop(n) for n in list(self.layer_events)])

    def _probe(self, tickets: tuple[Ticket, ...]) -> None:
        if not all(self.load_context.ticket_fits(t) for t in tickets):
            return
        timing = probe_chunk(self.backends, tickets, self.shard_readers)
        self.stats.add("probes")
        if timing is not None:
            self._probe_timings.append(timing)  # (list.append is atomic; drained by build_worker_meta)

    def _deadline_s(self, reqs: list[RequestTransfer]) -> float:
        """Seconds the loads may take: the longest deadline the cost model gave them, else ``load_deadline_s``."""
        planned = [r.deadline_s for r in reqs if r.deadline_s is not None]
        return min(self.config.load_deadline_s, max(planned)) if len(planned) == len(reqs) else \
            self.config.load_deadline_s

    def wait_for_layer(self, layer_name: str) -> None:
        """Return when this layer's loaded blocks of the step have landed (or failed: then they are reported).

        Pipelined loads deliver the layer groups up to this layer here; on CUDA the current stream then waits for
        the layer's copy event."""
        job = self._step_job
        layer_idx = self._layer_index.get(layer_name)
        if job is not None and layer_idx is not None and not job.finished:
            if job.layer_waited_s[layer_idx] is None:
                job.layer_waited_s[layer_idx] = time.monotonic()
            job.deliver_through(layer_idx)
        self.device.wait_current([self.layer_events.pop(layer_name, None)])

    def _deliver_async(self, job: LoadJob) -> None:
        try:
            job.deliver_through(len(self.layer_names) - 1)
        except Exception:  # reported as a failed load, never raised into the engine
            logger.exception("Range asynchronous load failed")
            job.cancel()
            job.fail_all()
        finally:  # (what it queued lands before the load counts as done, failed too: a host wait on this thread)
            job.fence()

    def _finish_step_job(self) -> None:
        """Settle the step's pipelined/synchronous job after the forward (idempotent within a step).

        A pipelined layer that attention never waited for was read before it landed (a platform whose attention
        does not call the connector's per-layer hooks): every block of the job is then reported, so vLLM
        recomputes the step instead of keeping what it computed on missing KV."""
        job, self._step_job = self._step_job, None
        if job is None:
            return
        if job.mode == PIPELINED and job.segments and not job.closed:
            unwaited = [i for i, t in enumerate(job.layer_delivered_s) if t is None]
            if unwaited:
                self.stats.add("layers_read_before_load", len(unwaited))
                if not self._warned_unwaited:
                    self._warned_unwaited = True
                    logger.warning("Range: attention read %d layer(s) before their pipelined load landed "
                                   "(wait_for_layer_load not called); those loads are recomputed", len(unwaited))
                job.cancel()
                job.fail_all()
        job.finish()  # (copies never waited for: later work on attention's stream waits for them)
        self.device.wait_current([self.layer_events.pop(n) for n in list(self.layer_events)])
        self._record_job(job)

    def _record_job(self, job: LoadJob) -> None:
        self._finish_load(job.reqs, dict(job.failed_from), job.done)  # (a copy: an overrunning thread may still add)
        observe_first_layer(self.stats, job, [t.type for t in self.config.tiers])
        ready = [t for t in job.layer_ready_s if t is not None]
        num_blocks = sum(len(dst) for _h, _s, dst in job.done)
        req_ids = tuple(r.req_id for r in job.reqs)
        if ready and num_blocks and not job.failed_from and self.layout is not None:
            per_shard = num_blocks * self.layout.block_bytes // max(1, self.plan.num_shards)
            self._load_timings.append((req_ids, per_shard, max(ready) - job.started_s, True))
        elif job.deadline_missed and self.layout is not None:  # how long the tier took at least, for the gate
            planned = sum(len(c.block_ids) for r in job.reqs for c in r.chunks)
            per_shard = planned * self.layout.block_bytes // max(1, self.plan.num_shards)
            self._load_timings.append((req_ids, per_shard, time.monotonic() - job.started_s, False))
        self._loaded_reqs.extend(r.req_id for r in job.reqs)
        self.load_timelines.append({
            "mode": job.mode, "started_s": job.started_s, "layer_ready_s": list(job.layer_ready_s),
            "layer_delivered_s": list(job.layer_delivered_s), "layer_waited_s": list(job.layer_waited_s),
            "num_groups": len(getattr(job, "groups", ())), "failed": dict(job.failed_from)})
        del self.load_timelines[:-64]

    def get_finished(self, finished_req_ids: set[str]) -> set[str]:
        """Asynchronous loads that ended (loaded, failed, past their deadline, or aborted by vLLM).

        Args:
            finished_req_ids: requests vLLM finished (e.g. aborted) since the last call: their loads stop writing
                at once and are reported here, so vLLM can free their blocks.

        Returns:
            Request ids to report in ``finished_recving``; their failed blocks are in
            :meth:`take_failed_block_ids` in the same step.
        """
        self._finish_step_job()
        for req_id in finished_req_ids:
            self._failures.pop(req_id, None)
        out = set(self._reassembled_async)  # asynchronous loads that were assembled from pieces in start_load
        self._reassembled_async.clear()
        if self._async_jobs:
            # Yield the GIL for a moment: between steps vLLM's worker loop polls its message queue, and a busy
            # loop would starve the threads that read and copy the asynchronous loads.
            wait([fut for _job, fut in self._async_jobs.values()], timeout=_ASYNC_POLL_S, return_when=FIRST_COMPLETED)
        now = time.monotonic()
        for req_id, (job, fut) in list(self._async_jobs.items()):
            if req_id in finished_req_ids and not fut.done():
                job.cancel()  # aborted: stop writing into blocks vLLM is about to free, and fence what was queued
                job.fence()
                self.stats.add("loads_aborted")
                self._loaded_reqs.append(req_id)
            elif fut.done():
                job.finish()
                self._record_job(job)
            elif now > job.deadline + self.config.tier.timeout_s:
                job.cancel()  # the delivery thread overran its deadline: nothing more is written
                job.fence()
                job.deadline_missed = True
                self.stats.add("load_deadline_misses")
                job.fail_all()
                job.finished = True
                self._record_job(job)
            else:
                continue
            del self._async_jobs[req_id]
            out.add(req_id)
        return out

    @property
    def num_loads_in_flight(self) -> int:
        """Asynchronous loads not yet reported (0 when idle)."""
        return len(self._async_jobs)

    def _finish_load(self, reqs: list[RequestTransfer], failed_from: dict[str, int],
                     done: list[tuple[ChunkHash, list[int], list[int]]]) -> None:
        """Record finished loads: ``done`` = (chunk hash, shards, block ids written) of each chunk that landed whole;
        requests in ``failed_from`` fail from that chunk on (reported to vLLM, which recomputes)."""
        layout = self.layout
        assert layout is not None
        loaded = 0
        for chunk_hash, shards, dst_ids in done:
            loaded += len(dst_ids)
            self.loaded_block_log.extend(dst_ids)
            self.last_loaded_tickets.extend((s, ticket_key(chunk_hash, self.shard_idxs[s], self.head_slice.start))
                                            for s in shards)
        for req in reqs:
            if req.req_id in failed_from:
                self._fail_from(req, failed_from[req.req_id])
        self.stats.add("loaded_blocks", loaded)  # tokens are counted once per engine, by the scheduler (LoadTally)
        self.stats.add("loaded_bytes", loaded * layout.block_bytes)
        count_tier_bytes(self.stats, [t.type for t in self.config.tiers], reqs, done, layout.block_bytes)

    def kv_rows(self, layer_idx: int, plane_idx: int) -> torch.Tensor:
        """``[num_blocks, row]`` view of one plane of one layer of the KV cache (after ``register_kv_caches``)."""
        return self.load_context.kv_rows(layer_idx, plane_idx)

    def drop(self, chunk_hash: ChunkHash, shard_idx: int) -> None:
        """Forget a chunk whose bytes proved bad or gone, so that it is not offered again."""
        with self._dropped_lock:
            self._dropped.append(chunk_hash)
        try:
            self.backends[shard_idx].delete_tickets(head_keys(chunk_hash, self.shard_idxs[shard_idx],
                                                              self.head_slice.heads))
        except BackendError as exc:
            logger.warning("Range: could not delete a bad ticket: %s", exc)

    def _fail_from(self, req: RequestTransfer, chunk_idx: int) -> None:
        failed = [b for c in req.chunks if c.chunk_idx >= chunk_idx for b in c.block_ids]
        self._failed_block_ids.update(failed)
        self._failures.setdefault(req.req_id, []).append((self.step_idx, chunk_idx))
        self._failed_blocks_at.update((b, self.step_idx) for b in failed)
        self._failed_loads.append((req.req_id, chunk_idx))
        self.stats.add("failed_blocks", len(failed))

    def take_loaded_block_log(self) -> list[int]:
        """Return and forget the block ids loaded since the last call (chain order within each step)."""
        out, self.loaded_block_log = self.loaded_block_log, []
        return out

    def take_failed_block_ids(self) -> set[int]:
        """Return and forget the block ids that failed to load since the last call (the step's pipelined loads are
        settled first)."""
        self._finish_step_job()
        out, self._failed_block_ids = self._failed_block_ids, set()
        return out

    # ---------------------------------------------------------------- saves
    def save(self, meta: RangeConnectorMetadata) -> None:
        """Write this step's new full chunks as one stripe per shard (split at the tier's value limit).

        The chunks are gathered out of the KV cache here, in the step (vLLM may reuse the blocks afterwards). With
        ``save_mode`` ``"sync"`` they are written before this returns; with ``"async"`` a background thread writes
        them (at most ``save_backlog_bytes`` gathered and unwritten; past it the save is skipped, except that an empty
        backlog takes any one save) and they are reported to the scheduler with the step after the write. A failed
        or skipped write is counted, never raised: a lost save is only a future miss. The step's pipelined loads are
        settled first (a chunk computed on top of a failed load is not saved). Every chunk of a save marked
        ``confirm`` is reported, stored or not, in ``RangeWorkerMetadata.save_results`` (in this step's report with
        ``"sync"``, in the report of the step after its write with ``"async"``); with ``"async"``, every chunk whose
        write ended unstored is also reported in ``RangeWorkerMetadata.unsaved``, for the scheduler's record of
        saves in flight.
        """
        self._finish_step_job()
        self.follow_reset(meta)
        if not meta.saves or not self.is_writer:  # (a replica's heads are written by its ticket group's writer)
            return
        if self.layout is None:  # no KV cache registered: nothing can be stored
            self.saver.report([(r.req_id, c.chunk_idx) for r in meta.saves if r.confirm for c in r.chunks], False,
                              [c.chunk_hash for r in meta.saves for c in r.chunks])
            return
        #: (the tiers a save goes to (``None``: all), confirmed) -> ((chunk_hash, block ids of the whole chunk), who
        #: waits for each chunk's outcome); confirmed saves apart, as the saver writes them in the step
        by_tiers: dict[tuple[tuple[int, ...] | None, bool], tuple[list, list[tuple[str, int] | None]]] = {}
        dropped: list[tuple[str, int] | None] = []
        dropped_hashes: list[ChunkHash] = []
        # Blocks whose load failed in a step the scheduler had not heard of when it planned these saves: KV computed
        # on top of them (by their request, or by another that shares them through vLLM's prefix cache) is wrong.
        known = meta.reports_learnt_through
        self._failed_blocks_at = {b: step for b, step in self._failed_blocks_at.items() if step > known}
        bad_blocks = self._failed_blocks_at.keys()
        for req in meta.saves:
            unknown = [c for step, c in self._failures.get(req.req_id, ()) if step > req.failures_learnt_through]
            failed_from = min(unknown) if unknown else None
            if bad_blocks and not bad_blocks.isdisjoint(req.prefix_block_ids):
                failed_from = -1
            for c in req.chunks:
                owner = (req.req_id, c.chunk_idx) if req.confirm else None
                target = by_tiers.setdefault((req.tiers, req.confirm), ([], []))
                if bad_blocks and failed_from is None and not bad_blocks.isdisjoint(c.block_ids):
                    failed_from = c.chunk_idx
                if failed_from is not None and c.chunk_idx >= failed_from:
                    self.stats.add("saves_dropped_after_failed_load")
                    dropped.append(owner)
                    dropped_hashes.append(c.chunk_hash)
                    continue
                target[0].append((c.chunk_hash, c.block_ids))
                target[1].append(owner)
        self.saver.report(dropped, False, dropped_hashes)
        for (tiers, _confirm), (chunks, owners) in by_tiers.items():  # (a promotion writes the DRAM tier only)
            if chunks:
                self.saver.save(chunks, self.load_context, owners, tiers=tiers)

    def wait_for_saves(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for the background writes of ``save_mode`` ``"async"`` (and, in a tier
        hierarchy, for the copies to the far tiers); whether all ended."""
        deadline = time.monotonic() + timeout_s
        if not self.saver.wait(timeout_s):
            return False
        return all(b.wait_far_writes(max(0.0, deadline - time.monotonic())) for b in self.backends
                   if isinstance(b, TieredBackend))

    # ---------------------------------------------------------------- to the scheduler
    def build_worker_meta(self) -> RangeWorkerMetadata | None:
        """Saves completed (and the outcomes of confirmed ones), loads finished, and chunks dropped since the last
        call; ``None`` when there is nothing to report."""
        with self._dropped_lock:
            dropped, self._dropped = self._dropped, []
        demoted = set().union(*(b.take_demoted() for b in self.backends if isinstance(b, TieredBackend)))
        if demoted:  # (distinct chunks, as evictions are counted)
            self.stats.add(tier_key("demoted_chunks", "memory"), len(demoted))
        tier_types = [t.type for t in self.config.tiers]
        for b in self.backends:
            if isinstance(b, TieredBackend):
                for tier_idx, n in b.take_far_copies_skipped().items():
                    if 0 <= tier_idx < len(tier_types):
                        self.stats.add(tier_key("far_copies_skipped", tier_types[tier_idx]), n)
        for b in leaf_backends(self.backends):
            take_evicted = getattr(b, "take_evicted", None)  # the DRAM tier (also behind a latency wrapper)
            if take_evicted is not None:
                evicted = list(dict.fromkeys(h for h in map(key_chunk_hash, take_evicted(stamp=self.step_idx))
                                             if h is not None))
                if evicted:
                    self.stats.add(tier_key("evicted_chunks", "memory"), len(evicted))
                dropped += evicted
        probe_timings = [self._probe_timings.pop(0) for _ in range(len(self._probe_timings))]
        if not (self.saver.has_saved() or dropped or self._failed_loads or self._loaded_reqs or self._load_timings
                or probe_timings):
            return None
        saved = self.saver.take_saved()
        meta = RangeWorkerMetadata(step_idx=self.step_idx, saved=saved, unsaved=self.saver.take_unsaved(),
                                   dropped=dropped,
                                   failed_loads=self._failed_loads,
                                   loaded=self._loaded_reqs, load_timings=self._load_timings,
                                   probe_timings=probe_timings, save_results=self.saver.take_results())
        self._failed_loads, self._loaded_reqs = [], []
        self._load_timings = []
        return meta

    def close(self) -> None:
        """Release backend connections and the bank reader."""
        self._finish_step_job()
        for job, _fut in self._async_jobs.values():
            job.cancel()
            job.fence()
        self._async_jobs.clear()
        self.reader.close()
        self.verifier.shutdown(wait=False)
        self._async_loader.shutdown(wait=False)
        self._prober.shutdown(wait=False)
        if not self.wait_for_saves(self.config.tier.timeout_s):  # (written before the backends close)
            logger.warning("Range: background saves still running at shutdown are abandoned")
        self.saver.close()
        self.shard_readers.shutdown(wait=False)
        for b in {id(b): b for b in self.backends}.values():
            b.close()
