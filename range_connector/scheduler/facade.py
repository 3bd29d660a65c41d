"""Scheduler side: lookup by prefix hash chain, hit rounding, and the per-step load/save plan.

Runs in vLLM's engine-core process (no tensors). ``get_num_new_matched_tokens`` may be called several times for one
request, so it only records the latest lookup; the load is planned once vLLM commits to it in
``update_state_after_alloc``. Saves cover the new full chunks of each prompt once their tokens are computed.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeoutError
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from range_connector.backends.base import Backend
from range_connector.config import RangeConfig
from range_connector.cost.calibration_file import load_calibration
from range_connector.cost.decision import Action, Decision
from range_connector.cost.gate import CostGate
from range_connector.cost.model import layout_bytes_per_token
from range_connector.errors import BackendError
from range_connector.kv.metadata import ChunkTransfer, RangeConnectorMetadata, RangeWorkerMetadata, RequestTransfer
from range_connector.kv.namespace import ChunkHash, prefix_hash_chain, request_salt, tail_chunk_hash
from range_connector.kv.sharding import ShardPlan, common_stored_prefix
from range_connector.kv.tickets import Ticket, ticket_key
from range_connector.metrics import LoadTally, tokens_per_chunk

if TYPE_CHECKING:
    from range_connector.scheduler.engine_view import EngineRequest, StepSchedule

logger = logging.getLogger("vllm." + __name__)


def settings_mismatch(theirs: dict[str, Any], ours: dict[str, Any]) -> str:
    """``"key: theirs != ours, ..."`` for every setting both sides name with different values ("" if none)."""
    return ", ".join(f"{k}: {theirs[k]!r} != {ours[k]!r}" for k in sorted(set(theirs) & set(ours))
                     if theirs[k] != ours[k])


def hit_tokens(num_stored_chunks: int, chunk_tokens: int, num_prompt_tokens: int, block_size: int) -> int:
    """Tokens the connector can promise for a prompt.

    The stored prefix is cut so that at least one prompt token is left to compute (vLLM needs one to produce
    logits), then rounded down to whole engine blocks (loads write whole blocks only).

    Args:
        num_stored_chunks: leading chunks present on every shard.
        chunk_tokens: tokens per chunk.
        num_prompt_tokens: prompt length in tokens.
        block_size: engine block size in tokens.

    Returns:
        A multiple of ``block_size`` in ``[0, num_prompt_tokens - 1]``.
    """
    cap = max(0, num_prompt_tokens - 1)
    return min(num_stored_chunks * chunk_tokens, cap) // block_size * block_size


@dataclass
class _RequestState:
    req_id: str
    prompt_token_ids: list[int]
    chunk_hashes: list[ChunkHash]
    tail_hash: ChunkHash | None = None  # the partial last chunk (saved by producers only)
    block_ids: list[int] = field(default_factory=list)
    num_saved_chunks: int = 0  # chunks [0, num_saved_chunks) are stored or scheduled for saving
    tail_saved: bool = False
    num_stored_chunks: int = 0  # full chunks the tier held at lookup (a load of them that timed out left them there)
    skip_saves: bool = False  # the tier could not pay for any hit of this prompt: it was not looked up, nor is saved


@dataclass
class _Lookup:
    chunk_hashes: list[ChunkHash]
    tickets: list[tuple[Ticket, ...]]  # [num_stored_chunks (+1 with the tail)] x [num_shards]
    num_stored_chunks: int  # full chunks
    num_computed_tokens: int
    num_hit_tokens: int
    mode: str = "pipelined"
    tail_hash: ChunkHash | None = None
    has_tail: bool = False
    decision: Decision | None = None
    #: predicted (load_s, recompute_s) of the hit, when the configuration chose its mode (no gate decision)
    predicted_s: tuple[float, float] | None = None
    skip_saves: bool = False  # see _RequestState.skip_saves


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
        plan: the deployment's shard plan (context-parallel sizes; default: ``num_shards`` shards, one writer).
    """

    def __init__(self, config: RangeConfig, namespace: bytes, block_size: int,
                 lookup_backends: list[Backend] | None, *, can_load: bool, can_save: bool,
                 num_layers: int = 0, layer_block_bytes: int = 0, settings: dict[str, Any] | None = None,
                 plan: ShardPlan | None = None) -> None:
        assert config.chunk_tokens is not None
        self.config = config
        self.namespace = namespace
        self.block_size = block_size
        self.chunk_tokens = config.chunk_tokens
        self.plan = plan or ShardPlan(self.chunk_tokens // block_size, config.num_shards)
        self.lookup_backends = lookup_backends
        self.can_load = can_load
        self.can_save = can_save
        self.num_layers = num_layers
        self.layer_block_bytes = layer_block_bytes
        #: what a consumer must share with a producer (namespace and the settings behind it), sent in
        #: ``kv_transfer_params`` so that mismatches are named, never silently mixed
        self.settings = {"namespace": namespace.hex(), **(settings or {})}
        #: a pure producer (prefill engine) also stores each prompt's partial last chunk, so that the decode engine
        #: loads all of the prompt but the last token
        self.save_tail = can_save and not can_load
        self._remote_wait_until: dict[str, float] = {}  # req_id -> when to stop waiting for announced KV
        #: req_id -> tokens loaded before its load failed: vLLM reschedules such a request (an asynchronous one
        #: through the waiting queue, where it is looked up again); it is not offered the failed hit a second time
        self._load_failed_at_tokens: dict[str, int] = {}
        self._probes: list[tuple[Ticket, ...]] = []  # background probes for the next step's metadata
        #: lookups that outlasted lookup_wait_s (req_id -> future), and the thread that runs them
        self._pending_lookups: dict[str, Future] = {}
        self._lookup_runner = ThreadPoolExecutor(max_workers=1, thread_name_prefix="range-lookup-wait")
        self._probe_until = 0.0  # monotonic time until which a probe is in flight
        # The DRAM tier's index: chunk hash -> tickets (the bytes are in the worker, which reports saves/evictions).
        self._index: dict[ChunkHash, tuple[Ticket, ...]] = {}
        self._leases: dict[str, dict[int, tuple[list[str], str]]] = {}  # req_id -> shard -> (stripe ids, token)
        self._lookups: dict[str, _Lookup] = {}
        self._loads: list[RequestTransfer] = []
        self._requests: dict[str, _RequestState] = {}
        self._lookup_down_until = 0.0  # monotonic time before which lookups are misses (a shard just failed)
        #: the cost model: with load_mode "auto" its gate takes, shortens or refuses each hit and picks its load mode;
        #: in every mode its estimators (learned from the engine's steps and the loads) give each load its deadline
        self.gate: CostGate | None = None
        if can_load and num_layers > 0 and layer_block_bytes > 0:
            calibration = load_calibration(config.calibration_file) if config.calibration_file else None
            self.gate = CostGate(config.tier.type, config.num_shards,
                                 layout_bytes_per_token(layer_block_bytes, num_layers, block_size), num_layers,
                                 block_size, self.chunk_tokens, calibration=calibration)
        self._decisions: dict[str, Decision] = {}  # req_id -> the gate's decision vLLM acted on
        #: (when the last step was built, its scheduled tokens, its request ids)
        self._last_step: tuple[float, int, set[str]] | None = None
        self._pool = ThreadPoolExecutor(max_workers=max(1, config.num_shards), thread_name_prefix="range-lookup")
        self.stats: dict[str, int] = {"lookups": 0, "lookup_errors": 0, "lookups_skipped": 0, "promised_tokens": 0,
                                      "lease_errors": 0, "remote_waits": 0, "remote_wait_timeouts": 0,
                                      "settings_mismatches": 0, "reoffers_refused": 0, "lookups_pending": 0,
                                      "lookups_skipped_unprofitable": 0, "loads_not_started_late": 0,
                                      "late_load_probes": 0}
        #: promised tokens of each load, settled as loaded, failed or aborted once the workers report it
        self.tally = LoadTally()

    # ---------------------------------------------------------------- lookup
    def _chain(self, request: EngineRequest) -> tuple[list[ChunkHash], ChunkHash | None]:
        """The prompt's prefix hash chain (full chunks) and the hash of its partial last chunk."""
        lora = request.lora_request.lora_name if getattr(request, "lora_request", None) else None
        media = [f.identifier for f in (getattr(request, "mm_features", None) or [])]
        salt = request_salt(lora, getattr(request, "cache_salt", None), media)
        tokens = request.prompt_token_ids or []
        chain = prefix_hash_chain(self.namespace, salt, tokens, self.chunk_tokens)
        return chain, tail_chunk_hash(chain, self.namespace, salt, tokens, self.chunk_tokens)

    def stored_prefix(self, chunk_hashes: list[ChunkHash], tail_hash: ChunkHash | None = None
                      ) -> list[tuple[Ticket, ...]]:
        """Tickets of the leading chunks present on every shard (with ``tail_hash``: the partial last chunk counts
        as one more chunk after the full ones, asked for in the same batched request).

        One batched ticket read per shard, in parallel; the result is the minimum over shards of each shard's
        stored prefix. Why the minimum is exactly the longest prefix present on every shard: each shard's set of
        stored prefixes of this chain is prefix-closed once cut at its first gap (a shard's answer is the length of
        its first run), and the intersection of prefix-closed sets of one chain is the shortest of them.

        A backend error counts as a miss (empty), never an exception; after one, lookups are misses without
        asking for the tier's ``retry_s`` seconds, so a dead or frozen shard costs one timeout, not one per request.
        A ticket that does not fit the registered layout is a miss.
        """
        if tail_hash is not None:
            chunk_hashes = [*chunk_hashes, tail_hash]
        if not chunk_hashes:
            return []
        if self.lookup_backends is None:
            out = []
            for h in chunk_hashes:
                tickets = self._index.get(h)
                if tickets is None:
                    break
                out.append(tickets)
            return out

        def one(shard_idx: int) -> list[Ticket]:
            keys = [ticket_key(h, shard_idx) for h in chunk_hashes]
            found = []
            for raw in self.lookup_backends[shard_idx].get_tickets(keys):
                t = Ticket.decode(raw, num_layers=self.num_layers, layer_block_bytes=self.layer_block_bytes,
                                  num_blocks=self.plan.blocks_per_shard)
                if t is None:
                    break
                found.append(t)
            return found

        if time.monotonic() < self._lookup_down_until:
            self.stats["lookups_skipped"] += 1
            return []
        try:
            if len(self.lookup_backends) == 1:
                per_shard = [one(0)]
            else:
                per_shard = list(self._pool.map(one, range(len(self.lookup_backends))))
        except BackendError as exc:
            self.stats["lookup_errors"] += 1
            self._lookup_down_until = time.monotonic() + self.config.tier.retry_s
            logger.warning("Range lookup failed; lookups are misses for %.1f s: %s", self.config.tier.retry_s, exc)
            return []
        return common_stored_prefix(per_shard)

    def get_num_new_matched_tokens(self, request: EngineRequest, num_computed_tokens: int) -> tuple[int, bool]:
        """See ``KVConnectorBase_V1.get_num_new_matched_tokens``; side-effect free apart from caching the lookup.

        A producer (``can_load`` false) still looks up, so that it does not save again what is stored, but
        promises nothing.
        """
        hashes, tail = self._chain(request)
        refusal = self._refused_unseen(request, num_computed_tokens)
        if refusal is not None:
            lookup = _Lookup(hashes, [], 0, num_computed_tokens, num_computed_tokens, "pipelined", tail,
                             decision=refusal, skip_saves=True)
            self._lookups[request.request_id] = lookup
            self.stats["lookups_skipped_unprofitable"] += 1
            return 0, False
        tickets = self._lookup(request.request_id, hashes, tail)
        if tickets is None:
            self.stats["lookups_pending"] += 1
            return None, False  # the lookup is still running: vLLM asks again next step and runs other requests
        stored = min(len(tickets), len(hashes))
        has_tail = len(tickets) > len(hashes)
        num_prompt = len(request.prompt_token_ids or [])
        hit = hit_tokens(stored, self.chunk_tokens, num_prompt, self.block_size)
        if has_tail:  # the whole prompt is stored: all of it but the last token (vLLM computes that one)
            hit = max(hit, num_prompt - 1)
        failed_at = self._load_failed_at_tokens.get(request.request_id)
        if failed_at is not None and hit > failed_at:  # this request's load failed there: recompute the rest
            hit, has_tail = max(failed_at, num_computed_tokens), False
            self.stats["reoffers_refused"] += 1
        self.stats["lookups"] += 1
        mode = self.config.load_mode
        lookup = _Lookup(hashes, tickets, stored, num_computed_tokens, hit, mode, tail, has_tail)
        self._lookups[request.request_id] = lookup
        if not self.can_load:
            return 0, False
        if self._wait_for_announced_kv(request, hit):
            return None, False  # vLLM asks again next step
        if mode == "auto":
            lookup.mode = "pipelined"
            # The gate weighs the hit against recomputing it; a producer's whole prompt (a tail) is always taken:
            # a decode engine exists to load it.
            if self.gate is not None and hit > num_computed_tokens and not has_tail:
                lookup.decision = self._background_probe(self.gate.decide(num_prompt, num_computed_tokens, hit),
                                                         lookup)
                lookup.num_hit_tokens = hit = max(num_computed_tokens, lookup.decision.hit_tokens)
                lookup.mode = lookup.decision.mode.value
        elif self.gate is not None and hit > num_computed_tokens and not has_tail:
            lookup.predicted_s = self.gate.predict_s(num_computed_tokens, hit)
            if self._late_before_start(lookup):
                lookup.num_hit_tokens = hit = num_computed_tokens
        external = max(0, hit - num_computed_tokens)
        return external, external > 0 and lookup.mode == "async"

    def _refused_unseen(self, request: EngineRequest, num_computed_tokens: int) -> Decision | None:
        """With ``load_mode`` ``auto`` on a tier that lives elsewhere: the gate's refusal when no hit of this prompt
        could pay (the tier is slower than recompute for it) and no probe is due; the request is then neither
        looked up nor saved (:meth:`CostGate.refuses_any_hit`). Producers and a request whose previous lookup is
        still running are always looked up."""
        if (self.gate is None or self.config.load_mode != "auto" or not self.can_load or self.lookup_backends is None
                or request.request_id in self._pending_lookups):
            return None
        decision = self.gate.refuses_any_hit(len(request.prompt_token_ids or []), num_computed_tokens)
        if decision is None:
            return None
        # (counted as a refusal: its offered_tokens is the prompt's largest possible hit, not a stored one)
        return dataclasses.replace(decision, hit_tokens=num_computed_tokens, reason="not looked up: " + decision.reason)

    def _lookup(self, req_id: str, hashes: list[ChunkHash], tail: ChunkHash | None) -> list[tuple[Ticket, ...]] | None:
        """:meth:`stored_prefix`, waiting at most ``lookup_wait_s`` for a tier that lives elsewhere; ``None`` while
        the request's lookup is still running (it is picked up when vLLM asks again)."""
        pending = self._pending_lookups.pop(req_id, None)
        if self.lookup_backends is None or (pending is None and self.config.lookup_wait_s >= self.config.tier.timeout_s):
            return self.stored_prefix(hashes, tail) if pending is None else pending.result()
        if pending is None:
            pending = self._lookup_runner.submit(self.stored_prefix, hashes, tail)
        try:
            return pending.result(timeout=self.config.lookup_wait_s)
        except FutureTimeoutError:
            self._pending_lookups[req_id] = pending
            return None

    def _background_probe(self, decision: Decision, lookup: _Lookup) -> Decision:
        """A probe of a tier that lives elsewhere (Valkey, files) is a background read of one stored chunk by the
        worker (:mod:`range_connector.worker.probes`), not a load the request waits for: the request is recomputed as
        refused. One probe in flight at a time (until its timing comes back, at most twice the tier's ``timeout_s``).
        The DRAM tier keeps probing through a short hit (it lends stripes in-process)."""
        if not decision.is_probe or self.lookup_backends is None:
            return decision
        if self._probe_slot_free(lookup):
            self._queue_probe(lookup)
        c = lookup.num_computed_tokens
        return dataclasses.replace(decision, action=Action.REFUSE, hit_tokens=c, num_new_tokens=0,
                                   with_load_s=decision.without_load_s, reason="probe: one chunk read in the background")

    def _late_before_start(self, lookup: _Lookup) -> bool:
        """In ``load_mode`` ``pipelined`` or ``async`` on a tier that lives elsewhere: whether the load is predicted to
        take longer than its own deadline (:meth:`CostGate.deadline_s`: bounded by what recomputing its tokens would
        cost), so that starting it could only make the request wait out the deadline before recomputing anyway. Such
        a hit is not offered (stat ``loads_not_started_late``); when a probe is due (the gate's clock: at most one per
        ``probe_interval_s`` and per ``probe_every_refusals`` such hits) one of its chunks is read in the background
        instead, so that a tier that became fast again is offered again. ``sync`` (kept for comparison) always
        loads."""
        if lookup.mode == "sync" or self.lookup_backends is None or lookup.predicted_s is None:
            return False
        load_s, recompute_s = lookup.predicted_s
        deadline_s = CostGate.deadline_s(load_s, recompute_s, self.config.min_load_deadline_s,
                                         self.config.load_deadline_s)
        if load_s <= deadline_s:
            return False
        self.stats["loads_not_started_late"] += 1
        if not self._probe_slot_free(lookup):
            self.gate.tiers.note_refusal(self.gate.backend)  # (a probe is in flight)
        elif self.gate.tiers.should_probe(self.gate.backend, time.monotonic()):
            self._queue_probe(lookup)
            self.stats["late_load_probes"] += 1
        return True

    def _probe_slot_free(self, lookup: _Lookup) -> bool:
        """Whether no probe is in flight and the lookup has a stored chunk past what vLLM holds to probe."""
        return (time.monotonic() >= self._probe_until
                and lookup.num_computed_tokens // self.chunk_tokens < len(lookup.tickets))

    def _queue_probe(self, lookup: _Lookup) -> None:
        """Have the worker read the first chunk of the lookup's hit in the background with the next step (one probe
        in flight at a time: until its timing comes back, at most twice the tier's ``timeout_s``)."""
        self._probes.append(lookup.tickets[lookup.num_computed_tokens // self.chunk_tokens])
        self._probe_until = time.monotonic() + 2.0 * self.config.tier.timeout_s

    def _wait_for_announced_kv(self, request: EngineRequest, hit: int) -> bool:
        """Whether to wait for KV that a producer announced in ``kv_transfer_params`` (disaggregated prefill) and
        that is not all visible yet: at most ``remote_wait_s`` per request, then what is missing is recomputed.
        A producer whose settings differ from ours is logged by name and not waited for."""
        params = getattr(request, "kv_transfer_params", None)
        info = params.get("range") if isinstance(params, dict) else None
        if not isinstance(info, dict) or "num_tokens" not in info:
            return False
        theirs = info.get("settings") or {}
        mismatched = settings_mismatch(theirs, self.settings)
        if mismatched:
            if request.request_id not in self._remote_wait_until:
                self._remote_wait_until[request.request_id] = 0.0
                self.stats["settings_mismatches"] += 1
                logger.error("Range: request %s comes from a producer with other settings (%s); its KV is not used",
                             request.request_id, mismatched)
            return False
        expected = min(int(info["num_tokens"]), len(request.prompt_token_ids or []) - 1)
        if hit >= expected:
            self._remote_wait_until.pop(request.request_id, None)
            return False
        now = time.monotonic()
        until = self._remote_wait_until.setdefault(request.request_id, now + self.config.remote_wait_s)
        if until and now < until:
            self.stats["remote_waits"] += 1
            return True
        if until:
            self._remote_wait_until[request.request_id] = 0.0
            self.stats["remote_wait_timeouts"] += 1
            logger.warning("Range: request %s: %d of the %d announced tokens arrived within %.1f s; recomputing the "
                           "rest", request.request_id, hit, expected, self.config.remote_wait_s)
        return False

    # ---------------------------------------------------------------- commit
    def update_state_after_alloc(self, request: EngineRequest, block_ids: list[int], num_external_tokens: int) -> None:
        """Plan the load that vLLM committed to (``num_external_tokens`` tokens after the local hit)."""
        lookup = self._lookups.pop(request.request_id, None)
        state = self._requests.get(request.request_id)
        if state is None:
            hashes, tail = (lookup.chunk_hashes, lookup.tail_hash) if lookup else self._chain(request)
            state = _RequestState(request.request_id, list(request.prompt_token_ids or []), hashes, tail)
            self._requests[request.request_id] = state
        if lookup is not None and lookup.decision is not None and self.gate is not None:
            self.gate.commit(lookup.decision)
            if num_external_tokens > 0:
                self._decisions[request.request_id] = lookup.decision
        if lookup is not None and lookup.skip_saves:
            state.skip_saves = True
        if lookup is not None and self.can_save:
            # Chunks already stored are not saved again.
            state.num_saved_chunks = max(state.num_saved_chunks, lookup.num_stored_chunks)
            state.num_stored_chunks = max(state.num_stored_chunks, lookup.num_stored_chunks)
            state.tail_saved = state.tail_saved or lookup.has_tail
        if num_external_tokens <= 0:
            return
        bpc = self.plan.blocks_per_chunk
        if lookup is None or lookup.num_computed_tokens + num_external_tokens > lookup.num_hit_tokens:
            # Not what was promised (vLLM does not do this today): fail those blocks so that vLLM recomputes them
            # rather than reading blocks nobody wrote.
            logger.warning("Range: vLLM asked for %d external tokens of request %s, more than promised",
                           num_external_tokens, request.request_id)
            start = (lookup.num_computed_tokens if lookup else 0) // self.block_size
            end = (start * self.block_size + num_external_tokens + self.block_size - 1) // self.block_size
            ids = tuple(block_ids[start:end])
            chunk = ChunkTransfer(start // bpc, ChunkHash(b""), tuple(range(len(ids))), ids)
            self._loads.append(RequestTransfer(request.request_id, (chunk,), num_external_tokens, fail=True))
            self.tally.plan(request.request_id, [(chunk.chunk_idx, num_external_tokens)], is_async=False,
                            preempted=getattr(request, "num_preemptions", 0) > 0)
            return
        first_token = lookup.num_computed_tokens
        last_token = first_token + num_external_tokens
        chunks = []
        # A hit that ends inside a block (a stored tail) loads that whole block; vLLM computes the rest of it.
        first_block, end_block = first_token // self.block_size, -(-last_token // self.block_size)
        for chunk_idx in range(first_block // bpc, (end_block + bpc - 1) // bpc):
            positions = [p for p in range(bpc) if first_block <= chunk_idx * bpc + p < end_block]
            chunk_hash = state.chunk_hashes[chunk_idx] if chunk_idx < len(state.chunk_hashes) else state.tail_hash
            chunks.append(ChunkTransfer(chunk_idx, chunk_hash, tuple(positions),  # type: ignore[arg-type]
                                        tuple(block_ids[chunk_idx * bpc + p] for p in positions),
                                        lookup.tickets[chunk_idx]))
        # Twice the predicted load, at most what recomputing would cost (CostGate.deadline_s). A producer's whole
        # prompt (a tail) has no prediction: it is waited for up to load_deadline_s (a decode engine exists to load
        # it).
        predicted = (lookup.decision.load_s, lookup.decision.recompute_s) if lookup.decision is not None \
            else lookup.predicted_s
        deadline_s = None if predicted is None else \
            CostGate.deadline_s(*predicted, self.config.min_load_deadline_s, self.config.load_deadline_s)
        self._loads.append(RequestTransfer(request.request_id, tuple(chunks), num_external_tokens, mode=lookup.mode,
                                           deadline_s=deadline_s))
        self.stats["promised_tokens"] += num_external_tokens
        self.tally.plan(request.request_id,
                        tokens_per_chunk(chunks, first_token, num_external_tokens, self.block_size, bpc),
                        is_async=lookup.mode == "async", preempted=getattr(request, "num_preemptions", 0) > 0)
        self._take_leases(request.request_id, chunks)

    # ---------------------------------------------------------------- leases
    def _take_leases(self, req_id: str, chunks: list[ChunkTransfer]) -> None:
        """Lease the promised stripes on every shard, so that eviction cannot remove them before the load.

        Leases are released when the worker reports the load finished (loaded or failed) or the request ends; a
        lease also expires by itself after ``lease_ttl_s``. A lease that cannot be taken only risks a load error.
        """
        if self.lookup_backends is None:
            return  # DRAM tier: loads finish in the step that commits to them, before any save can evict
        per_shard: dict[int, list[str]] = {}
        for c in chunks:
            for s, t in enumerate(c.tickets):
                ids = per_shard.setdefault(s, [])
                if t.stripe_id not in ids:
                    ids.append(t.stripe_id)
        taken: dict[int, tuple[list[str], str]] = {}
        for s, ids in per_shard.items():
            try:
                taken[s] = (ids, self.lookup_backends[s].lease(ids, self.config.lease_ttl_s))
            except BackendError as exc:
                self.stats["lease_errors"] += 1
                logger.warning("Range: lease on shard %d failed (the load may fail and be recomputed): %s", s, exc)
        if taken:
            self._release_leases(req_id)  # a request leases once at a time
            self._leases[req_id] = taken

    def _release_leases(self, req_id: str) -> None:
        for s, (ids, token) in self._leases.pop(req_id, {}).items():
            try:
                self.lookup_backends[s].release(ids, token)  # type: ignore[index]
            except BackendError as exc:
                self.stats["lease_errors"] += 1
                logger.warning("Range: lease release on shard %d failed (it expires by itself): %s", s, exc)

    def counters(self) -> dict[str, float]:
        """Cumulative counters of this side: :attr:`stats`, the token tally and the gate's decisions."""
        gate = self.gate.stats.snapshot() if self.gate is not None else {}
        return {**self.stats, **self.tally.counts, **gate}

    @property
    def num_leases(self) -> int:
        """Requests holding leases (0 when idle)."""
        return len(self._leases)

    # ---------------------------------------------------------------- per step
    def build_connector_meta(self, scheduler_output: StepSchedule) -> RangeConnectorMetadata:
        """Collect this step's loads and the saves of chunks whose tokens are computed by the end of the step."""
        meta = RangeConnectorMetadata(loads=self._loads, probes=self._probes)
        self._loads, self._probes = [], []
        if self.gate is not None:  # R from the engine's own steps: the time between two steps' plans
            now = time.monotonic()
            if self._last_step is not None:
                start_s, tokens, req_ids = self._last_step
                # Only when work was left after that step: once all its requests finished, the engine may have idled
                # until this step's requests arrived, and the gap is no step time (R would be underestimated).
                if tokens > 0 and now - start_s < 10.0 and not req_ids <= set(scheduler_output.finished_req_ids):
                    self.gate.observe_step(tokens, now - start_s)
            req_ids = {r.req_id for r in scheduler_output.scheduled_new_reqs}
            req_ids.update(scheduler_output.scheduled_cached_reqs.req_ids)
            self._last_step = (now, scheduler_output.total_num_scheduled_tokens, req_ids)
        for req_id in scheduler_output.finished_req_ids:
            self._requests.pop(req_id, None)
            self._lookups.pop(req_id, None)
            self._load_failed_at_tokens.pop(req_id, None)
            self._release_leases(req_id)
        progress: list[tuple[_RequestState, int]] = []
        for new in scheduler_output.scheduled_new_reqs:
            state = self._requests.get(new.req_id)
            if state is None:
                continue
            state.block_ids = list(new.block_ids[0])
            progress.append((state, new.num_computed_tokens + scheduler_output.num_scheduled_tokens[new.req_id]))
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            state = self._requests.get(req_id)
            if state is None:
                continue
            new_ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                state.block_ids = list(new_ids[0]) if new_ids else []
            elif new_ids:
                state.block_ids.extend(new_ids[0])
            progress.append((state, cached.num_computed_tokens[i] + scheduler_output.num_scheduled_tokens[req_id]))
        if self.can_save:
            for state, computed in progress:
                save = self._plan_save(state, computed)
                if save is not None:
                    meta.saves.append(save)
        return meta

    def _plan_save(self, state: _RequestState, num_computed_tokens: int) -> RequestTransfer | None:
        if state.skip_saves:
            return None
        bpc = self.plan.blocks_per_chunk
        num_full = min(num_computed_tokens, len(state.prompt_token_ids)) // self.chunk_tokens
        num_full = min(num_full, len(state.chunk_hashes), len(state.block_ids) // bpc)
        chunks = [
            ChunkTransfer(c, state.chunk_hashes[c], tuple(range(bpc)), tuple(state.block_ids[c * bpc:(c + 1) * bpc]))
            for c in range(state.num_saved_chunks, num_full)
            if self.lookup_backends is not None or state.chunk_hashes[c] not in self._index
        ]
        state.num_saved_chunks = max(state.num_saved_chunks, num_full)
        num_tokens = len(chunks) * self.chunk_tokens
        num_prompt = len(state.prompt_token_ids)
        if (self.save_tail and state.tail_hash is not None and not state.tail_saved and num_computed_tokens >= num_prompt
                and state.num_saved_chunks == len(state.chunk_hashes)):
            # The partial last chunk, as a whole chunk whose slots past the prompt are never loaded (padded with
            # its last block, so every stripe keeps one geometry).
            first = len(state.chunk_hashes) * bpc
            ids = state.block_ids[first:-(-num_prompt // self.block_size)]
            if ids:
                ids = ids + [ids[-1]] * (bpc - len(ids))
                chunks.append(ChunkTransfer(len(state.chunk_hashes), state.tail_hash, tuple(range(bpc)), tuple(ids)))
                num_tokens += num_prompt - first * self.block_size
                state.tail_saved = True
        if not chunks:
            return None
        return RequestTransfer(state.req_id, tuple(chunks), num_tokens)

    def update_connector_output(self, worker_meta: RangeWorkerMetadata | None,
                                finished_recving: set[str] | None = None) -> None:
        """Learn completed saves and dropped values (the DRAM tier's index lives here) and settle the tokens of
        finished loads (:class:`~range_connector.metrics.LoadTally`; ``finished_recving``: the asynchronous loads
        vLLM reports finished in this step, every worker done)."""
        self.tally.settle(worker_meta.loaded if worker_meta else (), worker_meta.failed_loads if worker_meta else (),
                          finished_recving or ())
        if worker_meta is None:
            return
        dropped = set(worker_meta.dropped)
        for req_id, chunk_idx in worker_meta.failed_loads:
            failed_at = chunk_idx * self.chunk_tokens
            self._load_failed_at_tokens[req_id] = min(self._load_failed_at_tokens.get(req_id, failed_at), failed_at)
            state = self._requests.get(req_id)
            if state is None:
                continue
            # Chunks computed in that step on top of the failed load were not saved, and chunks found gone or
            # corrupt were dropped: both are saved again once recomputed. Chunks whose load only ran out of time
            # are still stored and are not written twice.
            redo = max(chunk_idx, state.num_stored_chunks)
            redo = min([redo] + [i for i in range(chunk_idx, len(state.chunk_hashes)) if state.chunk_hashes[i] in dropped])
            state.num_saved_chunks = min(state.num_saved_chunks, redo)
            if state.tail_hash in dropped:
                state.tail_saved = False
        for req_id in worker_meta.loaded:
            self._release_leases(req_id)
        if self.gate is not None:  # B and T0 from completed loads and probes
            for shard_bytes, seconds, complete in worker_meta.probe_timings:
                self._probe_until = 0.0
                for shard_idx in range(self.gate.num_shards):
                    self.gate.observe_load(shard_idx, shard_bytes, seconds, lower_bound=not complete, probe=True)
            for req_ids, shard_bytes, seconds, complete in worker_meta.load_timings:
                decisions = [d for d in (self._decisions.pop(r, None) for r in req_ids) if d is not None]
                probe = bool(decisions) and all(d.is_probe for d in decisions)
                for shard_idx in range(self.gate.num_shards):
                    # A load that ran out of time says only that the tier is at least that slow.
                    self.gate.observe_load(shard_idx, shard_bytes, seconds, lower_bound=not complete, probe=probe)
                for decision in decisions:
                    self.gate.record_load(decision, seconds)
        if self.lookup_backends is None:
            for h, tickets in worker_meta.saved:
                self._index.pop(h, None)
                self._index[h] = tickets
        for h in worker_meta.dropped:
            self._index.pop(h, None)

    def request_finished(self, request: EngineRequest, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """Forget the request; saves are synchronous within a step, so the blocks can be freed now.

        Returns ``kv_transfer_params`` when the request asked for them (``do_remote_decode`` from a disaggregated
        proxy, or ``range_describe``): ``{"range": {"settings": ..., "namespace": ..., "chain_head": ...,
        "num_tokens": ...}}``, the tokens this producer stored for the prompt (durable: written in the step that
        computed them, before vLLM answers the request). ``range_expect`` (the consumer's settings, sent by the
        proxy) is compared with ours and a mismatch is logged by name.
        """
        state = self._requests.pop(request.request_id, None)
        self._lookups.pop(request.request_id, None)
        self.tally.request_finished(request.request_id)
        self._decisions.pop(request.request_id, None)
        self._remote_wait_until.pop(request.request_id, None)
        self._load_failed_at_tokens.pop(request.request_id, None)
        self._pending_lookups.pop(request.request_id, None)
        self._release_leases(request.request_id)
        params = getattr(request, "kv_transfer_params", None)
        if not isinstance(params, dict) or not (params.get("do_remote_decode") or params.get("range_describe")):
            return False, None
        info: dict[str, Any] = {"version": 1, "settings": self.settings}
        expect = params.get("range_expect")
        if isinstance(expect, dict):
            mismatched = settings_mismatch(expect, self.settings)
            if mismatched:
                self.stats["settings_mismatches"] += 1
                logger.error("Range: request %s: the consumer's settings differ from this producer's (%s)",
                             request.request_id, mismatched)
        if self.can_save and state is not None:
            num_tokens = state.num_saved_chunks * self.chunk_tokens
            head = state.chunk_hashes[state.num_saved_chunks - 1] if state.num_saved_chunks else None
            if state.tail_saved:
                num_tokens, head = len(state.prompt_token_ids), state.tail_hash
            info.update(num_tokens=num_tokens, chain_head=head.hex() if head else None)
        return False, {"range": info}

    def close(self) -> None:
        """Release leases, lookup connections and threads."""
        for req_id in list(self._leases):
            self._release_leases(req_id)
        self._pool.shutdown(wait=False)
        self._lookup_runner.shutdown(wait=False)
        for b in self.lookup_backends or []:
            b.close()
