"""Paired, alternated repeats of replays: each round runs every configuration once (in alternating order), and a
configuration is compared with the baseline of its own round, so that a machine that drifts between rounds (other
work, thermal state) shifts both sides of a pair alike. ``bench/replay.py --pairs N`` runs N rounds and prints
:func:`format_paired`; the JSON keeps :func:`paired_ratios` and :func:`hook_shares`.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

from range_connector.bench.replay import ReplayReport

__all__ = ["PAIRED_METRICS", "format_paired", "hook_shares", "paired_doc", "paired_ratios", "round_order"]

#: (row label, path into ReplayReport.summary): the timings compared pair by pair
PAIRED_METRICS: tuple[tuple[str, tuple[str, str]], ...] = (
    ("TTFT p50", ("ttft_s", "p50")),
    ("TTFT p99", ("ttft_s", "p99")),
    ("TPOT p50", ("tpot_s", "p50")),
    ("TPOT p99", ("tpot_s", "p99")),
    ("E2E p50", ("e2e_s", "p50")),
    ("E2E p99", ("e2e_s", "p99")),
)


def round_order(configs: Sequence[str], round_idx: int) -> list[str]:
    """The configurations in the order round ``round_idx`` runs them: as given in even rounds, reversed in odd ones
    (so that no configuration always runs first, on a machine that is still settling)."""
    return list(configs) if round_idx % 2 == 0 else list(reversed(configs))


def _value(report: ReplayReport, path: tuple[str, str]) -> float | None:
    section = report.summary.get(path[0]) or {}
    value = section.get(path[1]) if isinstance(section, dict) else None
    return float(value) if value is not None else None


def paired_ratios(rounds: Sequence[Sequence[ReplayReport]], baseline: str) -> dict[str, dict[str, list[float | None]]]:
    """``{label: {metric: [ratio to the baseline of the same round, per round]}}`` for every label other than
    ``baseline`` (:data:`PAIRED_METRICS`); a round without the label, its baseline, or a value has ``None``.

    Args:
        rounds: ``[num_rounds][num_configs]`` reports, each round's labels distinct.
        baseline: the label every other one is divided by.
    """
    labels: list[str] = []
    for reports in rounds:
        labels += [r.label for r in reports if r.label != baseline and r.label not in labels]
    out: dict[str, dict[str, list[float | None]]] = {}
    for label in labels:
        out[label] = {}
        for name, path in PAIRED_METRICS:
            per_round: list[float | None] = []
            for reports in rounds:
                by_label = {r.label: r for r in reports}
                mine, base = by_label.get(label), by_label.get(baseline)
                a = _value(mine, path) if mine is not None else None
                b = _value(base, path) if base is not None else None
                per_round.append(a / b if a is not None and b else None)
            out[label][name] = per_round
    return out


def hook_shares(report: ReplayReport) -> dict[str, float]:
    """Seconds inside each of Range's connector hooks over the replay (``vllm:range_hook_seconds_total``, summed
    over the engine's processes), divided by the replay's span in seconds; empty without Range or without
    metrics. On an engine pinned to one core it is the share of that core Range's hooks took."""
    if report.engine is None:
        return {}
    span_s = report.engine.extra.get("span_s") or 0.0
    hooks = report.engine.extra.get("range_hook_s") or {}
    return {hook: seconds / span_s for hook, seconds in hooks.items()} if span_s > 0 else {}


def _cell(ratios: list[float | None]) -> str:
    got = [r for r in ratios if r is not None]
    each = " ".join("-" if r is None else f"{r:.3f}" for r in ratios)
    if not got:
        return f"{each}  (no pair)"
    return f"{each}  median {statistics.median(got):.3f} [{min(got):.3f}..{max(got):.3f}]"


def format_paired(rounds: Sequence[Sequence[ReplayReport]], baseline: str) -> str:
    """Plain-text: per configuration and metric, the ratio to the baseline in each round, their median and range;
    then each Range configuration's hook time as a share of the replay (median over rounds, largest hooks first)."""
    lines = [f"paired ratios to {baseline} ({len(rounds)} rounds; per round, then median [min..max])"]
    for label, metrics in paired_ratios(rounds, baseline).items():
        for name, ratios in metrics.items():
            lines.append(f"  {label:>16s}  {name:9s} {_cell(ratios)}")
    shares: dict[str, dict[str, list[float]]] = {}
    for reports in rounds:
        for report in reports:
            for hook, share in hook_shares(report).items():
                shares.setdefault(report.label, {}).setdefault(hook, []).append(share)
    for label, by_hook in shares.items():
        total = [sum(v) for v in zip(*by_hook.values())] if by_hook else []
        ranked = sorted(by_hook.items(), key=lambda kv: -statistics.median(kv[1]))
        parts = ", ".join(f"{hook} {100 * statistics.median(v):.2f}%" for hook, v in ranked[:5])
        lines.append(f"  {label}: Range's hooks took {100 * statistics.median(total):.2f}% of the replay's span "
                     f"(median of {len(total)} rounds): {parts}")
    return "\n".join(lines)


def paired_doc(rounds: Sequence[Sequence[ReplayReport]], baseline: str) -> dict[str, Any]:
    """JSON-ready: the rounds' labels, :func:`paired_ratios` and each report's :func:`hook_shares`."""
    return {"baseline": baseline, "rounds": [[r.label for r in reports] for reports in rounds],
            "ratios": paired_ratios(rounds, baseline),
            "hook_shares": [[{"label": r.label, "shares": hook_shares(r)} for r in reports] for reports in rounds]}
