"""HTML pieces of ``range-connector report`` (:mod:`range_connector.ops.report`): a page section that collects
tables, notes and inline plots, and the table and image helpers it uses (stdlib ``html``, ``json``, ``base64``;
matplotlib's Agg canvas for the PNGs, imported when a plot is drawn).
"""

from __future__ import annotations

import base64
import html
import io
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = ["CSS", "GIB", "ReportSection", "cell", "figure_data_uri", "html_table", "kv_table"]

GIB = 1 << 30
_PNG_DPI = 100
_CELL_CHARS = 300  # longest value a key/value table shows before cutting it
_NUMBER_TEXT = re.compile(r"[-+]?[\d.,]+(e[-+]?\d+)?(%|x)?( / \d+)?|-")  # "0.56x", "26.9%", "60 / 60", "-"
CSS = """
body { font-family: system-ui, sans-serif; margin: 2em auto; max-width: 1200px; color: #222; }
h1 { font-size: 1.6em; } h2 { border-bottom: 2px solid #ccc; margin-top: 2em; } h3 { margin-top: 1.4em; }
table { border-collapse: collapse; margin: 0.6em 0; font-size: 0.85em; }
th, td { border: 1px solid #ccc; padding: 0.2em 0.5em; text-align: left; vertical-align: top; }
th { background: #eee; } td.n { text-align: right; font-variant-numeric: tabular-nums; }
code, pre { font-size: 0.85em; } pre { white-space: pre-wrap; }
img { max-width: 100%; border: 1px solid #ddd; margin: 0.4em 0; } .note { color: #666; }
"""


@dataclass(slots=True)
class ReportSection:
    """What one result file contributes: HTML fragments in page order, and how many of them are plots."""

    title: str
    parts: list[str] = field(default_factory=list)
    num_plots: int = 0

    def heading(self, text: str) -> None:
        self.parts.append(f"<h3>{html.escape(text)}</h3>")

    def note(self, text: str) -> None:
        self.parts.append(f'<p class="note">{html.escape(text)}</p>')

    def table(self, rows: Sequence[Sequence[Any]]) -> None:
        if len(rows) > 1:
            self.parts.append(html_table(rows))

    def kv(self, mapping: Mapping[str, Any]) -> None:
        self.parts.append(kv_table(mapping))

    def figure(self, fig: Figure, alt: str) -> None:
        self.parts.append(f'<img alt="{html.escape(alt)}" src="{figure_data_uri(fig)}">')
        self.num_plots += 1

    def details(self, summary: str, value: Any) -> None:
        text = json.dumps(value, indent=1, default=str)
        self.parts.append(f"<details><summary>{html.escape(summary)}</summary><pre>{html.escape(text)}</pre>"
                          "</details>")


def figure_data_uri(fig: Figure) -> str:
    """``data:image/png;base64,...`` of ``fig`` rendered with Agg at 100 dpi."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    FigureCanvasAgg(fig)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=_PNG_DPI)
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode("ascii")


def cell(value: Any) -> str:
    """A value as table text: ``-`` for none, floats to 4 significant digits (inside containers too), containers as
    compact JSON cut at 300 characters."""
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, (dict, list, tuple)):
        text = json.dumps(_rounded(value), default=str, separators=(", ", ": "))
        return text if len(text) <= _CELL_CHARS else text[:_CELL_CHARS] + " ..."
    return str(value)


def _rounded(value: Any) -> Any:
    if isinstance(value, float):
        return float(f"{value:.4g}")
    if isinstance(value, dict):
        return {k: _rounded(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_rounded(v) for v in value]
    return value


def _td(value: Any) -> str:
    numeric = (isinstance(value, (int, float)) and not isinstance(value, bool)) or (
        isinstance(value, str) and _NUMBER_TEXT.fullmatch(value) is not None)
    return f'<td class="n">{html.escape(cell(value))}</td>' if numeric else f"<td>{html.escape(cell(value))}</td>"


def html_table(rows: Sequence[Sequence[Any]]) -> str:
    """``<table>`` with ``rows[0]`` as the header row; every cell through :func:`cell`, escaped; numbers (and the
    side-by-side table's formatted numbers, which arrive as text) right-aligned."""
    head = "".join(f"<th>{html.escape(cell(c))}</th>" for c in rows[0])
    body = "".join("<tr>" + "".join(_td(c) for c in row) + "</tr>" for row in rows[1:])
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def kv_table(mapping: Mapping[str, Any]) -> str:
    """Two-column ``<table class="kv">``: key, value (through :func:`cell`)."""
    body = "".join(f"<tr><td>{html.escape(str(k))}</td><td>{html.escape(cell(v))}</td></tr>"
                   for k, v in mapping.items())
    return f'<table class="kv"><tbody>{body}</tbody></table>'
