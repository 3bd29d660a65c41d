"""What the worker measures of its loads for ``/metrics``, apart from the load itself: bytes by tier, the time to
the first layer (:mod:`range_connector.histograms`), and the transfer banks' occupancy gauges.

Each function reads a finished :class:`~range_connector.worker.loads.LoadJob` (or the worker's banks) and adds to the
worker's :class:`~range_connector.worker.counters.Counters`; the connector reports what changed each step.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from range_connector.backends.tiered import tickets_tier
from range_connector.histograms import gauge_key, observe
from range_connector.metrics import tier_key

if TYPE_CHECKING:
    from range_connector.kv.metadata import RequestTransfer
    from range_connector.kv.namespace import ChunkHash
    from range_connector.worker.banks import BankPool
    from range_connector.worker.counters import Counters
    from range_connector.worker.loads import LoadJob


def count_tier_bytes(stats: Counters, tier_types: Sequence[str], reqs: Sequence[RequestTransfer],
                     done: Sequence[tuple[ChunkHash, list[int], list[int]]], block_bytes: int) -> None:
    """Add the bytes of the chunks that landed whole (``done``: chunk hash, shards, block ids written) to
    ``loaded_bytes`` of the tier each came from (``tier_types``: ``tiers[i].type``; ``block_bytes``: one block of
    every layer on this rank)."""
    tier_of = {c.chunk_hash: tickets_tier(c.tickets) for r in reqs for c in r.chunks}
    by_tier: dict[str, int] = {}
    for chunk_hash, _shards, dst_ids in done:
        tier = tier_of.get(chunk_hash, 0)
        if tier < len(tier_types):
            by_tier[tier_types[tier]] = by_tier.get(tier_types[tier], 0) + len(dst_ids) * block_bytes
    for tier_type, nbytes in by_tier.items():
        stats.add(tier_key("loaded_bytes", tier_type), nbytes)


def job_tier(job: LoadJob, tier_types: Sequence[str]) -> str | None:
    """The farthest tier a load job reads (from its chunks' tickets), or ``None`` for a job with no tickets."""
    tiers = [tickets_tier(c.tickets) for r in job.reqs for c in r.chunks if c.tickets]
    if not tiers or max(tiers) >= len(tier_types):
        return None
    return tier_types[max(tiers)]


def observe_first_layer(stats: Counters, job: LoadJob, tier_types: Sequence[str]) -> None:
    """Histogram ``first_layer_seconds``: seconds from the job's start until its first layer's bytes were in reach
    (``layer_ready_s[0] - started_s``: bank filled, rows received, or view lent), by the job's farthest tier; a job
    that never got its first layer is not observed."""
    ready = job.layer_ready_s[0] if job.layer_ready_s else None
    tier = job_tier(job, tier_types)
    if ready is not None and tier is not None:
        observe(stats, "first_layer_seconds", tier, ready - job.started_s)


def bank_gauges(banks: BankPool) -> dict[str, Any]:
    """The banks' gauges (:data:`range_connector.histograms.GAUGES`): capacity, in use, bytes allocated."""
    return {gauge_key("banks"): banks.num_banks, gauge_key("banks_in_use"): banks.in_use,
            gauge_key("bank_bytes"): banks.allocated_bytes}
