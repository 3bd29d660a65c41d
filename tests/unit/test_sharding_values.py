"""ShardPlan (which blocks of a chunk each shard holds) and the stored value format (header, size, checksum)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from range_connector.errors import IntegrityError
from range_connector.sharding import ShardPlan
from range_connector.values import HEADER_BYTES, MAGIC, decode_value, encode_value

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


# ---------------------------------------------------------------------- values
def _payload(num_row_groups: int = 3, num_blocks: int = 2, row_bytes: int = 40, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, size=(num_row_groups, num_blocks, row_bytes), dtype=np.uint8)


def _decode(value: bytes, payload_bytes: int, *, verify: bool = True, groups: int = 3) -> np.ndarray:
    return decode_value(value, num_row_groups=groups, payload_bytes=payload_bytes, verify=verify, where=WHERE)


@pytest.mark.parametrize("shape", [(3, 2, 40), (1, 1, 1), (4, 3, 8), (2, 16, 4096)])
def test_encode_decode_round_trip(shape: tuple[int, int, int]) -> None:
    payload = _payload(*shape)

    value = encode_value(payload.data, shape[0])
    decoded = decode_value(value, num_row_groups=shape[0], payload_bytes=payload.nbytes, verify=True, where=WHERE)

    assert isinstance(value, bytes) and len(value) == HEADER_BYTES + payload.nbytes
    assert value[:4] == MAGIC
    assert decoded.dtype == np.uint8 and decoded.tobytes() == payload.tobytes()
    assert not decoded.flags.writeable


def test_encode_accepts_bytes_and_non_byte_views() -> None:
    payload = _payload()
    as_int64 = payload.reshape(-1).view(np.int64)

    assert encode_value(payload.tobytes(), 3) == encode_value(payload.data, 3) == encode_value(as_int64.data, 3)


@settings(max_examples=100, deadline=None)
@given(data=st.binary(max_size=2048), groups=st.integers(min_value=1, max_value=64))
def test_round_trip_property(data: bytes, groups: int) -> None:
    decoded = decode_value(encode_value(data, groups), num_row_groups=groups, payload_bytes=len(data), verify=True,
                           where=WHERE)
    assert decoded.tobytes() == data


def _flip(value: bytes, offset: int) -> bytes:
    corrupt = bytearray(value)
    corrupt[offset] ^= 0x01
    return bytes(corrupt)


@pytest.mark.parametrize("offset_in_payload", [0, 1, 100, -1])
def test_flipped_payload_byte_raises_when_verifying(offset_in_payload: int) -> None:
    payload = _payload()
    value = encode_value(payload.data, 3)
    offset = HEADER_BYTES + offset_in_payload if offset_in_payload >= 0 else len(value) - 1

    with pytest.raises(IntegrityError, match="checksum mismatch") as exc_info:
        _decode(_flip(value, offset), payload.nbytes, verify=True)
    assert WHERE in str(exc_info.value)


def test_flipped_payload_byte_is_not_caught_without_verification() -> None:
    # Documents the switch: verify_checksums = false trades this protection for speed; sizes and header are
    # still checked, the payload's bytes are not.
    payload = _payload()
    corrupt = _flip(encode_value(payload.data, 3), HEADER_BYTES + 5)

    decoded = _decode(corrupt, payload.nbytes, verify=False)

    assert decoded.tobytes() != payload.tobytes()
    assert decoded.tobytes() == corrupt[HEADER_BYTES:]


def test_flipped_checksum_field_raises_only_when_verifying() -> None:
    payload = _payload()
    corrupt = _flip(encode_value(payload.data, 3), HEADER_BYTES - 1)

    with pytest.raises(IntegrityError, match="checksum"):
        _decode(corrupt, payload.nbytes, verify=True)
    assert _decode(corrupt, payload.nbytes, verify=False).tobytes() == payload.tobytes()


@pytest.mark.parametrize("verify", [True, False])
@pytest.mark.parametrize("delta", [-1, 1, -HEADER_BYTES - 1])
def test_wrong_length_raises_naming_where(verify: bool, delta: int) -> None:
    payload = _payload()
    value = encode_value(payload.data, 3)
    wrong = value + b"\x00" if delta > 0 else value[: max(0, len(value) + delta)]

    with pytest.raises(IntegrityError, match="expected") as exc_info:
        _decode(wrong, payload.nbytes, verify=verify)
    assert str(exc_info.value).startswith(WHERE)


@pytest.mark.parametrize("verify", [True, False])
@pytest.mark.parametrize("offset", [0, 3, 4, 8])  # magic (first and last byte), row groups, payload size
def test_wrong_header_raises_naming_where(verify: bool, offset: int) -> None:
    payload = _payload()
    corrupt = _flip(encode_value(payload.data, 3), offset)

    with pytest.raises(IntegrityError, match="header") as exc_info:
        _decode(corrupt, payload.nbytes, verify=verify)
    assert str(exc_info.value).startswith(WHERE)


@pytest.mark.parametrize("verify", [True, False])
def test_layout_mismatch_is_an_integrity_error(verify: bool) -> None:
    # A value written under another layout (other row groups, same total size) is refused, never misread.
    payload = _payload(num_row_groups=3, num_blocks=2, row_bytes=40)
    value = encode_value(payload.data, 3)

    with pytest.raises(IntegrityError, match="header"):
        _decode(value, payload.nbytes, verify=verify, groups=6)
    with pytest.raises(IntegrityError, match="expected"):
        _decode(value, payload.nbytes * 2, verify=verify)
