"""The CUDA device seam itself (:class:`range_connector.worker.device.CudaDevice`): copies queued on the worker's
copy stream behind the engine's work, events that attention's stream waits on, no host synchronisation on the thread
that drives the forward, and aborted loads fenced before they are reported.

The compute stream is held busy with ``torch.cuda._sleep`` (a spin kernel) so that copies are still queued when the
test looks: ordering is checked with ``Event.query()``, never with the clock. The CPU twins of these tests are in
``tests/unit/test_device_seam.py``. Skipped with the reason on machines without a CUDA device."""

from __future__ import annotations

import threading
import time
from collections import Counter

import pytest
import torch

from bench.worker_roundtrip import KVShape, RoundTrip, config
from range_connector.backends.memory import MemoryBackend
from range_connector.worker.device import CudaDevice

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.timeout(120),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine"),
]

SPIN_CYCLES = 5_000_000_000  # seconds of one SM spinning: the copies queued behind it are still pending when looked at


class CountingCudaDevice(CudaDevice):
    """The real CUDA seam, counting host synchronisations and stream waits by thread name prefix."""

    def __init__(self, device: torch.device) -> None:
        super().__init__(device)
        self.host_syncs: Counter[str] = Counter()
        self.stream_waits: Counter[str] = Counter()

    @staticmethod
    def _who() -> str:
        return threading.current_thread().name.rsplit("_", 1)[0]

    def synchronize(self, events) -> None:  # type: ignore[no-untyped-def]
        events = [e for e in events if e is not None]
        if events:
            self.host_syncs[self._who()] += 1
        super().synchronize(events)

    def wait_current(self, events) -> None:  # type: ignore[no-untyped-def]
        events = [e for e in events if e is not None]
        self.stream_waits[self._who()] += len(events)
        super().wait_current(events)


def _trip(num_layers: int, *, num_banks: int = 2) -> tuple[RoundTrip, CountingCudaDevice]:
    backend = MemoryBackend(None)
    backend.supports_views = False
    dev = CountingCudaDevice(torch.device("cuda", torch.cuda.current_device()))
    shape = KVShape(num_layers=num_layers, layout="flash")
    rt = RoundTrip.build(config("memory", num_banks=num_banks, bank_bytes=1 << 17), shape, [backend], [backend],
                         num_chunks=4, device="cuda", loader_device=dev)
    return rt, dev


def test_copies_from_pinned_and_pageable_rows_land_after_their_event() -> None:
    dev = CudaDevice(torch.device("cuda"))
    dst_rows = torch.zeros(16, 256, dtype=torch.int16, device="cuda")
    pinned = torch.arange(8 * 256, dtype=torch.int16).view(8, 256).pin_memory()
    pageable = pinned.clone()
    dst = dev.index([3, 9, 12], dst_rows)
    assert dst.device == dst_rows.device
    torch.cuda._sleep(SPIN_CYCLES)  # the engine's stream is busy: the copies queue behind it
    events = [dev.copy_rows(dst_rows, dst, pinned, slice(2, 5)),
              dev.copy_rows(dst_rows, dev.index([0, 1], dst_rows), pinned, torch.tensor([7, 6])),
              dev.copy_rows(dst_rows, dev.index([15], dst_rows), pageable, torch.tensor([4]))]
    assert all(isinstance(e, torch.cuda.Event) for e in events)
    assert not events[0].query()  # queued behind the compute stream's work (a reused block is not overwritten early)
    dev.wait_current(events)  # (device-side: the host does not block)
    out = dst_rows.cpu()  # (on the current stream: after the wait)
    assert torch.equal(out[[3, 9, 12]], pinned[2:5]) and torch.equal(out[[0, 1]], pinned[[7, 6]])
    assert torch.equal(out[15], pageable[4]) and all(e.query() for e in events)


def test_pipelined_load_into_flash_layout_never_syncs_the_forward_thread() -> None:
    rt, dev = _trip(6)
    try:
        dst_ids = rt.pick_dst_ids()
        rt.loader.start_load(rt.load_meta(dst_ids))
        for i, name in enumerate(rt.shape.layer_names):
            rt.loader.wait_for_layer(name)
            assert dev.stream_waits["MainThread"] == i + 1
        assert not rt.loader.take_failed_block_ids()
        assert dev.host_syncs["MainThread"] == 0  # the copy stream overlaps: no host wait per layer group
        torch.cuda.synchronize()
        assert rt.matches(dst_ids)
    finally:
        rt.close()


def test_aborted_async_load_is_fenced_before_it_is_reported() -> None:
    rt, dev = _trip(4, num_banks=4)
    try:
        dst_ids = rt.pick_dst_ids()
        torch.cuda._sleep(SPIN_CYCLES)  # copies queue behind the engine's stream and stay pending
        rt.loader.start_load(rt.load_meta(dst_ids, mode="async"))
        job = rt.loader._async_jobs["load"][0]
        while dev.host_syncs["range-async-load"] == 0:  # every copy queued, the delivery thread in its fence
            time.sleep(0.001)  # (bounded by the test's timeout)
        assert job.events and not job.events[-1].query()
        assert rt.loader.get_finished({"load"}) == {"load"}  # vLLM aborted the request
        assert job.events and all(e.query() for e in job.events)  # fenced: vLLM may reuse the blocks now
        assert dev.host_syncs["MainThread"] <= 1
    finally:
        rt.close()
