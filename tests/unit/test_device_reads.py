"""CPU twin of the file tier's GPUDirect loads (``worker/device_reads.py``) and of the start-up probe that decides
them (``backends/file/gds.py``): the real worker half and the real file tier, with two fakes at the boundaries.

* :class:`DeviceTwin`, at the device seam: :class:`~tests.unit.test_device_seam.StreamDevice` (copies queued until
  their events are waited, host synchronisations counted by thread) whose ``empty_device`` gives
  :class:`DeviceMemory`, host memory that host code may not read (``numpy()`` raises, as a CUDA tensor's does), and
  whose ``read_back`` is the counted copy back to the host.
* :class:`FakeKvikio`, at the backend boundary (``sys.modules["kvikio"]``): ``CuFile.pread`` reads the file into the
  "device" buffer with ``preadv``; it can run in compatibility mode, refuse the cuFile driver, raise, or *lie*
  (return the length without writing: the stale bytes of dynamo#15079).

The real path on a GPU: ``tests/gpu/test_device_reads_cuda.py``.
"""

from __future__ import annotations

import logging
import os
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch

from bench.worker_roundtrip import KVShape, RoundTrip, config
from range_connector.backends.file.backend import FileBackend
from tests.unit.test_device_seam import StreamDevice

pytestmark = pytest.mark.timeout(60)


class DeviceMemory(torch.Tensor):
    """Host memory standing in for device memory: host code that reads it (``numpy()``) fails, as on CUDA."""

    def numpy(self, *args: object, **kwargs: object):  # type: ignore[override]
        raise AssertionError("host code read device memory (a CUDA tensor has no numpy())")


def host_view(t: torch.Tensor) -> memoryview:
    """What only the fakes may do: the twin's device memory as host bytes."""
    return memoryview(torch.Tensor.numpy(t.as_subclass(torch.Tensor))).cast("B")


class DeviceTwin(StreamDevice):
    """The CUDA seam's twin for device staging: ``read_back`` is counted per thread, like a host synchronisation."""

    kind = "fake-cuda"
    reads_device = True

    def __init__(self) -> None:
        super().__init__()
        self.read_backs: Counter[str] = Counter()

    def empty_device(self, nbytes: int) -> torch.Tensor:
        return torch.zeros(nbytes, dtype=torch.uint8).as_subclass(DeviceMemory)

    def read_back(self, buffer: torch.Tensor) -> torch.Tensor:
        self.read_backs[self._who()] += 1
        return torch.frombuffer(bytearray(host_view(buffer)), dtype=torch.uint8)


class FakeKvikio:
    """kvikio's Python surface as Range uses it, over POSIX reads into the twin's device memory."""

    __version__ = "fake"

    def __init__(self, *, compat: bool = False, driver_error: bool = False, lie: bool = False,
                 raises: bool = False) -> None:
        kv = self
        self.preads = 0

        class Defaults:
            @staticmethod
            def is_compat_mode_preferred() -> bool:
                return compat

        class Driver:
            @staticmethod
            def driver_open() -> None:
                if driver_error:
                    raise RuntimeError("cuFile driver: CU_FILE_DRIVER_NOT_INITIALIZED")

        class Future:
            def __init__(self, n: int) -> None:
                self.n = n

            def get(self) -> int:
                return self.n

        class CuFile:
            def __init__(self, path: str, flags: str = "r") -> None:
                self.fd = os.open(path, os.O_RDONLY)

            def __enter__(self) -> CuFile:
                return self

            def __exit__(self, *exc: object) -> None:
                os.close(self.fd)

            def pread(self, buf: torch.Tensor, size: int, file_offset: int = 0) -> Future:
                kv.preads += 1
                if raises:
                    raise OSError(5, "cuFileRead failed")
                if lie:
                    return Future(size)
                return Future(os.preadv(self.fd, [host_view(buf)[:size]], file_offset))

        self.defaults, self.cufile_driver, self.CuFile = Defaults, Driver, CuFile


class Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture
def log_lines():
    handler = Lines()
    log = logging.getLogger("vllm.range_connector.worker.device_reads")
    log.addHandler(handler)
    old = log.level
    log.setLevel(logging.INFO)
    yield handler.records
    log.removeHandler(handler)
    log.setLevel(old)


def _trip(tmp_path: Path, kvikio: FakeKvikio | None, monkeypatch: pytest.MonkeyPatch, dev: DeviceTwin, *,
          num_layers: int = 4, compat_device_reads: bool = False, layout: str = "flash") -> RoundTrip:
    monkeypatch.setitem(sys.modules, "kvikio", kvikio)  # (None: ``import kvikio`` raises ImportError)
    cfg = config("file", directory=str(tmp_path), num_banks=2, bank_bytes=1 << 16)
    shape = KVShape(num_layers=num_layers, layout=layout)  # (flash: K and V planes, 2 reads per layer and segment)
    save_b, load_b = FileBackend(tmp_path / "s", timeout_s=30.0), FileBackend(tmp_path / "s", timeout_s=30.0)
    return RoundTrip.build(cfg, shape, [save_b], [load_b], num_chunks=4, loader_device=dev,
                           compat_device_reads=compat_device_reads)


@pytest.mark.parametrize("layout", ["flash", "lbnhc"])  # (lbnhc: vLLM 0.32's token-major pages)
def test_twin_loads_file_stripes_through_device_banks_and_checks_the_host_copy(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, log_lines: list, layout: str) -> None:
    dev, kvikio = DeviceTwin(), FakeKvikio()
    rt = _trip(tmp_path, kvikio, monkeypatch, dev, layout=layout)
    try:
        backend = rt.loader.backends[0]
        assert backend.gds.io_path == "gds" and backend.gds.device_loads
        assert any("GPUDirect Storage: loads read straight into device memory" in r.getMessage() for r in log_lines)
        probe_preads = kvikio.preads
        assert dev.read_backs["MainThread"] == 3  # (the start-up probe's three reads, checked on the host)
        dev.read_backs.clear()
        dst_ids = rt.pick_dst_ids()
        assert not rt.load(dst_ids)  # pipelined: start_load, then one wait_for_layer per layer
        assert rt.matches(dst_ids) and dev.pending == 0
        groups = rt.loader.load_timelines[-1]["num_groups"]
        assert rt.loader.stats["device_read_groups"] == groups == 4  # (one 64 KiB layer per 64 KiB bank)
        assert kvikio.preads > probe_preads  # every byte came through CuFile.pread ...
        assert rt.loader.banks.allocations == 0  # ... into device banks: no host bank was ever allocated
        assert dev.read_backs["range-bank-reader"] == groups  # each bank brought back once, on the reader thread
        assert dev.read_backs["MainThread"] == 0 and dev.host_syncs["MainThread"] == 0  # the forward never waits
    finally:
        rt.close()


def test_a_corrupt_stripe_read_into_device_memory_fails_its_chunk(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    dev = DeviceTwin()
    rt = _trip(tmp_path, FakeKvikio(), monkeypatch, dev)
    try:
        [stripe] = list((tmp_path / "s" / "stripes").iterdir())
        with open(stripe, "r+b") as f:  # one byte of layer 0's first row (the first chunk's K plane)
            f.seek(4096 + 5)
            byte = f.read(1)
            f.seek(4096 + 5)
            f.write(bytes([byte[0] ^ 0x40]))
        dst_ids = rt.pick_dst_ids()
        failed = rt.load(dst_ids)
        assert rt.loader.stats["device_read_groups"] > 0  # (read into device memory ...)
        assert rt.loader.stats["load_integrity_errors"] >= 1  # (... and checked there)
        bpc = rt.loader.plan.blocks_per_chunk
        assert set(dst_ids[:bpc]) <= failed  # the corrupt chunk (and those after it) are recomputed
    finally:
        rt.close()


@pytest.mark.parametrize(("case", "reason"), [
    ("no-kvikio", "kvikio not installed"),
    ("driver", "cuFile driver open failed"),
    ("stale-bytes", "differ from the file"),
    ("read-raises", "probe read failed"),
])
def test_a_failed_gds_setup_is_reported_at_start_up_and_loads_fall_back_to_posix(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, log_lines: list, case: str, reason: str) -> None:
    kvikio = None if case == "no-kvikio" else FakeKvikio(driver_error=case == "driver", lie=case == "stale-bytes",
                                                         raises=case == "read-raises")
    dev = DeviceTwin()
    rt = _trip(tmp_path, kvikio, monkeypatch, dev)
    try:
        backend = rt.loader.backends[0]
        assert backend.gds.io_path == "posix" and reason in backend.gds.reason
        warned = [r.getMessage() for r in log_lines if r.levelno == logging.WARNING]
        assert any("GPUDirect set-up failed" in m and reason in m and "POSIX" in m for m in warned)
        assert rt.loader.load_context.device_banks is None
        preads = kvikio.preads if kvikio else 0
        dst_ids = rt.pick_dst_ids()
        assert not rt.load(dst_ids) and rt.matches(dst_ids)  # the right bytes, through POSIX into host banks
        assert rt.loader.stats["device_read_groups"] == 0 and (kvikio.preads if kvikio else 0) == preads
        assert rt.loader.banks.allocations > 0
    finally:
        rt.close()


@pytest.mark.parametrize("allowed", [False, True])
def test_kvikio_compatibility_mode_keeps_the_posix_bank_path_unless_allowed(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, log_lines: list, allowed: bool) -> None:
    dev = DeviceTwin()
    rt = _trip(tmp_path, FakeKvikio(compat=True), monkeypatch, dev, compat_device_reads=allowed)
    try:
        gds = rt.loader.backends[0].gds
        assert gds.io_path == "compat" and gds.device_loads is allowed
        assert any("compatibility mode" in r.getMessage() for r in log_lines)
        dst_ids = rt.pick_dst_ids()
        assert not rt.load(dst_ids) and rt.matches(dst_ids)
        assert (rt.loader.stats["device_read_groups"] > 0) is allowed
    finally:
        rt.close()


def test_host_kv_caches_probe_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    kvikio = FakeKvikio()
    monkeypatch.setitem(sys.modules, "kvikio", kvikio)
    cfg = config("file", directory=str(tmp_path), num_banks=2, bank_bytes=1 << 16)
    backends = [FileBackend(tmp_path / "s", timeout_s=30.0)]
    rt = RoundTrip.build(cfg, KVShape(layout="cpu"), backends, [FileBackend(tmp_path / "s", timeout_s=30.0)],
                         num_chunks=2)
    try:
        assert kvikio.preads == 0 and rt.loader.backends[0].gds is None
        assert rt.loader.load_context.device_banks is None
    finally:
        rt.close()
