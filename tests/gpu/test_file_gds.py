"""File tier into CUDA memory through kvikio's CuFile (GPUDirect Storage, or kvikio's POSIX compatibility mode where
the platform has no GDS driver).

Skipped with the reason on machines without a CUDA device or without kvikio (``pip install .[gds-cu13]``, or ``gds-cu12``); this
project's CI has neither, so only the capability check runs there (``tests/backends/test_file_backend.py``)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from range_connector.backends.base import RangeRead, StripeWrite
from range_connector.backends.file.backend import FileBackend, gds_status
from range_connector.backends.file.stripes import DeviceRead

_OK, _REASON = gds_status()

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.timeout(120),
    pytest.mark.skipif(not _OK, reason=f"no CUDA device / kvikio not installed: {_REASON}"),
]


@pytest.mark.parametrize("use_odirect", [False, True])
def test_device_reads_match_host_reads(tmp_path: Path, use_odirect: bool) -> None:
    import torch

    b = FileBackend(tmp_path / "s", use_odirect=use_odirect, timeout_s=60.0)
    assert b.supports_gds
    layer_bytes = 3 * 4096 + 123
    values = [random.Random(layer).randbytes(layer_bytes) for layer in range(4)]
    assert b.write_stripe(StripeWrite("gds1", values, [(b"k", b"t")]))
    ranges = [(0, 0, layer_bytes), (3, 0, layer_bytes), (1, 4097, 5000), (2, 1, 1), (2, layer_bytes - 7, 7)]
    dests = [torch.empty(n, dtype=torch.uint8, device="cuda") for _, _, n in ranges]
    ok = b.read_ranges_device([DeviceRead("gds1", layer, off, n, layer_bytes, d)
                               for (layer, off, n), d in zip(ranges, dests)]
                              + [DeviceRead("gone", 0, 0, 1, 1, torch.empty(1, dtype=torch.uint8, device="cuda"))])
    assert ok == [True] * len(ranges) + [False]
    torch.cuda.synchronize()
    for (layer, off, n), d in zip(ranges, dests):
        host = bytearray(n)
        assert b.read_ranges([RangeRead("gds1", layer, off, n, layer_bytes, memoryview(host))]) == [True]
        assert d.cpu().numpy().tobytes() == bytes(host) == values[layer][off:off + n]
    with pytest.raises(ValueError):
        b.read_ranges_device([DeviceRead("gds1", 0, layer_bytes - 1, 2, layer_bytes + 1,
                                         torch.empty(2, dtype=torch.uint8, device="cuda"))])
    b.close()
