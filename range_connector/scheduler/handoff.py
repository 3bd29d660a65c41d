"""The disaggregated hand-off (docs/disaggregated.md): what a prefill engine (``kv_producer``) announces when a request
ends, and how long a decode engine (``kv_consumer``) waits for the KV it was announced.

**Producer.** A producer answers ``kv_transfer_params = {"range": {"settings", "num_tokens", "chain_head", ...}}``
for the prompt tokens that are *stored*: the leading chunks that the tier held at lookup, or that every saving rank
(``num_saving_ranks``) reported written (``RangeWorkerMetadata.save_results``, for saves the scheduler marked
``confirm``). A chunk planned but not reported stored by every rank, or reported unstored by any rank, ends the
announced prefix; a planned save is never announced on its own.

The workers' report of the step that saved a prompt's last chunks reaches the scheduler *after* the request ended:
in vLLM 0.32 ``Scheduler.update_from_output`` (``vllm/v1/core/sched/scheduler.py``) frees a request that stopped,
and so calls ``request_finished``, inside its per-request loop (L2230, ``_free_request`` -> ``_connector_finished``
L3051), and hands the step's ``KVConnectorOutput`` to ``update_connector_output`` only after that loop (L2330,
``_update_from_kv_xfer_finished`` L3219). The dict ``request_finished`` returns is put by reference into the
request's ``EngineCoreOutput`` (L2281; vLLM itself adds ``remote_prefill_cached_tokens`` to it, L2239), and the
outputs are serialized only after ``update_from_output`` returns. So :meth:`Handoff.announcement` answers at once
with the chunks confirmed so far (never more), keeps the dict *open*, and :meth:`Handoff.close_open`, at the end of
that step's ``update_connector_output``, completes it in place with the step's confirmations and makes it final
(``build_connector_meta`` closes any still open too, should a step bring no connector output). If a future vLLM
copied the dict, announcements would only fall short (the consumer recomputes), never name KV that is not stored;
``tests/unit/test_disaggregated_prefill.py`` checks this order in the installed vLLM's source. A pure producer saves
synchronously (``spec.py``), so its saves' outcomes are in the report of the step that computed them.

**Consumer.** A consumer that receives an announcement waits at most ``remote_wait_s`` per request for that many
tokens to be visible, then recomputes what is missing. It does not wait at all when the producer announced no
tokens, nor while its own lookups count the tier as down (``PrefixLookup.is_down``): it recomputes at once. The
settings both sides share (namespace and the settings behind it) are compared by name: a mismatch is logged and the
KV is not used, never silently mixed. Everything read from ``kv_transfer_params`` is client input, parsed once per
request by :mod:`~range_connector.scheduler.request_input` (typed, bounded; what is not the expected shape is dropped
and counted).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections import Counter
from collections.abc import Iterable, Mapping, MutableMapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from range_connector.kv.metadata import RequestTransfer
from range_connector.scheduler.planning import RequestState
from range_connector.scheduler.request_input import MAX_ANNOUNCED_TOKENS, RequestInputs

if TYPE_CHECKING:
    from range_connector.scheduler.engine_view import EngineRequest

logger = logging.getLogger("vllm." + __name__)

#: the counters this module keeps in the scheduler's stats
HANDOFF_STATS = ("remote_waits", "remote_wait_timeouts", "settings_mismatches", "remote_nothing_announced",
                 "remote_waits_tier_down", "handoff_unconfirmed_chunks")


__all__ = ["HANDOFF_STATS", "MAX_ANNOUNCED_TOKENS", "Handoff", "SaveLedger", "settings_mismatch"]

#: characters of one value shown in a settings-mismatch message (client input: bounded in logs too)
MAX_SHOWN_CHARS = 120


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= MAX_SHOWN_CHARS else text[:MAX_SHOWN_CHARS] + "...'"


def settings_mismatch(theirs: Mapping[str, Any], ours: Mapping[str, Any]) -> str:
    """``"key: theirs != ours, ..."`` for every setting both sides name with different values ("" if none)."""
    return ", ".join(f"{k}: {_shown(theirs[k])} != {_shown(ours[k])}" for k in sorted(set(theirs) & set(ours))
                     if theirs[k] != ours[k])


@dataclass
class SaveLedger:
    """What a producer knows of one request's stored chunks (chunk ``len(chunk_hashes)`` is the partial last one).

    Attributes:
        num_stored_at_lookup_chunks: leading full chunks the tier held at lookup (not saved again).
        tail_stored_at_lookup: the tier held the whole prompt, its partial last chunk included, at lookup.
        already_stored: chunks not saved because the tier's index already holds them (the DRAM tier).
        planned: chunks handed to the workers to save and confirm.
        confirmations: chunk -> saving ranks that reported it stored.
        failed: chunks some rank reported not stored.
    """

    num_stored_at_lookup_chunks: int = 0
    tail_stored_at_lookup: bool = False
    already_stored: set[int] = field(default_factory=set)
    planned: set[int] = field(default_factory=set)
    confirmations: Counter[int] = field(default_factory=Counter)
    failed: set[int] = field(default_factory=set)

    def is_stored(self, chunk_idx: int, num_saving_ranks: int) -> bool:
        """The chunk is on the tier: held at lookup, or every saving rank reported it stored and none failed it."""
        if chunk_idx < self.num_stored_at_lookup_chunks or chunk_idx in self.already_stored:
            return True
        return chunk_idx not in self.failed and self.confirmations[chunk_idx] >= num_saving_ranks

    def num_unresolved(self, num_saving_ranks: int) -> int:
        """Planned chunks whose outcome is not known yet (neither failed nor confirmed by every saving rank)."""
        return sum(1 for c in self.planned if c not in self.failed and self.confirmations[c] < num_saving_ranks)


class Handoff:
    """Both ends of the hand-off for one engine.

    Args:
        settings: what a consumer must share with a producer (``namespace`` and the settings behind it).
        remote_wait_s: how long a consumer waits for announced KV, per request, seconds.
        stats: the scheduler's counters (:data:`HANDOFF_STATS` are counted here).
        num_saving_ranks: workers that save a slice of every chunk and report it (tensor-parallel ranks that each
            write their own slice): a chunk counts as stored once that many reported it stored.
        inputs: the requests' parsed client input (default: a store of its own, counting into ``stats``).

    Raises:
        ValueError: ``num_saving_ranks`` is less than 1.
    """

    def __init__(self, settings: dict[str, Any], remote_wait_s: float, stats: MutableMapping[str, int],
                 num_saving_ranks: int = 1, inputs: RequestInputs | None = None) -> None:
        if num_saving_ranks < 1:
            raise ValueError(f"num_saving_ranks must be at least 1, got {num_saving_ranks}")
        self.settings = settings
        self.remote_wait_s = remote_wait_s
        self.stats = stats
        self.inputs = inputs if inputs is not None else RequestInputs(stats)
        for key in HANDOFF_STATS:
            stats.setdefault(key, 0)
        self.num_saving_ranks = num_saving_ranks
        self._wait_until: dict[str, float] = {}  # req_id -> when to stop waiting for announced KV (0: not waiting)
        self._ledgers: dict[str, SaveLedger] = {}  # producer: requests that will be announced
        #: announcements returned by request_finished and completed at the end of the step: req_id -> (the
        #: ``"range"`` dict inside them, the request's state, tokens per chunk)
        self._open: dict[str, tuple[dict[str, Any], RequestState, int]] = {}

    # ------------------------------------------------------------------------------------------- consumer
    def forget(self, req_id: str) -> None:
        """The request ended (consumer side: stop waiting for it)."""
        self._wait_until.pop(req_id, None)

    def _announced_tokens(self, request: EngineRequest) -> int | None:
        """The tokens a producer announced for the request; ``None`` when there is no usable announcement (none,
        malformed, or from a producer whose settings differ from ours: then logged by name, once per request)."""
        announced = self.inputs.get(request).announcement
        if announced is None:
            return None
        mismatched = settings_mismatch(announced.settings, self.settings)
        if mismatched:
            if request.request_id not in self._wait_until:
                self._wait_until[request.request_id] = 0.0
                self.stats["settings_mismatches"] += 1
                logger.error("Range: request %s comes from a producer with other settings (%s); its KV is not used",
                             request.request_id, mismatched)
            return None
        return announced.num_tokens

    def announced_nothing(self, request: EngineRequest) -> bool:
        """The request carries an announcement of 0 tokens from a producer with our settings (it stored none of the
        prompt): it is computed at once, without a lookup and without waiting."""
        if self._announced_tokens(request) != 0:
            return False
        self.stats["remote_nothing_announced"] += 1
        logger.info("Range: request %s: its producer stored none of the prompt; computing it", request.request_id)
        return True

    def should_wait(self, request: EngineRequest, hit: int, *, tier_down: bool = False) -> bool:
        """Whether to wait for KV that a producer announced in ``kv_transfer_params`` and that is not all visible yet
        (``hit`` tokens are): at most ``remote_wait_s`` per request, then what is missing is recomputed. A producer
        whose settings differ from ours is logged by name and not waited for; nor is anything while ``tier_down``
        (our lookups count the tier as down: they are misses without asking, so waiting cannot help)."""
        announced = self._announced_tokens(request)
        if announced is None:
            return False
        req_id = request.request_id
        expected = min(announced, len(request.prompt_token_ids or []) - 1)
        if hit >= expected:
            self._wait_until.pop(req_id, None)
            return False
        if tier_down:
            if self._wait_until.get(req_id) != 0.0:
                self._wait_until[req_id] = 0.0
                self.stats["remote_waits_tier_down"] += 1
                logger.warning("Range: request %s: lookups count the tier as down; recomputing the %d announced "
                               "tokens at once (%d visible)", req_id, expected, hit)
            return False
        now = time.monotonic()
        until = self._wait_until.setdefault(req_id, now + self.remote_wait_s)
        if until and now < until:
            self.stats["remote_waits"] += 1
            return True
        if until:
            self._wait_until[req_id] = 0.0
            self.stats["remote_wait_timeouts"] += 1
            logger.warning("Range: request %s: %d of the %d announced tokens arrived within %.1f s; recomputing the "
                           "rest", req_id, hit, expected, self.remote_wait_s)
        return False

    # ------------------------------------------------------------------------------------------- producer
    def track(self, request: EngineRequest, *, num_stored_chunks: int, tail_stored: bool) -> None:
        """Follow the saves of a request that will be announced (``num_stored_chunks`` leading full chunks, and with
        ``tail_stored`` the whole prompt, were on the tier at its lookup); other requests are not followed."""
        if not self.inputs.get(request).wants_announcement:
            return
        ledger = self._ledgers.setdefault(request.request_id, SaveLedger())
        ledger.num_stored_at_lookup_chunks = max(ledger.num_stored_at_lookup_chunks, num_stored_chunks)
        ledger.tail_stored_at_lookup = ledger.tail_stored_at_lookup or tail_stored

    def plan_saves(self, req_id: str, first_chunk_idx: int, end_chunk_idx: int,
                   save: RequestTransfer | None) -> RequestTransfer | None:
        """Note a step's save plan of a followed request and return it marked ``confirm`` (others: unchanged).

        Args:
            first_chunk_idx: ``[first_chunk_idx, end_chunk_idx)``: the full chunks this plan covered; those it
                does not save were already stored (the DRAM tier's index).
            save: the plan (``planning.plan_save``), or ``None``.
        """
        ledger = self._ledgers.get(req_id)
        if ledger is None or req_id in self._open:
            return save
        planned = {c.chunk_idx for c in save.chunks} if save is not None else set()
        ledger.already_stored.update(c for c in range(first_chunk_idx, end_chunk_idx) if c not in planned)
        for c in planned:  # (a chunk saved again after a failed load starts over)
            ledger.planned.add(c)
            ledger.confirmations.pop(c, None)
            ledger.failed.discard(c)
        return dataclasses.replace(save, confirm=True) if save is not None and planned else save

    def redo_from(self, req_id: str, num_saved_chunks: int, tail_saved: bool) -> None:
        """A load of a followed request failed: chunks from ``num_saved_chunks`` on (and the partial last one unless
        ``tail_saved``) count as stored only once saved again."""
        ledger = self._ledgers.get(req_id)
        if ledger is None:
            return
        ledger.num_stored_at_lookup_chunks = min(ledger.num_stored_at_lookup_chunks, num_saved_chunks)
        ledger.tail_stored_at_lookup = ledger.tail_stored_at_lookup and tail_saved
        ledger.already_stored = {c for c in ledger.already_stored if c < num_saved_chunks}

    def learn(self, save_results: Iterable[tuple[str, int, bool]]) -> None:
        """Count the workers' ``(req_id, chunk_idx, stored)`` reports (all ranks of a step, aggregated by vLLM);
        reports of requests or chunks not followed are ignored."""
        for req_id, chunk_idx, stored in save_results:
            ledger = self._ledgers.get(req_id)
            if ledger is None or chunk_idx not in ledger.planned:
                continue
            if stored:
                ledger.confirmations[chunk_idx] += 1
            else:
                ledger.failed.add(chunk_idx)

    def drop(self, req_id: str) -> None:
        """Stop following a request that ended without an announcement still open."""
        if req_id not in self._open:
            self._ledgers.pop(req_id, None)

    def announcement(self, request: EngineRequest, state: RequestState | None, *, can_save: bool,
                     chunk_tokens: int) -> dict[str, Any] | None:
        """``kv_transfer_params`` for a finished request that asked for them (``do_remote_decode`` from a
        disaggregated proxy, or ``range_describe``): ``{"range": {"version", "settings", "num_tokens",
        "chain_head"}}``, the prompt tokens this producer knows to be stored; ``None`` otherwise. ``range_expect``
        (the consumer's settings, sent by the proxy) is compared with ours and a mismatch is logged by name.

        While some of the request's saves have no outcome yet (the step's worker report comes after this call), the
        answer names only the chunks confirmed so far and stays open: :meth:`close_open` completes it in place.
        """
        parsed = self.inputs.get(request)
        if not parsed.wants_announcement:
            return None
        info: dict[str, Any] = {"version": 1, "settings": self.settings}
        expect = parsed.expect
        if expect is not None:
            mismatched = settings_mismatch(expect, self.settings)
            if mismatched:
                self.stats["settings_mismatches"] += 1
                logger.error("Range: request %s: the consumer's settings differ from this producer's (%s)",
                             request.request_id, mismatched)
        if can_save and state is not None:
            ledger = self._ledgers.get(state.req_id)
            self._fill(info, state, ledger, chunk_tokens)
            if ledger is not None and ledger.num_unresolved(self.num_saving_ranks):
                self._open[state.req_id] = (info, state, chunk_tokens)
            else:
                self._finish(state.req_id, info, state)
        return {"range": info}

    def close_open(self) -> None:
        """Make every open announcement final, with the confirmations learnt so far (the end of the step in which
        their requests finished: vLLM serializes them after that)."""
        for req_id, (info, state, chunk_tokens) in list(self._open.items()):
            del self._open[req_id]
            self._fill(info, state, self._ledgers.get(req_id), chunk_tokens)
            self._finish(req_id, info, state)

    @property
    def num_followed(self) -> int:
        """Requests whose saves are followed for an announcement (0 when idle)."""
        return len(self._ledgers)

    def _finish(self, req_id: str, info: dict[str, Any], state: RequestState) -> None:
        ledger = self._ledgers.pop(req_id, None)
        if ledger is None:
            return
        unconfirmed = sorted(c for c in ledger.planned if not ledger.is_stored(c, self.num_saving_ranks))
        if unconfirmed:
            self.stats["handoff_unconfirmed_chunks"] += len(unconfirmed)
            logger.warning("Range: request %s: chunks %s were not reported stored by every saving rank (%d); "
                           "announcing %d of the %d prompt tokens", req_id, unconfirmed, self.num_saving_ranks,
                           info.get("num_tokens", 0), len(state.prompt_token_ids))

    def _fill(self, info: dict[str, Any], state: RequestState, ledger: SaveLedger | None, chunk_tokens: int) -> None:
        """Set ``num_tokens`` and ``chain_head`` of ``info`` to the stored prefix: the leading full chunks that are
        stored, then all of the prompt if its partial last chunk is stored too. Without a ledger (a request whose
        saves were not followed) only what the tier held at lookup counts."""
        if ledger is None:
            ledger = SaveLedger(num_stored_at_lookup_chunks=state.num_stored_chunks)
        num_full = len(state.chunk_hashes)
        k = 0
        while k < num_full and ledger.is_stored(k, self.num_saving_ranks):
            k += 1
        num_tokens, head = k * chunk_tokens, (state.chunk_hashes[k - 1] if k else None)
        if (k == num_full and state.tail_hash is not None
                and (ledger.tail_stored_at_lookup or ledger.is_stored(num_full, self.num_saving_ranks))):
            num_tokens, head = len(state.prompt_token_ids), state.tail_hash
        info["num_tokens"] = num_tokens
        info["chain_head"] = head.hex() if head else None
