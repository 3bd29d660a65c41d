"""Save in one engine, load in another, byte for byte: every KV layout, sharding and load path, and loads that start
after a local prefix-cache hit.

Driven through the engine-less harness (:mod:`tests.unit.scheduler_worker_harness`): the real ``RangeScheduler`` and
``RangeWorker`` in vLLM's hook order, in-memory stripe stores behind ``FlakyBackend``.
"""

from __future__ import annotations

import pytest

from range_connector.kv.tickets import ticket_key
from range_connector.scheduler.planning import hit_tokens
from tests.unit.scheduler_worker_harness import (
    BLOCK,
    LAYER_BLOCK_BYTES,
    LAYERS,
    LOAD_PATHS,
    NUM_PLANES,
    PATH_CONFIG,
    Engine,
    FakeRequest,
    chain,
    changed_blocks,
    copy_groups,
    live_leases,
    load_calls,
    produce,
    prompt_tokens,
    same_block,
    shard_backends,
    wrap,
)

# ---------------------------------------------------------------------------------------------------- round trip
SHARDINGS = [  # (num_shards, num_backends, chunk_tokens)
    pytest.param(1, 1, 32, id="1shard"),
    pytest.param(2, 2, 32, id="2shards-2backends"),
    pytest.param(2, 1, 32, id="2shards-shared-backend"),
    pytest.param(2, 2, 64, id="2shards-chunk64"),
]


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("kind", "path"), [
    (kind, path) for kind in ("dense", "mla", "split-kv") for path in LOAD_PATHS
    if path != "layer-banks" or kind != "mla"])
@pytest.mark.parametrize("prompt_len", [150, 128])
@pytest.mark.parametrize(("num_shards", "num_backends", "chunk_tokens"), SHARDINGS)
def test_save_in_one_engine_then_load_in_another_is_byte_exact(
    num_shards: int, num_backends: int, chunk_tokens: int, kind: str, prompt_len: int, path: str
) -> None:
    backends = shard_backends(num_shards, num_backends)
    kw = dict(num_shards=num_shards, chunk_tokens=chunk_tokens, kind=kind)
    prompt = prompt_tokens(prompt_len, seed=7)
    num_chunks = prompt_len // chunk_tokens
    a, a_blocks = produce(backends, prompt, **kw)
    # The plan saved every full chunk once, over the two steps of the chunked prefill: one stripe per shard per
    # step that completed a chunk.
    assert a.worker.stats["saved_chunks"] == num_chunks
    assert a.worker.stats["save_errors"] == 0
    saving_steps = len({min(num_chunks, 70 // chunk_tokens), num_chunks} - {0})
    assert a.worker.stats["saved_stripes"] == saving_steps * num_shards

    flaky = wrap(backends, path)
    b = Engine(flaky, seed=2, **kw, **PATH_CONFIG[path])  # type: ignore[arg-type]
    req = FakeRequest("B-0", prompt)
    ext = b.admit(req)
    expected_hit = hit_tokens(num_chunks, chunk_tokens, prompt_len, BLOCK)
    assert ext == expected_hit == {150: 128, 128: 112}[prompt_len]
    b_blocks = list(b.running["B-0"].block_ids)
    assert b_blocks != sorted(b_blocks)  # shuffled, non-contiguous destination blocks
    res = b.step(forward=False)

    assert res.invalid_block_ids == set()
    num_loaded = ext // BLOCK
    [load] = res.meta.loads
    assert load.num_tokens == ext
    assert [b_ for c in load.chunks for b_ in c.block_ids] == b_blocks[:num_loaded]
    assert all(len(c.tickets) == num_shards for c in load.chunks)
    if path != "views":
        assert res.loaded_block_log == b_blocks[:num_loaded]  # chain order
    else:  # one copy group per lent stripe: chain order within each group
        assert sorted(res.loaded_block_log) == sorted(b_blocks[:num_loaded])
    for i in range(num_loaded):
        assert same_block(res.after_load, b_blocks[i], a.kv, a_blocks[i]), f"block {i} differs"
    # Exactly the destination blocks changed; everything else of B is untouched.
    assert changed_blocks(res.before, res.after_load) == set(b_blocks[:num_loaded])
    assert b.worker.stats["loaded_blocks"] == num_loaded
    assert b.worker.stats["failed_blocks"] == 0
    assert b.worker.stats["copy_launches"] == len(LAYERS) * NUM_PLANES[kind] * copy_groups(res.meta, num_shards,
                                                                                            path)
    # One call per shard (per layer group on layer-banks; a shared backend answers each shard's call).
    assert sum(load_calls(flaky, path)) == num_shards * (len(LAYERS) if path == "layer-banks" else 1)
    hashes = chain(prompt, chunk_tokens)
    bpc = chunk_tokens // BLOCK
    # The tickets of the chunks read: at least those of every loaded block's shard, at most every shard's.
    got = set(b.worker.last_loaded_tickets)
    assert {(i % bpc % num_shards, ticket_key(hashes[i // bpc], i % bpc % num_shards))
            for i in range(num_loaded)} <= got
    assert got <= {(s, ticket_key(hashes[i // bpc], s)) for i in range(num_loaded) for s in range(num_shards)}
    a.close()
    b.close()


# ---------------------------------------------------------------------------------------------------- local hit
@pytest.mark.timeout(60)
@pytest.mark.parametrize("path", LOAD_PATHS)
@pytest.mark.parametrize(("num_shards", "chunk_tokens", "num_local_blocks"), [
    (1, 32, 1), (1, 32, 2), (1, 32, 3), (2, 32, 3), (2, 32, 6),
    (2, 64, 1), (2, 64, 3), (2, 64, 5),
])
def test_local_prefix_hit_loads_only_the_blocks_after_it(num_shards: int, chunk_tokens: int,
                                                         num_local_blocks: int, path: str) -> None:
    # C05: blocks of the local prefix-cache hit are never written by the load, even when the hit ends inside a
    # chunk (the load then starts at a block position other than 0 of that chunk, and inside a stripe).
    backends = shard_backends(num_shards, num_shards)
    kw = dict(num_shards=num_shards, chunk_tokens=chunk_tokens)
    prompt = prompt_tokens(150, seed=11)
    a, a_blocks = produce(backends, prompt, **kw)
    hit = hit_tokens(150 // chunk_tokens, chunk_tokens, 150, BLOCK)

    b = Engine(wrap(backends, path), seed=3, **kw, **PATH_CONFIG[path])  # type: ignore[arg-type]
    local = b.take_blocks(num_local_blocks)
    ext = b.admit(FakeRequest("B-0", prompt), local_blocks=local)
    assert ext == hit - num_local_blocks * BLOCK
    b_blocks = b.running["B-0"].block_ids
    res = b.step(forward=False)

    assert res.invalid_block_ids == set()
    [load] = res.meta.loads
    bpc = chunk_tokens // BLOCK
    first = load.chunks[0]
    assert first.chunk_idx == num_local_blocks // bpc
    assert first.block_positions[0] == num_local_blocks % bpc
    dest = b_blocks[num_local_blocks:hit // BLOCK]
    assert changed_blocks(res.before, res.after_load) == set(dest)
    assert sorted(res.loaded_block_log) == sorted(dest)
    for i in range(num_local_blocks, hit // BLOCK):
        assert same_block(res.after_load, b_blocks[i], a.kv, a_blocks[i])
    for blk in local:
        assert same_block(res.after_load, blk, res.before, blk)
    a.close()
    b.close()


@pytest.mark.timeout(30)
def test_local_hit_covering_the_stored_prefix_loads_nothing() -> None:
    backends = shard_backends(1, 1)
    prompt = prompt_tokens(150, seed=12)
    a, _ = produce(backends, prompt)
    b = Engine(backends, seed=3)
    local = b.take_blocks(8)  # 128 tokens locally, as much as the tier holds
    assert b.admit(FakeRequest("B-0", prompt), local_blocks=local) == 0
    assert b.sched.num_leases == 0  # nothing promised, nothing leased
    res = b.step(forward=False)
    assert res.meta.loads == [] and res.invalid_block_ids == set()
    assert changed_blocks(res.before, res.after_load) == set()
    assert live_leases(backends) == 0
    a.close()
    b.close()


@pytest.mark.timeout(30)
@pytest.mark.parametrize("path", LOAD_PATHS)
def test_two_requests_sharing_a_prefix_read_each_stripe_once(path: str) -> None:
    inner = shard_backends(2, 2)
    flaky = wrap(inner, path)
    prompt = prompt_tokens(150, seed=40)
    a, a_blocks = produce(inner, prompt, num_shards=2)
    b = Engine(flaky, num_shards=2, seed=12, **PATH_CONFIG[path])  # type: ignore[arg-type]
    assert b.admit(FakeRequest("B-0", prompt)) == 128
    assert b.admit(FakeRequest("B-1", prompt + prompt_tokens(20, seed=41))) == 128
    res = b.step(forward=False)
    assert res.invalid_block_ids == set()
    for req_id in ("B-0", "B-1"):
        blocks = b.running[req_id].block_ids
        for i in range(8):
            assert same_block(res.after_load, blocks[i], a.kv, a_blocks[i]), (req_id, i)
    # One call per shard, covering 2 stripes (x 4 layers) once for both requests; one copy per layer (and lent
    # stripe).
    if path in ("bank", "direct"):  # direct: every row has two destinations, so the load keeps the bank
        assert [f.calls["read_ranges"] for f in flaky] == [1, 1]
        assert [f.read_batches for f in flaky] == [[2 * len(LAYERS)], [2 * len(LAYERS)]]
    if path != "views":
        assert sum(m.counters.bytes_read for m in inner) == 8 * len(LAYERS) * LAYER_BLOCK_BYTES["dense"]
        assert b.worker.stats["copy_launches"] == len(LAYERS)
    if path == "layer-banks":
        assert [f.read_batches for f in flaky] == [[2] * len(LAYERS), [2] * len(LAYERS)]
    if path == "views":
        assert [f.calls["view_stripes"] for f in flaky] == [1, 1]
        assert [f.read_batches for f in flaky] == [[2], [2]]
        assert b.worker.stats["copy_launches"] == len(LAYERS) * 4
    assert b.worker.stats["loaded_blocks"] == 16
    a.close()
    b.close()
