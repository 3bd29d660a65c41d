"""The load protocol of prefill context parallelism (PCP): each rank loads its own shards, the ranks agree on what
landed, then exchange slices layer by layer so that every rank ends with every promised block.

One engine step with loads, on every rank of the PCP group (all ranks receive the same scheduler metadata, so all
take the same branches and issue the same collectives, in the same order, with the same sizes, empty shares
included):

1. ``start_load_kv``: the rank's worker loads the blocks of its own shards (:meth:`range_connector.kv.sharding.
   RankSlice.metadata`) within the load deadline; it reports the blocks that failed locally.
2. Still in ``start_load_kv``, :meth:`PcpExchange.agree`: two ``all_reduce(MIN)``. The first carries a digest of
   the step's load plan and its request count (as ``x`` and ``-x``: equal minima of both mean every rank holds the
   same plan); the second carries, per load request, the first chunk that failed on this rank. Afterwards every
   rank knows the same failed chunks; nothing is reported to vLLM before this point, so all ranks report the same
   blocks and recompute together.
3. ``wait_for_layer_load(layer)``, in model order: :meth:`PcpExchange.exchange_layer`: one ``all_gather`` of each
   rank's rows of the agreed chunks' blocks in that layer, padded to the largest share (the shares are computed
   from the metadata, identically everywhere; a rank with nothing to send sends padding), then one index copy per
   plane of the other ranks' rows into their block ids.
4. ``get_block_ids_with_load_errors``: :meth:`PcpExchange.failed_block_ids`; ``wait_for_save`` saves
   :meth:`PcpExchange.without_failed_saves` (nothing computed on top of a failed load is saved, on any rank).

The collectives run on a gloo group of Range's own (:func:`range_group`), created once by the ranks of the group
the engine hands over (vLLM's PCP or DCP group, whose members it only borrows) with Range's timeout, so that no
collective of Range's can be mistaken for, or block, one of vLLM's. Whether a collective is issued depends only on
the step's metadata and on the group being healthy, never on what this rank found locally: a rank with nothing to
load (no tickets of its shards, every read failed, an exception in its own load) still issues every collective,
with empty shares. Every collective waits at most its timeout (gloo ``Work.wait(timeout)``): a rank that died or
stopped costs the others one timeout, never a hang. After a failed collective the group is *broken* on this rank
(logged once, with the reason): it reports every block of the step as failed, and later loads fail without
collectives (the others, whose next collective it skips, time out once and break too: from then on every rank
recomputes, with no collective) until :meth:`PcpExchange.regroup` creates a fresh group on every rank. Under DCP (:attr:`ShardPlan.needs_exchange` false) ranks hold different token slices, so step 2 runs and
step 3 does nothing.

Mirrors vLLM 0.32: ``vllm/v1/worker/kv_connector_model_runner_mixin.py`` L77-104 (bind, ``start_load_kv``,
forward, ``wait_for_save``, ``get_block_ids_with_load_errors``, ``build_connector_worker_meta``) and the attention
wrapper ``vllm/model_executor/layers/attention/kv_transfer_utils.py`` L51-57 (``wait_for_layer_load`` before each
attention layer, ``save_kv_layer`` after it).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import msgpack
import torch
import torch.distributed as dist
import xxhash

from range_connector.errors import CollectiveError
from range_connector.kv.layout import block_rows
from range_connector.kv.sharding import ShardPlan
from range_connector.worker.device import index_on

logger = logging.getLogger("vllm." + __name__)

#: "No chunk failed" in the agreement vector.
NO_FAILURE = 1 << 62
_DIGEST_MASK = (1 << 62) - 1


# -------------------------------------------------------------------------------------------------- pure parts
def plan_digest(loads: Sequence[Any]) -> int:
    """A 62-bit digest of a step's load plan (request ids, chunk indices, block positions and ids)."""
    plan = [[r.req_id, bool(r.fail), [[c.chunk_idx, list(c.block_positions), list(c.block_ids)] for c in r.chunks]]
            for r in loads]
    return xxhash.xxh3_64_intdigest(msgpack.packb(plan)) & _DIGEST_MASK


def failed_from_blocks(loads: Sequence[Any], failed_block_ids: Iterable[int]) -> dict[str, int]:
    """Per load request, the first chunk holding a failed block (requests without one are absent).

    Args:
        loads: the step's :class:`~range_connector.kv.metadata.RequestTransfer` loads (global metadata).
        failed_block_ids: block ids this rank's worker reported failed.
    """
    failed = set(failed_block_ids)
    out: dict[str, int] = {}
    for r in loads:
        if r.fail and r.chunks:
            out[r.req_id] = r.chunks[0].chunk_idx
            continue
        for c in r.chunks:
            if failed.intersection(c.block_ids):
                out[r.req_id] = c.chunk_idx
                break
    return out


def blocks_from(loads: Sequence[Any], failed_from: Mapping[str, int]) -> frozenset[int]:
    """Block ids of every chunk at or after its request's failed chunk (what vLLM must recompute)."""
    return frozenset(b for r in loads if r.req_id in failed_from for c in r.chunks
                     if c.chunk_idx >= failed_from[r.req_id] for b in c.block_ids)


def exchange_shares(loads: Sequence[Any], failed_from: Mapping[str, int],
                    plan: ShardPlan) -> tuple[tuple[int, ...], ...]:
    """Block ids whose rows each writer rank sends in the per-layer exchange: the blocks of its own shards in the
    chunks that loaded on every rank, in metadata order (``[num_writers]`` tuples; empty without exchange)."""
    if not plan.needs_exchange:
        return ()
    shares: list[list[int]] = [[] for _ in range(plan.num_writers)]
    for r in loads:
        stop = failed_from.get(r.req_id, NO_FAILURE)
        for c in r.chunks:
            if c.chunk_idx >= stop:
                break
            for pos, block_id in zip(c.block_positions, c.block_ids):
                shard_idx, _ = plan.shard_of_block(pos)
                shares[plan.writer_of_shard(shard_idx)].append(block_id)
    return tuple(tuple(s) for s in shares)


# -------------------------------------------------------------------------------------------------- collectives
def range_group(base: Any, timeout_s: float) -> Any:
    """A new gloo process group of Range's own over the ranks of ``base`` (the same ranks, in the same order).

    Only those ranks take part in creating it (a rendezvous in the default group's store, under a name of Range's),
    and each of them must call this with the same ``base``, in the same order as its other such calls (the name
    counts the groups over those ranks this process made before). Needs ``torch.distributed`` initialized (vLLM's
    workers are). The group is not registered with ``torch.distributed``: use ``group.rank()`` and ``group.size()``.

    Args:
        base: a process group this rank belongs to (vLLM's PCP or DCP ``cpu_group``).
        timeout_s: how long any collective of the group may take, seconds (gloo gives up after it); creating it
            waits as long for the other ranks.

    Raises:
        RuntimeError: the other ranks did not join within ``timeout_s``.
    """
    from torch.distributed.distributed_c10d import (
        _get_default_store,  # (no public accessor of it)
    )

    ranks = tuple(dist.get_process_group_ranks(base))
    with _GROUPS_LOCK:
        made = _GROUPS_MADE.get(ranks, 0)
        _GROUPS_MADE[ranks] = made + 1
    store = dist.PrefixStore(f"range_pcp/{'_'.join(map(str, ranks))}/{made}/", _get_default_store())
    return dist.ProcessGroupGloo(store, dist.get_rank(base), len(ranks), timedelta(seconds=timeout_s))


_GROUPS_MADE: dict[tuple[int, ...], int] = {}  # global ranks -> groups of Range's over them made in this process
_GROUPS_LOCK = threading.Lock()


def _wait(work: Any, timeout_s: float, what: str) -> None:
    try:
        work.wait(timeout=timedelta(seconds=max(0.001, timeout_s)))
    except RuntimeError as exc:  # gloo: "Operation timed out!", "Connection closed by peer", ...
        raise CollectiveError(f"PCP {what} did not complete within {timeout_s:.1f} s: {exc}") from exc


def all_reduce_min(values: Sequence[int], group: Any, timeout_s: float, what: str = "all_reduce") -> list[int]:
    """``all_reduce(MIN)`` of an int64 vector over ``group``, waiting at most ``timeout_s`` seconds.

    Raises:
        CollectiveError: the collective failed or timed out.
    """
    t = torch.tensor(list(values), dtype=torch.int64)
    _wait(dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group, async_op=True), timeout_s, what)
    return t.tolist()


def exchange_layer_blocks(kv_layer: torch.Tensor, num_blocks: int, shares: Sequence[Sequence[int]], rank: int,
                          group: Any, timeout_s: float) -> int:
    """Give every rank the rows of every other rank's blocks in one layer (one ``all_gather``).

    Args:
        kv_layer: this rank's KV tensor of the layer in the engine's layout (CPU dense ``[num_blocks,
            num_kv_heads, block_size, 2 * head_size]``, MLA ``[num_blocks, (1,) block_size, 576]``, or ``[2,
            num_blocks, ...]`` K/V planes; see :func:`range_connector.kv.layout.block_rows`). Written in place.
        num_blocks: blocks of the tensor.
        shares: ``[group size]`` block ids whose rows each rank holds and sends; identical on every rank.
        rank: this rank's index in ``group``.
        group: the PCP process group (gloo on CPU).
        timeout_s: the most the collective may wait, seconds.

    Returns:
        Block ids written on this rank (the other ranks' shares).

    Raises:
        CollectiveError: the collective failed or timed out (the layer is then incomplete on this rank).
        ValueError: a block id is out of range.
    """
    max_n = max((len(s) for s in shares), default=0)
    if max_n == 0:
        return 0
    if any(not 0 <= b < num_blocks for s in shares for b in s):
        raise ValueError(f"PCP exchange: a block id is outside [0, {num_blocks})")
    layout, rows = block_rows({"layer": kv_layer}, ["layer"], num_blocks)
    send = torch.zeros((layout.num_planes, max_n, layout.row_elems), dtype=layout.row_dtype)  # (host: gloo)
    send[:, :len(shares[rank])] = gather_share(rows, shares[rank])
    recv = [torch.empty_like(send) for _ in shares]
    _wait(dist.all_gather(recv, send, group=group, async_op=True), timeout_s, "layer exchange")
    written = 0
    for w, share in enumerate(shares):
        if w == rank or not share:
            continue
        scatter_share(rows, share, recv[w][:, :len(share)])
        written += len(share)
    return written


def gather_share(rows: Sequence[torch.Tensor], block_ids: Sequence[int]) -> torch.Tensor:
    """``[num_planes, len(block_ids), row]``: the rows of ``block_ids`` in each plane, in host memory.

    Args:
        rows: ``[num_planes]`` views ``[num_blocks, row]`` of one layer (on the KV cache's device).
        block_ids: block ids to gather (the index is made on the rows' device).
    """
    if not block_ids:
        return torch.empty((len(rows), 0, rows[0].shape[1]), dtype=rows[0].dtype)
    idx = index_on(block_ids, rows[0])
    return torch.stack([plane_rows.index_select(0, idx) for plane_rows in rows]).to("cpu")


def scatter_share(rows: Sequence[torch.Tensor], block_ids: Sequence[int], received: torch.Tensor) -> None:
    """Write ``received`` ``[num_planes, len(block_ids), row]`` (host memory) into ``block_ids`` of each plane of
    ``rows`` (``[num_planes]`` views ``[num_blocks, row]``, on any device: index and rows are moved there)."""
    idx = index_on(block_ids, rows[0])
    for p, plane_rows in enumerate(rows):
        plane_rows.index_copy_(0, idx, received[p].to(plane_rows.device))


# -------------------------------------------------------------------------------------------------- one rank
@dataclass(frozen=True, slots=True)
class LoadAgreement:
    """What every rank of the group agreed about one step's loads.

    Attributes:
        failed_from: ``{req_id: first chunk idx that failed on any rank}``.
        failed_block_ids: blocks of those chunks and every later chunk of the request (vLLM recomputes them).
        shares: ``[num_writers]`` block ids each rank sends in every layer's exchange.
        consistent: every rank held the same plan and every collective so far completed.
    """

    failed_from: Mapping[str, int]
    failed_block_ids: frozenset[int]
    shares: tuple[tuple[int, ...], ...]
    consistent: bool


class PcpExchange:
    """One PCP rank's side of the protocol (module docstring). One owner: the rank's worker thread.

    Args:
        plan: the global shard plan.
        rank: this rank's index in ``group`` (its PCP rank, or DCP rank under DCP).
        group: a ``torch.distributed`` process group of ``plan.num_writers`` ranks; the collectives run on a group
            of Range's own over the same ranks (:func:`range_group`, created here: every rank of ``group`` must
            build its exchange).
        timeout_s: the most any collective waits, seconds (the agreement may be given longer: see :meth:`agree`).
        group_timeout_s: the timeout of Range's group (at least the longest wait given to :meth:`agree`);
            default ``timeout_s``.

    Attributes:
        group: Range's own process group.
        broken: a collective failed: no more collectives until :meth:`regroup`.

    Raises:
        ValueError: the group's size or this rank does not match the plan.
    """

    def __init__(self, plan: ShardPlan, rank: int, group: Any, timeout_s: float,
                 group_timeout_s: float | None = None) -> None:
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.plan, self.rank, self.timeout_s = plan, rank, timeout_s
        self.group_timeout_s = max(timeout_s, group_timeout_s or 0.0)
        self.broken = False
        self._check_group(group)
        self.group = range_group(group, self.group_timeout_s)
        self._loads: Sequence[Any] = ()
        self._agreement: LoadAgreement | None = None
        self._step_failed = False  # a collective failed after the agreement: every block of the step is suspect

    def _check_group(self, group: Any) -> None:
        size = dist.get_world_size(group)
        if size != self.plan.num_writers or dist.get_rank(group) != self.rank:
            raise ValueError(f"PCP group of {size} ranks (this one {dist.get_rank(group)}) does not match the plan's "
                             f"{self.plan.num_writers} writers (rank {self.rank})")

    def regroup(self, group: Any) -> None:
        """Create a fresh group of Range's own over the ranks of ``group`` after a failed collective (every rank of
        ``group`` must call it; collectives resume)."""
        self._check_group(group)
        self.group, self.broken = range_group(group, self.group_timeout_s), False
        logger.info("Range PCP rank %d: a fresh process group; collectives resume", self.rank)

    # ---------------------------------------------------------------- step 2
    def agree(self, loads: Sequence[Any], local_failed_block_ids: Iterable[int],
              timeout_s: float | None = None) -> LoadAgreement:
        """Agree with every rank on which chunks of this step's loads failed. Collective (two ``all_reduce``).

        Args:
            loads: the step's load requests from the scheduler metadata (the same on every rank).
            local_failed_block_ids: what this rank's worker reported failed after its own load.
            timeout_s: the most each collective waits; give the time left to the load deadline plus a margin, so
                that a rank still inside its (deadline-bounded) load is waited for. Default: ``timeout_s``.

        Returns:
            The agreement; also kept for :meth:`exchange_layer` and :meth:`failed_block_ids`. Never raises for a
            collective failure: then every chunk of every load fails on this rank (``consistent`` false).
        """
        self._loads, self._step_failed = list(loads), False
        wait_s = self.timeout_s if timeout_s is None else timeout_s
        local = failed_from_blocks(self._loads, local_failed_block_ids)
        agreed: dict[str, int] | None = None
        if self._loads and not self.broken:
            digest = plan_digest(self._loads)
            n = len(self._loads)
            try:
                head = all_reduce_min([digest, -digest, n, -n], self.group, wait_s, "plan check")
                if head[0] != -head[1] or head[2] != -head[3]:
                    logger.error("Range PCP: ranks hold different load plans; every load of the step fails")
                else:
                    mins = all_reduce_min([local.get(r.req_id, NO_FAILURE) for r in self._loads], self.group,
                                          wait_s, "failure agreement")
                    agreed = {r.req_id: m for r, m in zip(self._loads, mins) if m != NO_FAILURE}
            except CollectiveError as exc:
                logger.error("Range PCP rank %d: %s; the group is broken: collectives are off and every load is "
                             "recomputed until a fresh group is created (regroup)", self.rank, exc)
                self.broken = True
        consistent = agreed is not None or not self._loads
        if agreed is None:
            agreed = {r.req_id: r.chunks[0].chunk_idx for r in self._loads if r.chunks}
        self._agreement = LoadAgreement(agreed, blocks_from(self._loads, agreed),
                                        exchange_shares(self._loads, agreed, self.plan), consistent)
        return self._agreement

    # ---------------------------------------------------------------- step 3
    def exchange_layer(self, kv_layer: torch.Tensor, num_blocks: int, timeout_s: float | None = None) -> int:
        """Exchange one layer's agreed slices (call in ``wait_for_layer_load``, every layer, in model order).

        Returns:
            Blocks written on this rank. A failed collective breaks the group and makes every block of the step
            count as failed (:meth:`failed_block_ids`); it is logged, never raised.
        """
        a = self._agreement
        if a is None or not a.consistent or self._step_failed or self.broken or not a.shares:
            return 0
        try:
            return exchange_layer_blocks(kv_layer, num_blocks, a.shares, self.rank, self.group,
                                         self.timeout_s if timeout_s is None else timeout_s)
        except CollectiveError as exc:
            logger.error("Range PCP rank %d: %s; every block of this step's loads is reported failed", self.rank, exc)
            self.broken = self._step_failed = True
            return 0

    # ---------------------------------------------------------------- step 4
    def failed_block_ids(self) -> set[int]:
        """Blocks to report to vLLM for this step (the same on every rank unless a collective failed)."""
        if self._agreement is None:
            return set()
        if self._step_failed:
            return {b for r in self._loads for c in r.chunks for b in c.block_ids}
        return set(self._agreement.failed_block_ids)

    def failed_loads(self) -> list[tuple[str, int]]:
        """``(req_id, chunk_idx)`` from which each request's load failed (for the worker's metadata)."""
        if self._agreement is None:
            return []
        if self._step_failed:
            return [(r.req_id, r.chunks[0].chunk_idx) for r in self._loads if r.chunks]
        return sorted(self._agreement.failed_from.items())

    def without_failed_saves(self, meta: Any) -> Any:
        """``meta`` without the saves of chunks at or after an agreed failed load of the same request."""
        fails = dict(self.failed_loads())
        if not fails:
            return meta
        saves = []
        for r in meta.saves:
            stop = fails.get(r.req_id)
            chunks = r.chunks if stop is None else tuple(c for c in r.chunks if c.chunk_idx < stop)
            if chunks:
                saves.append(dataclasses.replace(r, chunks=chunks))
        return type(meta)(loads=meta.loads, saves=saves)

    def worker_metadata(self, worker_meta: Any) -> Any:
        """The worker's :class:`~range_connector.kv.metadata.RangeWorkerMetadata` with the agreed failed loads (so
        the scheduler saves those chunks again once recomputed, whichever rank they failed on)."""
        extra = [f for f in self.failed_loads() if worker_meta is None or f not in worker_meta.failed_loads]
        if not extra:
            return worker_meta
        from range_connector.kv.metadata import RangeWorkerMetadata

        if worker_meta is None:
            return RangeWorkerMetadata(failed_loads=extra)
        return dataclasses.replace(worker_meta, failed_loads=list(worker_meta.failed_loads) + extra)
