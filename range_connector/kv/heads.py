"""Which KV heads each tensor-parallel rank holds, and which ranks write them.

vLLM splits a layer's ``H`` KV heads over ``T`` tensor-parallel ranks (vLLM 0.32 ``config/model.py``
``get_num_kv_heads``: ``max(1, H // T)`` heads per rank; ``QKVParallelLinear`` replicates a head over ``T / H``
consecutive ranks when ``T > H``). MLA keeps one latent "head" that every rank holds in full. So every rank's KV is a
contiguous *head slice* ``[start, start + count)`` of the model's heads, and ranks that hold the same slice hold the
same bytes.

Tickets name the heads their bytes cover (:class:`~range_connector.kv.tickets.Ticket` ``head_start``,
``num_heads``) and are published under one key per head, so the namespace does not depend on ``T``. A *ticket group*
is one set of ``[num_shards]`` tickets the scheduler looks up per chunk: one per distinct head slice on a tier that
all ranks share (the first rank of each slice writes it; the replicas read it), or one per rank on a tier that lives
inside each worker process (the DRAM tier: every rank stores and reads its own). A chunk is a hit only when every
group has it on every shard, so a rank's missing slice shortens the hit for all ranks.

Scheduler -> worker metadata carries each chunk's tickets for every group, group-major (``[num_groups *
num_shards]``); :func:`group_view` gives one rank the ``[num_shards]`` tickets of its own group.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from range_connector.errors import ConfigError
from range_connector.kv.tickets import Ticket


@dataclass(frozen=True, slots=True)
class HeadSlice:
    """KV heads ``[start, start + count)`` of the model's heads, held by one rank."""

    start: int
    count: int

    @property
    def heads(self) -> range:
        """The head indices."""
        return range(self.start, self.start + self.count)


@dataclass(frozen=True, slots=True)
class RankLayout:
    """How one engine's tensor-parallel ranks hold KV heads and which of them write tickets.

    Attributes:
        total_heads: ``H``, the model's KV heads per layer (1 for MLA).
        rank_slices: ``[tp_size]`` the head slice of each rank.
        groups: ``[num_groups]`` the head slice of each ticket group.
        rank_group: ``[tp_size]`` the ticket group of each rank.
        writers: ``[tp_size]`` whether the rank writes its group's tickets and stripes (the first rank of each
            group).
    """

    total_heads: int
    rank_slices: tuple[HeadSlice, ...]
    groups: tuple[HeadSlice, ...]
    rank_group: tuple[int, ...]
    writers: tuple[bool, ...]

    @property
    def tp_size(self) -> int:
        """Tensor-parallel ranks."""
        return len(self.rank_slices)

    @property
    def num_groups(self) -> int:
        """Ticket groups per chunk and shard."""
        return len(self.groups)


def rank_layout(total_heads: int, tp_size: int, *, local_heads: int, process_local: bool) -> RankLayout:
    """The head slices of ``tp_size`` ranks, following vLLM's split (see the module docstring).

    Args:
        total_heads: ``H``, KV heads of the model per layer (use 1 for MLA, whose latent row every rank holds).
        tp_size: ``T``, tensor-parallel ranks.
        local_heads: KV heads per rank in the engine's KV-cache spec (checked against the split).
        process_local: the tier lives inside each worker process (the DRAM tier): one ticket group per rank.

    Returns:
        The layout.

    Raises:
        ConfigError: ``local_heads`` is not what vLLM's split gives (names ``tensor_parallel_size``).
    """
    if total_heads < 1 or tp_size < 1:
        raise ConfigError("tensor_parallel_size", f"{total_heads} KV heads over {tp_size} ranks")
    if tp_size >= total_heads:
        replicas = tp_size // total_heads
        expected = 1
        slices = tuple(HeadSlice(min(r // replicas, total_heads - 1), 1) for r in range(tp_size))
    else:
        expected = total_heads // tp_size
        slices = tuple(HeadSlice(r * expected, expected) for r in range(tp_size))
    if local_heads != expected or (tp_size < total_heads and total_heads % tp_size):
        raise ConfigError("tensor_parallel_size", f"{total_heads} KV heads over {tp_size} ranks: vLLM's split gives "
                                                  f"{expected} heads per rank, the KV cache holds {local_heads}")
    if process_local:
        groups = slices
        rank_group = tuple(range(tp_size))
    else:
        groups = tuple(dict.fromkeys(slices))
        rank_group = tuple(groups.index(s) for s in slices)
    writers = tuple(rank_group.index(rank_group[r]) == r for r in range(tp_size))
    return RankLayout(total_heads, slices, groups, rank_group, writers)


def single_rank_layout() -> RankLayout:
    """One rank holding every head (TP = 1; the engine-less harness)."""
    return RankLayout(1, (HeadSlice(0, 1),), (HeadSlice(0, 1),), (0,), (True,))


def group_view(meta: Any, group_idx: int, num_groups: int, num_shards: int) -> Any:
    """The step's :class:`~range_connector.kv.metadata.RangeConnectorMetadata` as one rank's worker sees it: every
    chunk's (and probe's) tickets cut to the ``[num_shards]`` of ticket group ``group_idx``. Chunks without tickets
    (saves, failed loads) pass unchanged.

    Args:
        meta: the scheduler's metadata, tickets ``[num_groups * num_shards]`` per chunk, group-major.
        group_idx: the rank's ticket group.
        num_groups: ticket groups in the metadata.
        num_shards: shards of the deployment.
    """
    if num_groups == 1:
        return meta
    lo, hi = group_idx * num_shards, (group_idx + 1) * num_shards

    def chunk(c: Any) -> Any:
        return dataclasses.replace(c, tickets=c.tickets[lo:hi]) if c.tickets else c

    loads = [dataclasses.replace(r, chunks=tuple(chunk(c) for c in r.chunks)) for r in meta.loads]
    return dataclasses.replace(meta, loads=loads, probes=[p[lo:hi] for p in meta.probes])


def resolve_pieces(tickets: Sequence[Ticket], group: HeadSlice) -> Ticket | tuple[Ticket, ...]:
    """What a ticket group holds of one chunk on one shard, from the tickets read under each of its heads' keys.

    Args:
        tickets: ``[group.count]`` the ticket found under the key of each head of the group, in head order (each
            covers its head: :meth:`~range_connector.kv.tickets.Ticket.decode_covering`).
        group: the group's head slice.

    Returns:
        The one ticket when a writer of exactly these heads stored them (the common case: same tensor-parallel
        layout), else the distinct *pieces*, by first head: tickets of writers of other head slices whose heads
        together cover the group's (a consumer of another tensor-parallel size; its worker reassembles them:
        :mod:`range_connector.worker.reassembly`).
    """
    distinct: dict[tuple[str, int, int, int], Ticket] = {}
    for t in tickets:
        distinct.setdefault((t.stripe_id, t.block_offset, t.head_start, t.num_heads), t)
    if len(distinct) == 1:
        (t,) = distinct.values()
        if (t.head_start, t.num_heads) == (group.start, group.count):
            return t
    return tuple(sorted(distinct.values(), key=lambda t: t.head_start))
