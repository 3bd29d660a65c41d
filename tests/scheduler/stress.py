"""The fence stress workload on the real-scheduler harness (:mod:`tests.scheduler.real_scheduler`).

A seeded random workload on a small KV pool: prompts that share prefixes of different lengths (so that loads,
vLLM's own prefix-cache hits and saves overlap), decodes that grow until vLLM preempts, client aborts between steps
and in the middle of a step (through ``finish_requests``, requests in ``WAITING_FOR_REMOTE_KVS`` included), and every
read and write held at the tier for a random number of engine steps (:class:`StepDelays`: events released by the
step count, never a sleep), so that copies are still in flight when vLLM frees and reuses their blocks.
:class:`CopyTracker` counts those: at each free of a request's blocks (``KVCacheManager.free``), the loads and saves
of that request that have not ended.

The oracles: attention checks every token's KV after each layer's load (``model_runner.py``); at the end every
chunk the workers reported stored is loaded again by a request of its prompt and checked byte for byte; no load
found a corrupt or vanished chunk (nothing corrupts the tier here); :meth:`RealEngine.assert_settled`.
"""

from __future__ import annotations

import random
import threading
from collections import Counter
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass, field
from typing import Any
from unittest import mock

from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.request import Request, RequestStatus

from range_connector.errors import BackendTimeoutError
from range_connector.kv.namespace import ChunkHash
from range_connector.worker.direct_receive import WriteGate
from range_connector.worker.loads import LoadJob
from tests.scheduler.real_scheduler import CHUNK_TOKENS, WIDE_S, RealEngine, prompt

__all__ = ["CopyTracker", "LateLoadWrite", "StepDelays", "StressReport", "Workload", "run_stress"]


class LateLoadWrite(AssertionError):
    """An asynchronous load wrote into the KV cache after vLLM had freed its request's blocks."""


# ---------------------------------------------------------------------------------------------- the delayed copier
class StepDelays:
    """Holds each read or write at the tier (``GatedBackend.delay``) for a random number of engine steps.

    Each call draws its delay from its kind's own generator (reads come from the banks' reader thread, writes from
    the saver thread, each in order), in ``[0, max_steps[kind]]``, and waits until :meth:`advance` has been called
    that many times. No wall clock: a call is released by the step count, by :meth:`open_reads` (the forward waits
    for a pipelined load now: the reads of this step pass), or by :meth:`release_all`.

    Args:
        seed: the seed of both generators.
        max_read_steps, max_write_steps: the longest delay of a read, of a write (0: never held).
    """

    def __init__(self, seed: int, *, max_read_steps: int, max_write_steps: int) -> None:
        self._rng = {"read": random.Random(f"{seed}-read"), "write": random.Random(f"{seed}-write")}
        self._max = {"read": max_read_steps, "write": max_write_steps}
        self._cond = threading.Condition()
        self.step = 0
        self._reads_open_at = -1  # reads pass while self.step == this
        self.enabled = True
        self.num_parked: Counter[str] = Counter()
        #: calls held at least one step, per kind
        self.num_held: Counter[str] = Counter()

    def __call__(self, what: str) -> None:
        with self._cond:
            if not self.enabled:
                return
            n = self._rng[what].randint(0, self._max[what])
            if n == 0 or (what == "read" and self._reads_open_at == self.step):
                return
            release_at = self.step + n
            self.num_held[what] += 1
            self.num_parked[what] += 1
            try:
                if not self._cond.wait_for(lambda: not self.enabled or self.step >= release_at or (
                        what == "read" and self._reads_open_at == self.step), WIDE_S):
                    raise BackendTimeoutError(f"a {what} held for {n} steps was not released within {WIDE_S} s")
            finally:
                self.num_parked[what] -= 1

    def advance(self) -> None:
        """One engine step begins: calls whose delay has passed go through."""
        with self._cond:
            self.step += 1
            self._cond.notify_all()

    def open_reads(self) -> None:
        """Until the next step, reads go through (a pipelined load's reader must not wait for a step that cannot
        begin before the forward, which waits for the load, ends)."""
        with self._cond:
            self._reads_open_at = self.step
            self._cond.notify_all()

    def reads_parked(self) -> bool:
        with self._cond:
            return self.num_parked["read"] > 0

    def release_all(self) -> None:
        """Stop holding anything, and release what is held."""
        with self._cond:
            self.enabled = False
            self._cond.notify_all()


# ---------------------------------------------------------------------------------------------- copies in flight
def _reads_done(job: LoadJob) -> bool:
    """Every read of the job ended (on the direct path its fills, on the bank path its banks)."""
    return all(f.done() for f in getattr(job, "_fills", ())) and all(b.done.done() for b in getattr(job, "_banks", ()))


@dataclass
class _Load:
    req_ids: frozenset[str]
    job: LoadJob
    delivery: Future | None  # an asynchronous load's delivery thread; None for the step's job

    def in_flight(self) -> bool:
        return not (self.job.finished or (self.delivery is not None and self.delivery.done())) \
            or not _reads_done(self.job)


class CopyTracker:
    """Which loads and saves of each request have not ended, and how often vLLM freed a request's blocks while one
    had not (wraps the worker's ``start_load``, ``save`` and ``saver.take_saved``, and listens to
    :attr:`RealEngine.on_free`).

    A load is in flight until its delivery ended and every read of it returned (a read held at the tier after the
    load was cancelled still counts); an asynchronous save until its write ended; and the loads and saves of the
    step that is running (planned by ``schedule()``, not yet run by the worker: a request aborted in the middle of
    a step) until the worker ran it.

    It also watches the asynchronous loads that were in flight when vLLM freed their request's blocks: any write
    of theirs into the KV cache that begins after that (a direct receive entering the job's ``WriteGate``, a copy
    out of a bank in ``LoadJob._copy``: :meth:`wrote`, called by :func:`run_stress`) is a late write, whether or not
    a request reads those blocks later.

    Attributes:
        at_free: ``{"load": n, "save": n, "step": n}``: frees of a request's blocks with such a copy in flight.
        late_writes: what :meth:`check` raises about.
        saved: every chunk the workers reported stored.
        dropped: every chunk a load found gone or corrupt (reported to the scheduler).
    """

    def __init__(self, eng: RealEngine) -> None:
        self.eng = eng
        self.loads: list[_Load] = []
        self.saves: list[tuple[frozenset[str], Future]] = []
        self.at_free: Counter[str] = Counter()
        self.saved: set[ChunkHash] = set()
        self.dropped: list[ChunkHash] = []
        self.late_writes: list[str] = []
        self._by_gate: dict[int, LoadJob] = {}  # id(job._gate) -> asynchronous job (held: ids stay unique)
        self._freed: dict[int, tuple[LoadJob, str]] = {}  # id(job) -> (job, request freed while it ran)
        worker = eng.worker
        real_start, real_save, real_take = worker.start_load, worker.save, worker.saver.take_saved

        def start_load(meta: Any) -> None:
            known = {id(job) for job, _fut in worker._async_jobs.values()}
            real_start(meta)
            for job, fut in worker._async_jobs.values():
                if id(job) not in known:
                    self.loads.append(_Load(frozenset(r.req_id for r in job.reqs), job, fut))
                    self._by_gate[id(job._gate)] = job
            if worker._step_job is not None:
                self.loads.append(_Load(frozenset(r.req_id for r in worker._step_job.reqs), worker._step_job, None))

        def save(meta: Any) -> None:
            before = set(worker.saver._pending)
            real_save(meta)
            new = set(worker.saver._pending) - before
            req_ids = frozenset(r.req_id for r in meta.saves)
            self.saves.extend((req_ids, fut) for fut in new)

        def take_saved() -> list:
            saved = real_take()
            self.saved.update(h for h, _group, _tickets in saved)
            return saved

        lookup = eng.range.lookup
        real_learn = lookup.learn

        def learn(saved: Any, dropped: Any) -> None:
            self.dropped.extend(dropped)
            real_learn(saved, dropped)

        worker.start_load, worker.save, worker.saver.take_saved = start_load, save, take_saved
        lookup.learn = learn
        eng.on_free.append(self._on_free)

    def _on_free(self, request: Request, block_ids: list[int]) -> None:
        req_id = request.request_id
        self.loads = [load for load in self.loads if load.in_flight()]
        self.saves = [(ids, fut) for ids, fut in self.saves if not fut.done()]
        if any(req_id in load.req_ids for load in self.loads):
            self.at_free["load"] += 1
            for load in self.loads:
                if req_id in load.req_ids and load.delivery is not None:
                    self._freed[id(load.job)] = (load.job, f"{req_id} (blocks {block_ids})")
        if any(req_id in ids for ids, _fut in self.saves):
            self.at_free["save"] += 1
        so = self.eng.executing
        if so is not None:
            plan = so.kv_connector_metadata.plan
            if any(r.req_id == req_id for r in (*plan.loads, *plan.saves)):
                self.at_free["step"] += 1

    def wrote(self, job: LoadJob | None, how: str) -> None:
        """A write of ``job`` into the KV cache begins (``how``: a receive, a bank copy)."""
        if job is not None and id(job) in self._freed:
            self.late_writes.append(f"{how} began in the blocks of {self._freed[id(job)][1]} after vLLM freed them")

    def gate_job(self, gate: WriteGate) -> LoadJob | None:
        """The asynchronous load whose write gate this is."""
        return self._by_gate.get(id(gate))

    def check(self) -> None:
        """Raises:
            LateLoadWrite: a load wrote into blocks vLLM had freed.
        """
        if self.late_writes:
            seen = list(dict.fromkeys(self.late_writes))
            raise LateLoadWrite(f"{len(self.late_writes)} late writes: " + "; ".join(seen[:3]))


# ---------------------------------------------------------------------------------------------- the workload
@dataclass(frozen=True)
class Workload:
    """The shape of one stress run (every choice inside it comes from ``seed``).

    Attributes:
        num_requests: requests that arrive, at random steps in ``[0, arrival_steps)``.
        num_families: prompts are one family's prefix (a random number of whole blocks, possibly none) and a
            suffix of their own; some repeat an earlier prompt whole.
        abort_p: per step, the chance that a client aborts a live request between steps.
        abort_waiting_p: per step, the chance that a client aborts a request in ``WAITING_FOR_REMOTE_KVS``
            between steps, when there is one.
        mid_step_abort_p: per step, the chance that a request of the step with a load or save in it is aborted
            after ``schedule()``, while the step runs.
        fail_read_p: per step, the chance that the tier's next read fails (transient: vLLM recomputes).
        short_p: the share of requests that stop after 1-4 tokens (the others decode up to ``max_new_tokens``):
            they end while their last saves are still being written.
    """

    num_requests: int = 60
    arrival_steps: int = 50
    num_families: int = 6
    family_tokens: int = 128
    max_suffix_tokens: int = 48
    max_new_tokens: int = 64
    short_p: float = 0.4
    repeat_p: float = 0.15
    abort_p: float = 0.03
    abort_waiting_p: float = 0.3
    mid_step_abort_p: float = 0.06
    fail_read_p: float = 0.0


@dataclass
class StressReport:
    """What one run produced (printed by the test, each count > 0 asserted)."""

    steps: int = 0
    preemptions: int = 0
    aborts: int = 0
    aborts_waiting_for_kv: int = 0
    aborts_mid_step: int = 0
    at_free: dict[str, int] = field(default_factory=dict)
    held: dict[str, int] = field(default_factory=dict)
    loaded_tokens: int = 0
    local_hit_tokens: int = 0
    saved_chunks: int = 0
    verified_chunks: int = 0

    @property
    def in_flight_at_free(self) -> int:
        return sum(self.at_free.values())

    def line(self) -> str:
        return (f"steps={self.steps} preemptions={self.preemptions} aborts={self.aborts} "
                f"(waiting-for-KV {self.aborts_waiting_for_kv}, mid-step {self.aborts_mid_step}) "
                f"in-flight-at-free={self.in_flight_at_free} {dict(self.at_free)} held={dict(self.held)} "
                f"loaded={self.loaded_tokens} local-hits={self.local_hit_tokens} saved-chunks={self.saved_chunks} "
                f"verified-chunks={self.verified_chunks}")


def _prompts(rng: random.Random, seed: int, w: Workload) -> list[list[int]]:
    families = [prompt(w.family_tokens, 1000 * seed + f) for f in range(w.num_families)]
    out: list[list[int]] = []
    for i in range(w.num_requests):
        if out and rng.random() < w.repeat_p:
            out.append(list(rng.choice(out)))
            continue
        prefix = rng.choice(families)[:16 * rng.randint(0, w.family_tokens // 16)]
        out.append(prefix + prompt(rng.randint(8, w.max_suffix_tokens), 1000 * seed + 100 + i))
    return out


def drain_unless_held(eng: RealEngine, delays: StepDelays) -> Callable[[], None]:
    """The runner's wait for asynchronous loads before ``get_finished``: wait for every load that is not stuck
    behind a read held at the tier (reads run in order on one thread), so that a load that can end is reported
    in the same step whatever the threads' timing."""
    def drain() -> None:
        deadline_polls = int(WIDE_S / 0.05)
        for _ in range(deadline_polls):
            held = delays.reads_parked()
            waitable = [fut for job, fut in eng.worker._async_jobs.values()
                        if not fut.done() and (not held or _reads_done(job))]
            if not waitable:
                return
            wait(waitable, timeout=0.05, return_when=FIRST_COMPLETED)
        raise AssertionError("an asynchronous load did not end")
    return drain


def run_stress(eng: RealEngine, seed: int, workload: Workload, delays: StepDelays) -> StressReport:
    """Run the workload to its end, then load every stored chunk again; returns the counts.

    Raises:
        KVMismatch: attention read wrong KV (:class:`~tests.scheduler.model_runner.KVMismatch`).
        LateLoadWrite: a load wrote into blocks vLLM had freed.
        AssertionError: any other oracle (stored chunks, bookkeeping). Whatever happens, nothing is left held at
            the tier.
    """
    tracker = CopyTracker(eng)
    eng.gate.delay = delays
    real_copy, real_enter = LoadJob._copy, WriteGate.__enter__
    real_wait_for_layer, real_drain = eng.worker.wait_for_layer, eng.runner._drain

    def copy(job: LoadJob, *args: Any) -> None:
        tracker.wrote(job, "a bank copy")
        real_copy(job, *args)

    def enter(gate: WriteGate) -> None:
        real_enter(gate)  # (raises once the job closed its gate)
        tracker.wrote(tracker.gate_job(gate), "a receive")

    def wait_for_layer(layer_name: str) -> None:
        job = eng.worker._step_job
        if job is not None and not job.finished:
            delays.open_reads()  # the forward waits for this step's load now
        real_wait_for_layer(layer_name)

    eng.worker.wait_for_layer = wait_for_layer  # type: ignore[method-assign]
    eng.runner._drain = drain_unless_held(eng, delays)  # type: ignore[method-assign]
    try:
        with mock.patch.object(LoadJob, "_copy", copy), mock.patch.object(WriteGate, "__enter__", enter):
            report, prompts = _drive(eng, seed, workload, delays, tracker)
            # Everything settles: the held calls go through, the background writes end.
            delays.release_all()
            eng.gate.fail_reads = 0
            assert eng.worker.wait_for_saves(WIDE_S)
            eng.add("flush", prompt(4, 7 + seed))  # one more step brings the last saves' reports
            eng.run()
            tracker.check()
    finally:
        delays.release_all()
        eng.worker.wait_for_layer, eng.runner._drain = real_wait_for_layer, real_drain  # type: ignore[method-assign]
    eng.assert_settled()
    report.preemptions = eng.num_preemptions
    report.at_free = dict(tracker.at_free)
    report.held = dict(delays.num_held)
    report.loaded_tokens = eng.range.tally.counts["loaded_tokens"]
    report.local_hit_tokens = eng.local_hits
    _verify(eng, prompts, tracker, report)
    return report


def _drive(eng: RealEngine, seed: int, w: Workload, delays: StepDelays, tracker: CopyTracker
           ) -> tuple[StressReport, list[list[int]]]:
    """The workload's steps, until every request ended."""
    rng = random.Random(seed)
    report = StressReport()
    prompts = _prompts(rng, seed, w)
    arrivals = sorted((rng.randrange(w.arrival_steps), i) for i in range(w.num_requests))
    max_tokens = [rng.randint(1, 4) if rng.random() < w.short_p else rng.randint(1, w.max_new_tokens)
                  for _ in prompts]

    def abort_in_step(so: SchedulerOutput) -> list[str]:
        if rng.random() >= w.mid_step_abort_p:
            return []
        plan = so.kv_connector_metadata.plan
        busy = sorted({r.req_id for r in (*plan.loads, *plan.saves)})
        if not busy:
            return []
        report.aborts_mid_step += 1
        report.aborts += 1
        return [rng.choice(busy)]

    for step in range(1000):
        while arrivals and arrivals[0][0] <= step:
            _, i = arrivals.pop(0)
            eng.add(f"r{i}", prompts[i], max_tokens=max_tokens[i])
        if not arrivals and not eng.scheduler.has_requests() and not eng.batch_queue:
            return report, prompts
        live = sorted(r for r, req in eng.scheduler.requests.items() if not req.is_finished())
        waiting = [r for r in live if eng.request(r).status == RequestStatus.WAITING_FOR_REMOTE_KVS]
        for candidates, p in ((live, w.abort_p), (waiting, w.abort_waiting_p)):
            if candidates and rng.random() < p:
                victim = rng.choice(candidates)
                was_waiting = eng.request(victim).status == RequestStatus.WAITING_FOR_REMOTE_KVS
                if eng.abort(victim):
                    report.aborts += 1
                    report.aborts_waiting_for_kv += was_waiting
        if rng.random() < w.fail_read_p:
            eng.gate.fail_reads = 1
        delays.advance()
        eng.step(abort_after_schedule=abort_in_step)
        tracker.check()
        report.steps += 1
    raise AssertionError("the workload did not end within 1000 steps")


def _verify(eng: RealEngine, prompts: list[list[int]], tracker: CopyTracker, report: StressReport) -> None:
    """Every chunk the workers reported stored is loaded again, from an engine whose own prefix cache is empty,
    by a request of its prompt (one token longer, so that the whole stored prefix is a hit), and attention checks
    it byte for byte; nothing was found gone or corrupt."""
    saved = set(tracker.saved)  # (the requests below save what was not stored yet)
    report.saved_chunks = len(saved)
    verified: set[ChunkHash] = set()
    for i, p in enumerate(dict.fromkeys(tuple(p) for p in prompts)):
        # The previous request's background writes end first: one still in flight when ``stored`` is read could land
        # before this request's lookup, which would then (rightly) load a chunk more than was counted.
        assert eng.worker.wait_for_saves(WIDE_S)
        eng.scheduler.reset_prefix_cache()
        request = eng.add(f"v{i}", list(p) + prompt(1, 5000 + i), max_tokens=1)
        chain = eng.range._chain(request)[0]
        stored = len(eng.range.stored_prefix(chain))
        eng.run()
        allocs = eng.calls("update_state_after_alloc", f"v{i}")
        external = allocs[0].info["num_external_tokens"] if allocs else 0
        assert external == stored * CHUNK_TOKENS, (
            f"v{i}: {stored} chunks stored, {external} tokens loaded; stored after its run: "
            f"{len(eng.range.stored_prefix(chain))}, prompt {len(p)} tokens, scheduler stats {eng.range.stats}")
        verified.update(chain[:stored])
    report.verified_chunks = len(verified)
    assert saved <= verified, f"{len(saved - verified)} stored chunks were never loaded again"
    assert not tracker.dropped and eng.worker.stats["load_integrity_errors"] == 0, \
        f"a load found {len(tracker.dropped)} chunks gone or corrupt: {dict(eng.worker.stats)}"
    eng.assert_settled()
