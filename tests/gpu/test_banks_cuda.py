"""Transfer banks into the KV cache on its own device: pinned staging and the worker's copy stream on CUDA, plain
host memory on CPU. The same test runs on both: the CPU twin runs everywhere (``make test``), so a test that names
an attribute the worker does not have fails here first instead of on the first lent GPU.

The CUDA case is skipped with the reason on machines without a CUDA device (this project's CI has none)."""

from __future__ import annotations

import pytest
import torch

from bench.worker_roundtrip import KVShape, RoundTrip, config
from range_connector.backends.memory import MemoryBackend
from range_connector.worker.device import CudaDevice, HostDevice

NO_CUDA = "no CUDA device on this machine"
DEVICES = [
    pytest.param("cpu", "cpu", id="cpu"),
    pytest.param("cuda", "flash", id="cuda-flash",
                 marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA)]),
]


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("device", "layout"), DEVICES)
def test_load_through_banks_is_byte_exact_on_the_kv_caches_device(device: str, layout: str) -> None:
    backend = MemoryBackend(None)
    backend.supports_views = False  # force the bank path
    backend.supports_scatter = False  # (on CPU too: no direct receive)
    shape = KVShape(num_layers=4, layout=layout)
    rt = RoundTrip.build(config("memory", num_banks=2, bank_bytes=1 << 16), shape, [backend], [backend],
                         num_chunks=4, device=device)
    try:
        loader = rt.loader
        expected = CudaDevice if device == "cuda" else HostDevice
        assert type(loader.device) is expected
        assert loader.banks.pin_memory is (device == "cuda") and loader.banks.device is loader.device
        dst_ids = rt.pick_dst_ids()
        assert rt.load(dst_ids) == set()  # (pipelined: the current stream waits for each layer's copy event)
        if device == "cuda":
            torch.cuda.synchronize()
        assert rt.matches(dst_ids)
        assert loader.stats.get("copy_launches", 0) > 0 and loader.banks.allocations <= 2
    finally:
        rt.close()
