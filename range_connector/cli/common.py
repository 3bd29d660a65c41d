"""What every ``range-connector`` sub-command shares: exit codes, the parser class, argument types, tables.

Each sub-command module (``valkey_command``, ``patch_command``, ``calibrate_command``, ``proxy_command``,
``cache_command``, ``report_command``) registers its parsers with an ``add_commands(subparsers)`` function whose
``subparsers`` make :class:`Parser` instances, and each leaf command sets ``handler`` (a function taking the parsed
``argparse.Namespace`` and returning one of the exit codes here) with ``parser.set_defaults(handler=...)``. At
module level the sub-command modules import only this module, ``range_connector.errors`` and the standard library;
each handler imports what it needs when it runs, so building the whole parser (``--help``) stays cheap.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import NoReturn

__all__ = [
    "EXIT_BAD_INPUT", "EXIT_FAILURE", "EXIT_OK", "EXIT_PATCH_NOT_APPLIED", "EXIT_SERVER_DEAD", "BadInput", "Parser", "print_table",
    "positive_float", "positive_int", "positive_ints",
]

EXIT_OK = 0
EXIT_FAILURE = 1
EXIT_BAD_INPUT = 2
EXIT_PATCH_NOT_APPLIED = 3
#: ``valkey status``: a recorded server does not answer
EXIT_SERVER_DEAD = 4


class BadInput(Exception):
    """Raised by the parser instead of printing usage and exiting."""


class Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise BadInput(f"{self.prog}: {message}")


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def positive_ints(text: str) -> tuple[int, ...]:
    values = tuple(positive_int(part) for part in text.split(",") if part.strip())
    if not values:
        raise argparse.ArgumentTypeError(f"expected a comma-separated list of positive integers, got {text!r}")
    return values


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text}")
    return value


def print_table(rows: Sequence[Sequence[str]]) -> None:
    """Print rows (the first one is the header) as left-aligned columns."""
    widths = [max(len(row[column]) for row in rows) for column in range(len(rows[0]))]
    for row in rows:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip())
