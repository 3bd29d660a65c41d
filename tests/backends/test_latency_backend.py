"""The latency-injecting wrapper (range_connector/backends/latency.py) around the DRAM tier: the delay per round
trip and the bandwidth cap are honoured (timed, with generous upper bounds for a loaded 2-core machine), settings
change at run time in-process and from another process through the control file, and a frozen tier turns into
BackendTimeoutError within the backend timeout. The protocol itself is checked by the conformance suite
(``latency`` in tests/backends/test_conformance_*.py)."""

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
SLACK_S = 1.5  # how much later than emulated a call may return on a busy machine


def slowed(timeout_s: float = 5.0, **settings) -> LatencyBackend:
    return LatencyBackend(MemoryBackend(), LatencyControl(TierLatency(**settings)), timeout_s=timeout_s)


def stored(backend, num_bytes: int) -> tuple[str, int]:
    """Write one single-layer stripe of ``num_bytes`` through the unslowed inner backend."""
    sid = uuid.uuid4().hex
    assert backend.inner.write_stripe(StripeWrite(sid, [bytes(num_bytes)], [])) is True
    return sid, num_bytes


def read_all(backend, sid: str, num_bytes: int) -> list[bool]:
    return backend.read_ranges([RangeRead(sid, 0, 0, num_bytes, num_bytes, memoryview(bytearray(num_bytes)))])


def timed(call) -> tuple[object, float]:
    start = time.monotonic()
    result = call()
    return result, time.monotonic() - start


@pytest.mark.timeout(30)
def test_delay_is_added_to_every_round_trip() -> None:
    b = slowed(delay_s=0.05)
    calls = [lambda: b.get_tickets([b"k"]), b.ping, lambda: b.lease(["x"], 1.0), lambda: b.release(["x"]),
             lambda: b.delete_tickets([b"k"]), lambda: b.view_stripes(["x"])]
    for call in calls:
        _, elapsed_s = timed(call)
        assert 0.05 <= elapsed_s < 0.05 + SLACK_S
    before = b.counters.round_trips
    _, elapsed_s = timed(lambda: [b.ping() for _ in range(10)])
    assert 0.5 <= elapsed_s < 0.5 + SLACK_S
    assert b.counters.round_trips - before == 10  # the wrapped backend's own counters, counted once
    assert timed(b.used_bytes)[1] < 0.05  # local accounting: not a round trip


@pytest.mark.timeout(30)
def test_bandwidth_cap_bounds_reads_and_writes() -> None:
    b = slowed(bandwidth_bytes_per_s=32 * MiB)
    sid = uuid.uuid4().hex
    ok, write_s = timed(lambda: b.write_stripe(StripeWrite(sid, [bytes(2 * MiB), bytes(2 * MiB)], [])))
    assert ok is True and 4 / 32 <= write_s < 4 / 32 + SLACK_S
    ok, read_s = timed(lambda: read_all(b, sid, 2 * MiB))
    assert ok == [True] and 2 / 32 <= read_s < 2 / 32 + SLACK_S
    missing, miss_s = timed(lambda: read_all(b, uuid.uuid4().hex, 2 * MiB))
    assert missing == [False] and miss_s < 2 / 32  # a miss moves no bytes


@pytest.mark.timeout(30)
def test_concurrent_reads_share_the_link_of_a_shard() -> None:
    """Four threads reading 1 MiB each at 16 MiB/s take 4/16 s together, not 1/16 s each in parallel."""
    b = slowed(bandwidth_bytes_per_s=16 * MiB)
    sid, n = stored(b, MiB)
    finished: list[float] = []
    barrier = threading.Barrier(4)

    def reader() -> None:
        barrier.wait()
        assert read_all(b, sid, n) == [True]
        finished.append(time.monotonic())

    threads = [threading.Thread(target=reader) for _ in range(4)]
    start = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=20)
    assert len(finished) == 4
    assert 4 / 16 <= max(finished) - start < 4 / 16 + SLACK_S


@pytest.mark.timeout(30)
def test_settings_change_at_run_time_from_another_thread() -> None:
    b = slowed()
    assert timed(b.ping)[1] < 0.2
    changer = threading.Thread(target=lambda: b.control.update(delay_s=0.3, bandwidth_bytes_per_s=8 * MiB))
    changer.start()
    changer.join(timeout=5)
    sid, n = stored(b, MiB)
    assert 0.3 + 1 / 8 <= timed(lambda: read_all(b, sid, n))[1] < 0.3 + 1 / 8 + SLACK_S
    b.control.update(delay_s=0.0, bandwidth_bytes_per_s=0)
    assert timed(lambda: read_all(b, sid, n))[1] < 0.2
    with pytest.raises(ValueError, match="^delay_s: "):
        b.control.update(delay_s=-1.0)
    with pytest.raises(TypeError):
        b.control.update(latency_s=1.0)


@pytest.mark.timeout(30)
def test_frozen_tier_raises_backend_timeout_within_the_backend_timeout() -> None:
    b = slowed(timeout_s=0.4, frozen=True)
    sid, n = stored(b, 1024)
    before = b.counters.snapshot()
    for call in (b.ping, lambda: read_all(b, sid, n), lambda: b.write_stripe(StripeWrite("abc", [b"x"], [])),
                 lambda: b.get_tickets([b"k"])):
        start = time.monotonic()
        with pytest.raises(BackendTimeoutError, match="frozen") as exc_info:
            call()
        assert 0.4 <= time.monotonic() - start < 0.4 + SLACK_S
        assert isinstance(exc_info.value, BackendError) and isinstance(exc_info.value, TimeoutError)
    assert b.counters.snapshot() == before  # a frozen tier does no work
    b.control.update(frozen=False)
    assert read_all(b, sid, n) == [True]


@pytest.mark.timeout(30)
def test_call_waiting_on_a_frozen_tier_goes_ahead_when_unfrozen_before_the_deadline() -> None:
    b = slowed(timeout_s=10.0, frozen=True)
    timer = threading.Timer(0.3, lambda: b.control.update(frozen=False))
    timer.start()
    _, elapsed_s = timed(b.ping)
    timer.join()
    assert 0.3 <= elapsed_s < 0.3 + SLACK_S


@pytest.mark.timeout(30)
def test_call_slower_than_the_deadline_times_out_at_the_deadline() -> None:
    b = slowed(timeout_s=0.3, bandwidth_bytes_per_s=MiB)
    sid, n = stored(b, 4 * MiB)  # 4 s at 1 MiB/s
    small_sid, small_n = stored(b, 64 * 1024)  # 1/16 s
    start = time.monotonic()
    with pytest.raises(BackendTimeoutError, match="deadline"):
        read_all(b, sid, n)
    assert 0.3 <= time.monotonic() - start < 0.3 + SLACK_S
    # The transfer that timed out does not hold the link for the 4 s it would have taken.
    assert read_all(b, small_sid, small_n) == [True]


@pytest.mark.timeout(60)
def test_control_file_written_by_another_process_changes_the_tier(tmp_path) -> None:
    control_file = tmp_path / "tier.json"
    control = LatencyControl(TierLatency(), control_file)  # no file yet: the starting settings hold
    b = LatencyBackend(MemoryBackend(), control, timeout_s=0.5)
    assert timed(b.ping)[1] < 0.2

    def write_from_another_process(**changes) -> None:
        args = ", ".join(f"{k}={v!r}" for k, v in changes.items())
        code = ("from range_connector.backends.latency import write_control_file; "
                f"write_control_file({str(control_file)!r}, {args})")
        subprocess.run([sys.executable, "-c", code], check=True, timeout=30)
        time.sleep(0.15)  # the file is looked at no more often than every 100 ms

    write_from_another_process(delay_s=0.2)
    assert 0.2 <= timed(b.ping)[1] < 0.2 + SLACK_S
    write_from_another_process(frozen=True)
    with pytest.raises(BackendTimeoutError):
        b.ping()
    assert control.current() == TierLatency(delay_s=0.2, frozen=True)
    control_file.write_text("{not json")  # a bad edit is ignored (with a warning); the last good settings hold
    time.sleep(0.15)
    assert control.current() == TierLatency(delay_s=0.2, frozen=True)
    write_control_file(control_file, frozen=False, delay_s=0)
    time.sleep(0.15)
    assert timed(b.ping)[1] < 0.2


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
