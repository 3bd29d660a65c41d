"""Transfer banks: a fixed set of staging buffers between a tier and the KV cache.

A load is cut into layer groups. For each group a reader thread (the banks' single owner of I/O) takes a free bank,
fills it with one batched ranged read per shard, and completes it; the consumer then verifies and copies each layer
of the group into the KV cache and releases the bank. At most ``num_banks`` banks exist, so a load of any size uses
bounded staging memory, reads of group ``g + 1`` overlap the copies of group ``g``, and each layer can be handed to
attention as soon as its bank has completed and been copied.

Completion is a ``concurrent.futures.Future``. On CUDA (:mod:`range_connector.worker.device`), banks are pinned host
memory, allocated once per pool slot and reused, and the consumer's copies run on the worker's copy stream, ending with
events that attention waits on; a bank is released with the event of its last copy (its *fence*), and the reader
thread waits for that fence before it fills the bank again, so the consumer never waits on the host for a copy.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from range_connector.errors import BackendTimeoutError
from range_connector.worker.device import CopyDevice, HostDevice


@dataclass
class TransferBank:
    """One staging buffer.

    Attributes:
        buffer: ``[capacity_bytes]`` uint8 tensor (pinned host memory when the KV cache is on CUDA; device memory
            in a device bank pool).
        done: completes (with ``None``) when the bank is filled, or with the exception that stopped the fill.
        host: the filled bytes in host memory, where ``buffer`` is not (a device bank's copy brought back for the
            checksum pass: :mod:`range_connector.worker.device_reads`), else ``None``.
    """

    buffer: torch.Tensor
    done: Future = field(default_factory=Future)
    abandoned: bool = False
    host: torch.Tensor | None = None


class BankPool:
    """A fixed number of reusable staging buffers.

    Args:
        num_banks: how many banks may exist at once (>= 1).
        device: the device seam: whether buffers are pinned (``device.pin_memory``) and how a fence is waited for.
        on_device: the buffers are device memory (``device.empty_device``: GPUDirect reads land there).
    """

    def __init__(self, num_banks: int, *, device: CopyDevice | None = None, on_device: bool = False) -> None:
        if num_banks < 1:
            raise ValueError(f"num_banks must be >= 1, got {num_banks}")
        self.num_banks = num_banks
        self.device = HostDevice() if device is None else device
        self.pin_memory = self.device.pin_memory
        self.on_device = on_device
        #: released buffers, each with the event of the last copy that reads it (``None``: none pending)
        self._free: list[tuple[torch.Tensor, object | None]] = []
        self._slots = threading.Semaphore(num_banks)
        self._lock = threading.Lock()
        #: buffers allocated so far (a new one only when none free is large enough).
        self.allocations = 0
        #: banks taken and not yet released; bytes of the buffers allocated and kept (free or in use)
        self.in_use = 0
        self.allocated_bytes = 0

    def acquire(self, nbytes: int, timeout_s: float | Callable[[Callable[[float], bool]], bool]) -> TransferBank:
        """Take a free bank of at least ``nbytes`` bytes, waiting up to ``timeout_s`` for one to be released, and for
        the copies still reading it (its fence: a host wait, on the calling thread, the bank reader).

        Args:
            nbytes: the bank's size in bytes.
            timeout_s: seconds, or a waiting policy ``wait(try_acquire) -> bool`` that calls
                ``try_acquire(timeout_s)`` until it succeeds or gives up (a layer-pipelined load's, whose deadline
                moves while its forward computes: :attr:`~range_connector.worker.loads.LoadJob.deadline`).

        Raises:
            BackendTimeoutError: no bank was released in time.
        """
        if callable(timeout_s):
            if not timeout_s(lambda t: self._slots.acquire(timeout=t)):
                raise BackendTimeoutError("no transfer bank free before the load's deadline")
        elif not self._slots.acquire(timeout=max(0.0, timeout_s)):
            raise BackendTimeoutError(f"no transfer bank free within {timeout_s:.3f} s")
        try:
            with self._lock:
                # (by position: ``list.remove`` would compare tensors with ``==``, elementwise)
                fits = [i for i, (b, _f) in enumerate(self._free) if b.numel() >= nbytes]
                buf, fence = None, None
                if fits:
                    buf, fence = self._free.pop(min(fits, key=lambda i: self._free[i][0].numel()))
                elif self._free:  # drop the largest too-small one: the pool never holds more than num_banks
                    largest = max(range(len(self._free)), key=lambda i: self._free[i][0].numel())
                    dropped, fence = self._free.pop(largest)
                    self.allocated_bytes -= dropped.numel()
                self.in_use += 1
            self.device.synchronize([fence])  # (outside the lock: the consumer releases banks meanwhile)
            if buf is None:
                buf = (self.device.empty_device(nbytes) if self.on_device
                       else torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pin_memory))
                with self._lock:
                    self.allocations += 1
                    self.allocated_bytes += nbytes
        except BaseException:
            with self._lock:
                self.in_use -= 1
            self._slots.release()  # (an allocation that failed must not cost a slot for ever)
            raise
        return TransferBank(buf)

    def release(self, bank: TransferBank, fence: object | None = None) -> None:
        """Give a bank back (idempotent per bank); ``fence``: the event of the last copy that reads it (the bank is
        not filled again before it completes)."""
        with self._lock:
            if bank.buffer.numel() == 0:
                return
            self._free.append((bank.buffer, fence))
            bank.buffer = torch.empty(0, dtype=torch.uint8)
            self.in_use -= 1
        self._slots.release()


class BankReader:
    """The single thread that fills banks (one per worker), in submission order; it also runs the direct receives
    that need no bank (:mod:`range_connector.worker.direct_receive`)."""

    def __init__(self) -> None:
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="range-bank-reader")

    def submit(self, pool: BankPool, nbytes: int, fill,
               timeout_s: float | Callable[[Callable[[float], bool]], bool]) -> TransferBank:
        """Queue ``fill(buffer)`` for a bank of ``nbytes``; return the bank whose ``done`` future completes (with
        :attr:`TransferBank.host` set to what ``fill`` returned). ``timeout_s``: how long the bank may be waited for
        (:meth:`BankPool.acquire`).

        If the consumer abandons the bank (deadline passed) before the fill ends, the reader releases it itself.
        """
        bank = TransferBank(torch.empty(0, dtype=torch.uint8))

        def run() -> None:
            try:
                got = pool.acquire(nbytes, timeout_s)
                bank.buffer = got.buffer
                bank.host = fill(bank.buffer[:nbytes])
                bank.done.set_result(None)
            except BaseException as exc:  # handed to the consumer through the future
                bank.done.set_exception(exc)
            if bank.abandoned:
                pool.release(bank)

        self._executor.submit(run)
        return bank

    def submit_task(self, fn) -> Future:
        """Queue ``fn()`` behind the fills already queued (a direct receive into the KV cache, which needs no bank);
        the returned future completes with its result or exception."""
        return self._executor.submit(fn)

    def close(self) -> None:
        """Stop accepting work (queued fills still run)."""
        self._executor.shutdown(wait=False)
