"""CUDA transfer banks: pinned staging, a copy stream of our own, and per-layer events that attention waits on.

Skipped with the reason on machines without a CUDA device (this project's CI has none)."""

from __future__ import annotations

import random

import pytest
import torch

from range_connector.backends.memory import MemoryBackend
from range_connector.config import RangeConfig, TierConfig
from range_connector.kv.metadata import ChunkTransfer, RangeConnectorMetadata, RequestTransfer
from range_connector.kv.namespace import prefix_hash_chain
from range_connector.worker.facade import RangeWorker

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.timeout(120),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine"),
]


def _kv(device: str) -> dict[str, torch.Tensor]:
    # Flash-attention-like layout [2, num_blocks, block_size, heads, head]: two planes per layer.
    return {f"l{i}": torch.randn(2, 64, 16, 2, 64, device=device).to(torch.bfloat16) for i in range(4)}


def test_load_through_pinned_banks_on_a_copy_stream_is_byte_exact() -> None:
    backend = MemoryBackend(None)
    backend.supports_views = False  # force the bank path
    cfg = RangeConfig(chunk_tokens=32, tiers=(TierConfig("memory"),), bank_bytes=1 << 16, num_banks=2).resolve(16)
    src = _kv("cuda")
    saver = RangeWorker(cfg, 16, tuple(src), 64, [backend])
    saver.register_kv_caches(src)
    hashes = prefix_hash_chain(b"ns", b"", list(range(128)), 32)
    blocks = random.sample(range(64), 8)
    saver.save(RangeConnectorMetadata(saves=[RequestTransfer("a", tuple(
        ChunkTransfer(i, h, (0, 1), tuple(blocks[2 * i:2 * i + 2])) for i, h in enumerate(hashes)), 128)]))
    tickets = {h: ts for h, _group, ts in saver.build_worker_meta().saved}
    dst = {k: torch.zeros_like(v) for k, v in src.items()}
    loader = RangeWorker(cfg, 16, tuple(dst), 64, [backend])
    loader.register_kv_caches(dst)
    assert loader._banks.pin_memory and loader._copy_stream is not None
    dblocks = random.sample(range(64), 8)
    loader.start_load(RangeConnectorMetadata(loads=[RequestTransfer("b", tuple(
        ChunkTransfer(i, h, (0, 1), tuple(dblocks[2 * i:2 * i + 2]), tickets[h]) for i, h in enumerate(hashes)), 128)]))
    for name in dst:
        loader.wait_for_layer(name)  # the current stream waits for the layer's copy event
    torch.cuda.synchronize()
    assert not loader.take_failed_block_ids()
    for name in src:
        assert torch.equal(dst[name][:, dblocks], src[name][:, blocks])
