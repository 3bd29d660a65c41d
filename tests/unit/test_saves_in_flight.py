"""Background saves (``save_mode`` ``"async"``) and the requests that arrive while they are written: the scheduler
asks such a request again later rather than let it miss the chunks in flight (``range_connector.scheduler.
saves_in_flight``), up to ``lookup_wait_s``, and stops waiting as soon as every write ended, stored or not."""

from __future__ import annotations

import pytest

from range_connector.backends.latency import LatencyBackend, LatencyControl, TierLatency
from range_connector.errors import BackendError
from range_connector.scheduler.saves_in_flight import SavesInFlight
from tests.unit.clocks import WIDE_S, StillClock, wait_until
from tests.unit.scheduler_worker_harness import Engine, FakeRequest, prompt_tokens, shard_backends, wrap


class StepClock:
    """A clock the test moves."""

    def __init__(self) -> None:
        self.now_s = 100.0

    def __call__(self) -> float:
        return self.now_s


def _record(num_saving_ranks: int = 1, wait_s: float = 5.0):
    clock, stats = StepClock(), {}
    return SavesInFlight(num_saving_ranks, wait_s, stats, clock=clock), clock, stats


H = [bytes([i]) * 16 for i in range(6)]


# ------------------------------------------------------------------------------------------------ the record itself
def test_a_chunk_leaves_the_record_once_every_saving_rank_reported_it_stored() -> None:
    saves, _clock, stats = _record(num_saving_ranks=2)
    saves.planned(H[:2])
    assert saves.should_wait("r", H[:3], 0)
    saves.learn([H[0], H[1]], [])  # one rank of two
    assert saves.should_wait("r", H[:3], 0)
    saves.learn([H[0]], [])  # the other rank, chunk 0 only
    assert len(saves) == 1 and saves.should_wait("r", H[:3], 0)
    saves.learn([H[1]], [])
    assert len(saves) == 0 and not saves.should_wait("r", H[:3], 0)
    assert stats == {"save_waits": 3, "save_wait_timeouts": 0}


def test_one_rank_that_did_not_store_a_chunk_ends_the_wait_for_it() -> None:
    saves, _clock, _stats = _record(num_saving_ranks=2)
    saves.planned(H[:2])
    saves.learn([], [H[1]])  # skipped or failed on one rank: the chunk is incomplete, waiting gains nothing
    assert not saves.should_wait("r", H[1:2], 0) and saves.should_wait("r", H[:2], 0)


def test_only_chunks_past_the_local_hit_are_waited_for() -> None:
    saves, _clock, stats = _record()
    saves.planned(H[:3])
    assert not saves.should_wait("r", H[:3], 3)  # vLLM's own prefix cache holds all three
    assert saves.should_wait("r", H[:3], 2)
    assert not saves.should_wait("s", H[3:5], 0)  # another prompt
    assert stats["save_waits"] == 1


def test_a_request_waits_at_most_wait_s_and_the_timeout_is_counted() -> None:
    saves, clock, stats = _record(wait_s=5.0)
    saves.planned(H[:1])
    assert saves.should_wait("r", H[:1], 0)
    clock.now_s += 4.9
    saves.planned(H[1:2])  # (a later save keeps the record busy; the request's own bound still counts)
    assert saves.should_wait("r", H[:2], 0)
    clock.now_s += 0.1
    assert not saves.should_wait("r", H[:2], 0)
    assert stats == {"save_waits": 2, "save_wait_timeouts": 1}
    assert saves.should_wait("r", H[1:2], 0)  # a new wait of its own starts over (chunk 1 is 0.1 s old)


def test_a_planned_chunk_whose_report_never_comes_expires_after_wait_s() -> None:
    saves, clock, _stats = _record(wait_s=2.0)
    saves.planned(H[:2])
    clock.now_s += 1.0
    saves.planned(H[2:3])
    clock.now_s += 1.0  # the first two are 2 s old: gone, the third stays
    assert len(saves) == 1
    assert not saves.should_wait("r", H[:2], 0) and saves.should_wait("s", H[:3], 0)


def test_a_reset_clears_the_record_and_forget_drops_a_wait() -> None:
    saves, clock, stats = _record(wait_s=5.0)
    saves.planned(H[:2])
    assert saves.should_wait("r", H[:2], 0)
    clock.now_s += 4.0
    saves.forget("r")  # finished: a later request of that id starts its own bound
    clock.now_s += 0.5
    saves.planned(H[:2])
    clock.now_s += 4.0
    assert saves.should_wait("r", H[:2], 0) and stats["save_wait_timeouts"] == 0
    saves.clear()
    assert len(saves) == 0 and not saves.should_wait("r", H[:2], 0)


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match="num_saving_ranks"):
        SavesInFlight(0, 1.0, {})
    with pytest.raises(ValueError, match="wait_s"):
        SavesInFlight(1, -1.0, {})


# ----------------------------------------------------------------------------------------------------- in the engine
def _frozen_writes(backends):
    """Writes through a tier that waits (on a clock that never moves) until the test unfreezes it."""
    clock = StillClock()
    control = LatencyControl(TierLatency(frozen=True), clock=clock)
    return [LatencyBackend(b, control, timeout_s=5.0, sleep=lambda s: None) for b in backends], control, clock


@pytest.mark.timeout(60)
@pytest.mark.parametrize("waits", [True, False], ids=["waits", "without-the-record"])
def test_a_request_arriving_while_its_prefix_is_written_waits_for_the_write_and_hits(waits: bool) -> None:
    # A's save of 4 chunks waits on a frozen tier; B (the same prompt) arrives. Without the record (what Range did
    # before) B's lookup misses all of it; with it, B is asked again while the write is held and hits once the report
    # of the write came back. Lookups read the tier directly (not frozen).
    prompt = prompt_tokens(150, seed=301)
    inner = shard_backends(1, 1)
    slow, control, clock = _frozen_writes(inner)
    control.update(frozen=False)
    eng = Engine(slow, lookup_backends=inner, seed=302, save_mode="async")
    if not waits:
        eng.sched.saves_in_flight = None
    assert eng.admit(FakeRequest("A-0", prompt)) == 0
    control.update(frozen=True)
    readings = clock.readings
    eng.step()  # returns while its save waits on the frozen tier
    wait_until(lambda: clock.readings >= readings + 3, "the save reached the frozen tier")
    eng.finish("A-0")
    b = FakeRequest("B-0", prompt)
    try:
        if not waits:
            assert eng.sched.get_num_new_matched_tokens(b, 0) == (0, False)  # the miss the record prevents
            return
        assert eng.sched.get_num_new_matched_tokens(b, 0) == (None, False)
        assert eng.sched.get_num_new_matched_tokens(b, 128) == (0, False)  # a local hit of all 4: nothing to wait for
        eng.step(forward=False)  # a step with nothing scheduled: the write is still held, nothing reported
        assert eng.sched.get_num_new_matched_tokens(b, 0) == (None, False)
        control.update(frozen=False)
        assert eng.worker.wait_for_saves(WIDE_S)
        eng.step(forward=False)  # the write's report reaches the scheduler
        assert eng.sched.get_num_new_matched_tokens(b, 0) == (128, False)
        assert eng.sched.stats["save_waits"] == 2 and eng.sched.stats["save_wait_timeouts"] == 0
    finally:
        control.update(frozen=False)
        eng.close()


def _engine_whose_writes_fail(seed: int, save_mode: str) -> Engine:
    """An engine on one shard whose every write raises (its lookups see the shard itself)."""
    inner = shard_backends(1, 1)
    [flaky] = wrap(inner)
    flaky.fail_write = BackendError
    return Engine([flaky], lookup_backends=inner, seed=seed, save_mode=save_mode)


@pytest.mark.timeout(60)
def test_a_failed_background_save_ends_the_wait_at_the_next_report() -> None:
    prompt = prompt_tokens(150, seed=303)
    eng = _engine_whose_writes_fail(304, "async")
    assert eng.admit(FakeRequest("A-0", prompt)) == 0
    first = eng.step()
    eng.finish("A-0")
    assert len(eng.sched.saves_in_flight) == 4 or (first.worker_meta and first.worker_meta.unsaved)
    assert eng.worker.wait_for_saves(WIDE_S)
    second = eng.step(forward=False)  # (the failure is reported with this step, or already with the first)
    unsaved = [h for r in (first, second) if r.worker_meta is not None for h in r.worker_meta.unsaved]
    assert len(unsaved) == 4 and not any(r.worker_meta and r.worker_meta.saved for r in (first, second))
    assert len(eng.sched.saves_in_flight) == 0  # (not expired: lookup_wait_s is 5 s, the reports ended them)
    assert eng.sched.get_num_new_matched_tokens(FakeRequest("B-0", prompt), 0) == (0, False)  # nothing to wait for
    assert eng.sched.stats["save_waits"] == 0 and eng.sched.stats["save_wait_timeouts"] == 0
    eng.close()


@pytest.mark.timeout(60)
def test_sync_saves_keep_no_record_and_report_no_unsaved_chunks() -> None:
    prompt = prompt_tokens(150, seed=305)
    eng = _engine_whose_writes_fail(306, "sync")
    assert eng.sched.saves_in_flight is None
    assert eng.admit(FakeRequest("A-0", prompt)) == 0
    res = eng.step()
    assert res.worker_meta is None or not res.worker_meta.unsaved
    eng.close()
