"""Which slice of every chunk each shard holds, which shards each context-parallel rank writes and reads, and the
min-across-shards lookup. The only module that knows context-parallel (PCP/DCP) ranks.

Vocabulary: a chunk is ``blocks_per_chunk`` engine blocks as the scheduler counts them; ``num_shards`` S; the
*writers* are the W ranks among which writes are split: the P prefill-context-parallel (PCP) ranks, or, when vLLM
splits the KV cache itself with decode context parallelism (DCP), the D DCP ranks. S is a multiple of W (S = W by
default); writer ``w`` writes shards ``w, w + W, w + 2W, ...`` (:func:`shards_of_rank`), each to its own backend, so
no byte is written twice and even one writer (W = 1) can spread a chunk over S servers.

Slicing rules (the rule's name, :attr:`ShardPlan.rule`, and S are in the namespace, so a reader with another rule
misses instead of misreading):

* ``block-round-robin-v1`` (DCP off: every rank holds a full replica of the KV cache, as vLLM 0.32's PCP does, and
  a PCP=1 engine is the same case with W = 1): block ``j`` of a chunk, as a whole engine block, belongs to shard
  ``j mod S``. Shard ``s`` stores its blocks in chunk order.
* ``dcp<D>-interleave<I>-block-round-robin-v1`` (DCP on, D > 1): vLLM splits every block across the D DCP ranks.
  The scheduler's block (``block_size * D`` tokens, a "virtual block") is one physical block of ``block_size``
  tokens on every DCP rank, and rank ``w`` holds the token at offset ``o`` of the virtual block when
  ``(o // I) % D == w``, at local slot ``(o // (D * I)) * I + o % I`` (vLLM 0.32 ``ParallelConfig.
  cp_kv_cache_interleave_size`` = I; the slot mapping is ``ComputeSlotMappingKernel`` in
  ``vllm/v1/worker/block_table.py``, L351-364, and ``vllm/v1/worker/gpu/block_table.py``, L329-335). Here the
  writers are the DCP ranks: shard ``s`` = ``w + W * i`` holds writer ``w``'s physical rows of the chunk's blocks
  ``j`` with ``j mod (S / W) == i``. Its token slice follows vLLM's interleave exactly (:meth:`ShardPlan.
  shard_token_offsets`); nothing is exchanged between ranks on load, since each rank needs only its own slice.

In both rules the S slices tile every chunk's tokens exactly once (checked by :meth:`ShardPlan.check_tiling` and
by property tests). The installed vLLM (0.32) keeps a full replica of the KV cache on every PCP rank and shards it
only with DCP (``ParallelConfig.pcp_shard_decode_requests``); PCP needs its GPU model runner, so on CPU the protocol
is exercised by the multi-process harness in ``tests/pcp``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from range_connector.errors import ConfigError
from range_connector.kv.namespace import SHARD_RULE

T = TypeVar("T")


def shards_of_rank(rank: int, num_writers: int, num_shards: int) -> tuple[int, ...]:
    """Shards written (and read) by writer ``rank``: ``rank, rank + W, rank + 2W, ...``.

    Args:
        rank: the writer's rank in its context-parallel group, ``0 <= rank < num_writers``.
        num_writers: W, the PCP size (or the DCP size when DCP splits the cache).
        num_shards: S, a positive multiple of W.

    Returns:
        ``S / W`` shard indices, ascending.

    Raises:
        ConfigError: S is not a positive multiple of W (names ``num_shards``), or ``rank`` is out of range.
    """
    check_shard_count(num_shards, num_writers)
    if not 0 <= rank < num_writers:
        raise ConfigError("rank", f"{rank} is not in [0, {num_writers})")
    return tuple(range(rank, num_shards, num_writers))


def check_shard_count(num_shards: int, num_writers: int) -> None:
    """Raise ``ConfigError("num_shards", ...)`` unless S is a positive multiple of the writer count W."""
    if num_writers < 1:
        raise ConfigError("num_shards", f"the context-parallel size must be >= 1, got {num_writers}")
    if num_shards < 1 or num_shards % num_writers:
        raise ConfigError("num_shards", f"{num_shards} is not a positive multiple of the context-parallel size "
                                        f"{num_writers}: each rank writes whole shards")


@dataclass(frozen=True, slots=True)
class ShardPlan:
    """Block-to-shard mapping of one chunk (see the module docstring for the two rules).

    Attributes:
        blocks_per_chunk: engine blocks per chunk, as the scheduler counts them (virtual blocks under DCP).
        num_shards: S.
        pcp_size: P, prefill context parallel size of the writer (1: none).
        dcp_size: D, decode context parallel size (1: the KV cache is not split across ranks).
        cp_interleave_tokens: vLLM's ``cp_kv_cache_interleave_size`` (tokens; only used when D > 1).

    Raises:
        ValueError: a count is not positive, S is not a multiple of the writer count, the chunk's blocks do not
            split evenly over a writer's shards, or D > 1 and P > 1 differ (vLLM then spans DCP over TP x PCP,
            which Range does not serve).
    """

    blocks_per_chunk: int
    num_shards: int
    pcp_size: int = 1
    dcp_size: int = 1
    cp_interleave_tokens: int = 1

    def __post_init__(self) -> None:
        if min(self.pcp_size, self.dcp_size, self.cp_interleave_tokens) < 1:
            raise ValueError(f"pcp_size {self.pcp_size}, dcp_size {self.dcp_size} and cp_interleave_tokens "
                             f"{self.cp_interleave_tokens} must be >= 1")
        if self.dcp_size > 1 and self.pcp_size > 1 and self.dcp_size != self.pcp_size:
            raise ValueError(f"dcp_size {self.dcp_size} spans more than the PCP group of {self.pcp_size} ranks; "
                             "Range shards by PCP or by DCP rank, not by TP x PCP")
        if self.num_shards < 1 or self.num_shards % self.num_writers:
            raise ValueError(f"num_shards {self.num_shards} is not a positive multiple of the "
                             f"{self.num_writers} writer ranks")
        per = self.num_shards if not self.splits_blocks else self.shards_per_writer
        if self.blocks_per_chunk < 1 or self.blocks_per_chunk % per:
            raise ValueError(f"blocks_per_chunk {self.blocks_per_chunk} is not a positive multiple of num_shards "
                             f"{self.num_shards}" + (f" / dcp_size {self.dcp_size}" if self.splits_blocks else ""))

    # ---------------------------------------------------------------- geometry
    @property
    def splits_blocks(self) -> bool:
        """Whether vLLM splits every block across ranks (DCP), so shards hold token slices of blocks."""
        return self.dcp_size > 1

    @property
    def num_writers(self) -> int:
        """W: the ranks among which writes are split (DCP ranks when DCP is on, else PCP ranks)."""
        return self.dcp_size if self.splits_blocks else self.pcp_size

    @property
    def shards_per_writer(self) -> int:
        """S / W."""
        return self.num_shards // self.num_writers

    @property
    def blocks_per_shard(self) -> int:
        """Rows of one chunk (per layer and plane) held by each shard: ``blocks_per_chunk / S`` whole blocks, or
        under DCP ``blocks_per_chunk / (S / D)`` physical blocks holding the writer's token slice."""
        return self.blocks_per_chunk // (self.shards_per_writer if self.splits_blocks else self.num_shards)

    @property
    def needs_exchange(self) -> bool:
        """Whether ranks must exchange slices after a load: they hold replicas (no DCP) and there are several."""
        return not self.splits_blocks and self.pcp_size > 1

    @property
    def rule(self) -> str:
        """The slicing rule's name, for the namespace."""
        if not self.splits_blocks:
            return SHARD_RULE
        return f"dcp{self.dcp_size}-interleave{self.cp_interleave_tokens}-{SHARD_RULE}"

    def writer_of_shard(self, shard_idx: int) -> int:
        """The rank that writes shard ``shard_idx``."""
        return shard_idx % self.num_writers

    def shard_blocks(self, shard_idx: int) -> range:
        """Positions (0-based, within the chunk) of the blocks whose rows shard ``shard_idx`` holds, stored order.

        Without DCP these are whole blocks (``s, s + S, ...``); under DCP the rows are the writer's physical rows
        of those blocks (its token slice of each).
        """
        if self.splits_blocks:
            return range(shard_idx // self.num_writers, self.blocks_per_chunk, self.shards_per_writer)
        return range(shard_idx, self.blocks_per_chunk, self.num_shards)

    def shard_of_block(self, block_pos: int) -> tuple[int, int]:
        """Return ``(shard_idx, slot in that shard's slice)`` of block ``block_pos`` (whole-block rule only).

        Raises:
            ValueError: under DCP, where each block is split over D shards (use :class:`RankSlice`).
        """
        if self.splits_blocks:
            raise ValueError("under DCP every block is split over dcp_size shards; ask a RankSlice")
        return block_pos % self.num_shards, block_pos // self.num_shards

    def shard_token_offsets(self, shard_idx: int, block_size: int) -> list[int]:
        """Token offsets (within the chunk, ascending) whose KV shard ``shard_idx`` stores.

        Args:
            shard_idx: the shard.
            block_size: tokens per physical engine block (the scheduler's block is ``block_size * D`` under DCP).

        Raises:
            ValueError: under DCP, ``block_size`` is not a multiple of ``cp_interleave_tokens`` (vLLM refuses it).
        """
        if not self.splits_blocks:
            return [p * block_size + t for p in self.shard_blocks(shard_idx) for t in range(block_size)]
        d, inter = self.dcp_size, self.cp_interleave_tokens
        if block_size % inter:
            raise ValueError(f"block_size {block_size} is not a multiple of cp_interleave_tokens {inter}")
        w = self.writer_of_shard(shard_idx)
        virtual = block_size * d
        return [p * virtual + o for p in self.shard_blocks(shard_idx) for o in range(virtual)
                if (o // inter) % d == w]

    def dcp_local_slot(self, offset: int, block_size: int) -> tuple[int, int]:
        """Under DCP: ``(dcp rank, slot in its physical block)`` of the token at ``offset`` in a virtual block
        (vLLM 0.32 ``vllm/v1/worker/block_table.py`` L356-364)."""
        d, inter = self.dcp_size, self.cp_interleave_tokens
        return (offset // inter) % d, (offset // (d * inter)) * inter + offset % inter

    def check_tiling(self, block_size: int) -> None:
        """Check that the S slices tile a chunk's tokens exactly once.

        Raises:
            ValueError: a token is held by no shard or by two (a bug in this module).
        """
        num_tokens = self.blocks_per_chunk * block_size * (self.dcp_size if self.splits_blocks else 1)
        seen = [0] * num_tokens
        for s in range(self.num_shards):
            for t in self.shard_token_offsets(s, block_size):
                seen[t] += 1
        bad = [t for t, n in enumerate(seen) if n != 1]
        if bad:
            raise ValueError(f"{self.rule}: tokens {bad[:8]} are held by {[seen[t] for t in bad[:8]]} shards")


# -------------------------------------------------------------------------------------------------- lookup
def leading_run(present: Sequence[T | None]) -> int:
    """Length of the run of present entries (not ``None``) from index 0: a shard's longest stored prefix."""
    n = 0
    for x in present:
        if x is None:
            break
        n += 1
    return n


def common_stored_prefix(per_shard: Sequence[Sequence[T | None]]) -> list[tuple[T, ...]]:
    """The leading chunks stored on every shard, given what each shard holds of a prompt's chain.

    Args:
        per_shard: ``[num_shards][num_chunks]``: shard ``s``'s ticket for chunk ``i``, or ``None`` when the shard
            lacks it (never written, evicted, or not fitting the layout). Rows may be shorter than the chain
            (missing entries are absent).

    Returns:
        ``[n]`` tuples ``(ticket on shard 0, ..., ticket on shard S-1)`` for chunks ``0 .. n-1``, with
        ``n = min over s of L_s``, where ``L_s`` is the :func:`leading_run` of shard ``s``.

    Why the minimum is exactly the longest prefix present on every shard. With eviction of arbitrary chunks, the
    set of chunks a shard holds is *not* prefix-closed in the chain (it may hold chunk 5 without chunk 3), so the
    per-shard answer is defined as ``L_s``, the length of the first run. Let ``A_s = {n : chunks 0..n-1 are all on
    shard s}``; by definition ``A_s = {0, ..., L_s}``, a prefix-closed set of prefix lengths. A prefix of length
    ``n`` is loadable iff every shard holds all its chunks, i.e. ``n`` is in ``A = ∩_s A_s``. An intersection of
    sets of the form ``{0, ..., L_s}`` is ``{0, ..., min_s L_s}``, so ``max A = min_s L_s``: the minimum never
    promises a chunk some shard lacks (no false hit) and never stops short of one all shards hold (no false miss).
    Checked against a brute-force oracle by property tests (``tests/unit/test_sharding.py``) and end to end against
    real Valkey servers (``tests/backends/test_sharded_lookup.py``).
    """
    if not per_shard:
        return []
    n = min(leading_run(row) for row in per_shard)
    return [tuple(row[i] for row in per_shard) for i in range(n)]  # type: ignore[misc]


# -------------------------------------------------------------------------------------------------- one rank
@dataclass(frozen=True, slots=True)
class RankSlice:
    """What one writer rank holds of every chunk, seen as a Range worker of its own (the *rank view*).

    A rank's shards ``r, r + W, ...`` are, to that rank, a chunk of ``local_plan.blocks_per_chunk`` blocks split
    over ``S / W`` local shards by the same round-robin rule. So a :class:`~range_connector.worker.facade.RangeWorker`
    built with :meth:`config`, :meth:`backends` and ``shard_idxs`` = :attr:`shard_idxs` (its ticket keys name the
    global shards) and fed :meth:`metadata` saves exactly this rank's shards (bytes and tickets identical to what
    a single writer of all S shards would store) and loads exactly them; the other shards' blocks then arrive
    through :mod:`range_connector.worker.pcp` (replicas) or are not needed (DCP). Chunk indices, hashes and block ids
    are kept; block positions are translated.

    Local position ``q`` of global position ``p`` (replicas): shard ``s = r + W * i`` holds ``p = j * S + s`` at
    slot ``j``; its local shard ``i`` holds local ``q = j * (S / W) + i`` at the same slot. Under DCP every
    position is local (``q = p``): the rank's physical rows of every block are its slice.

    Attributes:
        plan: the global plan.
        rank: the writer rank (PCP rank, or DCP rank under DCP).
    """

    plan: ShardPlan
    rank: int

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.plan.num_writers:
            raise ValueError(f"rank {self.rank} is not in [0, {self.plan.num_writers})")

    @property
    def shard_idxs(self) -> tuple[int, ...]:
        """This rank's shards (global indices), ascending."""
        return shards_of_rank(self.rank, self.plan.num_writers, self.plan.num_shards)

    @property
    def local_plan(self) -> ShardPlan:
        """The plan of the rank view: ``S / W`` shards over the rank's blocks of a chunk."""
        k = self.plan.shards_per_writer
        return ShardPlan(self.plan.blocks_per_shard * k, k)

    def local_position(self, block_pos: int) -> int | None:
        """Local position of chunk block ``block_pos`` in the rank view, or ``None`` if another rank's."""
        if self.plan.splits_blocks:
            return block_pos
        s, slot = self.plan.shard_of_block(block_pos)
        if self.plan.writer_of_shard(s) != self.rank:
            return None
        return slot * self.plan.shards_per_writer + s // self.plan.num_writers

    def global_position(self, local_pos: int) -> int:
        """Inverse of :meth:`local_position`."""
        if self.plan.splits_blocks:
            return local_pos
        k = self.plan.shards_per_writer
        return (local_pos // k) * self.plan.num_shards + self.rank + self.plan.num_writers * (local_pos % k)

    def backends(self, backends_by_shard: Sequence[T]) -> list[T]:
        """This rank's backends, in :attr:`shard_idxs` order (its worker is built with ``shard_idxs``, so tickets
        are published under their global shard index; see :class:`~range_connector.worker.facade.RangeWorker`).

        Args:
            backends_by_shard: ``[num_shards]`` (entries of other ranks' shards are not touched and may be
                ``None``), or ``[S / W]`` already this rank's.
        """
        if len(backends_by_shard) == self.plan.shards_per_writer:
            return list(backends_by_shard)
        return [backends_by_shard[s] for s in self.shard_idxs]

    def chunk(self, chunk: Any) -> Any | None:
        """A :class:`~range_connector.kv.metadata.ChunkTransfer` restricted to this rank's blocks, in local positions
        (``None`` when the rank holds none of them)."""
        pairs = sorted((q, b) for q, b in ((self.local_position(p), b)
                                          for p, b in zip(chunk.block_positions, chunk.block_ids)) if q is not None)
        if not pairs:
            return None
        tickets = tuple(chunk.tickets[s] for s in self.shard_idxs) if chunk.tickets else ()
        return dataclasses.replace(chunk, block_positions=tuple(q for q, _ in pairs),
                                   block_ids=tuple(b for _, b in pairs), tickets=tickets)

    def request(self, req: Any) -> Any:
        """A :class:`~range_connector.kv.metadata.RequestTransfer` restricted to this rank's blocks."""
        chunks = tuple(c for c in (self.chunk(c) for c in req.chunks) if c is not None)
        if req.fail:  # the whole request fails: keep one chunk so the worker reports it, from its first chunk
            chunks = chunks or tuple(req.chunks[:1])
        return dataclasses.replace(req, chunks=chunks)

    def metadata(self, meta: Any) -> Any:
        """The step's :class:`~range_connector.kv.metadata.RangeConnectorMetadata` as this rank's worker sees it."""
        return dataclasses.replace(meta, loads=[self.request(r) for r in meta.loads],
                                   saves=[self.request(r) for r in meta.saves], probes=[])
