"""The PCP layer exchange indexes a layer's rows on the rows' own device (CUDA rows with a CPU index fail in
``index_copy_``); the collective's buffers stay in host memory (gloo).

The ``meta`` device stands in for CUDA here: an index left on the CPU fails on it exactly as on CUDA."""

from __future__ import annotations

import pytest
import torch

from range_connector.worker.device import index_on
from range_connector.worker.pcp import gather_share, scatter_share


@pytest.mark.timeout(10)
def test_the_index_follows_the_rows_device() -> None:
    meta = torch.empty(8, 4, device="meta")
    assert index_on([1, 3], meta).device == meta.device
    assert index_on(torch.tensor([1, 3], dtype=torch.int32), meta).dtype == torch.long
    assert index_on([1, 3], torch.empty(8, 4)).device.type == "cpu"


@pytest.mark.timeout(10)
def test_scatter_writes_rows_on_another_device_with_an_index_there() -> None:
    rows = [torch.empty(8, 4, device="meta") for _ in range(2)]
    scatter_share(rows, [1, 3], torch.zeros(2, 2, 4))  # a CPU index would raise: "expected ... same device"
    with pytest.raises(RuntimeError, match="same device"):  # (the failure the seam avoids)
        rows[0].index_copy_(0, torch.tensor([1]), torch.zeros(1, 4, device="meta"))


@pytest.mark.timeout(10)
def test_gather_then_scatter_moves_the_rows_of_a_share() -> None:
    src = [torch.arange(32, dtype=torch.int64).view(8, 4) + 100 * p for p in range(2)]
    share = gather_share(src, [5, 2])
    assert share.device.type == "cpu" and share.shape == (2, 2, 4)
    dst = [torch.zeros(8, 4, dtype=torch.int64) for _ in range(2)]
    scatter_share(dst, [0, 7], share)
    for p in range(2):
        assert torch.equal(dst[p][[0, 7]], src[p][[5, 2]])
        assert not dst[p][1:7].any()
    assert gather_share(src, []).shape == (2, 0, 4)
