"""One self-contained HTML page from the result files of the benchmarks, the replay and the demo.

``range-connector report RESULT.json... -o page.html`` (:mod:`range_connector.cli.report_command`) calls
:func:`write_report`. Each file becomes one section of the page: the run (machine, command, commit, versions, when
the file records them), its tables and its plots. The kinds are told apart by shape (:func:`load_result`):

* ``replay``: ``bench/replay.py`` and the demo (``range_connector.bench.demo``) write
  :func:`range_connector.bench.replay_report.write_json` documents, a ``reports`` list of
  :meth:`~range_connector.bench.replay.ReplayReport.to_dict` results. Shown: the side-by-side table of
  :func:`~range_connector.bench.replay_report.comparison_rows_of_docs` (the one the scripts print) and the two
  TTFT plots of :func:`~range_connector.bench.replay_report.ttft_figures`.
* ``granularity`` and ``partition``: ``bench/granularity.py`` and ``bench/partition.py`` (``tool`` names the
  script); their ``rows`` and ``analysis`` as tables and a plot (:mod:`range_connector.ops.report_kinds`).
* ``benchmark``: any other ``bench/*.py`` result (``bench/threshold.py``, ``bench/soak.py``): a ``command`` and a
  ``machine`` (``bench/bench_common.py``'s ``machine_info``); its config and rows as tables, no plot.

Every plot is a matplotlib figure rendered to PNG (Agg, no pyplot state) and inlined as a ``data:image/png;base64``
URI; the page has no script and loads nothing from anywhere, so it can be mailed or archived as one file.
A file that cannot be read, is not JSON or has another shape raises :class:`~range_connector.errors.ResultFileError`
naming the file, before anything is written.
"""

from __future__ import annotations

import html
import json
import os
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from range_connector.errors import ResultFileError
from range_connector.ops.report_html import CSS, ReportSection
from range_connector.ops.report_kinds import SECTION_BUILDERS, run_section

__all__ = ["KINDS", "ResultFile", "load_result", "render_report", "write_report"]

KINDS = ("replay", "granularity", "partition", "benchmark")
"""What :func:`load_result` tells apart (see the module docstring)."""

@dataclass(frozen=True, slots=True)
class ResultFile:
    """One result file, read and classified.

    Attributes:
        path: Where it was read from.
        kind: One of :data:`KINDS`.
        doc: The parsed JSON object.
    """

    path: Path
    kind: str
    doc: dict[str, Any]


def load_result(path: str | os.PathLike[str]) -> ResultFile:
    """Read and classify one result file.

    Raises:
        ResultFileError: The file cannot be read, is not JSON, is not a JSON object, or is none of :data:`KINDS`;
            the message starts with the path.
    """
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise ResultFileError(f"{path}: cannot read it: {reason}") from None
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ResultFileError(f"{path}: not JSON (line {exc.lineno}, column {exc.colno}: {exc.msg})") from None
    if not isinstance(doc, dict):
        raise ResultFileError(f"{path}: not a result file: the JSON is a {type(doc).__name__}, not an object")
    reports = doc.get("reports")
    if reports is not None:
        if not isinstance(reports, list) or not all(isinstance(r, dict) and isinstance(r.get("label"), str)
                                                    and isinstance(r.get("summary"), dict) for r in reports):
            raise ResultFileError(f"{path}: 'reports' is not a list of replay reports (each with a label and a "
                                  "summary), as bench/replay.py and the demo write")
        return ResultFile(path, "replay", doc)
    tool = doc.get("tool")
    if tool in ("bench/granularity.py", "bench/partition.py"):
        if not isinstance(doc.get("rows"), list) or not isinstance(doc.get("config"), dict):
            raise ResultFileError(f"{path}: a {tool} result without its 'rows' list and 'config' object")
        return ResultFile(path, Path(tool).stem, doc)
    if "command" in doc and isinstance(doc.get("machine"), dict):
        return ResultFile(path, "benchmark", doc)
    keys = ", ".join(sorted(doc)[:8]) or "none"
    raise ResultFileError(f"{path}: not a result file that range-connector report knows (top-level keys: {keys}); "
                          "expected the JSON of bench/replay.py, the demo or a bench/*.py benchmark")


def render_report(results: Sequence[ResultFile], *, title: str | None = None) -> tuple[str, int]:
    """The page for ``results``, in their order.

    Returns:
        ``(html, number of inline plots)``.

    Raises:
        ResultFileError: A file's content does not have the fields its kind needs (the message names the file).
    """
    sections = []
    for result in results:
        section = ReportSection(f"{result.path.name} ({result.kind})")
        try:
            run_section(section, result.doc)
            SECTION_BUILDERS[result.kind](section, result.doc)
        except (KeyError, TypeError, ValueError, AttributeError, IndexError, ZeroDivisionError) as exc:
            raise ResultFileError(f"{result.path}: a {result.kind} result with unexpected content "
                                  f"({type(exc).__name__}: {exc})") from None
        sections.append(section)
    title = title or "Range connector: " + ", ".join(r.path.name for r in results)
    toc = "".join(f'<li><a href="#s{i}">{html.escape(s.title)}</a></li>' for i, s in enumerate(sections))
    body = "".join(f'<h2 id="s{i}">{html.escape(s.title)}</h2>' + "\n".join(s.parts) for i, s in enumerate(sections))
    page = (f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title>'
            f"<style>{CSS}</style></head><body><h1>{html.escape(title)}</h1>"
            f'<p class="note">Made by range-connector report on {time.strftime("%Y-%m-%d %H:%M:%S %Z")} from '
            f"{len(results)} result file(s).</p><ul>{toc}</ul>{body}</body></html>\n")
    return page, sum(s.num_plots for s in sections)


def write_report(paths: Iterable[str | os.PathLike[str]], output: str | os.PathLike[str], *,
                 title: str | None = None) -> tuple[Path, int]:
    """Read every file of ``paths`` (all of them before writing anything), render the page, write it.

    Returns:
        ``(output path, number of inline plots)``.

    Raises:
        ResultFileError: See :func:`load_result` and :func:`render_report`.
        OSError: ``output`` cannot be written.
    """
    results = [load_result(p) for p in paths]
    page, num_plots = render_report(results, title=title)
    output = Path(output)
    output.write_text(page, encoding="utf-8")
    return output, num_plots
