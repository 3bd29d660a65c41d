"""Latency histograms and occupancy gauges, carried in the connector's flat stats the way the counters are
(:mod:`range_connector.metrics`): this module imports no vLLM.

A histogram is kept, where it is observed, as cumulative per-bucket counters in the side's stats mapping (the
worker's :class:`~range_connector.worker.counters.Counters` or the scheduler's ``stats`` dict), under keys
:func:`bucket_key` (observations in bucket ``i``) and :func:`bucket_sum_key` (the sum of those observations, in the
histogram's unit). The connector sends what changed since its last report (``stats_delta``), and vLLM sums the
workers' and the scheduler's reports key by key (``RangeConnectorStats.aggregate``): bucket counts and sums add, so
histograms of several workers and several steps merge exactly. In the front end,
:func:`replay_histogram` puts each bucket's observations into a Prometheus histogram (``observe`` with the bucket's
mean, once per observation: the bucket counts and the sum come out exact, through the public API only).

A gauge is a level (banks in use, stripes leased); each side reports its current level, the delta is what travels,
and the front end adds the (summed) deltas to a Prometheus gauge: the gauge reads the sum of every worker's latest
level.

Buckets (:data:`LATENCY_BUCKETS_S`): 10 us to 30 s, about three per decade, so that DRAM lookups and copies
(microseconds to a millisecond) and remote tiers (milliseconds to seconds) both fall in resolved buckets.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, MutableMapping
from dataclasses import dataclass
from typing import Any

#: upper bounds of the latency buckets in seconds (Prometheus adds ``+Inf``)
LATENCY_BUCKETS_S: tuple[float, ...] = (1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025,
                                        0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
#: upper bounds of the realised/predicted ratio buckets (dimensionless; 1.0: the prediction was exact)
RATIO_BUCKETS: tuple[float, ...] = (0.1, 0.25, 0.5, 0.8, 0.9, 1.0, 1.1, 1.25, 2.0, 4.0, 10.0)

_PREFIX = "hist:"
GAUGE_PREFIX = "gauge:"


@dataclass(frozen=True, slots=True)
class HistogramSpec:
    """One histogram: its Prometheus name (``_bucket``, ``_count``, ``_sum`` are appended by the client), help,
    bucket upper bounds (in ``unit``) and unit."""

    name: str
    doc: str
    buckets: tuple[float, ...]
    unit: str = "seconds"


#: stats key -> histogram, each with a ``tier`` label (``tiers[i].type``)
HISTOGRAMS: dict[str, HistogramSpec] = {
    "lookup_seconds": HistogramSpec(
        "vllm:range_lookup_seconds",
        "Seconds of one lookup of a prompt's stored prefix on one tier (every shard asked in parallel; the DRAM "
        "tier: its index in the scheduler), by tier.", LATENCY_BUCKETS_S),
    "load_seconds": HistogramSpec(
        "vllm:range_load_seconds",
        "Seconds of one load job from its start until its last byte was in reach (the slowest rank's, once per "
        "job), by the farthest tier it read; its count equals vllm:range_tier_loads_total.", LATENCY_BUCKETS_S),
    "first_layer_seconds": HistogramSpec(
        "vllm:range_first_layer_seconds",
        "Seconds from a load job's start until its first layer's bytes were in reach (what a layer-pipelined "
        "forward waits before its first attention layer), each worker's, by the farthest tier the job read.",
        LATENCY_BUCKETS_S),
    "save_seconds": HistogramSpec(
        "vllm:range_save_seconds",
        "Seconds of one stripe write to one tier's shard (each worker's; far tiers of a hierarchy written in the "
        "background are timed there), by tier.", LATENCY_BUCKETS_S),
    "gate_load_ratio": HistogramSpec(
        "vllm:range_gate_load_ratio",
        "Realised over predicted seconds of each load the cost-model gate admitted (load_mode auto; 1.0: exact, "
        "above 1: slower than predicted), by the farthest tier the load read.", RATIO_BUCKETS, unit="ratio"),
}

#: stats key (under :data:`GAUGE_PREFIX`) -> (Prometheus gauge name, help, unit)
GAUGES: dict[str, tuple[str, str, str]] = {
    "banks": ("vllm:range_banks", "Transfer banks each worker may use (num_banks), summed over workers.", "banks"),
    "banks_in_use": ("vllm:range_banks_in_use",
                     "Transfer banks holding a load's layer group (being filled or copied) when the workers last "
                     "reported, summed over workers; divided by vllm:range_banks it is the banks' occupancy.",
                     "banks"),
    "bank_bytes": ("vllm:range_bank_bytes",
                   "Bytes of staging memory the transfer banks have allocated, summed over workers.", "bytes"),
    "leased_stripes": ("vllm:range_leased_stripes",
                       "Stripe leases the scheduler holds on the tier's shards for promised loads (one per stripe "
                       "and shard; the in-process DRAM tier needs none).", "stripes"),
    "leasing_requests": ("vllm:range_leasing_requests",
                         "Requests whose promised stripes are leased (their load has not ended yet).", "requests"),
}


def bucket_index(buckets: tuple[float, ...], value: float) -> int:
    """The bucket ``value`` falls in: the first ``i`` with ``value <= buckets[i]``, ``len(buckets)`` for ``+Inf``
    (Prometheus' ``le`` semantics)."""
    lo, hi = 0, len(buckets)
    while lo < hi:
        mid = (lo + hi) // 2
        if value <= buckets[mid]:
            hi = mid
        else:
            lo = mid + 1
    return lo


def bucket_key(name: str, tier: str, idx: int) -> str:
    """Stats key of the count of histogram ``name``'s bucket ``idx`` for ``tier`` (``hist:load_seconds@valkey#3``)."""
    return f"{_PREFIX}{name}@{tier}#{idx}"


def bucket_sum_key(name: str, tier: str, idx: int) -> str:
    """Stats key of the sum of the observations in that bucket (in the histogram's unit)."""
    return bucket_key(name, tier, idx) + "s"


def observe(stats: MutableMapping[str, Any], name: str, tier: str, value: float) -> None:
    """Add one observation ``value`` (in histogram ``name``'s unit: seconds, or a ratio) for ``tier`` to ``stats``.

    ``stats`` is a side's cumulative stats: a mapping with an atomic ``add_many`` (the worker's ``Counters``, added
    to from several threads) or a plain dict (the scheduler's, one thread). Non-finite or negative values are
    ignored.

    Raises:
        KeyError: ``name`` is not in :data:`HISTOGRAMS`.
    """
    spec = HISTOGRAMS[name]
    if not math.isfinite(value) or value < 0:
        return
    idx = bucket_index(spec.buckets, value)
    items = ((bucket_key(name, tier, idx), 1), (bucket_sum_key(name, tier, idx), value))
    add_many = getattr(stats, "add_many", None)
    if add_many is not None:
        add_many(items)
        return
    for key, n in items:
        stats[key] = stats.get(key, 0) + n


def gauge_key(name: str) -> str:
    """Stats key of gauge ``name`` (``gauge:banks_in_use``)."""
    return GAUGE_PREFIX + name


def parse_bucket_key(key: str) -> tuple[str, str, int, bool] | None:
    """``(histogram, tier, bucket idx, is_sum)`` of a :func:`bucket_key` / :func:`bucket_sum_key`, else ``None``."""
    if not key.startswith(_PREFIX):
        return None
    body, _, idx = key[len(_PREFIX):].rpartition("#")
    name, _, tier = body.partition("@")
    is_sum = idx.endswith("s")
    idx = idx[:-1] if is_sum else idx
    if not idx.isdigit() or name not in HISTOGRAMS or not tier:
        return None
    return name, tier, int(idx), is_sum


def bucket_deltas(data: Mapping[str, Any]) -> dict[tuple[str, str], dict[int, tuple[int, float]]]:
    """The histogram part of one interval's stats: ``(histogram, tier) -> bucket idx -> (observations, sum)``."""
    out: dict[tuple[str, str], dict[int, tuple[int, float]]] = {}
    for key, value in data.items():
        parsed = parse_bucket_key(key)
        if parsed is None:
            continue
        name, tier, idx, is_sum = parsed
        n, s = out.setdefault((name, tier), {}).get(idx, (0, 0.0))
        out[(name, tier)][idx] = (n, s + value) if is_sum else (n + int(value), s)
    return out


def replay_values(buckets: tuple[float, ...], idx: int, count: int, total: float) -> Iterable[float]:
    """``count`` values that fall in bucket ``idx`` and add up to ``total`` (the bucket's mean, kept inside the
    bucket's bounds against rounding): observing them reproduces the bucket's count and, within rounding, its sum."""
    if count <= 0:
        return ()
    mean = total / count
    lo = buckets[idx - 1] if idx > 0 else -math.inf
    hi = buckets[idx] if idx < len(buckets) else math.inf
    value = min(max(mean, math.nextafter(lo, math.inf)), hi)
    return (value,) * count


def replay_histogram(child: Any, buckets: tuple[float, ...], per_bucket: Mapping[int, tuple[int, float]]) -> None:
    """Observe one interval's buckets (:func:`bucket_deltas`) on a Prometheus histogram child."""
    for idx, (count, total) in sorted(per_bucket.items()):
        for value in replay_values(buckets, idx, count, total):
            child.observe(value)
