"""Admission of hits through the cost model (docs/cost-model.md): with ``load_mode`` ``auto`` the gate takes, shortens
or refuses each hit and picks its load mode; in the fixed modes a load predicted to miss its own deadline is not
started. A refused tier that lives elsewhere is re-measured by a background probe (the worker reads one stored chunk;
:mod:`range_connector.worker.probes`), one in flight at a time, so that a tier that recovers is offered again. The gate
learns ``R`` from the engine's steps and ``B``, ``T0`` from the workers' loads and probes.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterable, MutableMapping
from typing import Any

from range_connector.config import RangeConfig
from range_connector.cost.decision import Action, Decision
from range_connector.cost.gate import CostGate
from range_connector.kv.metadata import RangeWorkerMetadata
from range_connector.kv.tickets import Ticket
from range_connector.histograms import observe
from range_connector.metrics import tier_key
from range_connector.scheduler.planning import LookupResult


def slowest_rank_per_load(load_timings: Iterable[tuple[tuple[str, ...], int, float, bool]],
                          ) -> list[tuple[tuple[str, ...], int, float, bool]]:
    """One timing per load job: the tensor-parallel ranks of one engine each load their head slice of the same
    requests at once and each report it (vLLM aggregates their reports per step); the step waits for the slowest,
    so a job counts once, with the largest bytes per shard, the longest seconds, and complete only if every rank
    finished. (Ranks that finish a job in different steps still report it in different steps.)

    Args:
        load_timings: ``(req_ids, bytes per shard, seconds, complete)`` entries, any number per job.

    Returns:
        The merged entries, in the order their jobs first appear.
    """
    merged: dict[tuple[str, ...], tuple[tuple[str, ...], int, float, bool]] = {}
    for req_ids, shard_bytes, seconds, complete in load_timings:
        key = tuple(req_ids)
        seen = merged.get(key)
        merged[key] = ((key, shard_bytes, seconds, complete) if seen is None else
                       (key, max(seen[1], shard_bytes), max(seen[2], seconds), seen[3] and complete))
    return list(merged.values())


class Admission:
    """The gate's part in one engine's lookups.

    Args:
        config: resolved config (``load_mode``, deadlines, the tier's ``timeout_s``).
        gate: the cost gate, or ``None`` (a producer, or a layout not known yet: every hit is taken).
        chunk_tokens: tokens per chunk.
        remote: the tier lives elsewhere (Valkey, files): probes are background reads, not loads.
        stats: the scheduler's counters (``loads_not_started_late``, ``late_load_probes``).

    Attributes:
        probes: ``[num_shards]`` tickets of one stored chunk per probe, for the next step's metadata.
        decisions: ``req_id -> `` the decision vLLM acted on (matched with the load's realised time).
    """

    def __init__(self, config: RangeConfig, gate: CostGate | None, chunk_tokens: int, *, remote: bool,
                 stats: MutableMapping[str, int]) -> None:
        self.config = config
        self.gate = gate
        self.chunk_tokens = chunk_tokens
        self.remote = remote
        self.stats = stats
        self.probes: list[tuple[Ticket, ...]] = []
        self.decisions: dict[str, Decision] = {}
        self._probe_until = 0.0  # monotonic time until which a probe is in flight
        self._probe_tier: str | None = None  # in a hierarchy: the tier type of the probe in flight
        #: req_id -> in a hierarchy, the farthest tier type its committed load reads (its time is learnt as that's)
        self.load_tiers: dict[str, str | None] = {}
        #: (when the last step was built, its scheduled tokens, its request ids)
        self._last_step: tuple[float, int, set[str]] | None = None

    def refused_unseen(self, num_prompt_tokens: int, num_computed_tokens: int, *, pending: bool) -> Decision | None:
        """With ``load_mode`` ``auto`` on a tier that lives elsewhere: the gate's refusal when no hit of this prompt
        could pay (the tier is slower than recompute for it) and no probe is due; the request is then neither
        looked up nor saved (:meth:`CostGate.refuses_any_hit`). A request whose previous lookup is still running
        (``pending``) is always looked up."""
        if self.gate is None or self.config.load_mode != "auto" or not self.remote or pending:
            return None
        if len(self.config.tiers) > 1:  # (a hierarchy: a nearer tier may pay where the far one does not)
            return None
        decision = self.gate.refuses_any_hit(num_prompt_tokens, num_computed_tokens)
        if decision is None:
            return None
        # (counted as a refusal: its offered_tokens is the prompt's largest possible hit, not a stored one)
        return dataclasses.replace(decision, hit_tokens=num_computed_tokens, reason="not looked up: " + decision.reason)

    def decide(self, lookup: LookupResult, num_prompt_tokens: int) -> None:
        """``load_mode`` ``auto``: the gate weighs the lookup's hit against recomputing it and sets its decision,
        hit and load mode (a probe of a remote tier becomes a background read and the hit is refused)."""
        if self.gate is None:
            return
        c = lookup.num_computed_tokens
        if lookup.runs:  # a tier hierarchy: weighed run by run; a left-out far tier is probed now and then
            decision = self.gate.decide_runs(num_prompt_tokens, c, lookup.runs)
            self._probe_left_out(lookup, decision.hit_tokens)
            lookup.decision = decision
            lookup.num_hit_tokens = max(c, decision.hit_tokens)
            lookup.mode = decision.mode.value
            return
        decision = self.gate.decide(num_prompt_tokens, c, lookup.num_hit_tokens)
        if decision.is_probe and self.remote:
            if self._probe_slot_free(lookup):
                self._queue_probe(lookup)
            decision = dataclasses.replace(decision, action=Action.REFUSE, hit_tokens=c, num_new_tokens=0,
                                           with_load_s=decision.without_load_s,
                                           reason="probe: one chunk read in the background")
        lookup.decision = decision
        lookup.num_hit_tokens = max(c, decision.hit_tokens)
        lookup.mode = decision.mode.value

    def _probe_left_out(self, lookup: LookupResult, hit_tokens: int) -> None:
        """The first tier run the decision leaves out (a far tier slower than recompute for this prompt): have one
        of its chunks read in the background when its probe is due, so that the tier is offered again once it is
        fast again; else count the refusal toward its next probe."""
        assert self.gate is not None and lookup.runs
        start = lookup.num_computed_tokens
        for tier_type, end in lookup.runs:
            if end > hit_tokens:
                if not self.remote or tier_type == "memory":
                    return
                if self._probe_slot_free(lookup) and self.gate.tiers.should_probe(tier_type, time.monotonic()):
                    idx = max(start, hit_tokens) // self.chunk_tokens
                    if idx < len(lookup.tickets):
                        self.probes.append(lookup.tickets[idx])
                        self._probe_until = time.monotonic() + 2.0 * self.config.tier.timeout_s
                        self._probe_tier = tier_type
                        self.stats["tier_probes"] = self.stats.get("tier_probes", 0) + 1
                else:
                    self.gate.tiers.note_refusal(tier_type)
                return
            start = end

    def check_deadline(self, lookup: LookupResult) -> None:
        """The fixed load modes: predict the hit's load, and in ``pipelined`` or ``async`` on a tier that lives
        elsewhere, do not offer a load predicted to take longer than its own deadline (:meth:`CostGate.deadline_s`:
        bounded by what recomputing its tokens would cost), since starting it could only make the request wait out
        the deadline before recomputing anyway (stat ``loads_not_started_late``). When a probe is due (the gate's
        clock: at most one per ``probe_interval_s`` and per ``probe_every_refusals`` such hits) one of its chunks is
        read in the background instead, so that a tier that became fast again is offered again. ``sync`` (kept for
        comparison) always loads."""
        if self.gate is None:
            return
        if lookup.runs and lookup.mode != "sync":
            self._check_run_deadlines(lookup)
            return
        lookup.predicted_s = self.gate.predict_s(lookup.num_computed_tokens, lookup.num_hit_tokens, lookup.runs)
        if lookup.mode == "sync" or not self.remote:
            return
        load_s, recompute_s = lookup.predicted_s
        if load_s <= CostGate.deadline_s(load_s, recompute_s, self.config.min_load_deadline_s,
                                         self.config.load_deadline_s):
            return
        self.stats["loads_not_started_late"] += 1
        if not self._probe_slot_free(lookup):
            self.gate.tiers.note_refusal(self.gate.backend)  # (a probe is in flight)
        elif self.gate.tiers.should_probe(self.gate.backend, time.monotonic()):
            self._queue_probe(lookup)
            self.stats["late_load_probes"] += 1
        lookup.num_hit_tokens = lookup.num_computed_tokens

    def _check_run_deadlines(self, lookup: LookupResult) -> None:
        """:meth:`check_deadline` in a tier hierarchy: the hit keeps the longest prefix of its tier runs whose
        predicted load fits its own deadline (the DRAM run alone when the far run would be late; a DRAM run is
        never cut), and the first run left out is probed when its probe is due."""
        assert self.gate is not None and lookup.runs
        c = lookup.num_computed_tokens
        kept, predicted = c, self.gate.predict_s(c, c)
        for k, (tier_type, end) in enumerate(lookup.runs):
            load_s, recompute_s = self.gate.predict_s(c, end, lookup.runs[:k + 1])
            late = load_s > CostGate.deadline_s(load_s, recompute_s, self.config.min_load_deadline_s,
                                                self.config.load_deadline_s)
            if late and tier_type != "memory":  # (a DRAM run is never cut, as the DRAM tier alone is not)
                break
            kept, predicted = end, (load_s, recompute_s)
        lookup.predicted_s = predicted
        if kept < lookup.num_hit_tokens:
            self.stats["loads_not_started_late"] += 1
            self._probe_left_out(lookup, kept)
            lookup.num_hit_tokens = kept

    def commit(self, req_id: str, lookup: LookupResult, num_external_tokens: int) -> None:
        """vLLM committed to the lookup (``update_state_after_alloc``): the gate counts the decision; in a tier
        hierarchy the load's time is later learnt as its farthest tier's (conservative: the nearer runs' time is
        counted to it too)."""
        if lookup.runs:
            end = lookup.num_computed_tokens + num_external_tokens
            start, loaded = lookup.num_computed_tokens, []
            for tier_type, e in lookup.runs:  # each run's hit tokens taken, and those left out (gate, deadline)
                taken = max(0, min(e, end) - start)
                self._add(tier_key("hit_tokens_taken", tier_type), taken)
                self._add(tier_key("hit_tokens_left_out", tier_type), max(0, e - start) - taken)
                if start < end:
                    loaded.append(tier_type)
                start = e
            if num_external_tokens > 0:
                self.load_tiers[req_id] = loaded[-1] if loaded else None
        if lookup.decision is not None and self.gate is not None:
            self.gate.commit(lookup.decision)
            if num_external_tokens > 0:
                self.decisions[req_id] = lookup.decision

    def _add(self, key: str, n: float) -> None:
        if n:
            self.stats[key] = self.stats.get(key, 0) + n

    def deadline_s(self, lookup: LookupResult) -> float | None:
        """The load's deadline: twice the predicted load, at most what recomputing would cost
        (:meth:`CostGate.deadline_s`); ``None`` (the config's ``load_deadline_s``) without a prediction, e.g. a
        producer's whole prompt (a tail), which a decode engine exists to load."""
        predicted = (lookup.decision.load_s, lookup.decision.recompute_s) if lookup.decision is not None \
            else lookup.predicted_s
        if predicted is None:
            return None
        return CostGate.deadline_s(*predicted, self.config.min_load_deadline_s, self.config.load_deadline_s)

    def take_probes(self) -> list[tuple[Ticket, ...]]:
        """The probes queued since the last step (for its metadata)."""
        probes, self.probes = self.probes, []
        return probes

    def observe_step(self, schedule: Any) -> None:
        """``R`` from the engine's own steps: the time between two steps' plans (``schedule``: vLLM's step schedule,
        :class:`~range_connector.scheduler.engine_view.StepSchedule`)."""
        if self.gate is None:
            return
        now = time.monotonic()
        if self._last_step is not None:
            start_s, tokens, req_ids = self._last_step
            # Only when work was left after that step: once all its requests finished, the engine may have idled
            # until this step's requests arrived, and the gap is no step time (R would be underestimated).
            if tokens > 0 and now - start_s < 10.0 and not req_ids <= set(schedule.finished_req_ids):
                self.gate.observe_step(tokens, now - start_s)
        req_ids = {r.req_id for r in schedule.scheduled_new_reqs}
        req_ids.update(schedule.scheduled_cached_reqs.req_ids)
        self._last_step = (now, schedule.total_num_scheduled_tokens, req_ids)

    def learn(self, report: RangeWorkerMetadata) -> None:
        """``B`` and ``T0`` from the loads and probes the workers finished (a load that ran out of time says only
        that the tier is at least that slow); each decision is matched with its load's realised time."""
        order = [t.type for t in self.config.tiers]
        farthest: dict[tuple[str, ...], str | None] = {}
        for req_ids, _shard_bytes, seconds, _complete in slowest_rank_per_load(report.load_timings):
            known = [t for t in (self.load_tiers.get(r) for r in req_ids) if t in order]
            tier = farthest[req_ids] = max(known, key=order.index) if known else order[-1] if len(order) == 1 \
                else None
            if tier is not None:  # (per tier: the job's farthest tier, as the gate learns it)
                self._add(tier_key("loads", tier), 1)
                self.stats[tier_key("load_seconds", tier)] = self.stats.get(tier_key("load_seconds", tier), 0) + seconds
                observe(self.stats, "load_seconds", tier, seconds)
        if self.gate is None:
            return
        for shard_bytes, seconds, complete in report.probe_timings:
            self._probe_until = 0.0
            tier, self._probe_tier = self._probe_tier, None
            for shard_idx in range(self._num_shards(tier)):
                self.gate.observe_load(shard_idx, shard_bytes, seconds, lower_bound=not complete, probe=True,
                                       tier=tier)
        for req_ids, shard_bytes, seconds, complete in slowest_rank_per_load(report.load_timings):
            decisions = [d for d in (self.decisions.pop(r, None) for r in req_ids) if d is not None]
            probe = bool(decisions) and all(d.is_probe for d in decisions)
            tiers = {self.load_tiers.pop(r, None) for r in req_ids}
            tier = next(iter(tiers)) if len(tiers) == 1 else None  # (a job of loads from several tiers: the gate's)
            for shard_idx in range(self._num_shards(tier)):
                self.gate.observe_load(shard_idx, shard_bytes, seconds, lower_bound=not complete, probe=probe,
                                       tier=tier)
            for decision in decisions:
                self.gate.record_load(decision, seconds)
                self._observe_gated(decision, seconds, complete, farthest.get(req_ids))

    def _observe_gated(self, decision: Decision, seconds: float, complete: bool, tier: str | None) -> None:
        """The gate's prediction of an admitted load against its realised ``seconds``, by the load's farthest tier:
        counters ``gate_predicted_load_seconds`` and ``gate_realised_load_seconds`` and the histogram
        ``gate_load_ratio`` (realised / predicted). Loads cut by their deadline (``complete`` false: their seconds
        are a lower bound) and probes are left out."""
        predicted_s = decision.load_s
        if (tier is None or not complete or decision.is_probe or decision.action is Action.REFUSE
                or not 0 < predicted_s < float("inf")):
            return
        self._add(tier_key("gate_predicted_load_seconds", tier), predicted_s)
        self._add(tier_key("gate_realised_load_seconds", tier), seconds)
        observe(self.stats, "gate_load_ratio", tier, seconds / predicted_s)

    def forget(self, req_id: str) -> None:
        """The request ended."""
        self.decisions.pop(req_id, None)
        self.load_tiers.pop(req_id, None)

    def _num_shards(self, tier: str | None) -> int:
        assert self.gate is not None
        if tier is None:
            return self.gate.num_shards
        return 1 if tier == "memory" else self.config.num_shards

    def _probe_slot_free(self, lookup: LookupResult) -> bool:
        """Whether no probe is in flight and the lookup has a stored chunk past what vLLM holds to probe."""
        return (time.monotonic() >= self._probe_until
                and lookup.num_computed_tokens // self.chunk_tokens < len(lookup.tickets))

    def _queue_probe(self, lookup: LookupResult) -> None:
        """Have the worker read the first chunk of the lookup's hit in the background with the next step (one probe
        in flight at a time: until its timing comes back, at most twice the tier's ``timeout_s``)."""
        self.probes.append(lookup.tickets[lookup.num_computed_tokens // self.chunk_tokens])
        self._probe_until = time.monotonic() + 2.0 * self.config.tier.timeout_s
