"""The ``range-connector`` command.

Subcommands are grouped by topic, one module each; each topic is registered by its module's
``add_commands(subparsers)``, listed in :data:`_COMMAND_GROUPS`, and each leaf command sets ``handler`` (a function
taking the parsed ``argparse.Namespace`` and returning an exit code) with ``parser.set_defaults(handler=...)``
(:mod:`range_connector.cli.common` has the exit codes, the parser class and the argument types they share). To add a
topic, write its module and append its ``add_commands`` to :data:`_COMMAND_GROUPS`.

* :mod:`~range_connector.cli.valkey_command`: ``valkey start|status|stop``, the embedded Valkey servers;
* :mod:`~range_connector.cli.patch_command`: ``patch check|apply|revert``, the engine patch
  (:mod:`~range_connector.cli.patch` applies it);
* :mod:`~range_connector.cli.calibrate_command`: ``calibrate`` (:mod:`~range_connector.cli.calibrate` measures);
* :mod:`~range_connector.cli.proxy_command`: ``proxy``, the disaggregated-prefill proxy;
* :mod:`~range_connector.cli.cache_command`: ``cache stats|clear|lookup``, the cache's contents (no engine needed);
* :mod:`~range_connector.cli.report_command`: ``report``, one HTML page from benchmark, replay and demo result files;
* :mod:`~range_connector.cli.doctor_command`: ``doctor``, checks of an installation and a config
  (:mod:`range_connector.ops.doctor` checks).

Exit codes: 0 success, 1 a backend/runtime failure, 2 bad input (one line on stderr, no usage dump); ``patch check``
also exits 3 when the patch is not applied (and 2 when the vLLM file is not the pinned one); ``valkey status`` exits 4
when a recorded server is dead.

Examples::

    range-connector valkey start --shards 2
    range-connector valkey status
    range-connector valkey stop
    range-connector patch check          # the engine patch (patches/README.md) on the installed vLLM
    range-connector patch apply
    range-connector patch revert
    range-connector calibrate --model /path/to/model --output calibration.json
    range-connector calibrate --tiny --quick --backends valkey,file
    range-connector proxy --prefill http://10.0.0.1:8100 --decode http://10.0.0.2:8200 --port 8000
    range-connector cache stats --config range.json
    range-connector cache clear --config range.json --deployment old --yes
    range-connector cache lookup --config range.json --model /path/to/model --prompt-file prompt.txt
    range-connector report bench/results/replay-20261203-070733.json -o report.html
    range-connector doctor --config extra-config.json --model /path/to/model
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence

from range_connector.cli import (
    cache_command,
    calibrate_command,
    doctor_command,
    patch_command,
    proxy_command,
    report_command,
    valkey_command,
)
from range_connector.cli.common import EXIT_BAD_INPUT, EXIT_FAILURE, EXIT_OK, BadInput, Parser
from range_connector.errors import ConfigError, PatchMismatchError, RangeError

__all__ = ["build_parser", "main"]

PROG = "range-connector"

_COMMAND_GROUPS: tuple[Callable[[argparse._SubParsersAction[Parser]], None], ...] = (
    valkey_command.add_commands,
    patch_command.add_commands,
    calibrate_command.add_commands,
    proxy_command.add_commands,
    cache_command.add_commands,
    report_command.add_commands,
    doctor_command.add_commands,
)
"""Registrars of the command topics, in the order ``--help`` lists them."""


def build_parser() -> argparse.ArgumentParser:
    """Build the ``range-connector`` parser with every registered command group.

    Returns:
        A parser whose leaf commands set ``handler`` on the namespace; parse errors raise instead of exiting.
    """
    parser = Parser(prog=PROG, description="Tools for the Range vLLM KV connector.")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=Parser)
    subparsers.required = True
    for add_commands in _COMMAND_GROUPS:
        add_commands(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``range-connector`` command.

    Args:
        argv: Arguments without the program name; ``None`` means ``sys.argv[1:]``.

    Returns:
        Exit code: 0 success, 1 a backend or runtime failure, 2 bad input (including a vLLM file the engine patch
        was not written for), 3 ``patch check`` found the patch not applied. Errors are one line on stderr.
    """
    parser = build_parser()
    try:
        args = parser.parse_args(list(argv) if argv is not None else None)
    except BadInput as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except SystemExit as exc:  # --help / --version
        return exc.code if isinstance(exc.code, int) else EXIT_OK
    try:
        return int(args.handler(args))
    except (ConfigError, PatchMismatchError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except RangeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_FAILURE
    except OSError as exc:  # a directory or file given on the command line cannot be used (the message names it)
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_FAILURE


if __name__ == "__main__":
    sys.exit(main())
