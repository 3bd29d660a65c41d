"""The latency-injecting wrapper (range_connector/backends/latency.py) around the DRAM tier: the delay per round
trip and the bandwidth cap are honoured, settings change at run time in-process and from another process through the
control file, and a frozen tier turns into BackendTimeoutError at the backend timeout. The protocol itself is checked
by the conformance suite (``latency`` in tests/backends/test_conformance_*.py).

Durations are checked on a virtual clock (:class:`VirtualTime`, injected as the wrapper's ``clock`` and ``sleep``):
the wrapper's emulated time is then exact and a busy machine cannot change it, so no test here times a call against
the wall clock. One test shows that the default clock and sleep are real ones (a lower bound only, which sleeping
guarantees).
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
import uuid

import pytest

from range_connector.backends.base import RangeRead, StripeWrite
from range_connector.backends.factory import open_shard_backends
from range_connector.backends.latency import LatencyBackend, LatencyControl, TierLatency, write_control_file
from range_connector.backends.memory import MemoryBackend
from range_connector.config import RangeConfig
from range_connector.errors import BackendError, BackendTimeoutError, ConfigError

MiB = 1 << 20
WIDE_S = 30.0  # how long a thread of a test may take to do what it was started for: only a hang takes longer


class VirtualTime:
    """A clock that moves only when it is told to: ``sleep(s)`` advances it by ``s`` (and records ``s``), and with
    ``tick_s`` every reading advances it by that much (so that a wait on a frozen tier reaches its deadline).
    ``advance=False`` keeps it still on ``sleep`` (threads that sleep at once each see the same start)."""

    def __init__(self, *, tick_s: float = 0.0, advance: bool = True) -> None:
        self.now_s = 1000.0
        self.tick_s = tick_s
        self.advance = advance
        self.sleeps: list[float] = []
        self.readings = 0
        self._lock = threading.Lock()

    def __call__(self) -> float:
        with self._lock:
            self.readings += 1
            self.now_s += self.tick_s
            return self.now_s

    def sleep(self, seconds: float) -> None:
        with self._lock:
            self.sleeps.append(seconds)
            if self.advance:
                self.now_s += seconds


def slowed(clock: VirtualTime, timeout_s: float = 5.0, **settings) -> LatencyBackend:
    return LatencyBackend(MemoryBackend(), LatencyControl(TierLatency(**settings), clock=clock), timeout_s=timeout_s,
                          sleep=clock.sleep)


def stored(backend, num_bytes: int) -> tuple[str, int]:
    """Write one single-layer stripe of ``num_bytes`` through the unslowed inner backend."""
    sid = uuid.uuid4().hex
    assert backend.inner.write_stripe(StripeWrite(sid, [bytes(num_bytes)], [])) is True
    return sid, num_bytes


def read_all(backend, sid: str, num_bytes: int) -> list[bool]:
    return backend.read_ranges([RangeRead(sid, 0, 0, num_bytes, num_bytes, memoryview(bytearray(num_bytes)))])


def timed(clock: VirtualTime, call) -> tuple[object, float]:
    """``call()`` and the virtual seconds it took."""
    start = clock.now_s
    result = call()
    return result, clock.now_s - start


@pytest.mark.timeout(30)
def test_delay_is_added_to_every_round_trip() -> None:
    clock = VirtualTime()
    b = slowed(clock, delay_s=0.05)
    calls = [lambda: b.get_tickets([b"k"]), b.ping, lambda: b.lease(["x"], 1.0), lambda: b.release(["x"]),
             lambda: b.delete_tickets([b"k"]), lambda: b.view_stripes(["x"])]
    for call in calls:
        assert timed(clock, call)[1] == pytest.approx(0.05)
    before = b.counters.round_trips
    assert timed(clock, lambda: [b.ping() for _ in range(10)])[1] == pytest.approx(0.5)
    assert b.counters.round_trips - before == 10  # the wrapped backend's own counters, counted once
    assert timed(clock, b.used_bytes)[1] == 0.0  # local accounting: not a round trip


@pytest.mark.timeout(30)
def test_bandwidth_cap_bounds_reads_and_writes() -> None:
    clock = VirtualTime()
    b = slowed(clock, bandwidth_bytes_per_s=32 * MiB)
    sid = uuid.uuid4().hex
    ok, write_s = timed(clock, lambda: b.write_stripe(StripeWrite(sid, [bytes(2 * MiB), bytes(2 * MiB)], [])))
    assert ok is True and write_s == pytest.approx(4 / 32)
    ok, read_s = timed(clock, lambda: read_all(b, sid, 2 * MiB))
    assert ok == [True] and read_s == pytest.approx(2 / 32)
    missing, miss_s = timed(clock, lambda: read_all(b, uuid.uuid4().hex, 2 * MiB))
    assert missing == [False] and miss_s == 0.0  # a miss moves no bytes


@pytest.mark.timeout(30)
def test_concurrent_reads_share_the_link_of_a_shard() -> None:
    """Four threads reading 1 MiB each at 16 MiB/s at the same moment finish 1/16, 2/16, 3/16 and 4/16 s later:
    4/16 s together, not 1/16 s each in parallel (the clock stands still, so every call starts at the same time)."""
    clock = VirtualTime(advance=False)
    b = slowed(clock, bandwidth_bytes_per_s=16 * MiB)
    sid, n = stored(b, MiB)
    results: list[list[bool]] = []
    barrier = threading.Barrier(4)

    def reader() -> None:
        barrier.wait()
        results.append(read_all(b, sid, n))

    threads = [threading.Thread(target=reader) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=WIDE_S)
    assert results == [[True]] * 4
    assert sorted(clock.sleeps) == pytest.approx([1 / 16, 2 / 16, 3 / 16, 4 / 16])


@pytest.mark.timeout(30)
def test_settings_change_at_run_time_from_another_thread() -> None:
    clock = VirtualTime()
    b = slowed(clock)
    assert timed(clock, b.ping)[1] == 0.0
    changer = threading.Thread(target=lambda: b.control.update(delay_s=0.3, bandwidth_bytes_per_s=8 * MiB))
    changer.start()
    changer.join(timeout=WIDE_S)
    assert not changer.is_alive()
    sid, n = stored(b, MiB)
    assert timed(clock, lambda: read_all(b, sid, n))[1] == pytest.approx(0.3 + 1 / 8)
    b.control.update(delay_s=0.0, bandwidth_bytes_per_s=0)
    assert timed(clock, lambda: read_all(b, sid, n))[1] == 0.0
    with pytest.raises(ValueError, match="^delay_s: "):
        b.control.update(delay_s=-1.0)
    with pytest.raises(TypeError):
        b.control.update(latency_s=1.0)


@pytest.mark.timeout(30)
def test_frozen_tier_raises_backend_timeout_at_the_backend_timeout() -> None:
    clock = VirtualTime(tick_s=0.05)  # every reading moves the clock on: the wait reaches its deadline
    b = slowed(clock, timeout_s=0.4, frozen=True)
    sid, n = stored(b, 1024)
    before = b.counters.snapshot()
    for call in (b.ping, lambda: read_all(b, sid, n), lambda: b.write_stripe(StripeWrite("abc", [b"x"], [])),
                 lambda: b.get_tickets([b"k"])):
        start_s = clock.now_s
        with pytest.raises(BackendTimeoutError, match="frozen") as exc_info:
            call()
        # It gave up once its deadline had passed on the clock (a reading or two late: the clock ticks on every one).
        assert 0.4 <= clock.now_s - start_s <= 0.4 + 3 * clock.tick_s
        assert isinstance(exc_info.value, BackendError) and isinstance(exc_info.value, TimeoutError)
    assert b.counters.snapshot() == before  # a frozen tier does no work
    b.control.update(frozen=False)
    assert read_all(b, sid, n) == [True]


@pytest.mark.timeout(60)
def test_call_waiting_on_a_frozen_tier_goes_ahead_when_unfrozen_before_the_deadline() -> None:
    # The clock stands still, so the deadline never comes: the call can only end by the tier being unfrozen. It waits
    # (the wrapped backend is not touched while frozen), goes ahead once unfrozen, and answers.
    clock = VirtualTime()
    b = slowed(clock, timeout_s=10.0, frozen=True)
    touched_while_frozen: list[bool] = []
    inner_ping = b.inner.ping
    b.inner.ping = lambda: (touched_while_frozen.append(b.control.current().frozen), inner_ping())[1]
    outcome: list[object] = []

    def call() -> None:
        try:
            outcome.append(b.ping())
        except BaseException as exc:  # reported to the test thread
            outcome.append(exc)

    caller = threading.Thread(target=call, daemon=True)
    caller.start()
    end = time.monotonic() + WIDE_S
    while clock.readings < 5 and time.monotonic() < end:  # the call is in its wait loop (it reads the clock there)
        time.sleep(0.01)
    assert clock.readings >= 5 and caller.is_alive() and outcome == [] and touched_while_frozen == []
    b.control.update(frozen=False)
    caller.join(timeout=WIDE_S)
    assert not caller.is_alive()
    assert outcome == [None] and touched_while_frozen == [False]
    assert clock.now_s == 1000.0  # no time passed on the clock: it went ahead before its deadline


@pytest.mark.timeout(30)
def test_call_slower_than_the_deadline_times_out_at_the_deadline() -> None:
    clock = VirtualTime()
    b = slowed(clock, timeout_s=0.3, bandwidth_bytes_per_s=MiB)
    sid, n = stored(b, 4 * MiB)  # 4 s at 1 MiB/s
    small_sid, small_n = stored(b, 64 * 1024)  # 1/16 s
    start_s = clock.now_s
    with pytest.raises(BackendTimeoutError, match="deadline"):
        read_all(b, sid, n)
    assert clock.now_s - start_s == pytest.approx(0.3)  # it slept out the deadline, not the 4 s
    # The transfer that timed out does not hold the link for the 4 s it would have taken.
    assert timed(clock, lambda: read_all(b, small_sid, small_n)) == ([True], pytest.approx(1 / 16))


@pytest.mark.timeout(60)
def test_control_file_written_by_another_process_changes_the_tier(tmp_path) -> None:
    clock = VirtualTime()
    control_file = tmp_path / "tier.json"
    control = LatencyControl(TierLatency(), control_file, clock=clock)  # no file yet: the starting settings hold
    b = LatencyBackend(MemoryBackend(), control, timeout_s=0.5, sleep=clock.sleep)
    assert timed(clock, b.ping)[1] == 0.0

    def write_from_another_process(**changes) -> None:
        args = ", ".join(f"{k}={v!r}" for k, v in changes.items())
        code = ("from range_connector.backends.latency import write_control_file; "
                f"write_control_file({str(control_file)!r}, {args})")
        subprocess.run([sys.executable, "-c", code], check=True, timeout=60)

    def past_the_poll_period() -> None:
        clock.sleep(0.15)  # the file is looked at no more often than every 100 ms

    write_from_another_process(delay_s=0.2)
    past_the_poll_period()
    assert timed(clock, b.ping)[1] == pytest.approx(0.2)
    write_from_another_process(frozen=True)
    past_the_poll_period()
    clock.tick_s = 0.05  # (so that the frozen call reaches its deadline)
    with pytest.raises(BackendTimeoutError):
        b.ping()
    clock.tick_s = 0.0
    assert control.current() == TierLatency(delay_s=0.2, frozen=True)
    control_file.write_text("{not json")  # a bad edit is ignored (with a warning); the last good settings hold
    past_the_poll_period()
    assert control.current() == TierLatency(delay_s=0.2, frozen=True)
    write_control_file(control_file, frozen=False, delay_s=0)
    past_the_poll_period()
    assert timed(clock, b.ping)[1] == 0.0


@pytest.mark.timeout(30)
def test_the_default_clock_and_sleep_are_real_time() -> None:
    b = LatencyBackend(MemoryBackend(), LatencyControl(TierLatency(delay_s=0.05)), timeout_s=5.0)
    start = time.monotonic()
    b.ping()
    assert time.monotonic() - start >= 0.05  # (a lower bound: sleeping guarantees it, a busy machine cannot break it)


@pytest.mark.timeout(10)
@pytest.mark.parametrize(("text", "named"), [("{not json", "not JSON"), ('{"delay": 1}', "delay: unknown key"),
                                              ('{"delay_s": -1}', "delay_s: "), ('{"frozen": 1}', "frozen: "),
                                              ("[1]", "JSON object")])
def test_bad_control_file_at_start_up_is_a_config_error_naming_the_key(tmp_path, text: str, named: str) -> None:
    control_file = tmp_path / "tier.json"
    control_file.write_text(text)
    config = RangeConfig.from_extra_config({"backend": "memory", "tier_control_file": str(control_file)})
    with pytest.raises(ConfigError) as exc_info:
        open_shard_backends(config)
    message = str(exc_info.value)
    assert message.startswith(f"tier_control_file: {control_file}: ") and named in message and "\n" not in message
    with pytest.raises(ValueError):
        write_control_file(tmp_path / "other.json", delay=1)
    assert not (tmp_path / "other.json").exists()


@pytest.mark.timeout(10)
def test_config_wraps_every_shard_with_one_shared_control() -> None:
    plain = open_shard_backends(RangeConfig.from_extra_config({"backend": "memory", "num_shards": 2}))
    assert all(type(b) is MemoryBackend for b in plain)
    config = RangeConfig.from_extra_config({"backend": "memory", "num_shards": 3, "tier_delay_s": 0.01,
                                            "tier_bandwidth_bytes_per_s": 5e8, "backend_timeout_s": 2})
    shards = open_shard_backends(config)
    assert len(shards) == 3 and all(isinstance(b, LatencyBackend) for b in shards)
    assert shards[0] is shards[1] is shards[2]  # one in-process DRAM tier serves every shard: one wrapper
    assert isinstance(shards[0].inner, MemoryBackend) and shards[0].timeout_s == 2.0
    assert shards[0].control.current() == TierLatency(delay_s=0.01, bandwidth_bytes_per_s=5e8)
    assert shards[0].supports_views and shards[0].num_leases() == 0  # capabilities and extras of the tier


def test_a_control_file_present_at_start_up_is_applied(tmp_path) -> None:
    from range_connector.backends.latency import LatencyControl, TierLatency, write_control_file

    path = tmp_path / "tier.json"
    write_control_file(path, frozen=True, delay_s=0.25)
    control = LatencyControl(TierLatency(0.0, 0.0), path)
    assert control.current().frozen is True and control.current().delay_s == 0.25
