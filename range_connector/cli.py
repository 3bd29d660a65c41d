"""The ``range-connector`` command.

Subcommands are grouped by topic; each topic is registered by one ``_add_<topic>_commands(subparsers)`` function
listed in :data:`_COMMAND_GROUPS`, and each leaf command sets ``handler`` (a function taking the parsed
``argparse.Namespace`` and returning an exit code) with ``parser.set_defaults(handler=...)``. To add a topic
(``calibrate``, ``patch``, ``doctor``), write its registrar and append it to :data:`_COMMAND_GROUPS`.

Exit codes: 0 success, 1 a backend/runtime failure, 2 bad input (one line on stderr, no usage dump).

Examples::

    range-connector valkey start --shards 2
    range-connector valkey status
    range-connector valkey stop
    range-connector proxy --prefill http://10.0.0.1:8100 --decode http://10.0.0.2:8200 --port 8000
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
        type=Path,
        default=None,
        help="directory of servers.json, lock, logs and data dirs (default: $RANGE_CONNECTOR_RUNTIME_DIR, else "
        "$XDG_RUNTIME_DIR or the temp dir, /range-connector-<uid>)",
    )


def _runtime_dir(args: argparse.Namespace) -> Path:
    from range_connector.valkey_servers import default_runtime_dir

    return args.runtime_dir if args.runtime_dir is not None else default_runtime_dir()


def _add_valkey_commands(subparsers: argparse._SubParsersAction[_Parser]) -> None:
    valkey_parser = subparsers.add_parser("valkey", help="manage the embedded Valkey servers (one per shard)")
    valkey_commands = valkey_parser.add_subparsers(dest="valkey_command", metavar="{start,status,stop}")
    valkey_commands.required = True

    start = valkey_commands.add_parser("start", help="start the servers unless they are running; print their URLs")
    start.add_argument("--shards", type=_positive_int, required=True, help="number of shards (one server each)")
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
    from range_connector.valkey_servers import ensure_servers

    runtime_dir = _runtime_dir(args)
    urls = ensure_servers(args.shards, runtime_dir, start_timeout_s=args.start_timeout_s)
    print(f"{len(urls)} Valkey server(s) running (runtime dir {runtime_dir}):")
    for shard_idx, url in enumerate(urls):
        print(f"  shard {shard_idx}: {url}")
    print()
    print("For kv_connector_extra_config:")
    print(f'"valkey_urls": {json.dumps(urls)}')
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
# proxy


def _add_proxy_commands(subparsers: argparse._SubParsersAction[_Parser]) -> None:
    proxy = subparsers.add_parser(
        "proxy",
        help="disaggregated-prefill proxy: each request goes to a prefill engine (max_tokens=1), then to a decode "
        "engine with the returned kv_transfer_params",
    )
    proxy.add_argument("--prefill", action="append", required=True, metavar="URL",
                       help="base URL of a prefill engine (kv_producer), e.g. http://10.0.0.1:8100; repeatable")
    proxy.add_argument("--decode", action="append", required=True, metavar="URL",
                       help="base URL of a decode engine (kv_consumer); repeatable")
    proxy.add_argument("--host", default="127.0.0.1", help="interface to listen on (default: 127.0.0.1)")
    proxy.add_argument("--port", type=int, default=8000, help="port to listen on (default: 8000)")
    proxy.add_argument("--policy", choices=["round_robin", "least_loaded"], default="round_robin",
                       help="how a request picks among healthy engines of a kind (least_loaded: fewest in flight)")
    proxy.add_argument("--timeout-s", type=_positive_float, default=300.0,
                       help="default of --prefill-timeout-s and --decode-timeout-s (default: 300)")
    proxy.add_argument("--prefill-timeout-s", type=_positive_float, default=None,
                       help="deadline of the whole prefill call, seconds")
    proxy.add_argument("--decode-timeout-s", type=_positive_float, default=None,
                       help="longest silence of a decode engine (before its answer, between streamed chunks), seconds")
    proxy.add_argument("--connect-timeout-s", type=_positive_float, default=5.0,
                       help="deadline of one connection attempt, seconds (default: 5)")
    proxy.add_argument("--health-interval-s", type=_positive_float, default=5.0,
                       help="seconds between health checks of every engine (default: 5)")
    proxy.add_argument("--log-level", choices=["debug", "info", "warning", "error"], default="info")
    proxy.set_defaults(handler=_proxy)


def _proxy(args: argparse.Namespace) -> int:
    import asyncio
    import logging

    try:
        from range_connector.proxy import Policy, ProxyConfig, serve_proxy
    except ImportError as exc:
        print(f"error: the proxy needs aiohttp ({exc}): pip install 'range-connector[proxy]'", file=sys.stderr)
        return EXIT_FAILURE

    try:
        config = ProxyConfig(
            prefill_urls=tuple(args.prefill),
            decode_urls=tuple(args.decode),
            host=args.host,
            port=args.port,
            policy=Policy(args.policy),
            prefill_timeout_s=args.prefill_timeout_s or args.timeout_s,
            decode_timeout_s=args.decode_timeout_s or args.timeout_s,
            connect_timeout_s=args.connect_timeout_s,
            health_interval_s=args.health_interval_s,
        )
    except ConfigError as exc:  # name the command-line option, not the config field
        option = "--" + exc.key.removesuffix("_urls").replace("_", "-")
        print(f"error: {option}: {str(exc)[len(exc.key) + 2:]}", file=sys.stderr)
        return EXIT_BAD_INPUT
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        asyncio.run(serve_proxy(config))
    except OSError as exc:
        print(f"error: cannot listen on {args.host}:{args.port}: {exc}", file=sys.stderr)
        return EXIT_FAILURE
    return EXIT_OK


# --------------------------------------------------------------------------------------------------------------
# Parser and entry point

_COMMAND_GROUPS: tuple[Callable[[argparse._SubParsersAction[_Parser]], None], ...] = (
    _add_valkey_commands,
    _add_proxy_commands,
)
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
