"""The engines' own view of a replay: deltas of vLLM's Prometheus ``/metrics`` between two readings.

Counters (names as the installed vLLM exports them, ``vllm/v1/metrics/loggers.py``; prometheus_client adds ``_total`` to
counters) are read with :func:`range_connector.testing.client.scrape_metrics` (summed over label sets). Two families are
read per label as well: ``vllm:time_to_first_token_seconds_bucket`` (per ``le``, for the engine's TTFT percentiles) and
``vllm:prompt_tokens_by_source_total`` (per ``source``: ``local_compute``, ``local_cache_hit``,
``external_kv_transfer``).

vLLM counts a prompt's tokens once per engine that prefills it, and its external hits at admission
(``vllm:external_prefix_cache_hits``: tokens the connector promised to load, whether or not they then arrived).
Range's own counters (``vllm:range_*``, :mod:`range_connector.metrics`) say how each promise ended: loaded and
verified, failed (vLLM recomputed those tokens) or aborted. :func:`connector_check` compares the two counts, and
the share of prompt tokens served from the tier is Range's verified count over prompt tokens
(:attr:`EngineCounts.served_from_tier_share`); vLLM's admission share stays as ``external_hit_share``.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from range_connector.testing.client import scrape_metrics

__all__ = ["COUNTERS", "RANGE_COUNTERS", "EngineCounts", "MetricsSnapshot", "connector_check", "engine_counts",
           "histogram_quantile", "settle_metrics", "snapshot_metrics"]

#: Range's token counters (:data:`range_connector.metrics.PROM_COUNTERS`), report key -> sample name; an engine
#: that exports ``range_loaded_tokens`` runs Range.
RANGE_COUNTERS: dict[str, str] = {
    "range_loaded_tokens": "vllm:range_loaded_tokens_total",
    "range_failed_tokens": "vllm:range_failed_tokens_total",
    "range_aborted_tokens": "vllm:range_aborted_tokens_total",
    "range_preempted_load_tokens": "vllm:range_preempted_load_tokens_total",
}
#: Report key -> vLLM sample name (counters in tokens unless the key says otherwise).
COUNTERS: dict[str, str] = {
    "prompt_tokens": "vllm:prompt_tokens_total",
    "generation_tokens": "vllm:generation_tokens_total",
    "local_query_tokens": "vllm:prefix_cache_queries_total",
    "local_hit_tokens": "vllm:prefix_cache_hits_total",
    "external_query_tokens": "vllm:external_prefix_cache_queries_total",
    "external_hit_tokens": "vllm:external_prefix_cache_hits_total",
    "num_preemptions": "vllm:num_preemptions_total",
    "num_finished_requests": "vllm:request_success_total",
    "engine_ttft_count": "vllm:time_to_first_token_seconds_count",
    "engine_ttft_sum_s": "vllm:time_to_first_token_seconds_sum",
    **RANGE_COUNTERS,
    "range_hook_s": "vllm:range_hook_seconds_total",
}
TTFT_BUCKET = "vllm:time_to_first_token_seconds_bucket"
PROMPT_BY_SOURCE = "vllm:prompt_tokens_by_source_total"
#: Range's tokens loaded per tier (``tier`` label: ``memory``, ``valkey``, ``file``; docs/tiers.md)
TIER_TOKENS = "vllm:range_tier_loaded_tokens_total"
#: seconds inside each of Range's connector hooks (``hook`` label: docs/metrics.md)
HOOK_SECONDS = "vllm:range_hook_seconds_total"
_QUANTILES = (0.5, 0.9, 0.99)


@dataclass(frozen=True)
class MetricsSnapshot:
    """One reading of every engine's ``/metrics``.

    Attributes:
        counters: ``{url: {sample name: value summed over label sets}}``.
        ttft_buckets: ``{url: {upper bound le in s (inf for +Inf): cumulative count}}``.
        prompt_by_source: ``{url: {source: tokens}}``.
        tier_tokens: ``{url: {tier: tokens Range loaded from it}}``.
        hook_seconds: ``{url: {hook: seconds inside that connector hook}}`` (engines running Range).
        taken_at_s: ``time.monotonic()`` of the reading.
        errors: ``{url: one-line reason}`` for engines that could not be read (absent from the other fields).
    """

    counters: dict[str, dict[str, float]]
    ttft_buckets: dict[str, dict[float, float]]
    prompt_by_source: dict[str, dict[str, float]]
    taken_at_s: float
    errors: dict[str, str] = field(default_factory=dict)
    tier_tokens: dict[str, dict[str, float]] = field(default_factory=dict)
    hook_seconds: dict[str, dict[str, float]] = field(default_factory=dict)


def _scrape_labelled(url: str, timeout_s: float) -> tuple[dict[float, float], dict[str, float], dict[str, float],
                                                           dict[str, float]]:
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    response = httpx.get(f"{url.rstrip('/')}/metrics", timeout=timeout_s)
    response.raise_for_status()
    buckets: dict[float, float] = {}
    sources: dict[str, float] = {}
    tiers: dict[str, float] = {}
    hooks: dict[str, float] = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            if sample.name == TTFT_BUCKET:
                le = float(sample.labels["le"])
                buckets[le] = buckets.get(le, 0.0) + float(sample.value)
            elif sample.name == PROMPT_BY_SOURCE:
                source = sample.labels.get("source", "")
                sources[source] = sources.get(source, 0.0) + float(sample.value)
            elif sample.name == TIER_TOKENS:
                tier = sample.labels.get("tier", "")
                tiers[tier] = tiers.get(tier, 0.0) + float(sample.value)
            elif sample.name == HOOK_SECONDS:
                hook = sample.labels.get("hook", "")
                hooks[hook] = hooks.get(hook, 0.0) + float(sample.value)
    return buckets, sources, tiers, hooks


def snapshot_metrics(urls: Sequence[str], timeout_s: float = 10.0) -> MetricsSnapshot:
    """Read ``/metrics`` of every URL. An engine that cannot be read (down, killed mid-replay) is recorded in
    :attr:`MetricsSnapshot.errors` instead of raising.

    Args:
        urls: ``http://host:port`` of each engine.
        timeout_s: Per request, in seconds.
    """
    import httpx

    counters, buckets, sources, tiers, hooks, errors = {}, {}, {}, {}, {}, {}
    for url in urls:
        try:
            counters[url] = scrape_metrics(url, timeout_s=timeout_s)
            buckets[url], sources[url], tiers[url], hooks[url] = _scrape_labelled(url, timeout_s)
        except (httpx.HTTPError, ValueError) as exc:
            counters.pop(url, None)
            errors[url] = " ".join(f"{type(exc).__name__}: {exc}".split())[:300]
    return MetricsSnapshot(counters, buckets, sources, time.monotonic(), errors, tiers, hooks)


def _total(snapshot: MetricsSnapshot, name: str) -> float:
    return sum(c.get(name, 0.0) for c in snapshot.counters.values())


def settle_metrics(urls: Sequence[str], before: MetricsSnapshot, *, min_prompt_tokens: int, min_first_tokens: int,
                   timeout_s: float = 30.0, poll_interval_s: float = 0.25) -> MetricsSnapshot:
    """Read ``/metrics`` until the engines show at least ``min_prompt_tokens`` more prompt tokens and
    ``min_first_tokens`` more TTFT observations than ``before`` (vLLM publishes step statistics asynchronously).

    Args:
        urls: As in :func:`snapshot_metrics`.
        before: Reading taken before the requests.
        min_prompt_tokens: Prompt tokens of the requests that produced a first token.
        min_first_tokens: Number of those requests.
        timeout_s: Longest wait in seconds; the last reading is returned when it passes.
        poll_interval_s: Pause between readings in seconds.

    Returns:
        The last reading.
    """
    deadline_s = time.monotonic() + timeout_s
    while True:
        after = snapshot_metrics(urls)
        grown_prompt = _total(after, COUNTERS["prompt_tokens"]) - _total(before, COUNTERS["prompt_tokens"])
        grown_first = _total(after, COUNTERS["engine_ttft_count"]) - _total(before, COUNTERS["engine_ttft_count"])
        caught_up = grown_prompt >= min_prompt_tokens and grown_first >= min_first_tokens
        if caught_up or after.errors or time.monotonic() > deadline_s:  # a dead engine will not catch up
            return after
        time.sleep(poll_interval_s)


def histogram_quantile(q: float, cumulative: Mapping[float, float]) -> float | None:
    """Quantile ``q`` of a Prometheus histogram from cumulative bucket counts, by linear interpolation inside the
    bucket that holds it (the rule of Prometheus' ``histogram_quantile``; the first bucket starts at 0, and a
    quantile in the +Inf bucket is the largest finite bound).

    Args:
        q: In [0, 1].
        cumulative: ``{le: count of observations <= le}`` (seconds -> count), +Inf included.

    Returns:
        Seconds; ``None`` when the histogram is empty.
    """
    bounds = sorted(cumulative)
    if not bounds or cumulative[bounds[-1]] <= 0:
        return None
    target = q * cumulative[bounds[-1]]
    lower_bound, lower_count = 0.0, 0.0
    for le in bounds:
        count = cumulative[le]
        if count >= target:
            if math.isinf(le):
                return lower_bound
            if count == lower_count:
                return le
            return lower_bound + (le - lower_bound) * (target - lower_count) / (count - lower_count)
        lower_bound, lower_count = le, count
    return lower_bound


def connector_check(counts: Mapping[str, float]) -> dict[str, Any]:
    """vLLM's external hit tokens against Range's own account of the same promises (one engine, or a sum).

    vLLM counts a hit when it commits to the load; Range settles each load as loaded and verified, failed (vLLM
    recomputed it) or aborted, and counts separately the tokens of requests vLLM had preempted before (vLLM leaves
    those out of its hits). So once every load is settled, ``external hits == loaded + failed + aborted -
    preempted`` (:class:`range_connector.metrics.LoadTally`).

    Args:
        counts: :data:`COUNTERS` keys -> tokens (deltas).

    Returns:
        ``external_hit_tokens``, ``loaded_tokens``, ``failed_tokens``, ``aborted_tokens``,
        ``preempted_load_tokens``, ``difference_tokens`` (hits minus Range's account) and ``agrees``.
    """
    out = {"external_hit_tokens": round(counts.get("external_hit_tokens", 0.0))}
    for key in RANGE_COUNTERS:
        out[key.removeprefix("range_")] = round(counts.get(key, 0.0))
    accounted = out["loaded_tokens"] + out["failed_tokens"] + out["aborted_tokens"] - out["preempted_load_tokens"]
    out["difference_tokens"] = out["external_hit_tokens"] - accounted
    out["agrees"] = out["difference_tokens"] == 0
    return out


@dataclass
class EngineCounts:
    """What the engines counted between two readings (tokens unless the name says otherwise).

    Attributes:
        totals: :data:`COUNTERS` keys -> delta summed over engines.
        per_engine: ``{url: {key: delta}}``.
        prompt_by_source: ``{source: tokens}`` summed over engines.
        engine_ttft_s: Engine TTFT from the histogram delta: ``count``, ``mean`` and ``p50``/``p90``/``p99``
            (see :func:`histogram_quantile`), seconds.
        external_hit_share: ``external_hit_tokens / prompt_tokens``: what vLLM admitted from the connector
            (``None`` without prompt tokens).
        local_hit_share: ``local_hit_tokens / prompt_tokens``.
        range_engines: URLs of the engines that export Range's counters (empty: no Range connector).
    """

    totals: dict[str, float]
    per_engine: dict[str, dict[str, float]]
    prompt_by_source: dict[str, float]
    engine_ttft_s: dict[str, float | None]
    external_hit_share: float | None
    local_hit_share: float | None
    extra: dict[str, Any] = field(default_factory=dict)
    range_engines: tuple[str, ...] = ()

    @property
    def external_hit_tokens(self) -> int:
        """Tokens vLLM admitted as the connector's (external prefix-cache hits; promised, not necessarily loaded)."""
        return round(self.totals["external_hit_tokens"])

    @property
    def prompt_tokens(self) -> int:
        """Prompt tokens the engines prefilled (computed or cached)."""
        return round(self.totals["prompt_tokens"])

    @property
    def connector_check(self) -> dict[str, Any] | None:
        """:func:`connector_check` of :attr:`totals`; ``None`` without Range."""
        return connector_check(self.totals) if self.range_engines else None

    @property
    def served_from_tier_share(self) -> float | None:
        """Prompt tokens Range loaded and verified over prompt tokens; ``None`` without Range or prompt tokens."""
        prompt = self.totals["prompt_tokens"]
        return self.totals["range_loaded_tokens"] / prompt if self.range_engines and prompt else None

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return {"totals": self.totals, "per_engine": self.per_engine, "prompt_by_source": self.prompt_by_source,
                "engine_ttft_s": self.engine_ttft_s, "external_hit_share": self.external_hit_share,
                "local_hit_share": self.local_hit_share, "served_from_tier_share": self.served_from_tier_share,
                "connector_check": self.connector_check,
                "connector_check_per_engine": {url: connector_check(self.per_engine[url])
                                               for url in self.range_engines if url in self.per_engine},
                "range_engines": list(self.range_engines), **self.extra}


def _ttft(count: float, sum_s: float, buckets: Mapping[float, float]) -> dict[str, float | None]:
    ttft: dict[str, float | None] = {"count": count, "mean": sum_s / count if count else None}
    for q in _QUANTILES:
        ttft[f"p{round(q * 100)}"] = histogram_quantile(q, buckets)
    return ttft


def engine_counts(before: MetricsSnapshot, after: MetricsSnapshot) -> EngineCounts:
    """Deltas between two readings of the same engines (see :class:`EngineCounts`). Only engines read both times
    count; the others are listed in ``extra["unreadable_engines"]`` with the reason. Each engine's own TTFT
    (histogram percentiles included) is in ``extra["per_engine_ttft_s"]``."""
    readable = [url for url in after.counters if url in before.counters]
    per_engine = {url: {key: after.counters[url].get(name, 0.0) - before.counters[url].get(name, 0.0)
                        for key, name in COUNTERS.items()} for url in readable}
    totals = {key: sum(d[key] for d in per_engine.values()) for key in COUNTERS}
    sources: dict[str, float] = {}
    buckets: dict[float, float] = {}
    per_engine_ttft: dict[str, dict[str, float | None]] = {}
    for url in readable:
        for source, value in after.prompt_by_source[url].items():
            sources[source] = sources.get(source, 0.0) + value - before.prompt_by_source.get(url, {}).get(source, 0.0)
        earlier = before.ttft_buckets.get(url, {})
        mine = {le: value - earlier.get(le, 0.0) for le, value in after.ttft_buckets[url].items()}
        for le, value in mine.items():
            buckets[le] = buckets.get(le, 0.0) + value
        per_engine_ttft[url] = _ttft(per_engine[url]["engine_ttft_count"], per_engine[url]["engine_ttft_sum_s"], mine)
    prompt = totals["prompt_tokens"]
    by_tier: dict[str, float] = {}
    tier_tokens_per_engine: dict[str, dict[str, float]] = {}
    for url in readable:
        for tier, value in after.tier_tokens.get(url, {}).items():
            delta = value - before.tier_tokens.get(url, {}).get(tier, 0.0)
            by_tier[tier] = by_tier.get(tier, 0.0) + delta
            tier_tokens_per_engine.setdefault(url, {})[tier] = delta
    hook_s: dict[str, float] = {}
    for url in readable:
        for hook, value in after.hook_seconds.get(url, {}).items():
            hook_s[hook] = hook_s.get(hook, 0.0) + value - before.hook_seconds.get(url, {}).get(hook, 0.0)
    return EngineCounts(
        totals=totals, per_engine=per_engine, prompt_by_source=sources,
        engine_ttft_s=_ttft(totals["engine_ttft_count"], totals["engine_ttft_sum_s"], buckets),
        external_hit_share=totals["external_hit_tokens"] / prompt if prompt else None,
        local_hit_share=totals["local_hit_tokens"] / prompt if prompt else None,
        extra={"span_s": after.taken_at_s - before.taken_at_s,
               "served_by_tier_share": {t: v / prompt for t, v in sorted(by_tier.items()) if v} if prompt else {},
               "tier_tokens_per_engine": tier_tokens_per_engine,
               "range_hook_s": {h: round(v, 6) for h, v in sorted(hook_s.items(), key=lambda kv: -kv[1]) if v},
               "unreadable_engines": {**before.errors, **after.errors}, "per_engine_ttft_s": per_engine_ttft},
        range_engines=tuple(url for url in readable if RANGE_COUNTERS["range_loaded_tokens"] in after.counters[url]),
    )
