"""CPU twins of the CUDA copy path: the real worker half over a fake device that behaves like a copy stream.

:class:`StreamDevice` is a fake only at the device seam (:mod:`range_connector.worker.device`): a copy into the KV
cache is *queued*, not done, and lands only when an event at or after it is waited for, by the current stream
(:meth:`wait_current`, which models attention's stream reading after the copy) or on the host
(:meth:`synchronize`). Host synchronisations are counted by thread. A load that forgot a wait would leave its
blocks unwritten (the byte comparisons fail); a load that synchronised the host per layer group would show in the
counts. What is checked:

* a pipelined load of G layer groups: the thread that drives the forward makes no host synchronisation, in
  ``start_load_kv`` or in ``wait_for_layer_load``; each ``wait_for_layer_load`` makes exactly one stream wait; the
  bank reader fences each reused bank on the host (G - num_banks times), and the bytes land exactly;
* a synchronous load: no host synchronisation, one stream wait per layer at the end of ``start_load_kv``;
* an aborted asynchronous load: its queued copies have landed (fenced on the host) before ``get_finished``
  reports the request finished;
* an asynchronous load whose copy fails part-way (a device error): the copies queued before it have landed before
  the request is reported finished, with every block failed (vLLM recomputes into them).
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass

import pytest
import torch

from bench.worker_roundtrip import KVShape, RoundTrip, config
from range_connector.backends.memory import MemoryBackend
from range_connector.worker.device import CopyDevice

HANG_BOUND_S = 60.0  # only a hang reaches it


@dataclass(frozen=True)
class FakeEvent:
    """A copy's completion: every queued copy up to sequence number ``seq`` (stream order)."""

    seq: int


class StreamDevice(CopyDevice):
    """Copies queue in order and land when an event at or after them is waited for; host syncs counted by thread.

    Attributes:
        host_syncs: thread name prefix -> :meth:`synchronize` calls that named at least one event.
        stream_waits: thread name prefix -> events the current stream was made to wait for.
        held_thread: a thread name prefix whose host syncs block until :meth:`release` (a copy that takes long).
        fail_at: the sequence number (1-based) of a copy that raises when queued (a device error), if any.
    """

    kind = "fake-stream"
    pin_memory = False
    can_receive_direct = False  # (as on CUDA: loads stage through banks)

    def __init__(self, held_thread: str | None = None, fail_at: int | None = None) -> None:
        self._lock = threading.Lock()
        self._queue: list[tuple[int, torch.Tensor, torch.Tensor, torch.Tensor, slice | torch.Tensor]] = []
        self._seq = 0
        self.host_syncs: Counter[str] = Counter()
        self.stream_waits: Counter[str] = Counter()
        self.held_thread = held_thread
        self.fail_at = fail_at
        self.held_entered = threading.Event()
        self._released = threading.Event()

    @staticmethod
    def _who() -> str:
        return threading.current_thread().name.rsplit("_", 1)[0]  # (executor threads: "range-bank-reader_0")

    def copy_rows(self, dst_rows, dst, src_rows, src):  # type: ignore[no-untyped-def]
        with self._lock:
            if self._seq + 1 == self.fail_at:
                raise RuntimeError(f"copy {self.fail_at} failed (injected device error)")
            self._seq += 1
            self._queue.append((self._seq, dst_rows, dst.clone(), src_rows, src))
            return FakeEvent(self._seq)

    @property
    def pending(self) -> int:
        """Copies queued and not yet landed."""
        with self._lock:
            return len(self._queue)

    def _land_through(self, events: Iterable[FakeEvent | None]) -> int:
        """Run the queued copies up to the latest of ``events``; how many events were named."""
        seqs = [e.seq for e in events if e is not None]
        if not seqs:
            return 0
        with self._lock:
            while self._queue and self._queue[0][0] <= max(seqs):
                _seq, dst_rows, dst, src_rows, src = self._queue.pop(0)
                super().copy_rows(dst_rows, dst, src_rows, src)  # (the source is read now, as a stream would)
        return len(seqs)

    def wait_current(self, events: Iterable[FakeEvent | None]) -> None:
        n = self._land_through(list(events))
        if n:
            self.stream_waits[self._who()] += n

    def synchronize(self, events: Iterable[FakeEvent | None]) -> None:
        events = [e for e in events if e is not None]
        if not events:
            return
        if self.held_thread is not None and self._who().startswith(self.held_thread):
            self.held_entered.set()
            self._released.wait(HANG_BOUND_S)
        self.host_syncs[self._who()] += 1
        self._land_through(events)

    def release(self) -> None:
        self._released.set()


def _trip(num_layers: int, device: StreamDevice, *, num_banks: int = 2) -> RoundTrip:
    backend = MemoryBackend(None)
    backend.supports_views = False  # the bank path (the fake, like CUDA, takes no direct receive)
    shape = KVShape(num_layers=num_layers, layout="cpu")
    # 4 chunks of 2 blocks: 8 blocks x 8 KiB = 64 KiB per layer, so one layer per 64 KiB bank
    cfg = config("memory", num_banks=num_banks, bank_bytes=1 << 16)
    return RoundTrip.build(cfg, shape, [backend], [backend], num_chunks=4, loader_device=device)


def _layer_matches(rt: RoundTrip, dst_ids: list[int], name: str) -> bool:
    from bench.worker_roundtrip import block_view

    return torch.equal(block_view(rt.dst[name], "cpu", dst_ids), block_view(rt.src[name], "cpu", rt.src_ids))


@pytest.mark.timeout(60)
def test_pipelined_load_waits_on_the_stream_per_layer_and_never_syncs_the_forward_thread() -> None:
    num_layers, num_banks = 6, 2
    dev = StreamDevice()
    rt = _trip(num_layers, dev, num_banks=num_banks)
    try:
        dst_ids = rt.pick_dst_ids()
        rt.loader.start_load(rt.load_meta(dst_ids))
        assert dev.host_syncs["MainThread"] == 0 and dev.stream_waits["MainThread"] == 0
        for i, name in enumerate(rt.shape.layer_names):
            rt.loader.wait_for_layer(name)
            assert dev.stream_waits["MainThread"] == i + 1  # exactly one stream wait per layer
            assert dev.host_syncs["MainThread"] == 0
            assert _layer_matches(rt, dst_ids, name)  # landed once attention's stream waited for it
        assert not rt.loader.take_failed_block_ids()
        assert dev.host_syncs["MainThread"] == 0
        assert len(rt.loader.load_timelines[-1]["layer_ready_s"]) == num_layers
        assert rt.loader.load_timelines[-1]["num_groups"] == num_layers  # one layer per bank: G = num_layers
        # each bank filled again waits on the host, on the reader thread, for the copies that read it
        assert dev.host_syncs["range-bank-reader"] == num_layers - num_banks
        assert rt.matches(dst_ids) and dev.pending == 0
    finally:
        rt.close()


@pytest.mark.timeout(60)
def test_synchronous_load_hands_every_layer_to_the_stream_without_a_host_sync() -> None:
    dev = StreamDevice()
    rt = _trip(4, dev)
    try:
        dst_ids = rt.pick_dst_ids()
        rt.loader.start_load(rt.load_meta(dst_ids, mode="sync"))
        assert dev.stream_waits["MainThread"] == 4 and dev.host_syncs["MainThread"] == 0
        assert dev.pending == 0 and rt.matches(dst_ids)
        assert not rt.loader.take_failed_block_ids()
    finally:
        rt.close()


@pytest.mark.timeout(60)
def test_aborted_async_load_fences_its_queued_copies_before_it_is_reported_finished() -> None:
    dev = StreamDevice(held_thread="range-async-load")  # the delivery thread's own fence takes "long"
    rt = _trip(4, dev)
    try:
        dst_ids = rt.pick_dst_ids()
        rt.loader.start_load(rt.load_meta(dst_ids, mode="async"))
        assert dev.held_entered.wait(HANG_BOUND_S)  # every copy queued, the delivery thread waiting for them
        assert dev.pending > 0 and not rt.matches(dst_ids)
        finished = rt.loader.get_finished({"load"})  # vLLM aborted the request
        assert finished == {"load"}
        assert dev.pending == 0  # fenced before reported: vLLM may hand the blocks to another request now
        assert dev.host_syncs["MainThread"] == 1
        assert rt.loader.stats.get("loads_aborted") == 1
    finally:
        dev.release()
        rt.close()


@pytest.mark.timeout(60)
def test_async_load_whose_copy_fails_fences_the_copies_queued_before_it() -> None:
    dev = StreamDevice(fail_at=3)  # 4 layers of one plane (the CPU layout), one layer per bank: fails in the third
    rt = _trip(4, dev, num_banks=4)  # (a bank the reader fills twice, when it lags, fences only its own copies)
    try:
        dst_ids = rt.pick_dst_ids()
        rt.loader.start_load(rt.load_meta(dst_ids, mode="async"))
        finished: set[str] = set()
        while not finished:  # (bounded by the test's timeout: the delivery thread ends on the error)
            finished = rt.loader.get_finished(set())
        assert finished == {"load"}
        assert dev.pending == 0  # the 2 copies queued before the error landed before the report
        assert set(dst_ids) <= set(rt.loader.take_failed_block_ids())  # and every block is recomputed
        assert _layer_matches(rt, dst_ids, rt.shape.layer_names[1])  # (the landed copies are whole)
        assert dev.host_syncs["range-async-load"] == 1  # (the delivery thread's own fence, after the error)
    finally:
        rt.close()
