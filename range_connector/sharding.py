"""Which slice of every chunk each shard holds (the only module that knows shard slicing).

A chunk of ``chunk_tokens`` tokens is ``blocks_per_chunk`` whole engine blocks. With ``num_shards`` S, block ``j`` of
a chunk belongs to shard ``j mod S`` (rule ``block-round-robin-v1`` in the namespace). ``blocks_per_chunk`` is a
multiple of S (checked at start-up), so every shard holds the same number of blocks and the S slices tile every
chunk exactly once.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ShardPlan:
    """Block-to-shard mapping of one chunk.

    Attributes:
        blocks_per_chunk: engine blocks per chunk.
        num_shards: S.
    """

    blocks_per_chunk: int
    num_shards: int

    def __post_init__(self) -> None:
        if self.num_shards < 1 or self.blocks_per_chunk < 1 or self.blocks_per_chunk % self.num_shards:
            raise ValueError(
                f"blocks_per_chunk {self.blocks_per_chunk} is not a positive multiple of num_shards "
                f"{self.num_shards}"
            )

    @property
    def blocks_per_shard(self) -> int:
        """Blocks of one chunk held by each shard."""
        return self.blocks_per_chunk // self.num_shards

    def shard_blocks(self, shard_idx: int) -> range:
        """Positions (0-based, within the chunk) of the blocks that shard ``shard_idx`` holds, in stored order."""
        return range(shard_idx, self.blocks_per_chunk, self.num_shards)

    def shard_of_block(self, block_pos: int) -> tuple[int, int]:
        """Return ``(shard_idx, position inside that shard's slice)`` of block ``block_pos`` of a chunk."""
        return block_pos % self.num_shards, block_pos // self.num_shards
