"""The lookup across a tier hierarchy: nearest tier first, each farther tier asked only for what is still missing.

A chunk counts as held by a tier when every shard and every ticket group (TP rank) of that tier holds it (the
per-tier rule of :meth:`~range_connector.scheduler.lookup.PrefixLookup.stored_prefix`, min across shards). The hit
is the longest prefix of the chain whose chunks are each held by *some* tier, found as runs: the nearest tier's
stored prefix, then the next tier's stored prefix of the chunks after it, and so on (a hit may be "chunks 0-7 from
DRAM, 8-19 from Valkey"). A tier is asked only about chunks no nearer tier covered, in one batched request per shard,
so the object-count rule holds per tier. Chunks a nearer tier holds again after a farther tier's run are taken from
the farther one (runs go outward only).

Tickets of a farther tier come back with their stripe ids tagged with the tier
(:func:`~range_connector.backends.tiered.tag_stripe`), which routes the worker's reads; a stored ticket whose id
already looks tagged is a miss (storage is untrusted).
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from collections.abc import Sequence

from range_connector.backends.base import Backend
from range_connector.backends.tiered import TieredBackend, stripe_tier, tag_stripe, tickets_tier
from range_connector.config import RangeConfig
from range_connector.kv.namespace import ChunkHash
from range_connector.kv.tickets import Ticket
from range_connector.scheduler.lookup import PrefixLookup

Entry = tuple  # one chunk's ``[num_groups * num_shards]`` tickets (each a Ticket or a tuple of pieces)


def entry_tier(entry: Entry) -> int:
    """The tier a looked-up chunk is loaded from (from its first ticket's tag)."""
    return tickets_tier(entry)


def _tag(entry: Entry, tier: int) -> Entry | None:
    """``entry`` with every ticket's stripe id tagged with ``tier``; ``None`` if a stored id looks tagged already."""
    def one(t: Ticket) -> Ticket | None:
        if stripe_tier(t.stripe_id)[0] != 0:
            return None
        return t if tier == 0 else dataclasses.replace(t, stripe_id=tag_stripe(tier, t.stripe_id))

    out = []
    for item in entry:
        tagged = tuple(one(p) for p in item) if isinstance(item, tuple) else one(item)
        if tagged is None or (isinstance(tagged, tuple) and any(p is None for p in tagged)):
            return None
        out.append(tagged)
    return tuple(out)


class TieredLookup(PrefixLookup):
    """:class:`~range_connector.scheduler.lookup.PrefixLookup` over several tiers (see the module docstring).

    Args:
        config: resolved config with two or more tiers.
        backends: ``[num_shards]`` the scheduler's :class:`~range_connector.backends.tiered.TieredBackend` of each
            shard (``None`` in the DRAM tier's slot).
        **kwargs: as :class:`PrefixLookup` (``num_layers``, ``layer_block_bytes``, ``stats``, ``groups``).

    Attributes:
        tiers: ``[num_tiers]`` one :class:`PrefixLookup` per tier, nearest first (the DRAM tier's keeps the index).
    """

    def __init__(self, config: RangeConfig, plan, backends: Sequence[TieredBackend], **kwargs) -> None:
        remote = [i for i, t in enumerate(config.tiers) if t.type != "memory"]
        super().__init__(config.for_tier(remote[0]), plan, backends, **kwargs)
        self.full_config = config
        self.tiers: list[PrefixLookup] = []
        for i, tier in enumerate(config.tiers):
            shard_backends: list[Backend] | None = None
            if tier.type != "memory":
                shard_backends = [b.tiers[i] for b in backends]  # type: ignore[misc]
            self.tiers.append(PrefixLookup(config.for_tier(i), plan, shard_backends, **kwargs))
        self.index = self.tiers[0].index  # the DRAM tier's (empty and unused without one)

    @property
    def dedupes_saves(self) -> bool:
        return self.tiers[0].backends is None

    def is_down(self) -> bool:
        """Every tier that lives elsewhere counts as down."""
        return all(t.is_down() for t in self.tiers if t.is_remote)

    def stored_prefix(self, chunk_hashes: list[ChunkHash], tail_hash: ChunkHash | None = None) -> list:
        """The hit as runs over the tiers, nearest first (module docstring); entries as
        :meth:`PrefixLookup.stored_prefix` returns them, farther tiers' stripe ids tagged.

        Returns:
            ``[num_stored_chunks (+1 with the tail)]`` entries; :func:`entry_tier` tells each one's tier.
        """
        want = len(chunk_hashes) + (tail_hash is not None)
        out: list = []
        for i, sub in enumerate(self.tiers):
            if len(out) >= want:
                break
            rest = chunk_hashes[len(out):]
            for entry in sub.stored_prefix(rest, tail_hash):
                tagged = _tag(entry, i)
                if tagged is None:
                    return out
                out.append(tagged)
        return out

    def learn(self, saved, dropped) -> None:
        """The DRAM tier's index learns the workers' reports (the other tiers are asked, not told)."""
        self.tiers[0].learn(saved, dropped)

    def reset(self) -> bool:
        """Reset every tier (:meth:`PrefixLookup.reset`); ``False`` if one could not be cleared."""
        return all([t.reset() for t in self.tiers])

    def close(self) -> None:
        for t in self.tiers:
            t.close()
        self._pool.shutdown(wait=False)
        self._runner.shutdown(wait=False)


def make_lookup(config: RangeConfig, plan, backends: Sequence[Backend] | None, **kwargs) -> PrefixLookup:
    """The scheduler's lookup of ``config``'s tiers: a :class:`TieredLookup` over two or more tiers, else one
    :class:`~range_connector.scheduler.lookup.PrefixLookup` (``backends`` ``None``: the DRAM tier's index).

    Args:
        config: resolved config.
        plan: the shard plan.
        backends: ``[num_shards]`` as :func:`~range_connector.backends.factory.open_scheduler_backends` opens them.
        **kwargs: as :class:`PrefixLookup` (``num_layers``, ``layer_block_bytes``, ``stats``, ``groups``).
    """
    if len(config.tiers) > 1:
        return TieredLookup(config, plan, backends, **kwargs)  # type: ignore[arg-type]
    return PrefixLookup(config, plan, backends, **kwargs)


class Promotions:
    """Which chunks loaded from a farther tier earn a copy in the DRAM tier: a chunk is promoted at its
    ``after_hits``-th such load, counted over the last :attr:`MAX_TRACKED` chunks loaded from farther tiers (least
    recently loaded forgotten first), so that a prompt loaded once does not push the hot set out of DRAM.

    Args:
        after_hits: loads from farther tiers that earn a promotion (>= 1).
    """

    MAX_TRACKED = 1 << 16

    def __init__(self, after_hits: int) -> None:
        self.after_hits = after_hits
        self._loads: OrderedDict[ChunkHash, int] = OrderedDict()

    def admit(self, loaded: Sequence[tuple[int, ChunkHash]]) -> list[int]:
        """Count one load of each ``(chunk_idx, chunk hash)`` from a farther tier; returns the chunk indices to
        promote now (their count is then forgotten: a chunk evicted from DRAM again earns its way back)."""
        out = []
        for chunk_idx, h in loaded:
            n = self._loads.pop(h, 0) + 1
            if n >= self.after_hits:
                out.append(chunk_idx)
                continue
            self._loads[h] = n
            if len(self._loads) > self.MAX_TRACKED:
                self._loads.popitem(last=False)
        return out


def tier_runs(entries: Sequence[Entry], tier_types: Sequence[str], chunk_tokens: int, num_computed_tokens: int,
              hit_tokens: int) -> list[tuple[str, int]]:
    """The hit ``[0, hit_tokens)`` as runs of chunks of one tier: ``[(tier type, end token)]`` in chain order,
    ends increasing, the last one ``hit_tokens``; runs that end at or before ``num_computed_tokens`` are left out
    (vLLM holds them). ``entries``: the lookup's, one per stored chunk (and the tail's last)."""
    runs: list[tuple[str, int]] = []
    for c, entry in enumerate(entries):
        start = c * chunk_tokens
        if start >= hit_tokens:
            break
        tier = entry_tier(entry)
        name = tier_types[tier] if tier < len(tier_types) else "?"
        end = min((c + 1) * chunk_tokens, hit_tokens)
        if runs and runs[-1][0] == name:
            runs[-1] = (name, end)
        else:
            runs.append((name, end))
    if runs:
        runs[-1] = (runs[-1][0], hit_tokens)
    return [r for r in runs if r[1] > num_computed_tokens]
