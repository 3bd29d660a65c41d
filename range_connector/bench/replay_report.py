"""Side-by-side results of replays: a plain-text table with ratios to a baseline, JSON, and PNG plots.

Used by ``bench/replay.py`` (several configurations in one run), by the demo, and, from a result file's JSON
(:func:`comparison_rows_of_docs`, :func:`ttft_figures`), by ``range-connector report``.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

from range_connector.bench.handoff import format_handoff
from range_connector.bench.replay import ReplayReport

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = ["check_cell", "comparison_rows", "comparison_rows_of_docs", "format_comparison", "outputs_equal", "ratios",
           "same_outputs", "ttft_figures", "write_json", "write_plots"]

#: the row that says whether vLLM's external hits equal Range's loaded + failed tokens
_CHECK_ROW = "  hits == loaded + failed"

# (row label, path into ReplayReport.to_dict(), format, lower is better?)
_ROWS: tuple[tuple[str, tuple[str, ...], str, bool | None], ...] = (
    ("requests ok / sent", ("summary", "num_ok"), "d", None),
    ("errors", ("summary", "num_errors"), "d", True),
    ("TTFT p50 (s)", ("summary", "ttft_s", "p50"), ".3f", True),
    ("  engine's histogram p50 (s)", ("engine", "engine_ttft_s", "p50"), ".3f", True),
    ("TTFT p90 (s)", ("summary", "ttft_s", "p90"), ".3f", True),
    ("TTFT p99 (s)", ("summary", "ttft_s", "p99"), ".3f", True),
    ("  engine's histogram p99 (s)", ("engine", "engine_ttft_s", "p99"), ".3f", True),
    ("TPOT p50 (s)", ("summary", "tpot_s", "p50"), ".4f", True),
    ("TPOT p99 (s)", ("summary", "tpot_s", "p99"), ".4f", True),
    ("E2E p50 (s)", ("summary", "e2e_s", "p50"), ".3f", True),
    ("E2E p99 (s)", ("summary", "e2e_s", "p99"), ".3f", True),
    ("requests/s", ("summary", "request_throughput_per_s"), ".3f", False),
    ("output tokens/s", ("summary", "output_tokens_per_s"), ".1f", False),
    ("total tokens/s", ("summary", "total_tokens_per_s"), ".1f", False),
    ("engine prompt tokens", ("engine", "totals", "prompt_tokens"), ".0f", None),
    ("local prefix-cache hit tokens", ("engine", "totals", "local_hit_tokens"), ".0f", None),
    ("external hit tokens (vLLM, admitted)", ("engine", "totals", "external_hit_tokens"), ".0f", None),
    ("  loaded and verified (Range)", ("engine", "connector_check", "loaded_tokens"), "d", None),
    ("  failed, recomputed (Range)", ("engine", "connector_check", "failed_tokens"), "d", None),
    (_CHECK_ROW, ("engine", "connector_check", "difference_tokens"), "d", None),
    ("cached tokens (client usage)", ("summary", "cached_tokens"), "d", None),
    ("share served from the tier", ("engine", "served_from_tier_share"), ".1%", None),
    ("  from DRAM (memory tier)", ("engine", "served_by_tier_share", "memory"), ".1%", None),
    ("  from Valkey", ("engine", "served_by_tier_share", "valkey"), ".1%", None),
    ("  from files", ("engine", "served_by_tier_share", "file"), ".1%", None),
    ("share admitted from the tier (vLLM)", ("engine", "external_hit_share"), ".1%", None),
    ("share from local prefix cache", ("engine", "local_hit_share"), ".1%", None),
    ("engine TTFT mean (s)", ("engine", "engine_ttft_s", "mean"), ".3f", True),
    ("client TTFT mean (s)", ("summary", "ttft_s", "mean"), ".3f", True),
    ("engines whose /metrics failed", ("engine", "unreadable_engines"), "", None),
)


def _get(doc: Any, path: Sequence[str]) -> Any:
    for key in path:
        if not isinstance(doc, dict) or doc.get(key) is None:
            return None
        doc = doc[key]
    return doc


def _fmt(value: Any, spec: str) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return format(value, spec)


def ratios(reports: Sequence[ReplayReport], baseline: str = "none") -> dict[str, dict[str, float | None]]:
    """``{label: {row label: value / baseline value}}`` for every timing and throughput row and every report
    other than the baseline; empty when no report is labelled ``baseline``."""
    docs = {r.label: r.to_dict() for r in reports}
    if baseline not in docs:
        return {}
    out: dict[str, dict[str, float | None]] = {}
    for label, doc in docs.items():
        if label == baseline:
            continue
        row_ratios: dict[str, float | None] = {}
        for name, path, _, lower_better in _ROWS:
            if lower_better is None or name == "errors":
                continue
            value, base = _get(doc, path), _get(docs[baseline], path)
            row_ratios[name] = value / base if value is not None and base else None
        out[label] = row_ratios
    return out


def comparison_rows(reports: Sequence[ReplayReport], baseline: str = "none") -> list[list[str]]:
    """Table cells: a header row, then one row per metric: its value in each report, then ``label/baseline``
    ratios (``x`` suffix) for the timing and throughput rows."""
    return comparison_rows_of_docs([r.to_dict() for r in reports], outputs_equal(reports, baseline), baseline)


def comparison_rows_of_docs(docs: Sequence[dict[str, Any]], equal: dict[str, dict[str, Any]],
                            baseline: str = "none") -> list[list[str]]:
    """:func:`comparison_rows` from the JSON form: ``docs`` are :meth:`ReplayReport.to_dict` results (a result
    file's ``reports``) and ``equal`` is :func:`outputs_equal` (its ``outputs_equal_to_<baseline>``)."""
    labels = [doc["label"] for doc in docs]
    base_idx = labels.index(baseline) if baseline in labels else None
    others = [i for i in range(len(labels)) if i != base_idx] if base_idx is not None else []
    header = ["metric", *labels, *(f"{labels[i]}/{baseline}" for i in others)]
    rows = [header]
    if base_idx is not None:
        same = [(equal.get(label, {}).get("equal", 0), equal.get(label, {}).get("compared", 0)) for label in labels]
        rows.append([f"outputs equal to {baseline}", *(f"{a} / {b}" for a, b in same), *([""] * len(others))])
        parted = [sorted((equal.get(label, {}).get("first_differing_token") or {}).values()) for label in labels]
        if any(parted):
            rows.append(["  differ from output token #", *(",".join(map(str, p[:8])) + ("..." if len(p) > 8 else "")
                                                            if p else "-" for p in parted), *([""] * len(others))])
    for name, path, spec, lower_better in _ROWS:
        cells = [name]
        for doc in docs:
            value = _get(doc, path)
            if name.startswith("requests ok"):
                cells.append(f"{value} / {_get(doc, ('summary', 'num_requests'))}")
            elif name.startswith("engines whose"):
                cells.append("-" if doc.get("engine") is None else str(len(value or {})))
            elif name == _CHECK_ROW:
                cells.append(check_cell(_get(doc, ("engine", "connector_check"))))
            else:
                cells.append(_fmt(value, spec))
        for i in others:
            value, base = _get(docs[i], path), _get(docs[base_idx], path)  # type: ignore[index]
            ok = lower_better is not None and name != "errors" and value is not None and base
            cells.append(f"{value / base:.2f}x" if ok else "")
        rows.append(cells)
    return rows


def check_cell(check: dict[str, Any] | None) -> str:
    """``yes``, or ``NO (hits - accounted: +N)``, for :func:`range_connector.bench.replay_metrics.connector_check`;
    aborted loads and loads of re-admitted (preempted) requests are named when there are any; ``-`` without Range."""
    if check is None:
        return "-"
    verdict = "yes" if check["agrees"] else f"NO (hits - accounted: {check['difference_tokens']:+d})"
    extra = [f"{check[k]} {word}" for k, word in (("aborted_tokens", "aborted"),
                                                  ("preempted_load_tokens", "re-admitted")) if check[k]]
    return f"{verdict} ({', '.join(extra)})" if extra else verdict


def same_outputs(report: ReplayReport, baseline: ReplayReport) -> tuple[int, int]:
    """``(equal, compared)``: requests (by trace index) that succeeded in both reports with output digests, and
    how many of them generated the same token ids."""
    base = {r.index: r.output_digest for r in baseline.results if r.error is None and r.output_digest}
    pairs = [(r.output_digest, base[r.index]) for r in report.results
             if r.error is None and r.output_digest and r.index in base]
    return sum(a == b for a, b in pairs), len(pairs)


def output_divergences(report: ReplayReport, baseline: ReplayReport) -> dict[int, int]:
    """``{trace index: position of the first generated token that differs}`` for the requests whose outputs differ
    from the baseline's (both with token ids). Position 0 means the first token already differs (computed from the
    prompt's KV alone); a later one, that both agreed on the prompt and parted while decoding."""
    base = {r.index: r.output_token_ids for r in baseline.results if r.error is None and r.output_token_ids}
    out = {}
    for r in report.results:
        theirs = base.get(r.index)
        if r.error is not None or not r.output_token_ids or theirs is None or r.output_token_ids == theirs:
            continue
        pos = next((i for i, (a, b) in enumerate(zip(r.output_token_ids, theirs)) if a != b),
                   min(len(r.output_token_ids), len(theirs)))
        out[r.index] = pos
    return out


def outputs_equal(reports: Sequence[ReplayReport], baseline: str = "none") -> dict[str, dict[str, Any]]:
    """``{label: {"equal": n, "compared": n, "first_differing_token": {"<trace index>": position}}}`` against the
    report labelled ``baseline`` (:func:`same_outputs`, :func:`output_divergences`); empty without one."""
    base = next((r for r in reports if r.label == baseline), None)
    if base is None:
        return {}
    return {r.label: {**dict(zip(("equal", "compared"), same_outputs(r, base))),
                      "first_differing_token": {str(i): p for i, p in output_divergences(r, base).items()}}
            for r in reports}


def format_comparison(reports: Sequence[ReplayReport], baseline: str = "none") -> str:
    """The table of :func:`comparison_rows` as aligned plain text."""
    rows = comparison_rows(reports, baseline)
    widths = [max(len(row[c]) for row in rows) for c in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(w) if c == 0 else cell.rjust(w) for c, (cell, w) in enumerate(zip(row, widths)))
             for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    lines += [format_handoff(r) for r in reports if r.handoff]
    return "\n".join(lines)


def write_json(path: str | os.PathLike[str], reports: Sequence[ReplayReport], *, baseline: str = "none",
               extra: dict[str, Any] | None = None, compared: Sequence[str] | None = None) -> Path:
    """Write ``{"reports": [...], "ratios_vs_<baseline>": ..., **extra}`` as JSON; returns the path. The ratios are
    of the reports labelled in ``compared`` (all when ``None``): a report measured against another baseline (the
    demo's fleet, against the fleet without a connector) is left out of ``baseline``'s."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    ratioed = [r for r in reports if compared is None or r.label == baseline or r.label in compared]
    doc = {**(extra or {}), "baseline": baseline, f"ratios_vs_{baseline}": ratios(ratioed, baseline),
           f"outputs_equal_to_{baseline}": outputs_equal(reports, baseline), "reports": [r.to_dict() for r in reports]}
    path.write_text(json.dumps(doc, indent=1, default=str))
    return path


def ttft_figures(series: Sequence[tuple[str, Sequence[Mapping[str, Any]]]]) -> list[tuple[str, Figure]]:
    """The two TTFT plots of replays, as matplotlib figures (no pyplot state, so any backend and thread will do).

    Args:
        series: ``(label, results)`` per configuration; ``results`` are :class:`RequestResult` fields as a mapping
            (a result file's ``reports[i]["results"]``): ``ttft_s``, ``sent_s`` and ``e2e_s`` in seconds, ``error``.

    Returns:
        ``[("ttft-cdf", client TTFT CDF, one line per label), ("ttft-over-time", TTFT of each request against its
        send time, failed requests as red crosses at their time to failure)]``.
    """
    import matplotlib.ticker
    import numpy as np
    from matplotlib.figure import Figure

    cdf = Figure(figsize=(7, 4.5))
    ax = cdf.subplots()
    for label, results in series:
        ttfts = np.sort([r["ttft_s"] for r in results if r.get("error") is None and r.get("ttft_s") is not None])
        if len(ttfts):
            ax.step(ttfts, np.arange(1, len(ttfts) + 1) / len(ttfts), where="post", label=label)
    ax.set_xscale("log")
    ax.xaxis.set_major_locator(matplotlib.ticker.LogLocator(subs=(1.0, 2.0, 5.0)))
    ax.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda x, _: f"{x:g}"))
    ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax.set_xlabel("time to first token (s, client)")
    ax.set_ylabel("share of requests")
    ax.set_title("TTFT CDF")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    cdf.tight_layout()

    over_time = Figure(figsize=(8, 4.5))
    ax = over_time.subplots()
    for label, results in series:
        ok = [r for r in results if r.get("error") is None and r.get("ttft_s") is not None
              and r.get("sent_s") is not None]
        ax.plot([r["sent_s"] for r in ok], [r["ttft_s"] for r in ok], marker="o", markersize=3, linewidth=0.8,
                label=label)
        failed = [r for r in results if r.get("error") is not None and r.get("sent_s") is not None]
        if failed:
            ax.scatter([r["sent_s"] for r in failed], [r.get("e2e_s") or 0.0 for r in failed], marker="x",
                       color="red", label=f"{label}: failed")
    ax.set_xlabel("send time (s from the start of the measured phase)")
    ax.set_ylabel("time to first token (s, client)")
    ax.set_title("TTFT over time")
    ax.grid(True, alpha=0.3)
    ax.legend()
    over_time.tight_layout()
    return [("ttft-cdf", cdf), ("ttft-over-time", over_time)]


def write_plots(prefix: str | os.PathLike[str], reports: Sequence[ReplayReport]) -> list[Path]:
    """Write ``<prefix>-ttft-cdf.png`` and ``<prefix>-ttft-over-time.png`` (:func:`ttft_figures`), 120 dpi.

    Returns:
        The two paths.
    """
    prefix = Path(prefix)
    prefix.parent.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, fig in ttft_figures([(r.label, [asdict(x) for x in r.results]) for r in reports]):
        paths.append(prefix.with_name(f"{prefix.name}-{name}.png"))
        fig.savefig(paths[-1], dpi=120)
    return paths
