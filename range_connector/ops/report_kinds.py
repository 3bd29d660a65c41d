"""The sections of ``range-connector report`` per kind of result file (:mod:`range_connector.ops.report`).

Each builder takes the page section and the parsed JSON and appends tables and plots; a missing field raises
``KeyError``/``TypeError``, which :func:`range_connector.ops.report.render_report` turns into a
:class:`~range_connector.errors.ResultFileError` naming the file. Plots are drawn only from data the file holds: a
file without any successful measurement gets a note instead of an empty plot.

Units in the tables are those of the JSON fields (``*_s`` seconds, ``*_bytes`` bytes, ``gib_per_s`` GiB/s);
derived columns say theirs.
"""

from __future__ import annotations

import shlex
from collections.abc import Callable, Mapping
from typing import Any

from range_connector.ops.report_html import GIB, ReportSection

__all__ = ["SECTION_BUILDERS", "benchmark_section", "granularity_section", "partition_section", "replay_section",
           "run_section"]

MIB = 1 << 20
_MAX_ROWS = 200  # rows of a generic table before it is cut (the rest stays in the JSON)


def run_section(section: ReportSection, doc: Mapping[str, Any]) -> None:
    """The run: command, commit (``git`` and ``git_at_end`` of ``bench/bench_common.py``'s ``git_state``), start,
    wall time, machine and package versions; what the file does not record is said to be missing."""
    section.heading("Run")
    command = doc.get("command")
    run: dict[str, Any] = {"command": shlex.join(map(str, command)) if isinstance(command, list) else command}
    for key in ("started", "wall_s", "model"):
        if key in doc:
            run[key] = doc[key]
    git = doc.get("git")
    if isinstance(git, dict):
        dirty = git.get("dirty") or []
        run["commit"] = f"{git.get('head', '?')} {git.get('head_subject', '')}".strip()
        run["uncommitted changes under range_connector/"] = ", ".join(dirty) if dirty else "none"
        end = doc.get("git_at_end")
        if isinstance(end, dict) and end.get("head") != git.get("head"):
            run["commit at the end (others committed during the run)"] = end.get("head")
    else:
        run["commit"] = "not recorded in this file"
    section.kv(run)
    machine = dict(doc.get("machine") or {})
    if isinstance(machine.get("mem_total_bytes"), int):
        machine["mem_total_bytes"] = f"{machine['mem_total_bytes']} ({machine['mem_total_bytes'] / GIB:.1f} GiB)"
    for key, value in (doc.get("machine_end") or {}).items():
        machine[f"{key} (end)"] = value
    section.heading("Machine")
    if machine:
        section.kv(machine)
    else:
        section.note("not recorded in this file")
    if isinstance(doc.get("versions"), dict):
        section.heading("Versions")
        section.kv(doc["versions"])


def replay_section(section: ReportSection, doc: Mapping[str, Any]) -> None:
    """``bench/replay.py`` or the demo: the trace, each configuration, the side-by-side table, the TTFT plots."""
    from range_connector.bench.replay_report import comparison_rows_of_docs, ttft_figures

    reports = doc["reports"]
    baseline = doc.get("baseline", "none")
    if isinstance(doc.get("trace"), dict):
        section.heading("Trace")
        section.kv(doc["trace"])
    if isinstance(doc.get("engine_settings"), dict):
        section.heading("Engine settings")
        section.kv(doc["engine_settings"])
    section.heading("Configurations")
    section.table([["configuration", "startup (s)", "failed", "kv_transfer_config"],
                   *([r["label"], (r.get("options") or {}).get("startup_s"), (r.get("options") or {}).get("failed"),
                      (r.get("options") or {}).get("kv_transfer_config")] for r in reports)])
    section.heading(f"Side by side (ratios against {baseline})")
    section.table(comparison_rows_of_docs(reports, doc.get(f"outputs_equal_to_{baseline}") or {}, baseline))
    series = [(r["label"], r.get("results") or []) for r in reports]
    if any(res.get("ttft_s") is not None or res.get("error") is not None for _, results in series for res in results):
        section.heading("Time to first token")
        for name, fig in ttft_figures(series):
            section.figure(fig, f"{name} of {', '.join(label for label, _ in series)}")
    else:
        section.note("no plot: the file holds no per-request result")


def granularity_section(section: ReportSection, doc: Mapping[str, Any]) -> None:
    """``bench/granularity.py``: restore time of one payload against the object count N, per path."""
    config = doc["config"]
    section.heading("Config")
    section.kv({k: v for k, v in config.items() if k != "layout"})
    _notes(section, doc.get("notes"))
    rows = doc["rows"]
    section.heading("Rows (medians over the timed repeats)")
    table = [["path", "chunk_tokens", "N objects", "status", "restore_s", "GiB/s", "first_layer_s", "lookup_s",
              "byte_exact", "reason"]]
    for r in rows:
        med = r.get("restore_s_median")
        table.append([r["path"], r.get("chunk_tokens"), r.get("num_objects"), r.get("status"), med,
                      r.get("payload_bytes", config["payload_bytes"]) / GIB / med if med else None,
                      r.get("first_layer_s_median"), r.get("lookup_s_median"), r.get("byte_exact"), r.get("reason")])
    section.table(table)
    paths = (doc.get("analysis") or {}).get("paths") or {}
    if paths:
        section.heading("Per path: least-squares slope against N, and max/min of the medians over N")
        section.table([["path", "slope (us per object)", "intercept (s)", "max/min", "max/min of best"],
                       *([p, (a.get("fit") or {}).get("slope_us_per_object"), (a.get("fit") or {}).get("intercept_s"),
                          a.get("max_over_min"), a.get("max_over_min_of_best")] for p, a in paths.items())])
    for key in ("analysis", "security", "tiers"):
        if key in doc:
            section.details(f"{key} (JSON)", doc[key])
    points: dict[str, list[tuple[int, float]]] = {}
    for r in rows:
        if r.get("status") == "ok" and r.get("restore_s_median") and r.get("num_objects"):
            points.setdefault(r["path"], []).append((r["num_objects"], r["restore_s_median"]))
    if not points:
        section.note("no plot: no row restored successfully")
        return
    from matplotlib.figure import Figure

    fig = Figure(figsize=(10, 5))
    ax = fig.subplots()
    for path, pts in points.items():
        pts.sort()
        style = "-o" if path.startswith("range_") else ("--s" if path.startswith("lmcache_") else ":^")
        ax.plot([x for x, _ in pts], [y for _, y in pts], style, label=path,
                linewidth=2 if path.startswith("range") else 1)
    ax.set_xscale("log", base=2)
    ax.set_ylim(bottom=0)
    ax.set_xlabel("N = logical objects (chunks x layers) for the same payload")
    ax.set_ylabel("restore time, median (s)")
    ax.set_title(f"Restore of {config['payload_bytes'] / MIB:.0f} MiB of KV against the object count")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    section.heading("Restore time against N")
    section.figure(fig, "restore time against object count")


def partition_section(section: ReportSection, doc: Mapping[str, Any]) -> None:
    """``bench/partition.py``: restore bandwidth with the payload on S servers (one per shard, or one shared)."""
    section.heading("Config")
    section.kv(doc["config"])
    rows = doc["rows"]
    section.heading("Rows (medians over the timed rounds)")
    section.table([["case", "path", "status", "restore_s", "GiB/s", "MiB per server", "multi-server share",
                    "byte_exact", "reason"],
                   *([r["case"], r["path"], r.get("status"), r.get("restore_s_median"), r.get("gib_per_s"),
                      [round(b / MIB, 1) for b in r.get("server_bytes_median") or []],
                      r.get("multi_server_fraction_median"), r.get("byte_exact"), r.get("reason")] for r in rows)])
    per_path = (doc.get("analysis") or {}).get("per_path") or {}
    if per_path:
        section.heading("Bandwidth against S = 1 and against one shared server")
        section.table([["path", "S", "bandwidth / S1", "partitioned / shared"],
                       *([p, s, a.get("bandwidth_ratio_vs_S1"), a.get("partitioned_vs_shared")]
                         for p, per in per_path.items() for s, a in per.items())])
    if doc.get("errors"):
        section.details("errors", doc["errors"])
    if "analysis" in doc:
        section.details("analysis (JSON)", doc["analysis"])
    ok = [r for r in rows if r.get("status") == "ok" and r.get("gib_per_s")]
    if not ok:
        section.note("no plot: no case restored successfully")
        return
    from matplotlib.figure import Figure

    fig = Figure(figsize=(10, 5))
    ax = fig.subplots()
    ax.bar(range(len(ok)), [r["gib_per_s"] for r in ok],
           color=["tab:blue" if r.get("placement") != "shared" else "tab:gray" for r in ok])
    ax.set_xticks(range(len(ok)), [f"{r['case']}\n{r['path']}" for r in ok], fontsize=7, rotation=60)
    ax.set_ylabel("restore bandwidth, median (GiB/s)")
    ax.set_title("blue: one server per shard, grey: one shared server", fontsize=9)
    fig.tight_layout()
    section.heading("Restore bandwidth")
    section.figure(fig, "restore bandwidth per case")


def benchmark_section(section: ReportSection, doc: Mapping[str, Any]) -> None:
    """Another ``bench/*.py`` result: its config, notes and rows (their scalar fields), everything else as JSON."""
    if isinstance(doc.get("config"), dict):
        section.heading("Config")
        section.kv(doc["config"])
    _notes(section, doc.get("notes"))
    rows = [r for r in doc.get("rows") or [] if isinstance(r, dict)]
    if rows:
        columns: list[str] = []
        for r in rows:
            columns += [k for k, v in r.items() if k not in columns and (v is None or isinstance(v, (str, int, float)))]
        section.heading(f"Rows ({min(len(rows), _MAX_ROWS)} of {len(rows)})")
        section.table([columns, *([r.get(c) for c in columns] for r in rows[:_MAX_ROWS])])
    shown = {"command", "machine", "machine_end", "versions", "git", "git_at_end", "config", "notes", "rows",
             "started", "wall_s", "model"}
    rest = {k: v for k, v in doc.items() if k not in shown}
    if rest:
        section.details("other fields (JSON)", rest)
    section.note("no plot: range-connector report draws plots for the replay, the demo, granularity and partition")


def _notes(section: ReportSection, notes: Any) -> None:
    if notes:
        section.heading("Notes")
        section.table([["note"], *([n] for n in notes)])


SECTION_BUILDERS: dict[str, Callable[[ReportSection, Mapping[str, Any]], None]] = {
    "replay": replay_section, "granularity": granularity_section, "partition": partition_section,
    "benchmark": benchmark_section}
"""Section builder per :data:`range_connector.ops.report.KINDS` entry."""
