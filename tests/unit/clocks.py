"""Tests that cannot flake on timing (CONTRIBUTING.md, "No wall-clock thresholds in tests"): virtual clocks, wide waits
for background work, and what a load job was given, read off the job.

* :class:`VirtualClock`, :class:`StillClock`: time that moves only when the test says, for components that take a
  ``clock`` (``MemoryBackend``, the latency wrapper); :func:`virtual_monotonic` for code that reads
  ``time.monotonic()`` itself (the back-off windows of ``scheduler/lookup.py`` and ``worker/saves.py``, the remote
  wait of ``scheduler/handoff.py``); :func:`instant_probes` times background probes on one.
* :func:`wait_until`, :func:`in_background`, :data:`WIDE_S`: waiting for work on other threads with a bound that only
  a hang reaches.
* :func:`record_load_jobs`: the deadline the worker gave each load, checked without timing anything;
  :func:`reads_returned`: every read a held tier got has ended (nothing of an earlier load can still land);
  :func:`probe_timings_once_back`: a probe's timing, from whichever step it came back with.

Held tiers (a tier that answers exactly when the test says) are ``FlakyBackend.hold_reads`` in
:mod:`tests.unit.scheduler_worker_harness`.
"""

from __future__ import annotations

import functools
import threading
import time
import types
from collections.abc import Callable, Sequence
from typing import Any

#: how long a test waits for background work it started (a thread's read, a probe, an asynchronous load) before it
#: fails: far beyond anything a busy machine takes, so that only a hang reaches it
WIDE_S = 30.0
#: the longest a held load waits for the test to release it; then it goes ahead (so code that wrongly waits for the
#: tier gets its data, and the test sees the wrong outcome rather than a hang)
HOLD_MAX_S = 20.0


class VirtualClock:
    """Monotonic seconds that move only when the test says (:meth:`advance`): pass it as a component's ``clock``
    (``MemoryBackend(clock=...)``: lease expiry) and expire things without sleeping."""

    def __init__(self, start_s: float = 1000.0) -> None:
        self.now_s = start_s

    def __call__(self) -> float:
        return self.now_s

    def advance(self, seconds: float) -> None:
        self.now_s += seconds


def virtual_monotonic(monkeypatch: Any, *modules: Any) -> VirtualClock:
    """A :class:`VirtualClock` as ``time.monotonic`` of the given modules (as the modules see it: their ``time``
    name is replaced by a namespace whose ``monotonic`` is the clock, everything else the real ``time``), for code
    that reads ``time.monotonic()`` directly and takes no clock, such as the back-off windows after a tier error
    (``scheduler/lookup.py``, ``worker/saves.py``). The modules themselves are untouched."""
    clock = VirtualClock()
    fake_time = types.SimpleNamespace(**{name: getattr(time, name) for name in dir(time) if not name.startswith("_")})
    fake_time.monotonic = clock
    for module in modules:
        monkeypatch.setattr(module, "time", fake_time)
    return clock


def wait_until(condition: Callable[[], bool], what: str, timeout_s: float = WIDE_S) -> None:
    """Poll ``condition`` until it holds; fail naming ``what`` after ``timeout_s`` (only a hang takes that long)."""
    end = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < end, f"{what}: not within {timeout_s:g} s"
        time.sleep(0.005)


class StillClock:
    """A virtual clock that never moves, counting its readings: a frozen tier on it never reaches its deadline (its
    calls wait, reading the clock, until the tier is unfrozen), and the readings show that a call is waiting."""

    def __init__(self) -> None:
        self.readings = 0

    def __call__(self) -> float:
        self.readings += 1
        return 0.0


def in_background(fn: Callable[[], Any]) -> tuple[threading.Thread, list[Any]]:
    """Run ``fn()`` on a daemon thread (a step that waits for a held tier, say); ``(thread, [its result])``."""
    out: list[Any] = []
    thread = threading.Thread(target=lambda: out.append(fn()), daemon=True)
    thread.start()
    return thread, out


def instant_probes(monkeypatch: Any, probe_s: float = 1e-4) -> None:
    """Background probes (``worker/probes.py``) timed on a virtual clock: every probe takes ``probe_s`` seconds,
    however busy the machine, so what the cost gate decides from a probe's timing is fixed."""
    import range_connector.worker.facade as worker_facade
    from range_connector.worker.probes import probe_chunk

    ticks = iter(range(1 << 62))
    lock = threading.Lock()

    def virtual() -> float:  # each reading is probe_s after the last (a probe reads it at its start and its end)
        with lock:
            return next(ticks) * probe_s

    monkeypatch.setattr(worker_facade, "probe_chunk", functools.partial(probe_chunk, clock=virtual))


def record_load_jobs(monkeypatch: Any) -> list[tuple[Any, float]]:
    """Every ``LoadJob`` the worker starts from now on, with ``time.monotonic()`` read as it starts: its deadline was
    set just before, from a reading taken after any the test took before the step, so for a load given ``d`` seconds
    ``before + d <= job.deadline_at_start_s <= started + d`` holds however busy the machine (what the worker
    decided, checked without timing anything; ``job.deadline`` itself moves on while a pipelined job's forward
    computes)."""
    from range_connector.worker.loads import LoadJob

    jobs: list[tuple[Any, float]] = []
    start = LoadJob.start

    def recording_start(self) -> None:  # type: ignore[no-untyped-def]
        jobs.append((self, time.monotonic()))
        start(self)

    monkeypatch.setattr(LoadJob, "start", recording_start)
    return jobs


def probe_timings_once_back(engine: Any, *steps: Any) -> list[tuple[int, float, bool]]:
    """The probe timings reported by ``steps`` and, until one is back, by further steps without a forward: a probe's
    timing comes back with whichever step ends after the probe did."""
    timings = [t for r in steps if r.worker_meta is not None for t in r.worker_meta.probe_timings]
    end = time.monotonic() + WIDE_S
    while not timings:
        assert time.monotonic() < end, "the probe's timing never came back"
        res = engine.step(forward=False)
        timings += res.worker_meta.probe_timings if res.worker_meta is not None else []
    return timings


def reads_returned(engine: Any, flaky: Sequence[Any]) -> None:
    """Wait until every load call the tier got has returned and the worker's reader thread has run whatever was
    queued on it (the fills of a job that gave up end without reading): no read of an earlier load can land after."""
    wait_until(lambda: all(f.loads_in_flight == 0 for f in flaky), "the tier's load calls returned")
    engine.worker.reader.submit_task(lambda: None).result(timeout=WIDE_S)
    wait_until(lambda: all(f.loads_in_flight == 0 for f in flaky), "the tier's load calls returned")
