"""Latency-injecting wrapper: any backend, slowed down like a remote tier, for tests and benchmarks.

Every call of the stripe-store protocol (:mod:`range_connector.backends.base`) is one round trip; the wrapper makes
it take at least

    ``delay_s + bytes / bandwidth_bytes_per_s``

where ``bytes`` is what crossed the link (layer values and tickets written; bytes actually read) and the bandwidth is
a link shared by all concurrent calls of one shard, one link per direction (reads and writes do not slow each
other): a transfer starts when the previous one on that link has finished. ``bandwidth_bytes_per_s = 0`` means no
cap. ``frozen`` emulates a server that stopped answering: calls wait (without touching the wrapped backend) and
raise :class:`~range_connector.errors.BackendTimeoutError` at the backend deadline ``timeout_s``, or go ahead if
the tier is unfrozen before then. A call whose emulated time would pass the deadline also raises at the deadline
(its wrapped call has run: as on a real tier, a write that timed out may have been stored).

The wrapped backend does the real work first (bytes land in the caller's buffers), then the wrapper sleeps out the
rest of the emulated time; counters are the wrapped backend's own (:attr:`Backend.counters`), so round trips and
bytes are counted exactly once.

The settings live in a :class:`LatencyControl` shared by the wrappers of every shard of a tier. They change at run
time, thread-safely, through :meth:`LatencyControl.update` (in-process) or through a JSON control file (from any
process, e.g. a benchmark driving a vLLM engine), re-read at most every ``poll_s`` (100 ms) when its size, inode or
modification time changes::

    {"delay_s": 0.002, "bandwidth_bytes_per_s": 1.0e9, "frozen": false}

Any subset of the keys may be given; the last change wins, whether it came from the file or from ``update``. Write
the file with :func:`write_control_file` (atomic, so a reader never sees half a file).

Time is read from an injected ``clock`` and slept out with an injected ``sleep`` (``time.monotonic`` and
``time.sleep`` by default), so tests check the emulated durations exactly on a virtual clock instead of timing calls
(tests/backends/test_latency_backend.py).

Config keys (README): ``tier_delay_s``, ``tier_bandwidth_bytes_per_s``, ``tier_control_file``.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from range_connector.backends.base import Backend, RangeRead, StripeWrite
from range_connector.errors import BackendTimeoutError

logger = logging.getLogger("vllm." + __name__)

T = TypeVar("T")
_READ, _WRITE = 0, 1


@dataclass(frozen=True, slots=True)
class TierLatency:
    """How slow the tier is.

    Attributes:
        delay_s: seconds added to every round trip (>= 0).
        bandwidth_bytes_per_s: link bandwidth per shard and direction, bytes/s (0: no cap).
        frozen: whether the tier answers nothing (calls time out at the backend deadline).

    Raises:
        ValueError: a negative or non-finite number, or ``frozen`` not a bool (the message names the field).
    """

    delay_s: float = 0.0
    bandwidth_bytes_per_s: float = 0.0
    frozen: bool = False

    def __post_init__(self) -> None:
        for name in ("delay_s", "bandwidth_bytes_per_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                    or value < 0:
                raise ValueError(f"{name}: {value!r} is not a number >= 0")
        if not isinstance(self.frozen, bool):
            raise ValueError(f"frozen: {self.frozen!r} is not true or false")


def _parse_control(text: str, source: str) -> dict[str, Any]:
    """The changes a control file asks for. Raises ValueError naming the file and the key."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{source}: not JSON ({exc.msg} at line {exc.lineno})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{source}: expected a JSON object, got {type(data).__name__}")
    known = {f.name for f in dataclasses.fields(TierLatency)}
    for key in data:
        if key not in known:
            raise ValueError(f"{source}: {key}: unknown key (known: {', '.join(sorted(known))})")
    try:
        TierLatency(**data)  # validates every given value
    except ValueError as exc:
        raise ValueError(f"{source}: {exc}") from None
    return data


def write_control_file(path: str | os.PathLike[str], **changes: Any) -> None:
    """Write a control file atomically (temporary file, then rename).

    Args:
        path: the file named by ``tier_control_file``.
        **changes: any of ``delay_s``, ``bandwidth_bytes_per_s``, ``frozen``.

    Raises:
        ValueError: an unknown key or a bad value (nothing written).
    """
    path = Path(path)
    text = json.dumps(changes)
    _parse_control(text, str(path))
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


class LatencyControl:
    """The current :class:`TierLatency` of a tier, shared by its shards' wrappers; thread-safe.

    Args:
        settings: the starting settings (from the config).
        control_file: JSON file to follow (``None``: none). A file present at construction must be valid.
        poll_s: the file is looked at no more often than this (seconds).
        clock: monotonic seconds (the poll period and :meth:`wait_until_unfrozen` deadlines are read on it).

    Raises:
        ValueError: the control file exists but is unreadable or invalid (names the file and key).
    """

    def __init__(self, settings: TierLatency, control_file: str | os.PathLike[str] | None = None,
                 poll_s: float = 0.1, *, clock: Callable[[], float] = time.monotonic) -> None:
        self._settings = settings
        self._file = Path(control_file) if control_file else None
        self._poll_s = poll_s
        self.clock = clock
        self._changed = threading.Condition()
        self._next_poll_at = 0.0
        self._file_version: tuple[int, int, int] | None = None
        if self._file is not None:
            with self._changed:
                self._poll(clock(), strict=True)

    def current(self) -> TierLatency:
        """The settings now (re-reads the control file when due)."""
        now = self.clock()
        with self._changed:
            if self._file is not None and now >= self._next_poll_at:
                self._poll(now, strict=False)
            return self._settings

    def update(self, **changes: Any) -> TierLatency:
        """Change some settings at run time (``delay_s``, ``bandwidth_bytes_per_s``, ``frozen``).

        Raises:
            ValueError: an unknown field or a bad value (nothing changed).
        """
        with self._changed:
            self._settings = dataclasses.replace(self._settings, **changes)
            self._changed.notify_all()
            return self._settings

    def wait_until_unfrozen(self, deadline: float) -> TierLatency | None:
        """Block while the tier is frozen; the settings once it is not, ``None`` if ``deadline`` (on
        :attr:`clock`) passes first. The wait itself is real, at most ``poll_s`` at a time, and ends at once when
        :meth:`update` unfreezes the tier."""
        settings = self.current()
        while settings.frozen:
            left_s = deadline - self.clock()
            if left_s <= 0:
                return None
            with self._changed:
                self._changed.wait(min(left_s, self._poll_s))
            settings = self.current()
        return settings

    def _poll(self, now: float, *, strict: bool) -> None:
        """Apply the control file if it changed (the caller holds the lock)."""
        if self._file is None:
            return
        self._next_poll_at = now + self._poll_s
        try:
            st = self._file.stat()
        except FileNotFoundError:
            return
        except OSError as exc:
            if strict:
                raise ValueError(f"{self._file}: {exc.strerror or exc}") from None
            return
        version = (st.st_ino, st.st_size, st.st_mtime_ns)
        if version == self._file_version:
            return
        self._file_version = version
        try:
            changes = _parse_control(self._file.read_text(), str(self._file))
        except (OSError, ValueError) as exc:
            if strict:
                raise ValueError(str(exc)) from None
            logger.warning("tier latency control file ignored: %s", exc)
            return
        self._settings = dataclasses.replace(self._settings, **changes)
        self._changed.notify_all()
        logger.info("tier latency from %s: %s", self._file, self._settings)


class LatencyBackend(Backend):
    """A backend that behaves like ``inner`` on a slower link (see the module docstring).

    Args:
        inner: the backend doing the work (its counters, capacity and capabilities are this wrapper's).
        control: the shared settings; its :attr:`LatencyControl.clock` is the time the emulated durations are
            measured on.
        timeout_s: the backend deadline of one call, seconds (as ``backend_timeout_s``).
        sleep: sleeps out the rest of a call's emulated time (seconds; on the control's clock).

    Raises:
        ValueError: ``timeout_s`` is not > 0.
    """

    def __init__(self, inner: Backend, control: LatencyControl, *, timeout_s: float,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        if not timeout_s > 0:
            raise ValueError(f"timeout_s: {timeout_s!r} must be > 0")
        super().__init__(inner.name, inner.max_value_bytes, inner.capacity_bytes)
        self._inner = inner
        self.control = control
        self.timeout_s = timeout_s
        self._sleep = sleep
        self.counters = inner.counters
        self.is_shared = inner.is_shared
        self.supports_views = inner.supports_views
        self.supports_scatter = inner.supports_scatter
        self._link_lock = threading.Lock()
        self._link_free_at = [0.0, 0.0]  # per direction, monotonic s

    def __getattr__(self, name: str) -> Any:
        """Anything else the wrapped backend offers (e.g. ``num_leases``), unslowed."""
        inner = self.__dict__.get("_inner")
        if inner is None:
            raise AttributeError(name)
        return getattr(inner, name)

    @property
    def epoch_hint(self) -> int | None:  # type: ignore[override]
        return self._inner.epoch_hint

    def refresh_epoch(self) -> None:
        self._inner.refresh_epoch()

    @property
    def inner(self) -> Backend:
        """The wrapped backend."""
        return self._inner

    def _round_trip(self, what: str, direction: int, call: Callable[[], T], nbytes: Callable[[T], int]) -> T:
        clock = self.control.clock
        start = clock()
        deadline = start + self.timeout_s
        settings = self.control.wait_until_unfrozen(deadline)
        if settings is None:
            raise BackendTimeoutError(f"{self.name}: {what} not answered within {self.timeout_s:g} s (tier frozen "
                                      f"by the latency wrapper)")
        result = call()
        done_at = start + settings.delay_s
        bandwidth = settings.bandwidth_bytes_per_s
        size = nbytes(result)
        with self._link_lock:
            if bandwidth > 0 and size > 0:
                done_at = max(done_at, self._link_free_at[direction]) + size / bandwidth
            if done_at <= deadline and bandwidth > 0 and size > 0:
                self._link_free_at[direction] = done_at
        if done_at > deadline:
            self._sleep(max(0.0, deadline - clock()))
            raise BackendTimeoutError(f"{self.name}: {what} of {size} bytes needs {done_at - start:.3f} s at "
                                      f"{settings}, over the {self.timeout_s:g} s deadline")
        self._sleep(max(0.0, done_at - clock()))
        return result

    # ------------------------------------------------------------------ the protocol
    def get_tickets(self, keys: Sequence[bytes]) -> list[bytes | None]:
        return self._round_trip("get_tickets", _READ, lambda: self._inner.get_tickets(keys),
                                lambda got: sum(len(t) for t in got if t is not None))

    def write_stripe(self, write: StripeWrite) -> bool:
        size = write.nbytes + sum(len(raw) for _, raw in write.tickets)
        return self._round_trip("write_stripe", _WRITE, lambda: self._inner.write_stripe(write), lambda _: size)

    def read_ranges(self, reads: Sequence[RangeRead]) -> list[bool]:
        return self._round_trip("read_ranges", _READ, lambda: self._inner.read_ranges(reads),
                                lambda ok: sum(r.length for r, hit in zip(reads, ok) if hit))

    def view_stripes(self, stripe_ids: Sequence[str]) -> list[list[memoryview] | None]:
        return self._round_trip("view_stripes", _READ, lambda: self._inner.view_stripes(stripe_ids),
                                lambda got: sum(v.nbytes for layers in got if layers for v in layers))

    def lease(self, stripe_ids: Sequence[str], ttl_s: float) -> str:
        return self._round_trip("lease", _WRITE, lambda: self._inner.lease(stripe_ids, ttl_s), lambda _: 0)

    def release(self, stripe_ids: Sequence[str], token: str | None = None) -> None:
        self._round_trip("release", _WRITE, lambda: self._inner.release(stripe_ids, token), lambda _: 0)

    def delete_tickets(self, keys: Sequence[bytes]) -> None:
        self._round_trip("delete_tickets", _WRITE, lambda: self._inner.delete_tickets(keys), lambda _: 0)

    def drop_stripes(self, stripe_ids: Sequence[str]) -> None:
        self._round_trip("drop_stripes", _WRITE, lambda: self._inner.drop_stripes(stripe_ids), lambda _: 0)

    def clear(self) -> None:
        self._round_trip("clear", _WRITE, self._inner.clear, lambda _: 0)

    def ping(self) -> None:
        self._round_trip("ping", _READ, self._inner.ping, lambda _: 0)

    def used_bytes(self) -> int:
        return self._inner.used_bytes()

    def close(self) -> None:
        self._inner.close()


def slow_down(backends: Sequence[Backend], control: LatencyControl, *, timeout_s: float) -> list[Backend]:
    """Wrap every backend of a tier with one shared :class:`LatencyControl`.

    A backend object that serves several shards (the in-process DRAM tier) gets one wrapper, shared the same way.

    Returns:
        ``[num_shards]`` wrappers, in shard order.
    """
    wrappers: dict[int, Backend] = {}
    out = []
    for b in backends:
        if id(b) not in wrappers:
            wrappers[id(b)] = LatencyBackend(b, control, timeout_s=timeout_s)
        out.append(wrappers[id(b)])
    return out
