"""Where a prompt's chunks are stored: the min-across-shards longest-prefix lookup (one batched ticket read per
shard), or, for the in-process DRAM tier, the index this side keeps of what the workers hold.

:class:`PrefixLookup` never raises on a tier failure: a backend error is a miss, and after one, lookups are misses
without asking for the tier's ``retry_s`` seconds. Each lookup that asks the tier is timed (histogram
``lookup_seconds`` of the tier: :mod:`range_connector.histograms`). A lookup may wait at most ``lookup_wait_s``; past that it goes on
in the background and the request is asked again at the next step (:meth:`PrefixLookup.lookup` returns ``None``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import MutableMapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeoutError

from range_connector.backends.base import Backend
from range_connector.config import RangeConfig
from range_connector.errors import BackendError
from range_connector.histograms import observe
from range_connector.kv.heads import HeadSlice, resolve_pieces
from range_connector.kv.namespace import ChunkHash
from range_connector.kv.sharding import ShardPlan, common_stored_prefix
from range_connector.kv.tickets import MAX_LAYER_BYTES, Ticket, ticket_key

logger = logging.getLogger("vllm." + __name__)

#: chunks the DRAM tier's index keeps waiting for their other ticket groups' reports (the oldest are forgotten)
_MAX_PARTIAL_CHUNKS = 1 << 16


class PrefixLookup:
    """The stored prefix of a chain of chunk hashes, on every shard.

    Args:
        config: resolved config (the tier's ``timeout_s`` and ``retry_s``, ``lookup_wait_s``).
        plan: the shard plan (blocks per shard, for ticket checks).
        backends: ``[num_shards]`` backends to ask, or ``None`` for the DRAM tier (whose index is :attr:`index`).
        num_layers: attention layers (a ticket for another layout is a miss).
        layer_block_bytes: bytes of one block of one layer on one rank (likewise).
        stats: the scheduler's counters (``lookups_skipped``, ``lookup_errors`` are counted here).
        groups: ``[num_groups]`` the head slice of each ticket group (:mod:`range_connector.kv.heads`); a chunk is
            stored only when every group has it on every shard.

    Attributes:
        index: the DRAM tier's index, chunk hash -> ``[num_groups * num_shards]`` tickets (group-major), in
            least-recently-saved order; a chunk enters it once every group reported it saved.
    """

    def __init__(self, config: RangeConfig, plan: ShardPlan, backends: Sequence[Backend] | None, *,
                 num_layers: int, layer_block_bytes: int, stats: MutableMapping[str, int],
                 groups: Sequence[HeadSlice] = (HeadSlice(0, 1),)) -> None:
        self.config = config
        self.plan = plan
        self.backends = backends
        self.num_layers = num_layers
        self.layer_block_bytes = layer_block_bytes
        self.stats = stats
        self.groups = tuple(groups)
        self.index: dict[ChunkHash, tuple[Ticket, ...]] = {}
        #: chunks some ticket groups (not yet all) reported saved: chunk hash -> group -> ``[num_shards]`` tickets
        self._partial: dict[ChunkHash, dict[int, tuple[Ticket, ...]]] = {}
        self._down_until = 0.0  # monotonic time before which lookups are misses (a shard just failed)
        #: lookups that outlasted lookup_wait_s (req_id -> future), and the thread that runs them
        self._pending: dict[str, Future] = {}
        self._runner = ThreadPoolExecutor(max_workers=1, thread_name_prefix="range-lookup-wait")
        self._pool = ThreadPoolExecutor(max_workers=max(1, config.num_shards), thread_name_prefix="range-lookup")

    @property
    def dedupes_saves(self) -> bool:
        """Whether :attr:`index` knows every stored chunk, so that saves skip what it holds (the DRAM tier)."""
        return self.backends is None

    @property
    def is_remote(self) -> bool:
        """The tier lives elsewhere (Valkey, files): lookups ask its servers."""
        return self.backends is not None

    def is_down(self) -> bool:
        """Lookups count the tier as down: one failed less than the tier's ``retry_s`` ago, so they are misses
        without asking (always ``False`` for the DRAM tier, whose index lives here)."""
        return time.monotonic() < self._down_until

    def is_pending(self, req_id: str) -> bool:
        """The request's lookup outlasted ``lookup_wait_s`` and is still running."""
        return req_id in self._pending

    def forget(self, req_id: str) -> None:
        """The request ended: drop its pending lookup (its result is not needed)."""
        self._pending.pop(req_id, None)

    def stored_prefix(self, chunk_hashes: list[ChunkHash], tail_hash: ChunkHash | None = None
                      ) -> list[tuple[Ticket, ...]]:
        """Tickets of the leading chunks present on every shard (with ``tail_hash``: the partial last chunk counts
        as one more chunk after the full ones, asked for in the same batched request).

        One batched ticket read per shard, in parallel; the result is the minimum over shards of each shard's
        stored prefix. Why the minimum is exactly the longest prefix present on every shard: each shard's set of
        stored prefixes of this chain is prefix-closed once cut at its first gap (a shard's answer is the length of
        its first run), and the intersection of prefix-closed sets of one chain is the shortest of them.

        A backend error counts as a miss (empty), never an exception; after one, lookups are misses without
        asking for the tier's ``retry_s`` seconds, so a dead or frozen shard costs one timeout, not one per request.
        A ticket that does not fit the registered layout is a miss. Each shard is asked for the key of every KV
        head of every chunk in the same batched request; a chunk is on a shard when every head of every ticket
        group is (so one rank's missing slice shortens the hit of every rank). A group's entry is the one ticket
        its writer stored, or, when writers of other head slices stored them (a producer of another
        tensor-parallel size), the pieces that cover its heads (:func:`~range_connector.kv.heads.resolve_pieces`).

        Returns:
            ``[num_stored_chunks]`` x ``[num_groups * num_shards]`` entries (group-major), each a ticket or a tuple
            of pieces.
        """
        if tail_hash is not None:
            chunk_hashes = [*chunk_hashes, tail_hash]
        if not chunk_hashes:
            return []
        backends = self.backends
        start_s = time.monotonic()
        if backends is None:
            out = []
            for h in chunk_hashes:
                tickets = self.index.get(h)
                if tickets is None:
                    break
                out.append(tickets)
            observe(self.stats, "lookup_seconds", self.config.tier.type, time.monotonic() - start_s)
            return out

        groups = self.groups
        heads = [h for g in groups for h in g.heads]  # every group's heads, group by group
        head_block_bytes = self.layer_block_bytes // groups[0].count

        def one(shard_idx: int) -> list[tuple[Ticket | tuple[Ticket, ...], ...]]:
            # (a stored ticket is untrusted: its stripe's layer value is bounded by what this tier can hold)
            max_layer_bytes = min(MAX_LAYER_BYTES, backends[shard_idx].max_value_bytes)
            keys = [ticket_key(h, shard_idx, head) for h in chunk_hashes for head in heads]
            raws = backends[shard_idx].get_tickets(keys)
            if len(raws) != len(keys):  # (a tier that answers for other keys than it was asked: nothing is trusted)
                return []
            found = []
            for c in range(len(chunk_hashes)):
                covering = [Ticket.decode_covering(raws[c * len(heads) + i], num_layers=self.num_layers,
                                                   head_block_bytes=head_block_bytes,
                                                   num_blocks=self.plan.blocks_per_shard, head=head,
                                                   max_layer_bytes=max_layer_bytes)
                            for i, head in enumerate(heads)]
                if any(t is None for t in covering):
                    break
                entries, i = [], 0
                for g in groups:
                    entries.append(resolve_pieces(covering[i:i + g.count], g))  # type: ignore[arg-type]
                    i += g.count
                found.append(tuple(entries))
            return found

        if start_s < self._down_until:
            self.stats["lookups_skipped"] += 1
            return []
        try:
            if len(backends) == 1:
                per_shard = [one(0)]
            else:
                per_shard = list(self._pool.map(one, range(len(backends))))
        except BackendError as exc:
            self.stats["lookup_errors"] += 1
            self._down_until = time.monotonic() + self.config.tier.retry_s
            logger.warning("Range lookup failed; lookups are misses for %.1f s: %s", self.config.tier.retry_s, exc)
            return []
        finally:  # (a failed lookup's time too: what the scheduler waited)
            observe(self.stats, "lookup_seconds", self.config.tier.type, time.monotonic() - start_s)
        if len(groups) == 1:
            return [tuple(t for (t,) in shards) for shards in common_stored_prefix(per_shard)]
        return [tuple(shards[s][g] for g in range(len(groups)) for s in range(len(shards)))
                for shards in common_stored_prefix(per_shard)]

    def lookup(self, req_id: str, hashes: list[ChunkHash], tail: ChunkHash | None) -> list[tuple[Ticket, ...]] | None:
        """:meth:`stored_prefix`, waiting at most ``lookup_wait_s`` for a tier that lives elsewhere; ``None`` while
        the request's lookup is still running (it is picked up when vLLM asks again)."""
        pending = self._pending.pop(req_id, None)
        config = self.config
        if self.backends is None or (pending is None and config.lookup_wait_s >= config.tier.timeout_s):
            return self.stored_prefix(hashes, tail) if pending is None else pending.result()
        if pending is None:
            pending = self._runner.submit(self.stored_prefix, hashes, tail)
        try:
            return pending.result(timeout=config.lookup_wait_s)
        except FutureTimeoutError:
            self._pending[req_id] = pending
            return None

    def learn(self, saved: Sequence[tuple[ChunkHash, int, tuple[Ticket, ...]]], dropped: Sequence[ChunkHash]) -> None:
        """Take the workers' report of one step: chunks saved, ``(chunk hash, ticket group, [num_shards] tickets)``
        (the DRAM tier's index learns a chunk once every group reported it), and chunks found gone, corrupt or
        evicted by any rank (forgotten, so that they are not offered again)."""
        if self.backends is None:
            num_groups = len(self.groups)
            for h, group, tickets in saved:
                if not 0 <= group < num_groups:
                    continue
                parts = self._partial.setdefault(h, {})
                parts[group] = tickets
                if len(self._partial) > _MAX_PARTIAL_CHUNKS:  # a rank whose save failed never completes its chunks
                    self._partial.pop(next(iter(self._partial)))
                if len(parts) == num_groups:
                    del self._partial[h]
                    self.index.pop(h, None)
                    self.index[h] = tuple(t for g in range(num_groups) for t in parts[g])
        for h in dropped:
            self.index.pop(h, None)
            self._partial.pop(h, None)

    def reset(self) -> bool:
        """Forget every stored chunk of this deployment: clear each shared backend (:meth:`Backend.clear`), or the
        DRAM tier's index here (the workers clear their bytes when the next step's metadata tells them). Lookups
        miss from the moment this returns. A lookup still running in the background finishes with what it read.

        Returns:
            ``False`` if a backend could not be cleared (logged; it may still hold some entries), else ``True``.
        """
        self.index.clear()
        self._partial.clear()
        ok = True
        for backend in {id(b): b for b in self.backends or ()}.values():
            try:
                backend.clear()
            except (BackendError, NotImplementedError) as exc:
                logger.warning("Range reset: %s not cleared: %s", backend.name, exc)
                ok = False
        return ok

    def close(self) -> None:
        """Stop the lookup threads and close the backends."""
        self._pool.shutdown(wait=False)
        self._runner.shutdown(wait=False)
        for b in self.backends or []:
            b.close()
