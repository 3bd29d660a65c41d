"""The device seam: the one owner of copy streams, events and pinned staging on the worker side.

Everything the worker does that depends on where the KV cache lives goes through a :class:`CopyDevice`, built once
per worker by :func:`device_for` when the KV cache is registered:

* :class:`HostDevice` (KV cache in host memory): batched copies run inline; there are no events and nothing to wait.
* :class:`CudaDevice`: one copy stream of the worker's own, created once; transfer banks in pinned host memory; each
  batched copy into the KV cache is queued on the copy stream (after the work the compute stream had queued when
  the copy was issued, so a reused block is not overwritten while attention still reads it) and ends with an event.

Who waits for a copy's event, and how (the rule that gives the copy stream its overlap, and keeps aborts safe):

* ``wait_for_layer_load(layer)`` (pipelined loads): the *current stream* waits for the layer's event
  (:meth:`CopyDevice.wait_current`), a device-side wait: the host does not synchronise, so later layers keep
  copying while attention runs.
* a synchronous load (everything delivered in ``start_load_kv``): the current stream waits for every layer's event
  at the end of ``start_load_kv`` (device-side too).
* a transfer bank before it is filled again: the bank reader thread waits on the host for the bank's last copy
  (:meth:`CopyDevice.synchronize`, the bank's *fence*); the thread that drives the forward never does.
* an asynchronous load: its delivery thread waits on the host for its copies before the load counts as done; an
  aborted load (or one past its deadline) is fenced on the host before its request is reported finished, because
  vLLM may hand its blocks to another request at once.

Index tensors for a tensor's rows are made on that tensor's device (:meth:`CopyDevice.index`).

Tests replace the seam with a fake that defers copies until their events are waited and counts host
synchronisations by thread (``tests/unit/test_device_seam.py``); ``tests/gpu`` runs :class:`CudaDevice` itself.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch


class CopyDevice:
    """The seam's interface, implemented for host memory (this class: :class:`HostDevice` is its name).

    Attributes:
        kind: ``"cpu"`` or ``"cuda"``.
        pin_memory: transfer banks are pinned host memory (CUDA: copies from them are truly asynchronous).
        can_receive_direct: tiers may write straight into the KV rows (host memory only:
            :mod:`range_connector.worker.direct_receive`).
        reads_device: loads may stage in device memory (:meth:`empty_device`): a file tier with GPUDirect reads
            into it (:mod:`range_connector.worker.device_reads`); the host has no such staging.
    """

    kind = "cpu"
    pin_memory = False
    can_receive_direct = True
    reads_device = False

    def empty_device(self, nbytes: int) -> torch.Tensor:
        """A ``[nbytes]`` uint8 staging buffer in the KV cache's memory (here: host memory)."""
        return torch.empty(nbytes, dtype=torch.uint8)

    def read_back(self, buffer: torch.Tensor) -> torch.Tensor:
        """``buffer``'s bytes in host memory, landed (CUDA: a copy on the copy stream and a host wait for it, on the
        calling thread: the bank reader; here: ``buffer`` itself)."""
        return buffer

    def index(self, ids: Sequence[int] | torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        """``[len(ids)]`` int64 row indices on ``like``'s device (:func:`index_on`)."""
        return index_on(ids, like)

    def copy_rows(self, dst_rows: torch.Tensor, dst: torch.Tensor, src_rows: torch.Tensor,
                  src: slice | torch.Tensor) -> Any | None:
        """``dst_rows[dst] = src_rows[src]`` as one batched index copy.

        Args:
            dst_rows: ``[num_blocks, row]`` KV rows of one (layer, plane).
            dst: ``[n]`` destination block ids (int64, any device).
            src_rows: ``[num_src_rows, row]`` source rows in host memory (a bank or a lent stripe), same dtype and
                row width as ``dst_rows``.
            src: a slice or ``[n]`` int64 row indices into ``src_rows``.

        Returns:
            The event that completes when the copy has landed (``None``: it already has).
        """
        picked = src_rows[src] if isinstance(src, slice) else src_rows.index_select(0, src)
        dst_rows.index_copy_(0, self.index(dst, dst_rows), picked)
        return None

    def wait_current(self, events: Iterable[Any | None]) -> None:
        """Make the current stream wait for ``events`` (device-side: the host does not block). No-op on host."""

    def synchronize(self, events: Iterable[Any | None]) -> None:
        """Block the calling thread until ``events`` have completed (a host synchronisation). No-op on host."""


HostDevice = CopyDevice


class CudaDevice(CopyDevice):
    """KV cache on one CUDA device: a copy stream of the worker's own, pinned banks, events per copy.

    Args:
        device: the KV cache's device.
    """

    kind = "cuda"
    pin_memory = True
    can_receive_direct = False
    reads_device = True

    def __init__(self, device: torch.device) -> None:
        self.device = device
        #: the stream whose work a copy must follow (the engine's, current when the KV cache was registered)
        self.compute_stream = torch.cuda.current_stream(device)
        self.copy_stream = torch.cuda.Stream(device=device)
        #: pinned host copies of device staging buffers (:meth:`read_back`), by buffer address: one per bank
        self._mirrors: dict[int, torch.Tensor] = {}

    def empty_device(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    def read_back(self, buffer: torch.Tensor) -> torch.Tensor:
        """As :meth:`CopyDevice.read_back`: into a pinned mirror of the buffer, allocated once per staging buffer
        (banks are reused, so these are too; the cache is emptied past 16, after a bank was replaced)."""
        key, n = buffer.data_ptr(), buffer.numel()
        mirror = self._mirrors.get(key)
        if mirror is None or mirror.numel() < n:
            if len(self._mirrors) >= 16:
                self._mirrors.clear()
            mirror = self._mirrors[key] = torch.empty(n, dtype=torch.uint8, pin_memory=True)
        with torch.cuda.stream(self.copy_stream):
            mirror[:n].copy_(buffer, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.copy_stream)
        event.synchronize()
        return mirror[:n]

    def index(self, ids: Sequence[int] | torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        """As :meth:`CopyDevice.index`, made on the copy stream: the copies that use it are queued there, so its
        upload is ordered before them whatever stream the calling thread has current (an asynchronous load's
        thread has the default stream, not the engine's)."""
        with torch.cuda.stream(self.copy_stream):
            return index_on(ids, like)

    def copy_rows(self, dst_rows: torch.Tensor, dst: torch.Tensor, src_rows: torch.Tensor,
                  src: slice | torch.Tensor) -> Any | None:
        """As :meth:`CopyDevice.copy_rows`, queued on the copy stream; returns its ``torch.cuda.Event``.

        From pinned rows (a bank) the rows are moved to the device as they lie (one run, or the whole region when
        ``src`` picks rows: a bank region holds only the load's segments) and picked there, so the host never
        waits; from pageable rows (a lent stripe) they are picked on the host first (pageable memory makes the
        move synchronous anyway)."""
        stream = self.copy_stream
        with torch.cuda.stream(stream):
            stream.wait_stream(self.compute_stream)
            if isinstance(src, slice):
                staged = src_rows[src].to(self.device, non_blocking=True)
            elif src_rows.is_cuda:  # (a device bank: GPUDirect reads; picked on the device, no host memory)
                staged = src_rows.index_select(0, self.index(src, src_rows))
            elif src_rows.is_pinned():
                staged = src_rows.to(self.device, non_blocking=True).index_select(0, self.index(src, dst_rows))
            else:
                staged = src_rows.index_select(0, src).to(self.device, non_blocking=True)
            dst_idx = self.index(dst, dst_rows)
            if dst_idx is dst:  # (made by the caller, maybe on another stream: not reused before this copy read it)
                dst_idx.record_stream(stream)
            dst_rows.index_copy_(0, dst_idx, staged)
            event = torch.cuda.Event()
            event.record(stream)
        return event

    def wait_current(self, events: Iterable[Any | None]) -> None:
        current = torch.cuda.current_stream(self.device)
        for event in events:
            if event is not None:
                current.wait_event(event)

    def synchronize(self, events: Iterable[Any | None]) -> None:
        for event in events:
            if event is not None:
                event.synchronize()


def index_on(ids: Sequence[int] | torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``[len(ids)]`` int64 indices for ``like``'s rows, on ``like``'s device (an index on another device fails in
    ``index_copy_``, and makes ``index_select`` move it on every call)."""
    if isinstance(ids, torch.Tensor):
        return ids.to(device=like.device, dtype=torch.long, non_blocking=True)
    return torch.tensor(list(ids), dtype=torch.long).to(like.device, non_blocking=True)


def device_for(rows: Sequence[torch.Tensor]) -> CopyDevice:
    """The seam for KV rows: :class:`CudaDevice` for rows on a CUDA device, else :class:`HostDevice`."""
    if rows and rows[0].is_cuda:
        return CudaDevice(rows[0].device)
    return HostDevice()
