"""The file tier read straight into device memory on a real CUDA device with the real kvikio
(``worker/device_reads.py``): the start-up probe, device banks filled by ``CuFile.pread``, checked on the pinned copy
brought back, copied device to device into CUDA KV tensors; and a corrupt stripe that must fail its chunk.

kvikio's compatibility mode is allowed here (``compat_device_reads``): a lent GPU machine rarely has the GDS driver,
and the device path must run either way. Skipped with the reason without a CUDA device or kvikio (the CPU twin:
``tests/unit/test_device_reads.py``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from range_connector.backends.file.backend import FileBackend, gds_status

_OK, _REASON = gds_status()

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.timeout(120),
    pytest.mark.skipif(not _OK, reason=f"no CUDA device / kvikio not installed: {_REASON}"),
]


def _trip(tmp_path: Path, layout: str = "flash"):
    from bench.worker_roundtrip import KVShape, RoundTrip, config

    cfg = config("file", directory=str(tmp_path), num_banks=2, bank_bytes=1 << 20)
    shape = KVShape(num_layers=6, num_blocks=256, num_kv_heads=4, head_size=128, layout=layout)
    return RoundTrip.build(cfg, shape, [FileBackend(tmp_path / "s", timeout_s=60.0)],
                           [FileBackend(tmp_path / "s", timeout_s=60.0)], num_chunks=16, device="cuda",
                           compat_device_reads=True)


@pytest.mark.parametrize("layout", ["flash", "lbnhc"])  # (lbnhc: vLLM 0.32's token-major pages)
def test_file_stripes_load_into_cuda_kv_through_device_banks(tmp_path: Path, layout: str) -> None:
    rt = _trip(tmp_path, layout)
    try:
        gds = rt.loader.backends[0].gds
        assert gds is not None and gds.io_path in ("gds", "compat") and gds.device_loads, gds
        dst_ids = rt.pick_dst_ids()
        assert not rt.load(dst_ids)
        assert rt.matches(dst_ids)
        assert rt.loader.stats["device_read_groups"] == rt.loader.load_timelines[-1]["num_groups"] > 1
        assert rt.loader.banks.allocations == 0  # no host bank: every byte went through device memory
    finally:
        rt.close()


def test_a_corrupt_stripe_fails_its_chunk_on_the_device_path(tmp_path: Path) -> None:
    rt = _trip(tmp_path)
    try:
        [stripe] = list((tmp_path / "s" / "stripes").iterdir())
        with open(stripe, "r+b") as f:  # one byte of the first chunk's first row in layer 0
            f.seek(4096 + 3)
            byte = f.read(1)
            f.seek(4096 + 3)
            f.write(bytes([byte[0] ^ 0x01]))
        dst_ids = rt.pick_dst_ids()
        failed = rt.load(dst_ids)
        assert rt.loader.stats["device_read_groups"] > 0 and rt.loader.stats["load_integrity_errors"] >= 1
        assert set(dst_ids[:rt.loader.plan.blocks_per_chunk]) <= failed
    finally:
        rt.close()
