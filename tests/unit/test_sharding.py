"""ShardPlan (which blocks of a chunk each shard holds) and the stored value format (header, size, checksum)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from range_connector.sharding import ShardPlan

pytestmark = pytest.mark.timeout(30)

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
