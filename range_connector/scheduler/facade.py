"""Scheduler side: the facade vLLM's scheduler calls (engine-core process, no tensors).

``get_num_new_matched_tokens`` may be called several times for one request, so it only records the latest lookup
(:class:`~range_connector.scheduler.planning.LookupResult`); the load is planned once vLLM commits to it in
``update_state_after_alloc``. Saves cover the new full chunks of each prompt once their tokens are computed
(``build_connector_meta``). The parts, each with its own state: :mod:`~range_connector.scheduler.lookup` (where
chunks are stored, and the DRAM tier's index), :mod:`~range_connector.scheduler.admission` (the cost gate and
background probes), :mod:`~range_connector.scheduler.leases`, :mod:`~range_connector.scheduler.planning` (request
state, load and save plans) and :mod:`~range_connector.scheduler.handoff` (disaggregated prefill).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from range_connector.backends.base import Backend
from range_connector.config import RangeConfig
from range_connector.cost.calibration_file import load_calibration
from range_connector.cost.gate import CostGate
from range_connector.cost.model import layout_bytes_per_token
from range_connector.kv.heads import HeadSlice
from range_connector.kv.metadata import (
    ChunkTransfer,
    RangeConnectorMetadata,
    RangeWorkerMetadata,
    RequestTransfer,
)
from range_connector.kv.namespace import (
    ChunkHash,
    prefix_hash_chain,
    request_salt,
    tail_chunk_hash,
)
from range_connector.kv.sharding import ShardPlan
from range_connector.metrics import LoadTally, tokens_per_chunk
from range_connector.scheduler.admission import Admission
from range_connector.scheduler.handoff import Handoff
from range_connector.scheduler.leases import LeaseBook
from range_connector.scheduler.planning import (
    LookupResult,
    RequestState,
    computed_block_ids,
    failed_load,
    lookup_hit,
    plan_load,
    plan_save,
    redo_from,
    scheduled_progress,
    unread_lookup,
)
from range_connector.scheduler.request_input import RequestInputs
from range_connector.scheduler.saves_in_flight import SavesInFlight
from range_connector.scheduler.tiers import Promotions, entry_tier, make_lookup, tier_runs

if TYPE_CHECKING:
    from range_connector.scheduler.engine_view import EngineRequest, StepSchedule

logger = logging.getLogger("vllm." + __name__)


class RangeScheduler:
    """Scheduler half of the connector.

    Args:
        config: resolved config (``chunk_tokens`` set).
        namespace: the namespace fingerprint.
        block_size: engine block size in tokens.
        lookup_backends: ``[num_shards]`` backends to ask for stored prefixes, or ``None`` when the tier's index
            lives here (the in-process DRAM tier, whose bytes are in the worker).
        num_layers: attention layers (tickets must match).
        layer_block_bytes: bytes of one block of one layer (tickets must match).
        can_load: the role loads (``kv_both``/``kv_consumer``).
        can_save: the role saves (``kv_both``/``kv_producer``).
        settings: the settings a producer and a consumer must share (sent in ``kv_transfer_params``).
        plan: the deployment's shard plan (context-parallel sizes; default: ``num_shards`` shards, one writer).
        groups: ``[num_groups]`` the head slice of each ticket group (:mod:`range_connector.kv.heads`; default one
            group holding every head): lookups need every group, and each load carries every group's tickets.
        num_saving_ranks: workers that each save and report their own slice of every chunk (tensor-parallel ranks):
            a producer announces a chunk only once that many reported it stored
            (:class:`~range_connector.scheduler.handoff.Handoff`).

    Raises:
        ValueError: ``num_saving_ranks`` is less than 1.
    """

    def __init__(self, config: RangeConfig, namespace: bytes, block_size: int,
                 lookup_backends: list[Backend] | None, *, can_load: bool, can_save: bool,
                 num_layers: int = 0, layer_block_bytes: int = 0, settings: dict[str, Any] | None = None,
                 plan: ShardPlan | None = None, groups: Sequence[HeadSlice] = (HeadSlice(0, 1),),
                 num_saving_ranks: int = 1) -> None:
        assert config.chunk_tokens is not None
        self.config = config
        self.namespace = namespace
        self.block_size = block_size
        self.chunk_tokens = config.chunk_tokens
        self.plan = plan or ShardPlan(self.chunk_tokens // block_size, config.num_shards)
        self.can_load = can_load
        self.can_save = can_save
        #: what a consumer must share with a producer (namespace and the settings behind it), sent in
        #: ``kv_transfer_params`` so that mismatches are named, never silently mixed
        self.settings = {"namespace": namespace.hex(), **(settings or {})}
        #: a pure producer (prefill engine) also stores each prompt's partial last chunk, so that the decode engine
        #: loads all of the prompt but the last token
        self.save_tail = can_save and not can_load
        self.stats: dict[str, int] = {"lookups": 0, "lookup_errors": 0, "lookups_skipped": 0, "promised_tokens": 0,
                                      "lease_errors": 0, "remote_waits": 0, "remote_wait_timeouts": 0,
                                      "settings_mismatches": 0, "reoffers_refused": 0, "lookups_pending": 0,
                                      "lookups_skipped_unprofitable": 0, "loads_not_started_late": 0,
                                      "late_load_probes": 0, "resets": 0}
        lookup_kwargs = {"num_layers": num_layers, "layer_block_bytes": layer_block_bytes, "stats": self.stats,
                         "groups": groups}
        #: chunks loaded from farther tiers, counted until they earn a copy in the DRAM tier (``None``: no DRAM
        #: tier in front of others, or ``promote_after_hits`` 0)
        self.promotions = Promotions(config.promote_after_hits) if (
            len(config.tiers) > 1 and config.has_memory_tier and config.promote_after_hits > 0) else None
        self.stats["promoted_chunks@memory"] = 0
        self.lookup = make_lookup(config, self.plan, lookup_backends, **lookup_kwargs)
        self.leases = LeaseBook(lookup_backends, config.lease_ttl_s, self.stats)
        #: every request's client input, parsed once (typed, bounded; what is dropped is counted by kind)
        self.inputs = RequestInputs(self.stats)
        self.handoff = Handoff(self.settings, config.remote_wait_s, self.stats, num_saving_ranks, self.inputs)
        #: with save_mode "async": the chunks being written in the background, which a request waits for (at most
        #: lookup_wait_s) rather than miss them (``None`` with "sync": a step's saves are written within it)
        self.saves_in_flight = SavesInFlight(num_saving_ranks, config.lookup_wait_s, self.stats) if (
            can_save and config.save_mode == "async") else None
        gate: CostGate | None = None
        if can_load and num_layers > 0 and layer_block_bytes > 0:
            calibration = load_calibration(config.calibration_file) if config.calibration_file else None
            gate = CostGate(config.tiers[-1].type, config.num_shards,  # (a hierarchy: weighed run by run)
                            layout_bytes_per_token(layer_block_bytes, num_layers, block_size), num_layers,
                            block_size, self.chunk_tokens, calibration=calibration)
        self.admission = Admission(config, gate, self.chunk_tokens, remote=lookup_backends is not None,
                                   stats=self.stats)
        #: req_id -> tokens loaded before its load failed: vLLM reschedules such a request (an asynchronous one
        #: through the waiting queue, where it is looked up again); it is not offered the failed hit a second time
        self._load_failed_at_tokens: dict[str, int] = {}
        #: req_id -> the latest step whose report told of a failed load of it (stamped on its saves)
        self._failures_learnt_through: dict[str, int] = {}
        self._step_idx = 0
        self._reports_learnt_through = -1  # the latest step whose worker report update_connector_output processed
        self._lookups: dict[str, LookupResult] = {}
        self._loads: list[RequestTransfer] = []
        self._requests: dict[str, RequestState] = {}
        #: promised tokens of each load, settled as loaded, failed or aborted once the workers report it
        self.tally = LoadTally()
        #: times :meth:`reset_cache` ran (sent to the workers in every step's metadata)
        self.reset_generation = 0

    @property
    def gate(self) -> CostGate | None:
        """The cost model: with ``load_mode`` "auto" its gate takes, shortens or refuses each hit and picks its load
        mode; in every mode its estimators (learned from the engine's steps and the loads) give each load its
        deadline. Owned by :attr:`admission` (tests may swap it)."""
        return self.admission.gate

    @gate.setter
    def gate(self, gate: CostGate | None) -> None:
        self.admission.gate = gate

    # ---------------------------------------------------------------- lookup
    def _chain(self, request: EngineRequest) -> tuple[list[ChunkHash], ChunkHash | None]:
        """The prompt's prefix hash chain (full chunks) and the hash of its partial last chunk; both empty for a
        request whose salt input was dropped (:mod:`~range_connector.scheduler.request_input`: Range leaves it
        alone)."""
        parts = self.inputs.get(request).salt
        if parts is None:
            return [], None
        salt = request_salt(*parts)
        tokens = request.prompt_token_ids or []
        chain = prefix_hash_chain(self.namespace, salt, tokens, self.chunk_tokens)
        return chain, tail_chunk_hash(chain, self.namespace, salt, tokens, self.chunk_tokens)

    def stored_prefix(self, chunk_hashes: list[ChunkHash], tail_hash: ChunkHash | None = None) -> list:
        """See :meth:`range_connector.scheduler.lookup.PrefixLookup.stored_prefix`."""
        return self.lookup.stored_prefix(chunk_hashes, tail_hash)

    def get_num_new_matched_tokens(self, request: EngineRequest, num_computed_tokens: int) -> tuple[int | None, bool]:
        """See ``KVConnectorBase_V1.get_num_new_matched_tokens``; side-effect free apart from caching the lookup.

        A producer (``can_load`` false) still looks up, so that it does not save again what is stored, but
        promises nothing.
        """
        req_id = request.request_id
        hashes, tail = self._chain(request)
        num_prompt = len(request.prompt_token_ids or [])
        if self.inputs.get(request).salt is None:  # its salt input was dropped: Range leaves the request alone
            self._lookups[req_id] = LookupResult(hashes, [], 0, num_computed_tokens, num_computed_tokens, "pipelined",
                                                 tail, skip_saves=True)
            return 0, False
        if getattr(request, "skip_reading_prefix_cache", False):  # vLLM drops the answer (vllm#57596): not a miss
            self._lookups[req_id] = unread_lookup(self.lookup.lookup(req_id, hashes, tail), hashes, tail,
                                                  num_computed_tokens, self.stats)
            return 0, False
        if self.can_load and self.handoff.announced_nothing(request):  # its producer stored nothing: compute it now
            self._lookups[req_id] = LookupResult(hashes, [], 0, num_computed_tokens, num_computed_tokens, "pipelined",
                                                 tail)
            return 0, False
        refusal = self.admission.refused_unseen(num_prompt, num_computed_tokens, pending=self.lookup.is_pending(
            req_id)) if self.can_load else None
        if refusal is not None:
            self._lookups[req_id] = LookupResult(hashes, [], 0, num_computed_tokens, num_computed_tokens,
                                                 "pipelined", tail, decision=refusal, skip_saves=True)
            self.stats["lookups_skipped_unprofitable"] += 1
            return 0, False
        if (self.can_load and self.saves_in_flight is not None
                and self.saves_in_flight.should_wait(req_id, hashes, num_computed_tokens // self.chunk_tokens)):
            return None, False  # its prefix is being saved: vLLM asks again next step and runs other requests
        tickets = self.lookup.lookup(req_id, hashes, tail)
        if tickets is None:
            self.stats["lookups_pending"] += 1
            return None, False  # the lookup is still running: vLLM asks again next step and runs other requests
        # (the whole prompt stored, its tail too: all of it but the last token, which vLLM computes)
        stored, has_tail, hit = lookup_hit(len(tickets), len(hashes), self.chunk_tokens, num_prompt, self.block_size)
        failed_at = self._load_failed_at_tokens.get(req_id)
        if failed_at is not None and hit > failed_at:  # this request's load failed there: recompute the rest
            hit, has_tail = max(failed_at, num_computed_tokens), False
            self.stats["reoffers_refused"] += 1
        self.stats["lookups"] += 1
        mode = self.config.load_mode
        lookup = LookupResult(hashes, tickets, stored, num_computed_tokens, hit, mode, tail, has_tail)
        if len(self.config.tiers) > 1:
            lookup.runs = tier_runs(tickets, [t.type for t in self.config.tiers], self.chunk_tokens,
                                    num_computed_tokens, hit)
        self._lookups[req_id] = lookup
        if not self.can_load:
            return 0, False
        if self.handoff.should_wait(request, hit, tier_down=self.lookup.is_down()):
            return None, False  # vLLM asks again next step
        # The gate weighs the hit against recomputing it; a producer's whole prompt (a tail) is always taken: a
        # decode engine exists to load it.
        weighed = hit > num_computed_tokens and not has_tail
        if mode == "auto":
            lookup.mode = "pipelined"
            if weighed:
                self.admission.decide(lookup, num_prompt)
        elif weighed:
            self.admission.check_deadline(lookup)
        external = max(0, lookup.num_hit_tokens - num_computed_tokens)
        return external, external > 0 and lookup.mode == "async"

    # ---------------------------------------------------------------- commit
    def update_state_after_alloc(self, request: EngineRequest, block_ids: list[int], num_external_tokens: int) -> None:
        """Plan the load that vLLM committed to (``num_external_tokens`` tokens after the local hit)."""
        req_id = request.request_id
        lookup = self._lookups.pop(req_id, None)
        state = self._requests.get(req_id)
        if state is None:
            hashes, tail = (lookup.chunk_hashes, lookup.tail_hash) if lookup else self._chain(request)
            state = RequestState(req_id, list(request.prompt_token_ids or []), hashes, tail)
            state.skip_saves = self.inputs.get(request).salt is None
            self._requests[req_id] = state
        if lookup is not None:
            self.admission.commit(req_id, lookup, num_external_tokens)
            state.skip_saves = state.skip_saves or lookup.skip_saves
            if self.can_save:  # chunks already stored are not saved again
                state.num_saved_chunks = max(state.num_saved_chunks, lookup.num_stored_chunks)
                state.num_stored_chunks = max(state.num_stored_chunks, lookup.num_stored_chunks)
                state.tail_saved = state.tail_saved or lookup.has_tail
        if self.can_save:  # a request to announce: its saves are confirmed by the workers
            self.handoff.track(request, num_stored_chunks=lookup.num_stored_chunks if lookup else 0,
                               tail_stored=lookup.has_tail if lookup else False)
        if num_external_tokens <= 0:
            return
        bpc = self.plan.blocks_per_chunk
        preempted = getattr(request, "num_preemptions", 0) > 0
        if lookup is None or lookup.num_computed_tokens + num_external_tokens > lookup.num_hit_tokens:
            # Not what was promised (vLLM does not do this today): fail those blocks so that vLLM recomputes them.
            logger.warning("Range: vLLM asked for %d external tokens of request %s, more than promised",
                           num_external_tokens, req_id)
            load = failed_load(req_id, lookup, block_ids, num_external_tokens, block_size=self.block_size,
                               blocks_per_chunk=bpc)
            self._loads.append(load)
            self.tally.plan(req_id, [(load.chunks[0].chunk_idx, num_external_tokens)], is_async=False,
                            preempted=preempted)
            return
        chunks = plan_load(state, lookup, block_ids, num_external_tokens, block_size=self.block_size,
                           blocks_per_chunk=bpc)
        self._loads.append(RequestTransfer(
            req_id, tuple(chunks), num_external_tokens, mode=lookup.mode, deadline_s=self.admission.deadline_s(lookup),
            computed_block_ids=computed_block_ids(lookup, block_ids, num_external_tokens, block_size=self.block_size)))
        self.stats["promised_tokens"] += num_external_tokens
        tiers = {c.chunk_idx: entry_tier(c.tickets) for c in chunks if c.tickets}
        self.tally.plan(req_id, tokens_per_chunk(chunks, lookup.num_computed_tokens, num_external_tokens,
                                                 self.block_size, bpc),
                        is_async=lookup.mode == "async", preempted=preempted,
                        chunk_tiers={c: self.config.tiers[t].type for c, t in tiers.items()
                                     if t < len(self.config.tiers)})
        if self.promotions is not None and self.can_save:
            state.promote_chunks = self.promotions.admit([(c.chunk_idx, c.chunk_hash) for c in chunks
                                                          if tiers.get(c.chunk_idx, 0) > 0])
        self.leases.take(req_id, chunks)

    def counters(self) -> dict[str, float]:
        """Cumulative counters of this side: :attr:`stats`, the token tally, the gate's decisions, lease gauges."""
        gate = self.gate.stats.snapshot() if self.gate is not None else {}
        return {**self.stats, **self.tally.counts, **gate, **self.leases.occupancy()}

    @property
    def num_leases(self) -> int:
        """Requests holding leases (0 when idle)."""
        return len(self.leases)

    # ---------------------------------------------------------------- per step
    def build_connector_meta(self, scheduler_output: StepSchedule) -> RangeConnectorMetadata:
        """Collect this step's loads and the saves of chunks whose tokens are computed by the end of the step."""
        self.handoff.close_open()  # (should the last step have brought no connector output)
        meta = RangeConnectorMetadata(loads=self._loads, probes=self.admission.take_probes(), step_idx=self._step_idx,
                                      reports_learnt_through=self._reports_learnt_through,
                                      reset_generation=self.reset_generation)
        self._step_idx += 1
        self._loads = []
        self.admission.observe_step(scheduler_output)
        for req_id in scheduler_output.finished_req_ids:
            self.inputs.forget(req_id)
            self.handoff.drop(req_id)
            self._requests.pop(req_id, None)
            self._lookups.pop(req_id, None)
            self._load_failed_at_tokens.pop(req_id, None)
            self._failures_learnt_through.pop(req_id, None)
            self.leases.release(req_id)
            if self.saves_in_flight is not None:
                self.saves_in_flight.forget(req_id)
        progress = scheduled_progress(self._requests, scheduler_output)
        if self.can_save:
            stored = self.lookup.index if self.lookup.dedupes_saves else ()
            for state, computed in progress:
                promotion = self._promotion(state, computed, stored)
                if promotion is not None:
                    meta.saves.append(promotion)
                first = state.num_saved_chunks
                save = plan_save(state, computed, chunk_tokens=self.chunk_tokens, block_size=self.block_size,
                                 blocks_per_chunk=self.plan.blocks_per_chunk, save_tail=self.save_tail,
                                 already_stored=stored)
                save = self.handoff.plan_saves(state.req_id, first, state.num_saved_chunks, save)
                if save is not None:
                    if self.saves_in_flight is not None:
                        self.saves_in_flight.planned(c.chunk_hash for c in save.chunks)
                    prefix = tuple(state.block_ids[:save.chunks[0].chunk_idx * self.plan.blocks_per_chunk])
                    meta.saves.append(dataclasses.replace(
                        save, prefix_block_ids=prefix,
                        failures_learnt_through=self._failures_learnt_through.get(state.req_id, -1)))
        return meta

    def _promotion(self, state: RequestState, computed: int, in_dram: Any) -> RequestTransfer | None:
        """The save into the DRAM tier alone of the request's chunks admitted for promotion, once the step computes
        past them (their blocks then hold the loaded KV); ``None`` before, or when there are none."""
        if not state.promote_chunks or computed < (max(state.promote_chunks) + 1) * self.chunk_tokens:
            return None
        bpc = self.plan.blocks_per_chunk
        chunks = tuple(ChunkTransfer(c, state.chunk_hashes[c], tuple(range(bpc)),
                                     tuple(state.block_ids[c * bpc:(c + 1) * bpc]))
                       for c in state.promote_chunks if state.chunk_hashes[c] not in in_dram)
        state.promote_chunks = []
        if not chunks:
            return None
        self.stats["promoted_chunks@memory"] += len(chunks)
        return RequestTransfer(state.req_id, chunks, len(chunks) * self.chunk_tokens, tiers=(0,),
                               prefix_block_ids=tuple(state.block_ids[:chunks[0].chunk_idx * bpc]),
                               failures_learnt_through=self._failures_learnt_through.get(state.req_id, -1))

    def update_connector_output(self, worker_meta: RangeWorkerMetadata | None,
                                finished_recving: set[str] | None = None) -> None:
        """Learn completed saves and dropped values (the DRAM tier's index lives here) and settle the tokens of
        finished loads (:class:`~range_connector.metrics.LoadTally`; ``finished_recving``: the asynchronous loads
        vLLM reports finished in this step, every worker done).

        Last, the announcements of requests that finished in this step are completed with the saves the workers
        confirmed in it, and made final: vLLM calls ``request_finished`` before this, in the same step, and
        serializes its answer after (:mod:`range_connector.scheduler.handoff`)."""
        self.tally.settle(worker_meta.loaded if worker_meta else (), worker_meta.failed_loads if worker_meta else (),
                          finished_recving or ())
        if worker_meta is not None:
            self._learn(worker_meta)
        self.handoff.close_open()

    def _learn(self, worker_meta: RangeWorkerMetadata) -> None:
        self._reports_learnt_through = max(self._reports_learnt_through, worker_meta.step_idx)
        self.handoff.learn(worker_meta.save_results)
        dropped = set(worker_meta.dropped)
        for req_id, chunk_idx in worker_meta.failed_loads:
            self._failures_learnt_through[req_id] = max(self._failures_learnt_through.get(req_id, -1),
                                                        worker_meta.step_idx)
            failed_at = chunk_idx * self.chunk_tokens
            self._load_failed_at_tokens[req_id] = min(self._load_failed_at_tokens.get(req_id, failed_at), failed_at)
            state = self._requests.get(req_id)
            if state is not None:
                redo_from(state, chunk_idx, dropped)
                self.handoff.redo_from(req_id, state.num_saved_chunks, state.tail_saved)
        for req_id in worker_meta.loaded:
            self.leases.release(req_id)
        self.admission.learn(worker_meta)
        self.lookup.learn(worker_meta.saved, worker_meta.dropped)
        if self.saves_in_flight is not None:
            self.saves_in_flight.learn([h for h, _group, _tickets in worker_meta.saved],
                                       [*worker_meta.unsaved, *worker_meta.dropped])

    def request_finished(self, request: EngineRequest, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """Forget the request; saves gather their blocks within the step, so the blocks can be freed now.

        Returns ``kv_transfer_params`` when the request asked for them (``do_remote_decode`` from a disaggregated
        proxy, or ``range_describe``): :meth:`range_connector.scheduler.handoff.Handoff.announcement`, the chunks
        its workers reported stored. The report of this step's saves comes after this call (vLLM 0.32: L2230 before
        L2330 of ``v1/core/sched/scheduler.py``); :meth:`update_connector_output` completes the returned dict in
        place, before vLLM serializes it.
        """
        req_id = request.request_id
        state = self._requests.pop(req_id, None)
        self._lookups.pop(req_id, None)
        self.tally.request_finished(req_id)
        self.admission.forget(req_id)
        self.handoff.forget(req_id)
        self._load_failed_at_tokens.pop(req_id, None)
        self._failures_learnt_through.pop(req_id, None)
        self.lookup.forget(req_id)
        if self.saves_in_flight is not None:
            self.saves_in_flight.forget(req_id)
        self.leases.release(req_id)
        announcement = self.handoff.announcement(request, state, can_save=self.can_save, chunk_tokens=self.chunk_tokens)
        self.inputs.forget(req_id)
        return False, announcement

    def reset_cache(self) -> bool:
        """``KVConnectorBase_V1.reset_cache`` (vLLM's ``reset_prefix_cache(reset_connector=True)``, the API
        server's ``/reset_prefix_cache?reset_external=true``): remove this deployment's entries from the tier.

        Shared tiers (Valkey, files) are cleared from here, every shard, and lookups miss from the moment this
        returns; writes in flight store nothing (the tier's reset epoch). The in-process DRAM tier's index is
        cleared here and its bytes by each worker before the next step (``reset_generation`` in the metadata),
        which also drops the saves gathered before the reset. Other deployments' entries are untouched. Loads
        already planned read what is left and recompute what is gone.

        Returns:
            ``False`` if a shard could not be cleared (down or erroring; logged), else ``True``.
        """
        self.reset_generation += 1
        ok = self.lookup.reset()
        if self.saves_in_flight is not None:
            self.saves_in_flight.clear()
        self.stats["resets"] += 1
        logger.info("Range: cache of deployment %s reset%s", self.config.deployment, "" if ok else " (incomplete)")
        return ok

    def close(self) -> None:
        """Release leases, lookup connections and threads."""
        self.leases.release_all()
        self.lookup.close()
