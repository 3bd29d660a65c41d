"""What every ``range-connector`` sub-command shares: exit codes, the parser class, argument types, tables.

Each sub-command module (``valkey_command``, ``patch_command``, ``calibrate_command``, ``proxy_command``,
``cache_command``, ``report_command``, ``doctor_command``) registers its parsers with an ``add_commands(subparsers)``
function whose ``subparsers`` make :class:`Parser` instances, and each leaf command sets ``handler`` (a function
taking the parsed ``argparse.Namespace`` and returning one of the exit codes here) with
``parser.set_defaults(handler=...)``. At module level the sub-command modules import only this module,
``range_connector.errors`` and the standard library; each handler imports what it needs when it runs, so building the
whole parser (``--help``) stays cheap.

Every handler checks all its arguments before it starts an engine or a server or measures anything: argparse checks
types, and :func:`check_output_file` and :func:`check_directory` check paths that are written later, so a bad one is
found at once. A bad argument raises :class:`~range_connector.errors.ConfigError` naming the option (the entry point
prints one line and exits ``EXIT_BAD_INPUT``).
"""

from __future__ import annotations

import argparse
import os
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import NoReturn

from range_connector.errors import ConfigError

__all__ = [
    "EXIT_BAD_INPUT", "EXIT_FAILURE", "EXIT_OK", "EXIT_PATCH_NOT_APPLIED", "EXIT_SERVER_DEAD", "BadInput", "Parser",
    "check_directory", "check_output_file", "positive_float", "positive_int", "positive_ints", "print_table",
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


def _nearest_existing(path: Path) -> Path:
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def _check_can_create_in(directory: Path, option: str, what: str) -> None:
    """Create and remove a temporary file in ``directory`` (the only test that holds for root, read-only mounts and
    full file systems alike); raises ConfigError naming ``option``."""
    if not directory.is_dir():
        raise ConfigError(option, f"cannot create {what}: {directory} is not a directory")
    try:
        fd, probe = tempfile.mkstemp(prefix=".range-connector-check-", dir=directory)
    except OSError as exc:
        raise ConfigError(option, f"cannot create {what}: {directory} is not writable ({exc.strerror or exc})"
                          ) from None
    os.close(fd)
    os.unlink(probe)


def check_output_file(path: Path, option: str) -> Path:
    """Check now, before any work, that a file can later be written at ``path`` the way the commands write files (a
    temporary file in its directory renamed into place; missing parent directories created).

    Args:
        path: the file to be written (``~`` is expanded).
        option: the command-line option that named it, e.g. ``"--output"``.

    Returns:
        The expanded path.

    Raises:
        ConfigError: ``path`` is a directory, or its nearest existing ancestor is not a directory or not writable
            (key ``option``).
    """
    target = path.expanduser()
    if target.is_dir():
        raise ConfigError(option, f"{target} is a directory; name a file")
    _check_can_create_in(_nearest_existing(target.parent), option, str(target))
    return target


def check_directory(path: Path, option: str) -> Path:
    """Check now that ``path`` is a directory that files can be created in, or can be created as one.

    Args:
        path: the directory (``~`` is expanded).
        option: the command-line option that named it, e.g. ``"--runtime-dir"``.

    Returns:
        The expanded path.

    Raises:
        ConfigError: ``path`` or an ancestor is not a directory, or the nearest existing one is not writable (key
            ``option``).
    """
    target = path.expanduser()
    _check_can_create_in(_nearest_existing(target), option, f"files in {target}")
    return target
