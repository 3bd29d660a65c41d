"""``range-connector report``: one self-contained HTML page from result files of the benchmarks, the replay and the
demo (plots inline; no engine, no server, no network).

The work is :mod:`range_connector.ops.report`. Every argument is checked first: a result file that is missing,
unreadable, not JSON or of an unknown shape, or an output whose directory does not exist, is one line on stderr
naming it, exit 2, and nothing is written. matplotlib (the ``bench`` extra) draws the plots; without it the
command exits 1 with the pip line.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from range_connector.cli.common import EXIT_BAD_INPUT, EXIT_FAILURE, EXIT_OK, Parser, check_output_file
from range_connector.errors import ResultFileError

__all__ = ["add_commands"]


def add_commands(subparsers: argparse._SubParsersAction[Parser]) -> None:
    """Register ``report``."""
    report = subparsers.add_parser(
        "report", help="one self-contained HTML page (plots inline, tables, the run's machine, command and commit) "
        "from the JSON result files of bench/*.py, the replay and the demo")
    report.add_argument("results", nargs="+", type=Path, metavar="RESULT.json",
                        help="result files, one page section each, in this order")
    report.add_argument("-o", "--output", type=Path, required=True, metavar="PAGE.html", help="the page to write")
    report.add_argument("--title", default=None, help="page title (default: the result files' names)")
    report.set_defaults(handler=_report)


def _report(args: argparse.Namespace) -> int:
    output: Path = args.output
    directory = output.parent if str(output.parent) else Path(".")
    if output.is_dir():
        print(f"error: --output: {output} is a directory", file=sys.stderr)
        return EXIT_BAD_INPUT
    if not directory.is_dir():
        print(f"error: --output: {directory} is not a writable directory", file=sys.stderr)
        return EXIT_BAD_INPUT
    check_output_file(output, "--output")  # (a file made and removed there: os.access says yes to root anywhere)
    try:
        import matplotlib  # noqa: F401
    except ImportError as exc:
        print(f"error: report draws its plots with matplotlib ({exc}): pip install 'range-connector[bench]'",
              file=sys.stderr)
        return EXIT_FAILURE
    from range_connector.ops.report import write_report

    try:
        path, num_plots = write_report(args.results, output, title=args.title)
    except ResultFileError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    print(f"{path}: {len(args.results)} result file(s), {num_plots} plot(s), {path.stat().st_size} bytes")
    return EXIT_OK
