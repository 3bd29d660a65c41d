"""Where a request's time to first token goes behind the proxy: the client's view joined with the proxy's traces.

The replay client sends every request with an ``X-Request-Id`` and keeps its wall-clock send time
(:class:`~range_connector.bench.replay.RequestResult`); the proxy keeps the same id with its own stamps
(:mod:`range_connector.serving.request_traces`, ``GET /proxy/traces``). Both run on one host, so one clock. For each
measured request that both saw, :func:`handoff_rows` splits the client's TTFT into

* ``client_to_proxy_s``: sending until the proxy had the request;
* ``proxy_in_s``: the proxy reading the body and choosing the engine, until its first engine call was sent;
* ``prefill_s``: the prefill call, sent until its whole answer was read: the prefill engine's time for the request
  (queue, prefill, Range's save: a ``kv_producer`` answers once its KV is stored);
* ``between_s``: the proxy's own work between the calls (reading ``kv_transfer_params``, the settings check);
* ``decode_s``: the decode call, sent until its first streamed bytes: the decode engine's time for the request
  (queue, Range's lookup and load, the remaining prefill, the first token);
* ``proxy_to_client_s``: those bytes reaching the client as its first token;

and ``overhead_s = ttft_s - prefill_s - decode_s``: the time that is neither engine's (issue 18's hand-off goal:
at most 50 ms at p50). The six parts add up to the client's TTFT. In a fleet (no prefill call) ``prefill_s`` and
``between_s`` are 0.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["HANDOFF_GOAL_S", "fetch_traces", "format_handoff", "handoff_report", "handoff_rows"]

#: the hand-off overhead allowed at p50 (issue 18, item 1)
HANDOFF_GOAL_S = 0.050
_PARTS = ("ttft_s", "client_to_proxy_s", "proxy_in_s", "prefill_s", "between_s", "decode_s", "proxy_to_client_s",
          "overhead_s")


def fetch_traces(base_url: str, timeout_s: float = 10.0) -> list[dict[str, Any]] | None:
    """``GET /proxy/traces`` of ``base_url``: the proxy's traces, or ``None`` when it is no Range proxy (or the
    answer is unusable: not JSON, not a list of objects)."""
    import httpx

    try:
        response = httpx.get(f"{base_url.rstrip('/')}/proxy/traces", timeout=timeout_s)
        if response.status_code != 200:
            return None
        traces = response.json().get("traces")
    except (httpx.HTTPError, ValueError, AttributeError):
        return None
    if not isinstance(traces, list) or not all(isinstance(t, dict) for t in traces):
        return None
    return traces


def handoff_rows(results: Sequence[Any], traces: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per result that has a TTFT and a complete trace of the same request id (see the module docstring).

    Args:
        results: :class:`~range_connector.bench.replay.RequestResult` (``request_id``, ``sent_wall_s``, ``ttft_s``).
        traces: the proxy's trace dicts (:meth:`HandoffTrace.to_dict`).

    Returns:
        ``[{"index", "request_id", "ttft_s", "client_to_proxy_s", "proxy_in_s", "prefill_s", "between_s",
        "decode_s", "proxy_to_client_s", "overhead_s"}]`` in seconds, in the order of ``results``.
    """
    by_id = {t.get("request_id"): t for t in traces}
    rows = []
    for r in results:
        t = by_id.get(r.request_id)
        if t is None or r.ttft_s is None or r.sent_wall_s is None:
            continue
        stamps = [t.get(k) for k in ("received_s", "decode_sent_s", "first_chunk_s")]
        if not all(isinstance(x, (int, float)) for x in stamps):
            continue
        received_s, decode_sent_s, first_chunk_s = stamps
        sent_s, answered_s = t.get("prefill_sent_s"), t.get("prefill_answered_s")
        prefilled = isinstance(sent_s, (int, float)) and isinstance(answered_s, (int, float))
        prefill_s = answered_s - sent_s if prefilled else 0.0
        decode_s = first_chunk_s - decode_sent_s
        rows.append({
            "index": r.index, "request_id": r.request_id, "ttft_s": r.ttft_s,
            "client_to_proxy_s": received_s - r.sent_wall_s,
            "proxy_in_s": (sent_s if prefilled else decode_sent_s) - received_s, "prefill_s": prefill_s,
            "between_s": decode_sent_s - answered_s if prefilled else 0.0, "decode_s": decode_s,
            "proxy_to_client_s": r.sent_wall_s + r.ttft_s - first_chunk_s,
            "overhead_s": r.ttft_s - prefill_s - decode_s,
        })
    return rows


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def handoff_report(results: Sequence[Any], traces: Sequence[dict[str, Any]] | None) -> dict[str, Any] | None:
    """The rows of :func:`handoff_rows` with p50/p90/p99 of each part and the goal's verdict; ``None`` without
    traces (the endpoint is no Range proxy) or when no request could be joined."""
    if traces is None:
        return None
    rows = handoff_rows(results, traces)
    if not rows:
        return None
    stats = {part: {f"p{int(q * 100)}": _percentile([row[part] for row in rows], q) for q in (0.5, 0.9, 0.99)}
             for part in _PARTS}
    overhead_p50_s = stats["overhead_s"]["p50"]
    return {"num_joined": len(rows), "num_results": len(results), "stats_s": stats,
            "goal_overhead_p50_s": HANDOFF_GOAL_S, "overhead_p50_ok": overhead_p50_s <= HANDOFF_GOAL_S,
            "rows": rows}


def format_handoff(report: Any) -> str:
    """Lines saying where a :class:`~range_connector.bench.replay.ReplayReport`'s TTFT went (p50 of each part)."""
    h = report.handoff
    p50 = {part: h["stats_s"][part]["p50"] * 1000 for part in _PARTS}
    return (f"{report.label}: TTFT split from the proxy's traces ({h['num_joined']} requests, p50 of each part, ms): "
            f"client->proxy {p50['client_to_proxy_s']:.1f}, proxy {p50['proxy_in_s']:.1f}, prefill call "
            f"{p50['prefill_s']:.1f}, between {p50['between_s']:.1f}, decode call to first token {p50['decode_s']:.1f}, "
            f"proxy->client {p50['proxy_to_client_s']:.1f}\n"
            f"{report.label}: outside both engines (TTFT - prefill call - decode call) p50 {p50['overhead_s']:.1f} ms "
            f"(goal <= {HANDOFF_GOAL_S * 1000:.0f} ms: {'met' if h['overhead_p50_ok'] else 'NOT met'}), "
            f"p99 {h['stats_s']['overhead_s']['p99'] * 1000:.1f} ms")
