"""Rank views and the pure parts of the PCP protocol, in one process (the multi-process protocol is in tests/pcp).

* P rank views of the real ``RangeWorker`` together store exactly what one writer of all S shards stores (same
  ticket keys, same bytes per chunk and shard), and each loads exactly its own blocks.
* The scheduler's real lookup (``RangeScheduler.stored_prefix``) equals the brute-force oracle under random
  eviction of random chunks on random shards (in-memory shards here; real Valkey in tests/backends).
* The agreement's bookkeeping (failed chunks, reported blocks, exchange shares, saves dropped, worker metadata) on a
  one-rank gloo group.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

from range_connector.backends.memory import MemoryBackend
from range_connector.config import RangeConfig, TierConfig
from range_connector.kv.metadata import ChunkTransfer, RangeConnectorMetadata, RangeWorkerMetadata, RequestTransfer
from range_connector.kv.sharding import RankSlice, ShardPlan
from range_connector.kv.tickets import Ticket, ticket_key
from range_connector.scheduler.facade import RangeScheduler
from range_connector.worker.facade import RangeWorker
from range_connector.worker.pcp import (
    NO_FAILURE,
    PcpExchange,
    blocks_from,
    exchange_shares,
    failed_from_blocks,
    plan_digest,
)
from range_connector.worker.pcp_router import rank_view_config
from tests.unit.scheduler_worker_harness import (
    BLOCK,
    LAYER_BLOCK_BYTES,
    LAYERS,
    NAMESPACE,
    NUM_BLOCKS,
    chain,
    make_kv,
    prompt_tokens,
    same_block,
)

pytestmark = pytest.mark.timeout(90)


def config(num_shards: int, chunk_tokens: int) -> RangeConfig:
    # the PCP ranks agree on failures in start_load_kv, before the forward: loads complete there (load_mode "sync");
    # what each rank view stored is checked when its save returns (save_mode "sync")
    return RangeConfig(tiers=(TierConfig("memory"),), num_shards=num_shards, chunk_tokens=chunk_tokens,
                       load_mode="sync", save_mode="sync").resolve(BLOCK)


def save_meta(hashes, block_ids: list[int], bpc: int) -> RangeConnectorMetadata:
    chunks = tuple(ChunkTransfer(i, h, tuple(range(bpc)), tuple(block_ids[i * bpc:(i + 1) * bpc]))
                   for i, h in enumerate(hashes))
    return RangeConnectorMetadata(saves=[RequestTransfer("a", chunks, len(chunks) * bpc * BLOCK)])


def chunk_bytes(mem: MemoryBackend, raw: bytes, layer_block_bytes: int, bps: int) -> list[bytes]:
    """One shard's bytes of one chunk in every layer, cut out of its stripe by the ticket."""
    t = Ticket.decode(raw, num_layers=len(LAYERS), layer_block_bytes=layer_block_bytes, num_blocks=bps)
    assert t is not None
    [layers] = mem.view_stripes([t.stripe_id])
    return [bytes(v[t.plane_range(0)[0]:sum(t.plane_range(0))]) for v in layers]


@pytest.mark.parametrize(("pcp_size", "num_shards", "chunk_tokens", "kind"), [
    (2, 2, 32, "dense"), (2, 4, 64, "dense"), (4, 4, 64, "dense"), (3, 3, 48, "mla"), (1, 2, 32, "dense")])
def test_rank_views_store_what_one_writer_of_every_shard_stores(pcp_size: int, num_shards: int, chunk_tokens: int,
                                                                  kind: str) -> None:
    bpc = chunk_tokens // BLOCK
    plan = ShardPlan(bpc, num_shards, pcp_size=pcp_size)
    prompt = prompt_tokens(5 * chunk_tokens + 3, seed=7)
    hashes = chain(prompt, chunk_tokens)
    block_ids = list(range(NUM_BLOCKS - 1, NUM_BLOCKS - 1 - len(hashes) * bpc, -1))
    meta = save_meta(hashes, block_ids, bpc)
    kv = make_kv(kind, seed=3)  # every PCP rank holds this replica
    # One writer of all S shards (the single-rank path as it is today).
    single = [MemoryBackend(None, name=f"single-{s}") for s in range(num_shards)]
    w = RangeWorker(config(num_shards, chunk_tokens), BLOCK, LAYERS, NUM_BLOCKS, single)
    w.register_kv_caches(kv)
    w.save(meta)
    # P rank views, each writing its own shards to the same kind of per-shard stores.
    ranked = [MemoryBackend(None, name=f"ranked-{s}") for s in range(num_shards)]
    writes_per_rank = []
    for r in range(pcp_size):
        view = RankSlice(plan, r)
        rw = RangeWorker(rank_view_config(view, config(num_shards, chunk_tokens), BLOCK), BLOCK, LAYERS, NUM_BLOCKS,
                         view.backends(ranked), shard_idxs=view.shard_idxs)
        rw.register_kv_caches(kv)
        rw.save(view.metadata(meta))
        writes_per_rank.append(rw.stats["saved_stripes"])
    assert writes_per_rank == [num_shards // pcp_size] * pcp_size  # each rank writes only its shards, once
    lbb = LAYER_BLOCK_BYTES[kind]
    for s in range(num_shards):
        keys = [ticket_key(h, s) for h in hashes]
        raw_single, raw_ranked = single[s].get_tickets(keys), ranked[s].get_tickets(keys)
        assert all(x is not None for x in raw_single + raw_ranked)
        for a, b in zip(raw_single, raw_ranked):
            assert chunk_bytes(single[s], a, lbb, plan.blocks_per_shard) == \
                chunk_bytes(ranked[s], b, lbb, plan.blocks_per_shard)
        assert ranked[s].used_bytes() == single[s].used_bytes()


@pytest.mark.parametrize(("pcp_size", "num_shards"), [(2, 2), (2, 4), (4, 4)])
def test_a_rank_view_loads_exactly_its_own_blocks(pcp_size: int, num_shards: int) -> None:
    chunk_tokens = 64
    bpc = chunk_tokens // BLOCK
    plan = ShardPlan(bpc, num_shards, pcp_size=pcp_size)
    prompt = prompt_tokens(3 * chunk_tokens, seed=8)
    hashes = chain(prompt, chunk_tokens)
    src_ids = list(range(3 * bpc))
    backends = [MemoryBackend(None, name=f"m{s}") for s in range(num_shards)]
    src = make_kv("dense", seed=4)
    saver = RangeWorker(config(num_shards, chunk_tokens), BLOCK, LAYERS, NUM_BLOCKS, backends)
    saver.register_kv_caches(src)
    saver.save(save_meta(hashes, src_ids, bpc))
    sched = RangeScheduler(config(num_shards, chunk_tokens), NAMESPACE, BLOCK, backends, can_load=True,
                           can_save=True, num_layers=len(LAYERS), layer_block_bytes=LAYER_BLOCK_BYTES["dense"])
    tickets = sched.stored_prefix(hashes)
    sched.close()
    assert len(tickets) == 3
    # A load that starts inside chunk 0 (a local prefix hit of one block), into other block ids.
    dst_ids = list(range(40, 40 + 3 * bpc))
    chunks = tuple(ChunkTransfer(i, hashes[i], tuple(p for p in range(bpc) if i * bpc + p >= 1),
                                 tuple(dst_ids[i * bpc + p] for p in range(bpc) if i * bpc + p >= 1), tickets[i])
                   for i in range(3))
    meta = RangeConnectorMetadata(loads=[RequestTransfer("b", chunks, 3 * chunk_tokens - BLOCK)])
    loaded: list[int] = []
    for r in range(pcp_size):
        view = RankSlice(plan, r)
        dst = make_kv("dense", seed=100 + r)
        rw = RangeWorker(rank_view_config(view, config(num_shards, chunk_tokens), BLOCK), BLOCK, LAYERS, NUM_BLOCKS,
                         view.backends(backends), shard_idxs=view.shard_idxs)
        rw.register_kv_caches(dst)
        rw.start_load(view.metadata(meta))
        assert rw.take_failed_block_ids() == set()
        mine = rw.take_loaded_block_log()
        own_positions = {p for s in view.shard_idxs for p in plan.shard_blocks(s)}
        assert sorted(mine) == sorted(dst_ids[i] for i in range(1, 3 * bpc) if i % bpc in own_positions)
        for b in mine:
            assert same_block(dst, b, src, src_ids[dst_ids.index(b)])
        loaded += mine
    assert sorted(loaded) == dst_ids[1:]  # the ranks together load every promised block once


@settings(max_examples=200, deadline=None)
@given(num_shards=st.sampled_from([1, 2, 4]), num_chunks=st.integers(1, 6), data=st.data())
def test_scheduler_lookup_equals_the_oracle_under_random_eviction(num_shards: int, num_chunks: int, data) -> None:
    chunk_tokens = 4 * BLOCK
    backends = [MemoryBackend(None, name=f"m{s}") for s in range(num_shards)]
    prompt = prompt_tokens(num_chunks * chunk_tokens + 1, seed=data.draw(st.integers(0, 10**6)))
    hashes = chain(prompt, chunk_tokens)
    w = RangeWorker(config(num_shards, chunk_tokens), BLOCK, LAYERS, NUM_BLOCKS, backends)
    w.register_kv_caches(make_kv("dense", seed=0))
    w.save(save_meta(hashes, list(range(num_chunks * 4)), 4))
    evicted = data.draw(st.sets(st.tuples(st.integers(0, num_shards - 1), st.integers(0, num_chunks - 1))))
    for s, i in evicted:
        backends[s].delete_tickets([ticket_key(hashes[i], s)])
    sched = RangeScheduler(config(num_shards, chunk_tokens), NAMESPACE, BLOCK, backends, can_load=True,
                           can_save=True, num_layers=len(LAYERS), layer_block_bytes=LAYER_BLOCK_BYTES["dense"])
    oracle = max(n for n in range(num_chunks + 1) if all((s, i) not in evicted
                                                         for s in range(num_shards) for i in range(n)))
    try:
        assert len(sched.stored_prefix(hashes)) == oracle
    finally:
        sched.close()
        w.close()


# ---------------------------------------------------------------------- agreement bookkeeping
def load(req_id: str, chunks: list[tuple[int, list[int], list[int]]], fail: bool = False) -> RequestTransfer:
    return RequestTransfer(req_id, tuple(ChunkTransfer(i, b"h", tuple(pos), tuple(ids)) for i, pos, ids in chunks),
                           0, fail=fail)


LOADS = [load("a", [(0, [0, 1, 2, 3], [10, 11, 12, 13]), (1, [0, 1, 2, 3], [14, 15, 16, 17])]),
         load("b", [(2, [2, 3], [20, 21]), (3, [0, 1, 2, 3], [22, 23, 24, 25])]),
         load("c", [(0, [0, 1], [30, 31])], fail=True)]


def test_failed_blocks_map_to_the_first_failed_chunk_of_each_request() -> None:
    assert failed_from_blocks(LOADS, {15, 24}) == {"a": 1, "b": 3, "c": 0}
    assert failed_from_blocks(LOADS, set()) == {"c": 0}
    assert blocks_from(LOADS, {"a": 1, "b": 3}) == frozenset({14, 15, 16, 17, 22, 23, 24, 25})


def test_exchange_shares_give_each_rank_its_shards_blocks_of_the_agreed_chunks() -> None:
    plan = ShardPlan(4, 4, pcp_size=2)  # rank 0: shards 0, 2 (positions 0, 2); rank 1: shards 1, 3
    shares = exchange_shares(LOADS, {"a": 1, "c": 0}, plan)
    assert shares == ((10, 12, 20, 22, 24), (11, 13, 21, 23, 25))
    assert exchange_shares(LOADS, {}, ShardPlan(4, 2, pcp_size=2, dcp_size=2)) == ()  # DCP: nothing to exchange


def test_plan_digest_changes_with_any_block() -> None:
    other = [load("a", [(0, [0, 1, 2, 3], [10, 11, 12, 99]), (1, [0, 1, 2, 3], [14, 15, 16, 17])])] + LOADS[1:]
    assert plan_digest(LOADS) == plan_digest(list(LOADS)) != plan_digest(other)
    assert 0 <= plan_digest(LOADS) < NO_FAILURE


@pytest.fixture(scope="module")
def one_rank_group(tmp_path_factory: pytest.TempPathFactory) -> Iterator[object]:
    """A real gloo group of one rank in this process."""
    if dist.is_initialized():  # pragma: no cover - another test left one
        pytest.skip("a torch.distributed default group already exists in this process")
    store = dist.FileStore(str(tmp_path_factory.mktemp("gloo") / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


def test_a_rank_reports_the_agreed_failures_and_saves_nothing_computed_on_them(one_rank_group) -> None:
    ex = PcpExchange(ShardPlan(4, 1), 0, one_rank_group, timeout_s=5.0)
    agreement = ex.agree(LOADS, local_failed_block_ids={16})
    assert agreement.consistent and dict(agreement.failed_from) == {"a": 1, "c": 0}
    assert ex.failed_block_ids() == {14, 15, 16, 17, 30, 31}
    assert ex.failed_loads() == [("a", 1), ("c", 0)]
    saves = RangeConnectorMetadata(saves=[load("a", [(1, [0], [14]), (2, [0], [40])]), load("z", [(0, [0], [50])])])
    kept = ex.without_failed_saves(saves)
    assert [(r.req_id, [c.chunk_idx for c in r.chunks]) for r in kept.saves] == [("z", [0])]
    meta = ex.worker_metadata(RangeWorkerMetadata(failed_loads=[("a", 1)], loaded=["a"]))
    assert meta.failed_loads == [("a", 1), ("c", 0)] and meta.loaded == ["a"]
    assert ex.worker_metadata(None).failed_loads == [("a", 1), ("c", 0)]
    # A step without loads issues no collective and reports nothing.
    ex.agree([], local_failed_block_ids=set())
    assert ex.failed_block_ids() == set() and ex.worker_metadata(None) is None


def test_a_group_that_does_not_match_the_plan_is_refused(one_rank_group) -> None:
    with pytest.raises(ValueError, match="does not match"):
        PcpExchange(ShardPlan(4, 2, pcp_size=2), 0, one_rank_group, timeout_s=1.0)
