"""Orderings that only vLLM's real scheduler produces, each a named scenario on :mod:`tests.scheduler.real_scheduler`.

Every scenario ends with the two oracles: attention in every step read exactly the KV of its prefix (a loaded block
is byte-identical to the same block recomputed), and :meth:`RealEngine.assert_settled` (vLLM's block pool whole,
no lease on the tier or in Range's scheduler, no request state, Range's token tally equal to vLLM's count of
external hits). Each scenario also runs once with the naive handling of its ordering swapped in
(``..._catches_the_naive_ordering``), where a check must fire: the checks are not vacuous.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future

import pytest
import torch
from vllm.v1.request import RequestStatus

import range_connector.scheduler.facade
from range_connector.metrics import LoadTally
from range_connector.scheduler.planning import scheduled_progress
from range_connector.scheduler.saves_in_flight import SavesInFlight
from range_connector.worker.loads import LoadJob
from range_connector.worker.saves import StripeSaver
from tests.scheduler.real_scheduler import WIDE_S, RealEngine, prompt

pytestmark = pytest.mark.timeout(120)

#: a prefix of three chunks (96 tokens, six blocks) that a first request stores
STORED_TOKENS = 96


def _stored_prefix(eng: RealEngine, seed: int) -> list[int]:
    x = prompt(STORED_TOKENS, seed)
    eng.produce("P", x + prompt(4, seed + 1))
    return x


# ---------------------------------------------------------------------------------------------------- 1
def _finish_in_the_loading_step(eng: RealEngine, how: str) -> None:
    x = _stored_prefix(eng, 1)
    eng.add("B", x + prompt(8, 3), max_tokens=1 if how == "stops" else 4)
    rec = eng.step(abort_after_schedule=["B"] if how == "aborted-mid-step" else ())
    assert [r.req_id for r in rec.scheduler_output.kv_connector_metadata.plan.loads] == ["B"]
    if how == "stops":
        assert rec.finished == {"B": "length"}
    # The ordering: vLLM finished B (request_finished) before it handed Range the connector output of the very step
    # that loaded B (update_connector_output, whose report says B's load ended).
    order = [(c.hook, c.req_ids) for c in eng.hook_log if c.step == rec.idx
             and c.hook in ("request_finished", "update_connector_output")]
    assert order == [("request_finished", ("B",)), ("update_connector_output", ("B",))]
    eng.run()
    assert eng.range.tally.counts == {"loaded_tokens": STORED_TOKENS, "failed_tokens": 0, "aborted_tokens": 0,
                                      "preempted_load_tokens": 0, "loaded_tokens@file": STORED_TOKENS}, \
        f"tally: {eng.range.tally.counts}"
    eng.assert_settled()
    assert eng.freed["B"] == 1


@pytest.mark.parametrize("how", ["stops", "aborted-mid-step"])
def test_request_finished_before_the_connector_output_of_the_same_step(engine, how: str) -> None:
    """A request whose last step loads its prefix: vLLM calls ``request_finished`` (it stopped, or a client aborted it
    while the step ran) before ``update_connector_output`` brings that step's report. The load still settles as
    loaded, its leases go, and nothing of the request is left behind."""
    _finish_in_the_loading_step(engine(load_mode="pipelined"), how)


def test_request_finished_before_the_connector_output_of_the_same_step_catches_the_naive_ordering(
        engine, monkeypatch: pytest.MonkeyPatch) -> None:
    def settle_at_finish(self: LoadTally, req_id: str) -> None:
        # Naive: "the request's last connector output has arrived by now", so what is unsettled was aborted.
        planned = self._planned.pop(req_id, None)
        if planned is not None:
            self.counts["aborted_tokens"] += sum(n for _, n in planned.chunk_tokens)

    monkeypatch.setattr(LoadTally, "request_finished", settle_at_finish)
    with pytest.raises(AssertionError, match="tally"):
        _finish_in_the_loading_step(engine(load_mode="pipelined"), "stops")


def test_a_producer_finished_before_its_save_report_announces_only_what_is_stored(engine) -> None:
    """The same ordering on a prefill engine (``kv_producer``): the request's only step computes and saves its whole
    prompt, the write fails, and vLLM finishes the request (and sends its announcement) before that step's report
    reaches Range. A decode engine must not be told of KV that is not stored (it would wait ``remote_wait_s``)."""
    eng = engine(kv_role="kv_producer")
    x = prompt(100, 5)
    eng.gate.fail_writes = True
    request = eng.add("Q", x, kv_transfer_params={"do_remote_decode": True})
    rec = eng.step()
    assert rec.finished == {"Q": "length"}
    assert [c.hook for c in eng.hook_log if c.step == rec.idx and c.hook in (
        "request_finished", "update_connector_output")] == ["request_finished", "update_connector_output"]
    [call] = eng.calls("request_finished", "Q")
    announced = call.result[1]["range"]["num_tokens"]
    stored_chunks = len(eng.range.stored_prefix(*eng.range._chain(request)))
    assert announced <= stored_chunks * 32, f"announced {announced} tokens, {stored_chunks} chunks stored"


# ---------------------------------------------------------------------------------------------------- 2
def _abort_while_waiting(eng: RealEngine) -> None:
    x = _stored_prefix(eng, 11)
    eng.gate.reads.hold()  # the tier does not answer the load's read until the test says so
    eng.add("C", x + prompt(40, 13), max_tokens=2)
    eng.step()  # C is admitted: blocks for its hit, an asynchronous load started, C waits for it
    assert eng.request("C").status == RequestStatus.WAITING_FOR_REMOTE_KVS
    eng.gate.reads.wait_parked()
    c_blocks = eng.block_ids("C")
    assert len(c_blocks) == STORED_TOKENS // 16
    eng.abort("C")
    # vLLM keeps C's blocks (delay_free_blocks): the load may still write them.
    assert eng.freed["C"] == 0 and "C" in eng.scheduler.requests
    assert eng.range.num_leases == 0 and eng.live_leases() == 0  # (request_finished released them)
    before = eng.runner.block_bytes(c_blocks)
    rec = eng.step()  # the worker hears of the abort, stops the load and reports it: vLLM frees the blocks now
    assert rec.kv_output is not None and rec.kv_output.finished_recving == {"C"}
    assert eng.freed["C"] == 1 and "C" not in eng.scheduler.requests
    eng.add("D", prompt(180, 14), max_tokens=6)  # a new request computes in the freed blocks
    eng.step()
    d_blocks = eng.block_ids("D")
    assert set(c_blocks) & set(d_blocks), "the aborted request's blocks were reused"
    d_before = eng.runner.block_bytes(c_blocks)
    eng.gate.reads.release()  # the read in flight at the abort completes, after the free
    eng.worker._async_loader.submit(lambda: None).result(WIDE_S)  # (the delivery thread is done with it)
    assert torch.equal(eng.runner.block_bytes(c_blocks), d_before), "a write landed in the aborted request's blocks"
    eng.run()  # D's attention reads only D's KV in every later step
    assert eng.range.tally.counts["aborted_tokens"] == STORED_TOKENS
    assert eng.range.tally.counts["loaded_tokens"] == 0
    eng.assert_settled()
    assert eng.freed["C"] == 1
    assert not torch.equal(before, d_before)  # (D did write there: the check above could see a late write)


@pytest.mark.parametrize("path", ["direct", "bank"])
def test_abort_while_waiting_for_remote_kvs(engine, path: str) -> None:
    """A client aborts a request whose asynchronous load is in flight (``WAITING_FOR_REMOTE_KVS``, the read held at
    the tier). vLLM frees its blocks only once the worker reports the load finished; after that, nothing lands in
    them, even when the held read completes while another request computes there. Blocks freed once, leases
    released, the tally settles the promised tokens as aborted. ``path``: the read lands straight in the KV cache,
    or in a transfer bank first."""
    _abort_while_waiting(engine(load_mode="async", scatter=path == "direct", num_blocks=16))


@pytest.mark.parametrize("path", ["direct", "bank"])
def test_abort_while_waiting_for_remote_kvs_catches_the_naive_ordering(engine, monkeypatch, path: str) -> None:
    # Naive: the abort is reported to vLLM (so it frees the blocks) without stopping the load that writes them.
    monkeypatch.setattr(LoadJob, "cancel", lambda self: None)
    with pytest.raises(AssertionError, match="a write landed|wrong KV"):
        _abort_while_waiting(engine(load_mode="async", scatter=path == "direct", num_blocks=16))


# ---------------------------------------------------------------------------------------------------- 3
def _preempt_and_readmit(eng: RealEngine) -> None:
    # The ordering under test is a re-admission while the request's own store is still in flight: Range's wait for
    # saves in flight (section 6) would hold R2 back until lookup_wait_s, so it is off here.
    eng.range.saves_in_flight.wait_s = 0.0
    x = _stored_prefix(eng, 21)
    eng.gate.writes.hold()  # the stores issued from here on stay in flight (vllm#46014)
    eng.add("R1", prompt(46, 23), max_tokens=30)  # a decode that needs a new block soon
    eng.step()
    r2_prompt = x + prompt(160, 24)
    eng.add("R2", r2_prompt, max_tokens=4)
    eng.run(until=lambda: eng.request("R2").num_preemptions > 0)
    assert eng.tokens["R2"] == [], "R2 was preempted in the middle of its prefill"
    assert eng.gate.writes.num_parked >= 1, "a store of R2's was in flight when it was preempted"
    eng.run(until=lambda: eng.request("R2").status in (RequestStatus.RUNNING, RequestStatus.WAITING_FOR_REMOTE_KVS))
    # Re-admitted with its store still in flight: looked up again, offered exactly what is stored.
    readmission = [c for c in eng.calls("update_state_after_alloc", "R2")][-1]
    assert readmission.info["num_external_tokens"] == STORED_TOKENS
    assert eng.gate.writes.num_parked >= 1
    eng.gate.writes.release()
    eng.run()
    assert eng.worker.wait_for_saves(WIDE_S)
    assert eng.vllm_preempted_hits == STORED_TOKENS
    eng.assert_settled()
    # What R2 saved before and after its preemption is what a later request loads (attention checks every byte).
    eng.add("S", r2_prompt, max_tokens=1)
    eng.run()
    assert eng.calls("update_state_after_alloc", "S")[0].info["num_external_tokens"] == len(r2_prompt) // 16 * 16 - 16
    eng.assert_settled()


@pytest.mark.parametrize("load_mode", ["pipelined", "async"])
def test_preemption_with_a_pending_load_and_readmission(engine, load_mode: str) -> None:
    """vllm#46014's ordering on a small pool: a request is preempted in the middle of its prefill while a store of
    its chunks is still in flight, then re-admitted (after an asynchronous load, as a resumed request) while that
    store is still in flight. It is looked up again and offered only what is stored, its KV is right in every step,
    the chunks it saves from its new blocks are right for the next reader, and everything settles (the tally
    counts the re-admission's load as a preempted request's, as vLLM does)."""
    _preempt_and_readmit(engine(load_mode=load_mode, save_mode="async", num_blocks=20, max_num_batched_tokens=64))


def test_preemption_with_a_pending_load_and_readmission_catches_the_naive_ordering(engine, monkeypatch) -> None:
    def blocks_appended_on_resume(requests, schedule):
        # Naive: a resumed request's block table is taken as more blocks for the old one (as for a running request).
        cached = schedule.scheduled_cached_reqs
        resumed, cached.resumed_req_ids = cached.resumed_req_ids, set()
        try:
            return scheduled_progress(requests, schedule)
        finally:
            cached.resumed_req_ids = resumed

    monkeypatch.setattr(range_connector.scheduler.facade, "scheduled_progress", blocks_appended_on_resume)
    with pytest.raises(AssertionError, match="wrong KV"):
        _preempt_and_readmit(engine(load_mode="pipelined", save_mode="async", num_blocks=20,
                                    max_num_batched_tokens=64))


# ---------------------------------------------------------------------------------------------------- 4
def _free_then_reuse(eng: RealEngine, save_mode: str) -> None:
    x = prompt(STORED_TOKENS, 31)
    stored_at_finish: list[int] = []
    real_finished = eng.connector.request_finished

    def finished(request, block_ids):  # what the tier holds when vLLM finishes the request
        stored_at_finish.append(len(eng.range.stored_prefix(eng.range._chain(request)[0])))
        return real_finished(request, block_ids)

    eng.connector.request_finished = finished
    if save_mode == "async":
        eng.gate.writes.hold()  # the background write of A's chunks waits until B has overwritten A's blocks
    eng.add("A", x + prompt(8, 32), max_tokens=1)
    rec = eng.step()  # A computes its whole prompt, its chunks are saved in this step, and it finishes
    assert rec.finished == {"A": "length"}
    a_blocks = list(rec.scheduler_output.scheduled_new_reqs[0].block_ids[0])
    [call] = eng.calls("request_finished", "A")
    assert call.result == (False, None), "Range never asks vLLM to delay freeing"
    assert eng.freed["A"] == 1 and eng.num_free_blocks() == eng.num_blocks - 1  # ... so the blocks are free now
    if save_mode == "async":
        eng.gate.writes.wait_parked()
        assert stored_at_finish == [0]
    else:
        assert stored_at_finish == [STORED_TOKENS // 32], "a synchronous save is stored before the request ends"
    a_kv = eng.runner.block_bytes(a_blocks)
    eng.add("B", prompt((eng.num_blocks - 1) * 16, 33), max_tokens=1)  # takes every free block, A's included
    rec = eng.step()
    assert set(a_blocks) <= set(rec.scheduler_output.scheduled_new_reqs[0].block_ids[0])
    assert not torch.equal(eng.runner.block_bytes(a_blocks), a_kv), "B overwrote A's former blocks"
    eng.run()
    eng.gate.writes.release()
    assert eng.worker.wait_for_saves(WIDE_S)
    assert all(not c.info.get("finished_sending") for c in eng.calls("update_connector_output"))
    eng.add("C", x + prompt(8, 34), max_tokens=1)
    eng.run()  # C loads what A saved; attention checks it byte for byte against A's prefix
    assert eng.calls("update_state_after_alloc", "C")[0].info["num_external_tokens"] == STORED_TOKENS
    eng.assert_settled()


@pytest.mark.parametrize("save_mode", ["sync", "async"])
def test_delayed_free_keeps_blocks_until_finished_sending(engine, save_mode: str) -> None:
    """Range never delays a free (``request_finished`` returns ``(False, ...)``, no ``finished_sending``): what makes
    that safe is that a step's saves copy their blocks out of the KV cache inside the step that computed them,
    before vLLM sees the step's output and can free and reuse the blocks. Synchronous saves are on the tier when the
    request ends; asynchronous ones are written later from their copy, after another request overwrote the freed
    blocks, and still hold the first request's KV."""
    _free_then_reuse(engine(save_mode=save_mode, num_blocks=16), save_mode)


def test_delayed_free_keeps_blocks_until_finished_sending_catches_the_naive_ordering(engine, monkeypatch) -> None:
    eng = engine(save_mode="async", num_blocks=16)
    valve = eng.gate.writes
    real_save = StripeSaver.save
    waits: list[Future] = []  # (the saver's pending set holds them weakly)

    def save_when_written(self: StripeSaver, chunks, context, *args, **kwargs) -> None:
        # Naive: the background writer reads the blocks when it writes them, after the step (and after the free).
        done: Future = Future()

        def later() -> None:
            valve.pass_through()  # the write's turn comes
            before = set(self._pending)
            real_save(self, chunks, context, *args, **kwargs)  # copies the blocks out now, then queues the write
            for write in set(self._pending) - before:
                write.result()
            done.set_result(None)

        threading.Thread(target=later, daemon=True).start()
        waits.append(done)
        self._pending.add(done)

    monkeypatch.setattr(StripeSaver, "save", save_when_written)
    with pytest.raises(AssertionError, match="wrong KV"):
        _free_then_reuse(eng, "async")


# ---------------------------------------------------------------------------------------------------- 5
@pytest.mark.parametrize("overlap", [False, True], ids=["sync-scheduling", "async-scheduling"])
def test_load_failure_reported_after_the_next_step_was_scheduled(engine, overlap: bool) -> None:
    """R's load fails (a transient tier error); vLLM rewinds R and recomputes it. With asynchronous scheduling the
    step after the failing one was scheduled before vLLM knew, and computed R's next tokens on top of the failed
    KV. R is aborted after recomputing 192 tokens, so the chunk computed on top of the failure (tokens 192-223)
    was not written again from good KV: no stored chunk may hold that KV. Then S loads R's prompt.

    Before saves carried ``failures_learnt_through`` (the worker skips what was planned before the scheduler learnt
    of a failure), the async-scheduling case failed here with ``KVMismatch: S -> 192 -> [27, 28, 29, 30]``."""
    eng = engine(load_mode="pipelined", overlap=overlap, max_num_batched_tokens=64)
    x = _stored_prefix(eng, 41)
    r_prompt = x + prompt(160, 43)
    eng.gate.fail_reads = 1  # R's load fails; the tickets stay (the tier is only unreachable for a moment)
    eng.add("R", r_prompt, max_tokens=2)
    rewound = [False]

    def recomputed_192() -> bool:
        r = eng.request("R")
        failed = eng.range.tally.counts["failed_tokens"] == STORED_TOKENS
        rewound[0] = rewound[0] or (failed and r.num_computed_tokens < STORED_TOKENS)
        return rewound[0] and r.num_computed_tokens >= 192

    eng.run(until=recomputed_192)
    eng.abort("R")
    eng.add("S", r_prompt, max_tokens=1)
    eng.run()  # S loads the stored prefix of R's prompt; attention checks every byte of it
    eng.assert_settled()


# ---------------------------------------------------------------------------------------------------- 6
def _arrive_while_the_prefix_is_written(eng: RealEngine) -> None:
    x = prompt(STORED_TOKENS, 61)
    eng.gate.writes.hold()  # A's store stays in flight
    eng.add("A", x + prompt(4, 62), max_tokens=1)
    eng.run()
    eng.gate.writes.wait_parked(1)  # A's store, written on the saver thread, waits at the tier
    eng.add("B", x + prompt(8, 63), max_tokens=1)

    def b_asked_three_times_or_scheduled() -> bool:
        b = eng.scheduler.requests.get("B")
        return b is None or b.status != RequestStatus.WAITING or len(eng.calls("get_num_new_matched_tokens", "B")) >= 3

    eng.run(until=b_asked_three_times_or_scheduled)
    b = eng.scheduler.requests.get("B")
    assert b is not None and b.status == RequestStatus.WAITING, "B was scheduled while its prefix was being written"
    eng.gate.writes.release()
    assert eng.worker.wait_for_saves(WIDE_S)
    eng.run()  # the write's report reaches Range's scheduler; B is admitted with its hit
    [admission] = eng.calls("update_state_after_alloc", "B")
    assert admission.info["num_external_tokens"] == STORED_TOKENS, "B missed the prefix that was being written"
    eng.assert_settled()


def test_a_request_arriving_while_its_prefix_is_written_waits_and_loads_it(engine) -> None:
    """With background saves (Range's default), B arrives while A's store of the same prefix is held at the tier.
    vLLM's scheduler keeps B waiting (Range answers "ask again") while it runs its steps, and admits it with the whole
    stored prefix once the write ended; attention checks every loaded byte."""
    _arrive_while_the_prefix_is_written(engine(load_mode="pipelined", save_mode="async"))


def test_a_request_arriving_while_its_prefix_is_written_catches_the_naive_ordering(engine, monkeypatch) -> None:
    # Naive: look up at once, whatever is in flight; B misses the prefix a few steps from being stored.
    monkeypatch.setattr(SavesInFlight, "should_wait", lambda self, req_id, hashes, first: False)
    with pytest.raises(AssertionError, match="was scheduled while|missed the prefix"):
        _arrive_while_the_prefix_is_written(engine(load_mode="pipelined", save_mode="async"))
