"""vLLM's carriers for Range's counters: :class:`RangeConnectorStats` (worker and scheduler intervals, summed by vLLM)
and :class:`RangePromMetrics` (the counters on ``/metrics``). How they travel: :mod:`range_connector.metrics`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

from range_connector.histograms import GAUGE_PREFIX, GAUGES, HISTOGRAMS, bucket_deltas, replay_histogram
from range_connector.metrics import (
    GATE_DECISIONS,
    HOOKS,
    PROM_COUNTERS,
    PROM_GATE,
    PROM_HOOKS,
    PROM_REJECTED,
    PROM_SAVES_SKIPPED,
    PROM_TIER_COUNTERS,
    SAVES_SKIPPED_STATS,
    hook_key,
    tier_key,
)
from range_connector.config.keys import TIER_TYPES
from range_connector.scheduler.request_input import REJECTION_STATS

if TYPE_CHECKING:
    from vllm.config import VllmConfig


@dataclass
class RangeConnectorStats(KVConnectorStats):
    """Counters of one interval (``data``: name -> count), summed across workers and steps.

    Worker names: ``loaded_blocks``, ``loaded_bytes``, ``failed_blocks``, ``saved_chunks``, ``saved_bytes``,
    ``save_errors``, ``saves_skipped_capacity``, ``saves_skipped_no_space`` (the tier's storage was full),
    ``load_backend_errors``, ``load_integrity_errors``, ``load_deadline_misses``. Scheduler names:
    ``lookups``, ``promised_tokens``, ... and the token tally (:class:`LoadTally`: ``loaded_tokens``,
    ``failed_tokens``, ``aborted_tokens``, ``preempted_load_tokens``). The cost-model gate's counters (scheduler
    side, :meth:`range_connector.cost.gate.DecisionStats.snapshot`): ``decisions_taken``,
    ``decisions_shortened``, ``decisions_refused``, ``decisions_probes``, ``loads_async``, ``loads_pipelined``, and
    ``predicted_load_s`` / ``realised_load_s`` / ``realised_loads`` (sums; seconds as floats). Both sides:
    ``hook_s@<hook>``, seconds spent inside each connector hook (floats). Histogram buckets
    (``hist:<name>@<tier>#<i>`` counts and ``...#<i>s`` sums) and gauge levels (``gauge:<name>``) ride in the same
    mapping and add the same way (:mod:`range_connector.histograms`).
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


class RangePromMetrics(KVConnectorPromMetrics):
    """Range's counters, histograms and gauges on vLLM's ``/metrics`` (:data:`PROM_COUNTERS`, :data:`PROM_GATE`,
    :data:`~range_connector.histograms.HISTOGRAMS`, :data:`~range_connector.histograms.GAUGES`, ...), one child per
    engine (labels ``model_name``, ``engine``, as vLLM's own). Built by ``RangeConnector.build_prom_metrics`` in the
    process that serves ``/metrics``."""

    def __init__(self, vllm_config: VllmConfig, metric_types: dict[type, type], labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters: dict[str, dict[int, Any]] = {}
        for key, (name, doc) in PROM_COUNTERS.items():
            counter = self._counter_cls(name=name, documentation=doc, labelnames=labelnames)
            self._counters[key] = {idx: counter.labels(*values) for idx, values in per_engine_labelvalues.items()}
        gate = self._counter_cls(name=PROM_GATE[0], documentation=PROM_GATE[1], labelnames=[*labelnames, "decision"])
        for key, decision in GATE_DECISIONS.items():
            self._counters[key] = {idx: gate.labels(*values, decision)
                                   for idx, values in per_engine_labelvalues.items()}
        for key, (name, doc) in PROM_TIER_COUNTERS.items():
            by_tier = self._counter_cls(name=name, documentation=doc, labelnames=[*labelnames, "tier"])
            for tier in TIER_TYPES:
                self._counters[tier_key(key, tier)] = {idx: by_tier.labels(*values, tier)
                                                       for idx, values in per_engine_labelvalues.items()}
        hooks = self._counter_cls(name=PROM_HOOKS[0], documentation=PROM_HOOKS[1], labelnames=[*labelnames, "hook"])
        for hook in HOOKS:
            self._counters[hook_key(hook)] = {idx: hooks.labels(*values, hook)
                                              for idx, values in per_engine_labelvalues.items()}
        rejected = self._counter_cls(name=PROM_REJECTED[0], documentation=PROM_REJECTED[1],
                                     labelnames=[*labelnames, "kind"])
        for kind, key in REJECTION_STATS.items():
            self._counters[key] = {idx: rejected.labels(*values, kind)
                                   for idx, values in per_engine_labelvalues.items()}
        skipped = self._counter_cls(name=PROM_SAVES_SKIPPED[0], documentation=PROM_SAVES_SKIPPED[1],
                                    labelnames=[*labelnames, "reason"])
        for reason, key in SAVES_SKIPPED_STATS.items():
            self._counters[key] = {idx: skipped.labels(*values, reason)
                                   for idx, values in per_engine_labelvalues.items()}
        #: (histogram key, tier) -> engine -> child
        self._histograms: dict[tuple[str, str], dict[int, Any]] = {}
        for key, spec in HISTOGRAMS.items():
            hist = self._histogram_cls(name=spec.name, documentation=spec.doc, labelnames=[*labelnames, "tier"],
                                       buckets=list(spec.buckets))
            for tier in TIER_TYPES:
                self._histograms[(key, tier)] = {idx: hist.labels(*values, tier)
                                                 for idx, values in per_engine_labelvalues.items()}
        #: gauge stats key -> engine -> (child, level): levels are kept here and set (vLLM's gauges are
        #: "mostrecent" in multiprocess mode, which has no inc)
        self._gauges: dict[str, dict[int, Any]] = {}
        self._levels: dict[tuple[str, int], float] = {}
        for key, (name, doc, _unit) in GAUGES.items():
            gauge = self._gauge_cls(name=name, documentation=doc, labelnames=labelnames,
                                    multiprocess_mode="mostrecent")
            self._gauges[GAUGE_PREFIX + key] = {idx: gauge.labels(*values)
                                                for idx, values in per_engine_labelvalues.items()}

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        """Add one interval's counts (:class:`RangeConnectorStats` data) to engine ``engine_idx``'s counters, its
        histogram buckets to the histograms and its gauge deltas to the gauges; other keys are ignored."""
        for key, value in transfer_stats_data.items():
            children = self._counters.get(key)
            if children is not None and value > 0 and engine_idx in children:
                children[engine_idx].inc(value)
            gauges = self._gauges.get(key)
            if gauges is not None and value and engine_idx in gauges:
                level = self._levels.get((key, engine_idx), 0.0) + value
                self._levels[(key, engine_idx)] = level
                gauges[engine_idx].set(level)
        for (name, tier), per_bucket in bucket_deltas(transfer_stats_data).items():
            children = self._histograms.get((name, tier))
            if children is not None and engine_idx in children:
                replay_histogram(children[engine_idx], HISTOGRAMS[name].buckets, per_bucket)
