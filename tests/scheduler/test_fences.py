"""Fences between copies and compute, under stress on vLLM's real scheduler (:mod:`tests.scheduler.stress`).

The three guarantees (docs/architecture.md, "Fences"): an asynchronous save reads its blocks only after the step
that wrote them finished; a load never writes into a block that a running request still reads; a block freed while
its save or load is in flight is not reused before the copy is fenced. :func:`test_fences_hold_under_stress` runs a
seeded random workload (a small KV pool, shared prefixes with vLLM's prefix cache on, preemption, client aborts
between steps and in the middle of one, every tier read and write held for a random number of steps) and checks
every token's KV in every step, every stored chunk loaded again, and the bookkeeping; it reports how many
preemptions, aborts and copies in flight at free time it produced, and asserts each is above zero. Each
``test_mutation_*`` removes one fence, with the copier delayed, and the same oracles must catch it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from range_connector.connector import RangeConnector
from range_connector.worker.facade import RangeWorker
from range_connector.worker.loads import LoadJob
from range_connector.worker.saves import StripeSaver
from tests.scheduler.model_runner import LAYER_NAMES
from tests.scheduler.real_scheduler import KVMismatch, RealEngine, prompt
from tests.scheduler.stress import (
    LateLoadWrite,
    StepDelays,
    StressReport,
    Workload,
    run_stress,
)

pytestmark = pytest.mark.timeout(180)

#: the KV pool: 21 usable blocks (336 tokens) for prompts of up to 176 tokens that decode up to 64 more
NUM_BLOCKS = 22


def _stress(engine: Callable[..., RealEngine], seed: int, load_mode: str, save_mode: str, *,
            scatter: bool = True, max_read_steps: int = 3, max_write_steps: int = 4,
            workload: Workload | None = None) -> StressReport:
    """One stress run. Transient read failures are injected with asynchronous loads only: with layer-pipelined
    loads and vLLM's prefix cache they hit a vLLM limitation and a Range bug of their own (the two ``xfail`` tests
    below)."""
    eng = engine(load_mode=load_mode, save_mode=save_mode, scatter=scatter, num_blocks=NUM_BLOCKS,
                 max_num_batched_tokens=128, max_num_seqs=8, prefix_caching=True)
    if eng.range.saves_in_flight is not None:
        # No waiting for saves in flight (test_orderings.py tests it): a held write's report comes with this step or
        # the next, as the saver thread goes, and a wait on it would make admission, and so the preemptions this
        # run must produce, depend on thread timing.
        eng.range.saves_in_flight.wait_s = 0.0
    # A pipelined load's reads are held too, until attention asks for the layer (StepDelays.open_reads); a
    # synchronous save's write is never held (it runs on the engine's thread, inside the step).
    delays = StepDelays(seed, max_read_steps=max_read_steps, max_write_steps=max_write_steps if save_mode == "async"
                        else 0)
    workload = workload or Workload(fail_read_p=0.05 if load_mode == "async" else 0.0)
    return run_stress(eng, seed, workload, delays)


STRESS = [pytest.param(seed, load_mode, "async", id=f"seed{seed}-{load_mode}-load-async-save")
          for seed in (1, 2, 3) for load_mode in ("async", "pipelined")]
STRESS += [pytest.param(4, load_mode, "sync", id=f"seed4-{load_mode}-load-sync-save")
           for load_mode in ("async", "pipelined")]


@pytest.mark.parametrize(("seed", "load_mode", "save_mode"), STRESS)
def test_fences_hold_under_stress(engine, seed: int, load_mode: str, save_mode: str) -> None:
    """The oracles hold for every request of the workload, and the run produced what it is meant to stress:
    preemptions, aborts, and frees of blocks whose copy was still in flight. ``seed`` 2 loads through the transfer
    banks, the others straight into the KV cache (direct receive)."""
    report = _stress(engine, seed, load_mode, save_mode, scatter=seed != 2)
    print(f"\nfences seed={seed} load={load_mode} save={save_mode}: {report.line()}")
    assert report.preemptions > 0, report.line()
    assert report.aborts > 0, report.line()
    assert report.in_flight_at_free > 0, report.line()


# ---------------------------------------------------------------------------------------------------- mutations
class _GatherLater(list):
    """A stripe's values not gathered yet (mutation a): what ``_gather_stripe`` would have copied."""

    def __init__(self, *args: Any) -> None:
        super().__init__()
        self.args = args


def test_mutation_the_saver_copies_the_blocks_when_it_writes(engine, monkeypatch: pytest.MonkeyPatch) -> None:
    """Fence removed: an asynchronous save gathers its blocks out of the KV cache in the step that computed them
    (``StripeSaver.save``). Mutated, the saver thread copies them when their write's turn comes (held at the tier
    for some steps), after vLLM may have freed the blocks and given them to another request."""
    real_gather, real_write = StripeSaver._gather_stripe, StripeSaver._write_stripes
    delays: list[StepDelays] = []

    def write_then_gather(self: StripeSaver, stripes: list, *args: Any) -> None:
        delays[0]("write")  # the copier's turn comes late
        real_write(self, [(s, backend, chunks, real_gather(self, *values.args) if isinstance(values, _GatherLater)
                           else values, *rest) for s, backend, chunks, values, *rest in stripes], *args)

    monkeypatch.setattr(StripeSaver, "_gather_stripe", lambda self, *args: _GatherLater(*args))
    monkeypatch.setattr(StripeSaver, "_write_stripes", write_then_gather)
    real_stress = run_stress

    def run(eng: RealEngine, seed: int, workload: Workload, d: StepDelays) -> StressReport:
        delays.append(d)
        return real_stress(eng, seed, workload, d)

    monkeypatch.setattr(f"{__name__}.run_stress", run)
    with pytest.raises(KVMismatch) as caught:
        _stress(engine, 1, "pipelined", "async")
    print(f"\ncaught: {type(caught.value).__name__}: {caught.value}")


def test_mutation_the_save_copies_before_the_step_finished(engine, monkeypatch: pytest.MonkeyPatch) -> None:
    """Fence removed: the worker saves in ``wait_for_save``, after every layer of the step ran
    (``RangeConnector.save_kv_layer`` does nothing). Mutated, the save gathers its blocks at the first layer's
    ``save_kv_layer``, while the later layers of the step have not written their KV yet."""
    def save_at_the_first_layer(self: RangeConnector, layer_name: str, *args: Any, **kwargs: Any) -> None:
        if layer_name == LAYER_NAMES[0]:
            self._worker.save(self._bound_metadata())

    monkeypatch.setattr(RangeConnector, "save_kv_layer", save_at_the_first_layer)
    monkeypatch.setattr(RangeConnector, "wait_for_save", lambda self: None)
    with pytest.raises(KVMismatch) as caught:
        _stress(engine, 1, "async", "async")
    print(f"\ncaught: {type(caught.value).__name__}: {caught.value}")


def _cancel_without_closing(self: LoadJob) -> None:
    # LoadJob.cancel without `self._gate.close()` and `with self.lock: self.closed = True`: reads not started yet
    # are skipped, but one already at the tier lands (direct receive) or is copied from its bank.
    self._cancelled.set()
    for event in self._delivered:
        event.set()
    for b in self._banks[self._next_group:]:
        self._abandon(b)
    self._next_group = len(self.groups) if hasattr(self, "groups") else 0


@pytest.mark.parametrize("path", ["direct", "bank"])
def test_mutation_a_cancelled_load_still_writes(engine, monkeypatch: pytest.MonkeyPatch, path: str) -> None:
    """Fence removed: ``LoadJob.cancel`` closes the job's write gate and lock, waiting for a write in progress, so
    an aborted load whose read is still at the tier never writes once vLLM freed its blocks. Mutated, the read
    lands in blocks another request now computes in."""
    monkeypatch.setattr(LoadJob, "cancel", _cancel_without_closing)
    with pytest.raises((LateLoadWrite, KVMismatch)) as caught:
        _stress(engine, 1, "async", "async", scatter=path == "direct")
    print(f"\ncaught: {type(caught.value).__name__}: {caught.value}")


def test_mutation_an_aborted_load_is_reported_before_it_stops(engine, monkeypatch: pytest.MonkeyPatch) -> None:
    """Fence removed: ``RangeWorker.get_finished`` cancels an aborted request's load before it reports it finished
    (vLLM frees the blocks on that report). Mutated, the load is reported and runs on."""
    real_get_finished = RangeWorker.get_finished

    def report_without_cancel(self: RangeWorker, finished_req_ids: set[str]) -> set[str]:
        for req_id in finished_req_ids:
            job, fut = self._async_jobs.get(req_id, (None, None))
            if job is not None and not fut.done():
                job.cancel = lambda: None  # type: ignore[method-assign]
        return real_get_finished(self, finished_req_ids)

    monkeypatch.setattr(RangeWorker, "get_finished", report_without_cancel)
    with pytest.raises((LateLoadWrite, KVMismatch)) as caught:
        _stress(engine, 1, "async", "async")
    print(f"\ncaught: {type(caught.value).__name__}: {caught.value}")


# ---------------------------------------------------------------------------------------------------- found by it
#: a prefix of three chunks (96 tokens, six blocks)
STORED_TOKENS = 96


def test_a_save_computed_on_blocks_shared_with_a_failed_load_is_not_stored(engine) -> None:
    """A's layer-pipelined load fails (a transient tier error). In the same step B, whose prompt starts with the
    same prefix, is scheduled on A's blocks: vLLM caches the blocks of a synchronous load when it allocates them,
    so B's local prefix-cache hit is the blocks A's load has not written yet. B computes two chunks on top of them
    and saves them in that step. vLLM rewinds both (A recomputes the shared blocks). Found by the stress test: the
    worker skipped only A's saves, so B's chunks were stored with valid checksums of wrong KV, and C loaded them
    (``KVMismatch``). Saves now carry the blocks their KV was computed on (``prefix_block_ids``), and the worker
    skips those that depend on a block whose failed load the scheduler had not heard of."""
    eng = engine(load_mode="pipelined", prefix_caching=True)
    x = prompt(STORED_TOKENS, 71)
    eng.produce("P", x + prompt(4, 72))
    eng.scheduler.reset_prefix_cache()  # (P's blocks out of vLLM's cache: A's hit is Range's)
    eng.gate.fail_reads = 1
    eng.add("A", x + prompt(8, 73), max_tokens=2)
    b_prompt = x + prompt(72, 74)
    eng.add("B", b_prompt, max_tokens=2)
    rec = eng.step()
    plan = rec.scheduler_output.kv_connector_metadata.plan
    assert [r.req_id for r in plan.loads] == ["A"] and [r.req_id for r in plan.saves] == ["B"]
    assert eng.calls("get_num_new_matched_tokens", "B")[0].info["num_computed_tokens"] == STORED_TOKENS
    assert rec.kv_output.invalid_block_ids, "A's load failed"
    eng.run()
    assert eng.worker.wait_for_saves(60)
    eng.scheduler.reset_prefix_cache()
    eng.add("C", b_prompt + prompt(1, 75), max_tokens=1)
    eng.run()  # C loads B's chunks: attention checks them against the prefix's KV
    eng.assert_settled()


@pytest.mark.xfail(strict=True, raises=KVMismatch, reason=(
    "vLLM 0.32 keeps the blocks of a failed synchronous load in its prefix cache under kv_load_failure_policy "
    "'recompute' (Scheduler._handle_invalid_blocks evicts them only under 'fail'), expecting their request to "
    "recompute them; a request aborted (or preempted) before it does leaves them to the next hit"))
def test_vllm_serves_the_blocks_of_a_failed_load_that_nobody_recomputed(engine) -> None:
    """Not Range's to fix (and why the stress test injects read failures only with asynchronous loads, whose
    blocks vLLM caches only once they landed): A's pipelined load fails, A is aborted before it recomputes, and D
    with the same prefix is served A's unwritten blocks from vLLM's own prefix cache."""
    eng = engine(load_mode="pipelined", prefix_caching=True)
    x = prompt(STORED_TOKENS, 81)
    eng.produce("P", x + prompt(4, 82))
    eng.scheduler.reset_prefix_cache()
    eng.gate.fail_reads = 1
    eng.add("A", x + prompt(8, 83), max_tokens=4)
    rec = eng.step()
    assert rec.kv_output.invalid_block_ids, "A's load failed"
    eng.abort("A")
    eng.add("D", x + prompt(8, 84), max_tokens=1)
    eng.run()
    eng.assert_settled()
