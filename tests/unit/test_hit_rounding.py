"""``scheduler.hit_tokens``: the stored prefix cut to leave one prompt token, rounded down to whole engine blocks."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from range_connector.scheduler.planning import hit_tokens

pytestmark = pytest.mark.timeout(30)

CHUNK = 256
BLOCK = 16


@pytest.mark.parametrize(
    ("num_stored_chunks", "num_prompt_tokens", "expected"),
    [
        # Prompt exactly a multiple of the chunk, fully stored: the last token is recomputed, so the last block
        # (which holds it) is recomputed too.
        (2, 2 * CHUNK, 2 * CHUNK - BLOCK),
        (1, CHUNK, CHUNK - BLOCK),
        # One more token than whole chunks: every stored chunk is loaded.
        (2, 2 * CHUNK + 1, 2 * CHUNK),
        (1, CHUNK + 1, CHUNK),
        # One less than whole chunks: only the full chunks are stored.
        (1, 2 * CHUNK - 1, CHUNK),
        (0, CHUNK - 1, 0),
        # Stored prefix shorter than the prompt.
        (1, 5 * CHUNK + 7, CHUNK),
        (3, 5 * CHUNK + 7, 3 * CHUNK),
        # Stored prefix longer than the prompt (e.g. another request stored more): capped by the prompt.
        (10, 3 * CHUNK + 5, 3 * CHUNK),
        (10, 3 * CHUNK, 3 * CHUNK - BLOCK),
        (10, 3 * CHUNK + BLOCK + 1, 3 * CHUNK + BLOCK),
        (10, 3 * CHUNK + BLOCK, 3 * CHUNK),
        # Nothing stored, empty or one-token prompts.
        (0, 1000, 0),
        (5, 0, 0),
        (5, 1, 0),
        (5, BLOCK, 0),
        (5, BLOCK + 1, BLOCK),
    ],
)
def test_hit_at_chunk_and_block_boundaries(num_stored_chunks: int, num_prompt_tokens: int, expected: int) -> None:
    assert hit_tokens(num_stored_chunks, CHUNK, num_prompt_tokens, BLOCK) == expected


@pytest.mark.parametrize(
    ("num_stored_chunks", "chunk_tokens", "num_prompt_tokens", "block_size", "expected"),
    [
        (1, 256, 200, 128, 128),  # prompt inside the first chunk: round 199 down to blocks
        (1, 256, 129, 128, 128),
        (1, 256, 128, 128, 0),  # one block prompt: nothing can be promised
        (4, 512, 1000, 128, 896),  # 999 rounded down to 128
        (2, 96, 1000, 32, 192),
        (1, 96, 96, 32, 64),
        (3, 48, 145, 48, 144),
    ],
)
def test_hit_rounds_down_to_engine_blocks(
    num_stored_chunks: int, chunk_tokens: int, num_prompt_tokens: int, block_size: int, expected: int
) -> None:
    assert hit_tokens(num_stored_chunks, chunk_tokens, num_prompt_tokens, block_size) == expected


def test_case_C04_full_hit_of_a_non_block_multiple_prompt_leaves_tokens_to_compute() -> None:
    # C04: a prompt of a few hundred tokens, not a multiple of the block size, fully cached.
    num_prompt_tokens, chunk_tokens, block_size = 300, 64, 16
    num_stored_chunks = num_prompt_tokens // chunk_tokens  # every full chunk is stored

    hit = hit_tokens(num_stored_chunks, chunk_tokens, num_prompt_tokens, block_size)

    assert hit == 256
    assert hit % block_size == 0 and 0 < num_prompt_tokens - hit
    # With a chunk of one block, the full hit stops at the block that holds the last token.
    assert hit_tokens(num_prompt_tokens // block_size, block_size, num_prompt_tokens, block_size) == 288


@settings(max_examples=400, deadline=None)
@given(
    block_size=st.sampled_from([1, 2, 16, 32, 48, 64, 128, 256]),
    blocks_per_chunk=st.integers(min_value=1, max_value=16),
    num_stored_chunks=st.integers(min_value=0, max_value=64),
    num_prompt_tokens=st.integers(min_value=0, max_value=20_000),
)
def test_hit_properties(block_size: int, blocks_per_chunk: int, num_stored_chunks: int, num_prompt_tokens: int) -> None:
    chunk_tokens = block_size * blocks_per_chunk

    hit = hit_tokens(num_stored_chunks, chunk_tokens, num_prompt_tokens, block_size)

    assert hit % block_size == 0
    assert 0 <= hit <= max(0, num_prompt_tokens - 1)
    assert hit <= num_stored_chunks * chunk_tokens
    # The largest such value: one more block would break one of the bounds.
    assert hit + block_size > min(num_stored_chunks * chunk_tokens, max(0, num_prompt_tokens - 1))
    # Monotone in what is stored.
    assert hit_tokens(num_stored_chunks + 1, chunk_tokens, num_prompt_tokens, block_size) >= hit


def test_a_load_that_ends_inside_a_block_names_that_block_as_computed_by_vllm_too() -> None:
    """A stored tail is loaded up to the prompt's last token, which vLLM computes into the load's last block: the
    worker must stage that block (``RequestTransfer.computed_block_ids``); a load ending on a block boundary leaves
    vLLM no block of its own."""
    from range_connector.scheduler.planning import LookupResult, computed_block_ids

    lookup = LookupResult([], [], 0, num_computed_tokens=32, num_hit_tokens=32 + 47)
    block_ids = [10, 11, 12, 13, 14]
    assert computed_block_ids(lookup, block_ids, 47, block_size=16) == (14,)  # vLLM computes token 79: block 4
    assert computed_block_ids(lookup, block_ids, 48, block_size=16) == ()  # token 80 starts a block of its own
    assert computed_block_ids(lookup, block_ids, 17, block_size=16) == (13,)  # token 49: block 3
