"""Connector statistics carried from workers to vLLM's stats loggers."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats


@dataclass
class RangeConnectorStats(KVConnectorStats):
    """Counters of one interval (``data``: name -> count), summed across workers and steps.

    Names: ``loaded_blocks``, ``loaded_tokens``, ``loaded_bytes``, ``failed_blocks``, ``saved_chunks``,
    ``saved_bytes``, ``save_errors``, ``load_backend_errors``, ``load_integrity_errors``, ``load_deadline_misses``.
    The cost-model gate's counters (scheduler side, :meth:`range_connector.cost_estimators.DecisionStats.snapshot`):
    ``decisions_taken``, ``decisions_shortened``, ``decisions_refused``, ``decisions_probes``, ``loads_async``,
    ``loads_pipelined``, and ``predicted_load_s`` / ``realised_load_s`` / ``realised_loads`` (sums; seconds as
    floats).
    """

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for k, v in (other.data or {}).items():
            self.data[k] = self.data.get(k, 0) + v
        return self

    def reduce(self) -> dict[str, int | float]:
        return dict(self.data)

    def is_empty(self) -> bool:
        return not any(self.data.values())


def stats_delta(current: dict[str, int], last: dict[str, int]) -> dict[str, Any]:
    """Counters that changed since ``last`` (which is updated in place)."""
    delta = {k: v - last.get(k, 0) for k, v in current.items() if v != last.get(k, 0)}
    last.update(current)
    return delta
