"""Leases on promised stripes: taken when vLLM commits to a load, so that eviction cannot remove what was promised,
and released on every path (the load finished, the request ended, the connector closed); a lease also expires by
itself after ``lease_ttl_s`` on the shard's own server.

A lease that cannot be taken, or released, is counted (``lease_errors``) and only risks a load error that vLLM
recomputes; it never raises.
"""

from __future__ import annotations

import logging
from collections.abc import MutableMapping, Sequence

from range_connector.backends.base import Backend
from range_connector.errors import BackendError
from range_connector.histograms import gauge_key
from range_connector.kv.metadata import ChunkTransfer

logger = logging.getLogger("vllm." + __name__)


class LeaseBook:
    """The leases each request holds, per shard.

    Args:
        backends: ``[num_shards]`` backends, or ``None`` for the DRAM tier (its loads finish in the step that commits
            to them, before any save can evict: nothing to lease).
        lease_ttl_s: lifetime of a lease that is never released.
        stats: the scheduler's counters (``lease_errors``).

    Attributes:
        held: ``req_id -> shard_idx -> (stripe ids, lease token)``.
    """

    def __init__(self, backends: Sequence[Backend] | None, lease_ttl_s: float,
                 stats: MutableMapping[str, int]) -> None:
        self.backends = backends
        self.lease_ttl_s = lease_ttl_s
        self.stats = stats
        self.held: dict[str, dict[int, tuple[list[str], str]]] = {}

    def __len__(self) -> int:
        """Requests holding leases (0 when idle)."""
        return len(self.held)

    def take(self, req_id: str, chunks: Sequence[ChunkTransfer]) -> None:
        """Lease the stripes of ``chunks`` (every ticket group's) on every shard (one call per shard); a request
        leases once at a time, so its earlier leases are released."""
        if self.backends is None:
            return
        per_shard: dict[int, list[str]] = {}
        num_shards = len(self.backends)
        for c in chunks:
            for i, entry in enumerate(c.tickets):  # [num_groups * num_shards], group-major; a ticket or pieces
                ids = per_shard.setdefault(i % num_shards, [])
                for t in entry if isinstance(entry, tuple) else (entry,):
                    if t.stripe_id not in ids:
                        ids.append(t.stripe_id)
        taken: dict[int, tuple[list[str], str]] = {}
        for s, ids in per_shard.items():
            try:
                taken[s] = (ids, self.backends[s].lease(ids, self.lease_ttl_s))
            except BackendError as exc:
                self.stats["lease_errors"] += 1
                logger.warning("Range: lease on shard %d failed (the load may fail and be recomputed): %s", s, exc)
        if taken:
            self.release(req_id)
            self.held[req_id] = taken

    def release(self, req_id: str) -> None:
        """Release the request's leases, if it holds any."""
        for s, (ids, token) in self.held.pop(req_id, {}).items():
            try:
                self.backends[s].release(ids, token)  # type: ignore[index]
            except BackendError as exc:
                self.stats["lease_errors"] += 1
                logger.warning("Range: lease release on shard %d failed (it expires by itself): %s", s, exc)

    def occupancy(self) -> dict[str, int]:
        """The lease gauges (:data:`range_connector.histograms.GAUGES`): stripe leases held (one per stripe and
        shard) and the requests holding them."""
        stripes = sum(len(ids) for shards in self.held.values() for ids, _token in shards.values())
        return {gauge_key("leased_stripes"): stripes, gauge_key("leasing_requests"): len(self.held)}

    def release_all(self) -> None:
        """Release every lease (the connector is closing)."""
        for req_id in list(self.held):
            self.release(req_id)
