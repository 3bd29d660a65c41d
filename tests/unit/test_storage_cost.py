"""What storage costs: round trips, commands and copies follow bytes, not chunks; a save batch over the tier's value
limit is split into stripes (and still loads byte for byte), and a chunk over the limit is not saved.

Driven through the engine-less harness (:mod:`tests.unit.scheduler_worker_harness`), counting calls at the backend
boundary (``FlakyBackend``) and the stores' own counters.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.unit.scheduler_worker_harness import (
    LAYER_BLOCK_BYTES,
    LAYERS,
    LOAD_PATHS,
    NUM_PLANES,
    PATH_CONFIG,
    Engine,
    FakeRequest,
    chain,
    produce,
    prompt_tokens,
    same_block,
    saved_chunk_idxs,
    shard_backends,
    stored_ticket,
    wrap,
)

# ---------------------------------------------------------------------------------------------------- cost

def _save_then_load(num_shards: int, chunk_tokens: int, kind: str, path: str = "bank") -> dict[str, Any]:
    """Engine W saves 256 tokens in one step; engine R loads them. Returns what each side cost."""
    inner = shard_backends(num_shards, num_shards)
    prompt = prompt_tokens(257, seed=50)  # 256 tokens can be promised: 16 blocks
    kw = dict(num_shards=num_shards, chunk_tokens=chunk_tokens, kind=kind)
    w, w_blocks = produce(inner, prompt, first_step_tokens=None, **kw)
    assert w.worker.stats["saved_chunks"] == 256 // chunk_tokens
    assert w.worker.stats["saved_stripes"] == num_shards  # one step, one stripe per shard
    write_cost = [m.counters.snapshot() for m in inner]

    flaky = wrap(inner, path)
    r = Engine(flaky, seed=20, **kw, **PATH_CONFIG[path])  # type: ignore[arg-type]
    assert r.admit(FakeRequest("R-0", prompt)) == 256
    r_blocks = r.running["R-0"].block_ids
    res = r.step(forward=False)
    assert res.invalid_block_ids == set()
    for i in range(16):
        assert same_block(res.after_load, r_blocks[i], w.kv, w_blocks[i]), i
    after = [m.counters.snapshot() for m in inner]
    read_cost = [{k: a[k] - b[k] for k in a} for a, b in zip(after, write_cost)]
    w.close()
    r.close()
    return {"write": write_cost, "read": read_cost, "copy_launches": r.worker.stats["copy_launches"],
            "calls": [dict(f.calls) for f in flaky], "read_batches": [f.read_batches for f in flaky]}


@pytest.mark.timeout(30)
@pytest.mark.parametrize("path", LOAD_PATHS)
@pytest.mark.parametrize("kind", ["dense", "split-kv"])
@pytest.mark.parametrize("num_shards", [1, 2])
def test_storage_cost_follows_bytes_not_chunks(num_shards: int, kind: str, path: str) -> None:
    # The same 256 tokens x 4 layers, cut into 4 or 8 chunks (chunk_tokens 64 or 32, block 16), saved in one step:
    # one stripe per shard (one command per layer value plus one for all tickets); then one ticket read, one lease,
    # one load call (ranged read / stripe view; per layer group on layer-banks) and one release per shard, and one
    # index copy per (layer, plane) (and lent stripe), whatever the number of chunks.
    coarse = _save_then_load(num_shards, 64, kind, path)
    fine = _save_then_load(num_shards, 32, kind, path)
    layers_planes = len(LAYERS) * NUM_PLANES[kind]
    for side in ("write", "read"):
        assert [c["round_trips"] for c in fine[side]] == [c["round_trips"] for c in coarse[side]], side
        assert [c["commands"] for c in fine[side]] == [c["commands"] for c in coarse[side]], side
        assert ([c["bytes_written"] + c["bytes_read"] for c in fine[side]]
                == [c["bytes_written"] + c["bytes_read"] for c in coarse[side]]), side
    assert [c["round_trips"] for c in fine["write"]] == [2] * num_shards  # a lookup, one stripe write
    load_call = "read_ranges" if path != "views" else "view_stripes"
    groups = len(LAYERS) if path == "layer-banks" else 1
    assert fine["calls"] == coarse["calls"] == [
        {"get_tickets": 1, "lease": 1, load_call: groups, "release": 1}] * num_shards
    assert [c["round_trips"] for c in fine["read"]] == [3 + groups] * num_shards
    if path == "views":
        assert fine["read_batches"] == coarse["read_batches"] == [[1]] * num_shards  # one stripe each
        assert fine["copy_launches"] == coarse["copy_launches"] == layers_planes * num_shards
    elif path == "direct":  # one whole-value read per layer (its planes back to back), nothing to copy
        assert fine["read_batches"] == coarse["read_batches"] == [[len(LAYERS)]] * num_shards
        assert fine["copy_launches"] == coarse["copy_launches"] == 0
    else:
        assert fine["read_batches"] == coarse["read_batches"] == [[layers_planes // groups] * groups] * num_shards
        assert fine["copy_launches"] == coarse["copy_launches"] == layers_planes


# ---------------------------------------------------------------------------------------------------- stripe split
@pytest.mark.timeout(30)
@pytest.mark.parametrize("path", LOAD_PATHS)
@pytest.mark.parametrize("num_shards", [1, 2])
def test_save_batch_over_the_value_limit_is_split_into_stripes_and_loads_byte_exact(num_shards: int,
                                                                                     path: str) -> None:
    bps = 2 // num_shards
    per_chunk = bps * LAYER_BLOCK_BYTES["dense"]  # one chunk's share of one layer value on one shard
    inner = shard_backends(num_shards, num_shards, max_value_bytes=3 * per_chunk)
    kw = dict(num_shards=num_shards)
    prompt = prompt_tokens(257, seed=51)
    hashes = chain(prompt, 32)
    a, a_blocks = produce(inner, prompt, first_step_tokens=None, **kw)  # 8 chunks in one save batch
    assert a.worker.stats["saved_chunks"] == 8
    assert a.worker.stats["saved_stripes"] == 3 * num_shards  # 3 + 3 + 2 chunks per shard
    assert a.worker.stats["save_errors"] == 0
    for s in range(num_shards):
        tickets = [stored_ticket(inner[s], h, s, blocks_per_shard=bps) for h in hashes[:8]]
        assert all(t is not None for t in tickets)
        groups = [[t.stripe_id for t in tickets[i:i + 3]] for i in (0, 3, 6)]  # type: ignore[union-attr]
        assert [len(set(g)) for g in groups] == [1, 1, 1] and len({g[0] for g in groups}) == 3
        assert [t.block_offset for t in tickets] == [i % 3 * bps for i in range(8)]  # type: ignore[union-attr]

    flaky = wrap(inner, path)
    b = Engine(flaky, seed=21, **kw, **PATH_CONFIG[path])  # type: ignore[arg-type]
    assert b.admit(FakeRequest("B-0", prompt)) == 256
    b_blocks = b.running["B-0"].block_ids
    res = b.step(forward=False)
    assert res.invalid_block_ids == set()
    for i in range(16):
        assert same_block(res.after_load, b_blocks[i], a.kv, a_blocks[i]), i
    if path in ("bank", "direct"):
        assert [f.read_batches for f in flaky] == [[3 * len(LAYERS)]] * num_shards  # 3 stripes x 4 layers
    elif path == "layer-banks":
        assert [f.read_batches for f in flaky] == [[3] * len(LAYERS)] * num_shards  # 3 stripes, per layer
    else:
        assert [f.read_batches for f in flaky] == [[3]] * num_shards  # 3 stripes lent per shard
    assert b.worker.stats["copy_launches"] == len(LAYERS) * {"views": 3 * num_shards, "direct": 0}.get(path, 1)
    a.close()
    b.close()


@pytest.mark.timeout(30)
def test_chunk_larger_than_the_value_limit_is_not_saved() -> None:
    inner = shard_backends(1, 1, max_value_bytes=2 * LAYER_BLOCK_BYTES["dense"] - 1)
    eng = Engine(inner, seed=22)
    eng.admit(FakeRequest("r0", prompt_tokens(70, seed=52)))
    res = eng.step()  # no exception
    assert saved_chunk_idxs(res.meta) == [0, 1]
    assert eng.worker.stats["save_errors"] == 1 and eng.worker.stats["saved_chunks"] == 0
    assert res.worker_meta is None and inner[0].used_bytes() == 0
    eng.close()
