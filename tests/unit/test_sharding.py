"""ShardPlan (which slice of a chunk each shard holds, whole blocks or vLLM's DCP interleave), the ranks' shards and
rank views, and the min-across-shards lookup against a brute-force oracle."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from range_connector.errors import ConfigError
from range_connector.kv.namespace import ChunkHash
from range_connector.kv.sharding import RankSlice, ShardPlan, common_stored_prefix, leading_run, shards_of_rank

pytestmark = pytest.mark.timeout(90)

WHERE = "valkey://127.0.0.1:7001 key rc1:abcd:s0:t0"


# ---------------------------------------------------------------------- ShardPlan
@settings(max_examples=200, deadline=None)
@given(num_shards=st.integers(min_value=1, max_value=16), blocks_per_shard=st.integers(min_value=1, max_value=16))
def test_shard_slices_tile_a_chunk_exactly_once(num_shards: int, blocks_per_shard: int) -> None:
    plan = ShardPlan(num_shards * blocks_per_shard, num_shards)

    slices = [list(plan.shard_blocks(s)) for s in range(num_shards)]

    assert plan.blocks_per_shard == blocks_per_shard
    assert all(len(s) == blocks_per_shard for s in slices)
    assert sorted(pos for s in slices for pos in s) == list(range(plan.blocks_per_chunk))
    for shard_idx, positions in enumerate(slices):
        assert positions == sorted(positions)
        for slot, pos in enumerate(positions):
            assert plan.shard_of_block(pos) == (shard_idx, slot)


def test_round_robin_rule() -> None:
    plan = ShardPlan(8, 4)

    assert [list(plan.shard_blocks(s)) for s in range(4)] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert plan.shard_of_block(6) == (2, 1)


def test_one_shard_holds_the_whole_chunk_in_order() -> None:
    plan = ShardPlan(5, 1)

    assert list(plan.shard_blocks(0)) == [0, 1, 2, 3, 4]
    assert [plan.shard_of_block(p) for p in range(5)] == [(0, p) for p in range(5)]


@pytest.mark.parametrize(("blocks_per_chunk", "num_shards"), [(4, 0), (4, -1), (4, 3), (3, 2), (1, 2), (6, 4)])
def test_bad_plans_raise(blocks_per_chunk: int, num_shards: int) -> None:
    with pytest.raises(ValueError, match="num_shards"):
        ShardPlan(blocks_per_chunk, num_shards)


@pytest.mark.parametrize(("blocks_per_chunk", "num_shards"), [(0, 1), (0, 4), (-4, 2)])
def test_plans_without_blocks_raise(blocks_per_chunk: int, num_shards: int) -> None:
    with pytest.raises(ValueError):
        ShardPlan(blocks_per_chunk, num_shards)


def test_plan_is_frozen() -> None:
    plan = ShardPlan(4, 2)
    with pytest.raises(AttributeError):
        plan.num_shards = 4  # type: ignore[misc]


# ---------------------------------------------------------------------- rules, ranks, tiling
plans = st.builds(
    lambda writers, k, blocks_per_shard, dcp, interleave_log2: ShardPlan(
        blocks_per_shard * (k if dcp else writers * k), writers * k, pcp_size=writers, dcp_size=writers if dcp else 1,
        cp_interleave_tokens=1 << interleave_log2),
    writers=st.integers(1, 4), k=st.integers(1, 3), blocks_per_shard=st.integers(1, 3), dcp=st.booleans(),
    interleave_log2=st.integers(0, 3))


@settings(max_examples=300, deadline=None)
@given(plan=plans, block_size_log2=st.integers(3, 4))
def test_every_rule_tiles_every_chunk_exactly_once(plan: ShardPlan, block_size_log2: int) -> None:
    block_size = 1 << block_size_log2  # 8 or 16 tokens: a multiple of every interleave drawn
    plan.check_tiling(block_size)  # raises if a token is held by no shard or by two

    offsets = [plan.shard_token_offsets(s, block_size) for s in range(plan.num_shards)]
    per_chunk = plan.blocks_per_chunk * block_size * plan.dcp_size
    assert sorted(t for o in offsets for t in o) == list(range(per_chunk))
    # Every shard holds the same number of rows: blocks_per_shard physical blocks of block_size tokens.
    assert {len(o) for o in offsets} == {plan.blocks_per_shard * block_size}


@settings(max_examples=200, deadline=None)
@given(dcp=st.integers(2, 4), k=st.integers(1, 2), blocks=st.integers(1, 2), interleave_log2=st.integers(0, 4))
def test_dcp_slices_follow_vllm_interleave(dcp: int, k: int, blocks: int, interleave_log2: int) -> None:
    """The tokens a DCP rank's shards hold are the tokens vLLM stores on that rank: for every prefix length the
    count equals vLLM's own ``get_dcp_local_seq_lens``, and each rank's tokens of a virtual block fill its physical
    block's slots 0..block_size-1 once (vLLM's slot mapping)."""
    import torch
    from vllm.v1.attention.backends.utils import get_dcp_local_seq_lens

    block_size = 16
    interleave = 1 << interleave_log2
    plan = ShardPlan(blocks * k, dcp * k, pcp_size=1, dcp_size=dcp, cp_interleave_tokens=interleave)
    per_chunk = plan.blocks_per_chunk * block_size * dcp
    for rank in range(dcp):
        mine = sorted(t for s in shards_of_rank(rank, dcp, plan.num_shards)
                      for t in plan.shard_token_offsets(s, block_size))
        for n in range(0, per_chunk + 1, 7):
            expected = int(get_dcp_local_seq_lens(torch.tensor([n]), dcp, rank, interleave)[0])
            assert sum(1 for t in mine if t < n) == expected
        slots = [plan.dcp_local_slot(o, block_size) for o in range(block_size * dcp)]
        assert sorted(slot for w, slot in slots if w == rank) == list(range(block_size))


def test_rule_names_are_distinct_and_whole_blocks_keep_the_old_name() -> None:
    from range_connector.kv.namespace import SHARD_RULE

    assert ShardPlan(4, 2, pcp_size=2).rule == ShardPlan(4, 4).rule == SHARD_RULE  # a PCP=1 reader shares it
    assert ShardPlan(4, 2, pcp_size=2, dcp_size=2).rule == f"dcp2-interleave1-{SHARD_RULE}"
    assert ShardPlan(4, 2, dcp_size=2, cp_interleave_tokens=16).rule != ShardPlan(4, 2, dcp_size=2).rule


@pytest.mark.parametrize(("rank", "writers", "shards", "expected"), [
    (0, 1, 1, (0,)), (0, 1, 3, (0, 1, 2)), (1, 2, 2, (1,)), (1, 2, 6, (1, 3, 5)), (3, 4, 8, (3, 7))])
def test_shards_of_rank(rank: int, writers: int, shards: int, expected: tuple[int, ...]) -> None:
    assert shards_of_rank(rank, writers, shards) == expected


@pytest.mark.parametrize(("rank", "writers", "shards", "key"), [
    (0, 2, 3, "num_shards"), (0, 2, 0, "num_shards"), (2, 2, 4, "rank"), (-1, 2, 4, "rank"), (0, 0, 4, "num_shards")])
def test_bad_rank_layouts_name_the_key(rank: int, writers: int, shards: int, key: str) -> None:
    with pytest.raises(ConfigError, match=f"^{key}: "):
        shards_of_rank(rank, writers, shards)


@pytest.mark.parametrize("kwargs", [dict(pcp_size=2, dcp_size=4), dict(pcp_size=0), dict(cp_interleave_tokens=0)])
def test_unsupported_context_parallel_layouts_raise(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        ShardPlan(8, 4, **kwargs)


@settings(max_examples=300, deadline=None)
@given(plan=plans)
def test_rank_views_partition_every_chunk(plan: ShardPlan) -> None:
    from range_connector.kv.metadata import ChunkTransfer

    bpc = plan.blocks_per_chunk
    chunk = ChunkTransfer(0, ChunkHash(b"h"), tuple(range(bpc)), tuple(100 + p for p in range(bpc)))
    views = [RankSlice(plan, r) for r in range(plan.num_writers)]
    for v in views:
        local = v.local_plan
        assert local.num_shards == plan.shards_per_writer and local.blocks_per_shard == plan.blocks_per_shard
        for q in range(local.blocks_per_chunk):
            p = v.global_position(q)
            assert v.local_position(p) == q
            # Local shard i of the view is global shard shard_idxs[i], holding the same block at the same slot.
            i, slot = local.shard_of_block(q)
            if not plan.splits_blocks:
                assert plan.shard_of_block(p) == (v.shard_idxs[i], slot)
    got = [v.chunk(chunk) for v in views]
    if plan.splits_blocks:  # every rank holds its slice of every block
        assert all(c.block_ids == chunk.block_ids for c in got)
    else:  # every block on exactly one rank
        assert sorted(b for c in got if c is not None for b in c.block_ids) == list(chunk.block_ids)


# ---------------------------------------------------------------------- min-across-shards lookup
def oracle_common_prefix(present: list[list[bool]]) -> int:
    """Brute force: the longest n such that every shard holds every chunk below n."""
    num_chunks = min((len(row) for row in present), default=0)
    return max(n for n in range(num_chunks + 1) if all(all(row[:n]) for row in present))


@settings(max_examples=2000, deadline=None)
@given(num_shards=st.integers(1, 8), num_chunks=st.integers(0, 12), data=st.data())
def test_min_over_shards_is_the_longest_prefix_on_every_shard(num_shards: int, num_chunks: int, data) -> None:
    # Every chunk written to every shard, then random chunks evicted on random shards.
    evicted = data.draw(st.sets(st.tuples(st.integers(0, num_shards - 1), st.integers(0, max(0, num_chunks - 1))),
                                max_size=num_shards * num_chunks))
    present = [[(s, i) not in evicted for i in range(num_chunks)] for s in range(num_shards)]
    per_shard = [[f"t{s}.{i}" if ok else None for i, ok in enumerate(row)] for s, row in enumerate(present)]

    got = common_stored_prefix(per_shard)

    assert len(got) == min(leading_run(row) for row in per_shard) == oracle_common_prefix(present)
    assert got == [tuple(f"t{s}.{i}" for s in range(num_shards)) for i in range(len(got))]


def test_common_prefix_edge_cases() -> None:
    assert common_stored_prefix([]) == []
    assert common_stored_prefix([["a", "b"], ["c"]]) == [("a", "c")]  # a shorter row ends the prefix
    assert common_stored_prefix([[None, "b"], ["c", "d"]]) == []  # chunk 1 alone is useless
    assert leading_run(["a", None, "c"]) == 1
