"""The ``range-connector`` command.

Subcommands are grouped by topic; each topic is registered by one ``_add_<topic>_commands(subparsers)`` function
listed in :data:`_COMMAND_GROUPS`, and each leaf command sets ``handler`` (a function taking the parsed
``argparse.Namespace`` and returning an exit code) with ``parser.set_defaults(handler=...)``. To add a topic
(``proxy``, ``calibrate``, ``patch``, ``doctor``), write its registrar and append it to :data:`_COMMAND_GROUPS`.

Exit codes: 0 success, 1 a backend/runtime failure, 2 bad input (one line on stderr, no usage dump).

Examples::

    range-connector valkey start --shards 2
    range-connector valkey status
    range-connector valkey stop
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import NoReturn

from range_connector.errors import ConfigError, RangeError

__all__ = ["build_parser", "main"]

PROG = "range-connector"
EXIT_OK = 0
EXIT_FAILURE = 1
EXIT_BAD_INPUT = 2


class _BadInput(Exception):
    """Raised by the parser instead of printing usage and exiting."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise _BadInput(f"{self.prog}: {message}")


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text}")
    return value


# --------------------------------------------------------------------------------------------------------------
# valkey


def _add_runtime_dir_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--runtime-dir",
        "--data-dir",
        dest="runtime_dir",
        type=Path,
        default=None,
        help="folder of the servers' data dirs (shard-<i>-data), logs, servers.json and lock (default: "
        "$RANGE_CONNECTOR_RUNTIME_DIR, else $XDG_RUNTIME_DIR or the temp dir, /range-connector-<uid>)",
    )


def _runtime_dir(args: argparse.Namespace) -> Path:
    from range_connector.valkey_servers import default_runtime_dir

    return args.runtime_dir if args.runtime_dir is not None else default_runtime_dir()


def _add_valkey_commands(subparsers: argparse._SubParsersAction[_Parser]) -> None:
    valkey_parser = subparsers.add_parser("valkey", help="manage the embedded Valkey servers (one per shard)")
    valkey_commands = valkey_parser.add_subparsers(dest="valkey_command", metavar="{start,status,stop}")
    valkey_commands.required = True

    start = valkey_commands.add_parser(
        "start", help="start the servers unless they are running; print their URLs and the config line to use")
    start.add_argument("--shards", type=_positive_int, required=True,
                       help="number of shards, one server each (with prefill context parallelism of size P: P, or a "
                       "multiple of P)")
    start.add_argument(
        "--start-timeout-s", type=_positive_float, default=10.0, help="seconds to wait for each server to answer"
    )
    _add_runtime_dir_option(start)
    start.set_defaults(handler=_valkey_start)

    status = valkey_commands.add_parser("status", help="show the recorded servers, their memory and key counts")
    _add_runtime_dir_option(status)
    status.set_defaults(handler=_valkey_status)

    stop = valkey_commands.add_parser("stop", help="stop the recorded servers")
    stop.add_argument("--timeout-s", type=_positive_float, default=5.0, help="grace period before SIGKILL")
    _add_runtime_dir_option(stop)
    stop.set_defaults(handler=_valkey_stop)


def _valkey_start(args: argparse.Namespace) -> int:
    from range_connector.valkey_servers import ensure_servers, server_status

    runtime_dir = _runtime_dir(args)
    urls = ensure_servers(args.shards, runtime_dir, start_timeout_s=args.start_timeout_s)
    data_dirs = {status.url: status.data_dir for status in server_status(runtime_dir)}
    print(f"{len(urls)} Valkey server(s) running (runtime dir {runtime_dir}); the servers never talk to each other:")
    for shard_idx, url in enumerate(urls):
        print(f"  shard {shard_idx}: {url}  data dir {data_dirs.get(url, '?')}")
    print()
    print("For kv_connector_extra_config:")
    print(f'"valkey_urls": {json.dumps(urls)}')
    print()
    print("Engine flag:")
    config = {"kv_connector": "RangeConnector", "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
              "kv_connector_extra_config": {"valkey_urls": urls, "num_shards": len(urls)}}
    print(f"--kv-transfer-config '{json.dumps(config)}'")
    return EXIT_OK


def _valkey_status(args: argparse.Namespace) -> int:
    from range_connector.valkey_servers import server_status

    runtime_dir = _runtime_dir(args)
    statuses = server_status(runtime_dir)
    if not statuses:
        print(f"no Valkey servers recorded in {runtime_dir}")
        return EXIT_OK
    header = ("SHARD", "PID", "PORT", "URL", "ALIVE", "USED_MEMORY_BYTES", "KEYS")
    rows = [header] + [
        (
            str(status.shard_idx),
            str(status.pid),
            str(status.port),
            status.url,
            "yes" if status.alive else "no",
            "-" if status.used_memory_bytes is None else str(status.used_memory_bytes),
            "-" if status.num_keys is None else str(status.num_keys),
        )
        for status in statuses
    ]
    widths = [max(len(row[column]) for row in rows) for column in range(len(header))]
    print(f"runtime dir {runtime_dir}")
    for row in rows:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip())
    return EXIT_OK


def _valkey_stop(args: argparse.Namespace) -> int:
    from range_connector.valkey_servers import stop_servers

    runtime_dir = _runtime_dir(args)
    num_stopped = stop_servers(runtime_dir, timeout_s=args.timeout_s)
    print(f"stopped {num_stopped} Valkey server(s) in {runtime_dir}")
    return EXIT_OK


# --------------------------------------------------------------------------------------------------------------
# Parser and entry point

_COMMAND_GROUPS: tuple[Callable[[argparse._SubParsersAction[_Parser]], None], ...] = (_add_valkey_commands,)
"""Registrars of the command topics, in the order ``--help`` lists them."""


def build_parser() -> argparse.ArgumentParser:
    """Build the ``range-connector`` parser with every registered command group.

    Returns:
        A parser whose leaf commands set ``handler`` on the namespace; parse errors raise instead of exiting.
    """
    parser = _Parser(prog=PROG, description="Tools for the Range vLLM KV connector.")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    subparsers.required = True
    for add_commands in _COMMAND_GROUPS:
        add_commands(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``range-connector`` command.

    Args:
        argv: Arguments without the program name; ``None`` means ``sys.argv[1:]``.

    Returns:
        Exit code: 0 success, 1 a backend or runtime failure, 2 bad input. Errors are printed as one line on stderr.
    """
    parser = build_parser()
    try:
        args = parser.parse_args(list(argv) if argv is not None else None)
    except _BadInput as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except SystemExit as exc:  # --help / --version
        return exc.code if isinstance(exc.code, int) else EXIT_OK
    try:
        return int(args.handler(args))
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except RangeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_FAILURE


if __name__ == "__main__":
    sys.exit(main())
