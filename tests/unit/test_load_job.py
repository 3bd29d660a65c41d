"""A load job on its own: built from a :class:`~range_connector.worker.context.LoadContext` and real backends, no
``RangeWorker``. Stripes are written the way the worker writes them (tickets with per-chunk and whole-stripe
checksums); the job must land their bytes in the destination blocks exactly, and a corrupted stored byte must fail
the chunk instead of reaching the KV cache.
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
import xxhash

from range_connector.backends.base import Backend, StripeWrite
from range_connector.backends.file.backend import FileBackend
from range_connector.backends.memory import MemoryBackend
from range_connector.config import RangeConfig, TierConfig
from range_connector.kv.layout import block_rows
from range_connector.kv.metadata import ChunkTransfer, RequestTransfer
from range_connector.kv.namespace import ChunkHash
from range_connector.kv.sharding import ShardPlan
from range_connector.kv.stripes import chunk_checksum, new_stripe_id
from range_connector.kv.tickets import Ticket, ticket_key
from range_connector.worker.banks import BankPool, BankReader
from range_connector.worker.context import LoadContext
from range_connector.worker.counters import Counters
from range_connector.worker.loads import PIPELINED, SYNC, LoadJob

LAYERS = ("layer.0", "layer.1", "layer.2")
NUM_BLOCKS, BLOCK, HEADS, HEAD = 16, 16, 2, 8
BLOCKS_PER_CHUNK = 2


def kv_cache(seed: int) -> dict[str, torch.Tensor]:
    """CPU-layout KV tensors ``[num_blocks, heads, block_size, 2 * head]`` (bf16) filled with seeded noise."""
    gen = torch.Generator().manual_seed(seed)
    return {name: torch.randn(NUM_BLOCKS, HEADS, BLOCK, 2 * HEAD, generator=gen).to(torch.bfloat16)
            for name in LAYERS}


def store_chunks(backend: Backend, source: dict[str, torch.Tensor], chunk_blocks: list[list[int]]) -> list[Ticket]:
    """Write the source blocks of each chunk into one stripe, as the worker's save does; one ticket per chunk."""
    layout, rows = block_rows(source, LAYERS, NUM_BLOCKS)
    stripe_blocks = len(chunk_blocks) * BLOCKS_PER_CHUNK
    index = torch.tensor([b for blocks in chunk_blocks for b in blocks])
    values = [torch.stack([rows[layer * layout.num_planes + p].index_select(0, index)
                           for p in range(layout.num_planes)]).contiguous() for layer in range(len(LAYERS))]
    views = [memoryview(v.view(torch.uint8).numpy()).cast("B") for v in values]
    stripe_id = new_stripe_id()
    stripe_sums = tuple(xxhash.xxh3_64_intdigest(v) for v in views)
    tickets = [Ticket(stripe_id, c * BLOCKS_PER_CHUNK, BLOCKS_PER_CHUNK, stripe_blocks, len(LAYERS),
                      layout.num_planes, layout.row_bytes,
                      tuple(chunk_checksum(v, layout.num_planes, stripe_blocks, c * BLOCKS_PER_CHUNK,
                                           BLOCKS_PER_CHUNK, layout.row_bytes) for v in views), stripe_sums)
               for c in range(len(chunk_blocks))]
    keys = [(ticket_key(ChunkHash(bytes([c]) * 32), 0), t.encode()) for c, t in enumerate(tickets)]
    assert backend.write_stripe(StripeWrite(stripe_id, views, keys))
    return tickets


@pytest.fixture(params=["memory", "file"])
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Backend]:
    b: Backend = MemoryBackend() if request.param == "memory" else FileBackend(tmp_path / "tier", timeout_s=5.0)
    yield b
    b.close()


def context_for(dest: dict[str, torch.Tensor], backend: Backend) -> tuple[LoadContext, list]:
    layout, rows = block_rows(dest, LAYERS, NUM_BLOCKS)
    config = RangeConfig(tiers=(TierConfig("memory"),), chunk_tokens=BLOCK * BLOCKS_PER_CHUNK, num_shards=1)
    pools = [ThreadPoolExecutor(max_workers=1), ThreadPoolExecutor(max_workers=1)]
    reader = BankReader()
    dropped: list = []
    ctx = LoadContext(config=config, layout=layout, layer_names=LAYERS, plan=ShardPlan(BLOCKS_PER_CHUNK, 1),
                      backends=[backend], rows=rows, banks=BankPool(config.num_banks), reader=reader,
                      verifier=pools[0], shard_readers=pools[1], stats=Counters(), layer_events={},
                      drop=lambda chunk_hash, shard_idx: dropped.append((chunk_hash, shard_idx)))
    return ctx, [*pools, reader, dropped]


def run_job(ctx: LoadContext, tickets: list[Ticket], dst_blocks: list[list[int]], mode: str) -> LoadJob:
    import time

    chunks = tuple(ChunkTransfer(c, ChunkHash(bytes([c]) * 32), tuple(range(BLOCKS_PER_CHUNK)), tuple(blocks),
                                 (t,)) for c, (t, blocks) in enumerate(zip(tickets, dst_blocks)))
    req = RequestTransfer("req-0", chunks, num_tokens=len(chunks) * BLOCKS_PER_CHUNK * BLOCK, mode=mode)
    job = LoadJob(ctx, [req], time.monotonic() + 30.0, mode)
    job.start()
    for layer_idx in range(len(LAYERS)):  # as attention asks, layer by layer
        job.deliver_through(layer_idx)
    job.finish()
    return job


def close(extra: list) -> None:
    verifier, shard_readers, reader, _ = extra
    reader.close()
    verifier.shutdown()
    shard_readers.shutdown()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode", [PIPELINED, SYNC])
def test_a_load_job_lands_stored_chunks_bit_exact_in_scattered_blocks(backend: Backend, mode: str) -> None:
    source, dest = kv_cache(1), kv_cache(2)
    src_blocks, dst_blocks = [[3, 9], [4, 1]], [[12, 0], [7, 5]]
    tickets = store_chunks(backend, source, src_blocks)
    untouched = {name: t.clone() for name, t in dest.items()}
    ctx, extra = context_for(dest, backend)
    try:
        job = run_job(ctx, tickets, dst_blocks, mode)
    finally:
        close(extra)
    assert job.failed_from == {} and extra[3] == []
    assert [entry[0] for entry in job.done] == [ChunkHash(bytes([c]) * 32) for c in range(2)]
    for name in LAYERS:
        for s_blocks, d_blocks in zip(src_blocks, dst_blocks):
            for s, d in zip(s_blocks, d_blocks):
                assert torch.equal(dest[name][d].view(torch.int16), source[name][s].view(torch.int16))
        others = sorted(set(range(NUM_BLOCKS)) - {b for blocks in dst_blocks for b in blocks})
        assert torch.equal(dest[name][others].view(torch.int16), untouched[name][others].view(torch.int16))


@pytest.mark.timeout(60)
def test_a_corrupted_stored_byte_fails_its_chunk_and_never_reaches_attention(backend: Backend) -> None:
    source, dest = kv_cache(1), kv_cache(2)
    src_blocks, dst_blocks = [[3, 9], [4, 1]], [[12, 0], [7, 5]]
    tickets = store_chunks(backend, source, src_blocks)
    # flip one byte of the second chunk's rows in the last layer, where the tier keeps it
    t = tickets[1]
    offset = (t.block_offset * t.row_bytes) + 5  # plane 0, first row of chunk 1
    if isinstance(backend, MemoryBackend):
        value = bytearray(backend._stripes[t.stripe_id][-1])
        value[offset] ^= 0xFF
        backend._stripes[t.stripe_id][-1] = bytes(value)
    else:
        path = backend.root / "stripes" / t.stripe_id
        data = bytearray(path.read_bytes())
        layer_bytes = t.num_planes * t.stripe_blocks * t.row_bytes
        data[len(data) - layer_bytes + offset] ^= 0xFF
        path.write_bytes(bytes(data))
    ctx, extra = context_for(dest, backend)
    try:
        job = run_job(ctx, tickets, dst_blocks, PIPELINED)
    finally:
        close(extra)
    assert job.failed_from == {"req-0": 1}
    assert [entry[0] for entry in job.done] == [ChunkHash(bytes([0]) * 32)]
    assert ctx.stats["load_integrity_errors"] >= 1 and extra[3][0][0] == ChunkHash(bytes([1]) * 32)
    for name in LAYERS:  # the good chunk landed; the bad chunk's bytes are not what was stored
        for s, d in zip(src_blocks[0], dst_blocks[0]):
            assert torch.equal(dest[name][d].view(torch.int16), source[name][s].view(torch.int16))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("chunks_loaded", [[1], [0, 1]], ids=["part-of-a-stripe", "whole-stripe"])
def test_a_block_vllm_writes_its_first_computed_token_into_is_not_verified_after_that_write(
        tmp_path: Path, chunks_loaded: list[int]) -> None:
    """A stored tail leaves vLLM the prompt's last token, in the load's last block: vLLM writes that token's KV of
    layer ``l`` (``unified_kv_cache_update``) before attention asks Range for layer ``l``. Its KV differs from the
    stored one in a few bits when another engine, in another batch, computed it. Verified from the KV cache after
    that write, the block failed its checksum and the whole chunk was recomputed (``make demo``, 3 December 2026).
    Here the file tier's direct receive lands every row before "vLLM" writes its token into the last block of
    each layer, just before that layer is delivered: nothing may fail, and the block holds the stored bytes except
    where vLLM wrote."""
    backend = FileBackend(tmp_path / "tier", timeout_s=5.0)
    source, dest = kv_cache(1), kv_cache(2)
    src_blocks, dst_blocks = [[3, 9], [4, 1]], [[12, 0], [7, 5]]
    tickets = store_chunks(backend, source, src_blocks)
    ctx, extra = context_for(dest, backend)
    computed_block = dst_blocks[chunks_loaded[-1]][-1]
    chunks = tuple(ChunkTransfer(c, ChunkHash(bytes([c]) * 32), tuple(range(BLOCKS_PER_CHUNK)),
                                 tuple(dst_blocks[c]), (tickets[c],)) for c in chunks_loaded)
    req = RequestTransfer("req-0", chunks, num_tokens=len(chunks) * BLOCKS_PER_CHUNK * BLOCK - 1, mode=PIPELINED,
                          computed_block_ids=(computed_block,))
    vllm_token = torch.full((HEADS, 2 * HEAD), 7.0, dtype=torch.bfloat16)
    try:
        import time

        job = LoadJob(ctx, [req], time.monotonic() + 30.0, PIPELINED)
        job.start()
        assert job.direct is not None  # (the path under test: rows received in place)
        while any(t is None for t in job.layer_ready_s):  # every row has landed (bounded by the test's timeout)
            time.sleep(0.001)
        for layer_idx, name in enumerate(LAYERS):
            dest[name][computed_block, :, BLOCK - 1] = vllm_token  # vLLM's KV of the block's last token
            job.deliver_through(layer_idx)
        job.finish()
    finally:
        close(extra)
        backend.close()
    assert job.failed_from == {} and ctx.stats["load_integrity_errors"] == 0 and extra[3] == []
    for name in LAYERS:
        for c in chunks_loaded:
            for s, d in zip(src_blocks[c], dst_blocks[c]):
                got, want = dest[name][d].clone(), source[name][s].clone()
                if d == computed_block:  # vLLM's token or the stored one; every other byte is the stored one
                    assert (torch.equal(got[:, BLOCK - 1].view(torch.int16), vllm_token.view(torch.int16))
                            or torch.equal(got[:, BLOCK - 1].view(torch.int16), want[:, BLOCK - 1].view(torch.int16)))
                    got[:, BLOCK - 1] = want[:, BLOCK - 1]
                assert torch.equal(got.view(torch.int16), want.view(torch.int16))
