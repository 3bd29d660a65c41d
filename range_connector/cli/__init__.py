"""The ``range-connector`` command.

Subcommands are grouped by topic; each topic is registered by one ``_add_<topic>_commands(subparsers)`` function
listed in :data:`_COMMAND_GROUPS`, and each leaf command sets ``handler`` (a function taking the parsed
``argparse.Namespace`` and returning an exit code) with ``parser.set_defaults(handler=...)``. To add a topic
(``calibrate``, ``patch``, ``doctor``), write its registrar and append it to :data:`_COMMAND_GROUPS`.

Exit codes: 0 success, 1 a backend/runtime failure, 2 bad input (one line on stderr, no usage dump); ``patch check``
also exits 3 when the patch is not applied (and 2 when the vLLM file is not the pinned one).

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
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import NoReturn

from range_connector.errors import ConfigError, PatchMismatchError, RangeError

__all__ = ["build_parser", "main"]

PROG = "range-connector"
EXIT_OK = 0
EXIT_FAILURE = 1
EXIT_BAD_INPUT = 2
EXIT_PATCH_NOT_APPLIED = 3


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


def _positive_ints(text: str) -> tuple[int, ...]:
    values = tuple(_positive_int(part) for part in text.split(",") if part.strip())
    if not values:
        raise argparse.ArgumentTypeError(f"expected a comma-separated list of positive integers, got {text!r}")
    return values


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
    from range_connector.backends.valkey.servers import default_runtime_dir

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
    from range_connector.backends.valkey.servers import ensure_servers, server_status

    runtime_dir = _runtime_dir(args)
    urls = ensure_servers(args.shards, runtime_dir, start_timeout_s=args.start_timeout_s)
    data_dirs = {status.url: status.data_dir for status in server_status(runtime_dir)}
    print(f"{len(urls)} Valkey server(s) running (runtime dir {runtime_dir}); the servers never talk to each other:")
    for shard_idx, url in enumerate(urls):
        print(f"  shard {shard_idx}: {url}  data dir {data_dirs.get(url, '?')}")
    print()
    print("For kv_connector_extra_config:")
    print(f'"tiers": [{json.dumps({"type": "valkey", "servers": urls})}]')
    print()
    print("Engine flag:")
    config = {"kv_connector": "RangeConnector", "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
              "kv_connector_extra_config": {"tiers": [{"type": "valkey", "servers": urls}]}}
    print(f"--kv-transfer-config '{json.dumps(config)}'")
    return EXIT_OK


def _valkey_status(args: argparse.Namespace) -> int:
    from range_connector.backends.valkey.servers import server_status

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
    print(f"runtime dir {runtime_dir}")
    _print_table(rows)
    return EXIT_OK


def _print_table(rows: Sequence[Sequence[str]]) -> None:
    """Print rows (the first one is the header) as left-aligned columns."""
    widths = [max(len(row[column]) for row in rows) for column in range(len(rows[0]))]
    for row in rows:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip())


def _valkey_stop(args: argparse.Namespace) -> int:
    from range_connector.backends.valkey.servers import stop_servers

    runtime_dir = _runtime_dir(args)
    num_stopped = stop_servers(runtime_dir, timeout_s=args.timeout_s)
    print(f"stopped {num_stopped} Valkey server(s) in {runtime_dir}")
    return EXIT_OK


# --------------------------------------------------------------------------------------------------------------
# patch


def _add_patch_commands(subparsers: argparse._SubParsersAction[_Parser]) -> None:
    patch_parser = subparsers.add_parser(
        "patch", help="the engine patch: MLA's direct-call branch reaches the connector's per-layer hooks")
    patch_commands = patch_parser.add_subparsers(dest="patch_command", metavar="{check,apply,revert}")
    patch_commands.required = True
    for name, handler, help_text in (
        ("check", _patch_check, "exit 0 if applied, 3 if not applied, 2 if the file is not the pinned vLLM's"),
        ("apply", _patch_apply, "apply it (atomic write, the original kept as a backup); a no-op if applied"),
        ("revert", _patch_revert, "restore the original bytes and remove the backup; a no-op if not applied"),
    ):
        command = patch_commands.add_parser(name, help=help_text)
        command.add_argument("--vllm-dir", type=Path, default=None,
                             help="vLLM's package directory (default: the installed vLLM, found without importing it)")
        command.set_defaults(handler=handler)


def _patch_check(args: argparse.Namespace) -> int:
    from range_connector.cli.patch import PatchState, patch_status

    status = patch_status(args.vllm_dir)
    print(f"{status.state.value}: {status.target}")
    return EXIT_OK if status.state is PatchState.APPLIED else EXIT_PATCH_NOT_APPLIED


def _patch_apply(args: argparse.Namespace) -> int:
    from range_connector.cli.patch import PATCH_NAME, apply_patch

    status, changed = apply_patch(args.vllm_dir)
    print(f"applied {PATCH_NAME} to {status.target} (original kept in {status.backup})" if changed
          else f"already applied: {status.target}")
    return EXIT_OK


def _patch_revert(args: argparse.Namespace) -> int:
    from range_connector.cli.patch import revert_patch

    status, changed = revert_patch(args.vllm_dir)
    print(f"reverted: {status.target}" if changed else f"not applied: {status.target}")
    return EXIT_OK


# --------------------------------------------------------------------------------------------------------------
# calibrate


def _add_calibrate_commands(subparsers: argparse._SubParsersAction[_Parser]) -> None:
    cal = subparsers.add_parser(
        "calibrate", help="measure prefill rate R and tier speed B, T0; write the calibration file; print B* table",
        description="Measure the served model's prefill rate (a short sweep against a vLLM server, started here on "
        "--model or running at --url) and each backend's delivered bandwidth and fixed latency (reads of synthetic "
        "stripes, removed afterwards); write the calibration file and print the break-even table.")
    what = cal.add_mutually_exclusive_group()
    what.add_argument("--model", help="model directory: its config gives s, layers and vocabulary; an engine is "
                      "started on it (without a connector) unless --url is given")
    what.add_argument("--tiny", action="store_true", help="use the tiny GQA test model (built if needed)")
    cal.add_argument("--url", help="http://host:port of a running vLLM API server to measure instead")
    cal.add_argument("--backends", type=lambda t: tuple(x for x in t.split(",") if x), default=None,
                     help="comma-separated backends to measure (default: the config's backend; '' for none)")
    cal.add_argument("--extra-config", default="{}", help="kv_connector_extra_config JSON (tiers, "
                     "num_shards, ...); embedded Valkey servers are used when it names none")
    cal.add_argument("--output", type=Path, default=Path("range-calibration.json"), help="calibration file")
    cal.add_argument("--quick", action="store_true", help="fewer and shorter prompts, smaller reads, fewer repeats")
    cal.add_argument("--prompt-tokens", type=_positive_ints, help="prompt lengths of the prefill sweep")
    cal.add_argument("--prefill-repeats", type=_positive_int, help="requests per prompt length")
    cal.add_argument("--read-mib", type=_positive_ints, help="sizes of the timed stripe reads, MiB")
    cal.add_argument("--read-repeats", type=_positive_int, help="reads per size")
    cal.add_argument("--skip-prefill", action="store_true", help="do not measure R (see --tokens-per-s)")
    cal.add_argument("--tokens-per-s", type=_positive_float, help="record this constant R when skipping prefill")
    cal.add_argument("--bytes-per-token", type=_positive_float, help="s, KV bytes per token (default: --model)")
    cal.add_argument("--num-layers", type=_positive_int, help="layer values per stripe (default: --model)")
    cal.add_argument("--vocab-size", type=_positive_int, help="token ids drawn below this (default: --model)")
    cal.add_argument("--engine-t0-s", type=float, default=0.0, help="engine seconds per hit added to every T0")
    cal.add_argument("--start-timeout-s", type=_positive_float, default=300.0, help="engine start-up deadline")
    cal.add_argument("--table-tokens", type=_positive_ints,
                     help="prompt lengths of the table's saving columns (default 1024,4096,16384,65536)")
    cal.set_defaults(handler=_calibrate)


def _calibrate(args: argparse.Namespace) -> int:
    from range_connector.cli import calibrate as c
    from range_connector.config import RangeConfig

    try:
        extra = json.loads(args.extra_config)
    except ValueError as exc:
        raise ConfigError("--extra-config", f"not JSON ({exc})") from None
    if not isinstance(extra, dict):
        raise ConfigError("--extra-config", "not a JSON object")
    backends = args.backends if args.backends is not None else (RangeConfig.from_extra_config(extra).backend,)
    model = args.model
    if args.tiny:
        from range_connector.testing.tiny_models import build_model

        model = str(build_model("gqa", "tiny"))
    if args.engine_t0_s < 0:
        raise ConfigError("--engine-t0-s", f"{args.engine_t0_s} must be >= 0")
    opts = c.CalibrateOptions(
        output=args.output, model=model, url=args.url, backends=tuple(backends), extra_config=extra,
        prompt_tokens=args.prompt_tokens or (c.QUICK_PROMPT_TOKENS if args.quick else c.FULL_PROMPT_TOKENS),
        prefill_repeats=args.prefill_repeats or (2 if args.quick else 5),
        read_bytes=tuple(m * c.MiB for m in args.read_mib) if args.read_mib else (
            c.QUICK_READ_BYTES if args.quick else c.FULL_READ_BYTES),
        read_repeats=args.read_repeats or (3 if args.quick else 5), skip_prefill=args.skip_prefill,
        tokens_per_s=args.tokens_per_s, bytes_per_token=args.bytes_per_token, num_layers=args.num_layers,
        vocab_size=args.vocab_size, engine_t0_s=args.engine_t0_s, start_timeout_s=args.start_timeout_s,
        table_tokens=args.table_tokens or c.TABLE_PROMPT_TOKENS)
    calibration = c.run_calibration(opts)
    try:
        header, rows = c.break_even_rows(calibration, opts.table_tokens)
    except ValueError:
        print("no break-even table: it needs R (measured or --tokens-per-s) and s (--model or --bytes-per-token)")
        return EXIT_OK
    rate = calibration.prefill
    print()
    print(f"R = {rate.tokens_per_s():,.0f} tokens/s at context 0 (attention term {rate.attention_s_per_token2:.3g} "
          f"s/token^2, fixed {calibration.prefill_overhead_s * 1e3:.1f} ms per request removed); "
          f"s = {calibration.bytes_per_token:,.0f} bytes/token")
    _print_table([header, *rows])
    measured = max((n for n, _ in calibration.prefill_points), default=None)
    if measured is not None and max(opts.table_tokens) > measured:
        print(f"(savings above {measured} tokens extrapolate the fitted prefill curve)")
    return EXIT_OK


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
        from range_connector.serving.proxy import Policy, ProxyConfig, serve_proxy
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
    _add_patch_commands,
    _add_calibrate_commands,
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
        Exit code: 0 success, 1 a backend or runtime failure, 2 bad input (including a vLLM file the engine patch
        was not written for), 3 ``patch check`` found the patch not applied. Errors are one line on stderr.
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
