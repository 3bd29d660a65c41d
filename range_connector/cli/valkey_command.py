"""``range-connector valkey start|status|stop``: the embedded Valkey servers, one per shard.

The servers themselves are run by :mod:`range_connector.backends.valkey.servers`; this module is the command's
parsers and handlers only. Every sub-command takes ``--runtime-dir`` (alias ``--data-dir``), the folder of the
servers' data dirs, logs, ``servers.json`` and lock. Each handler returns ``EXIT_OK``; failures raise (the entry
point turns them into exit codes).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from range_connector.cli.common import EXIT_OK, Parser, positive_float, positive_int, print_table

__all__ = ["add_commands"]


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
    from range_connector.config.paths import default_runtime_dir

    return args.runtime_dir if args.runtime_dir is not None else default_runtime_dir()


def add_commands(subparsers: argparse._SubParsersAction[Parser]) -> None:
    """Register ``valkey`` and its ``start``, ``status`` and ``stop`` sub-commands."""
    valkey_parser = subparsers.add_parser("valkey", help="manage the embedded Valkey servers (one per shard)")
    valkey_commands = valkey_parser.add_subparsers(dest="valkey_command", metavar="{start,status,stop}")
    valkey_commands.required = True

    start = valkey_commands.add_parser(
        "start", help="start the servers unless they are running; print their URLs and the config line to use")
    start.add_argument("--shards", type=positive_int, required=True,
                       help="number of shards, one server each (with prefill context parallelism of size P: P, or a "
                       "multiple of P)")
    start.add_argument(
        "--start-timeout-s", type=positive_float, default=10.0, help="seconds to wait for each server to answer"
    )
    _add_runtime_dir_option(start)
    start.set_defaults(handler=_valkey_start)

    status = valkey_commands.add_parser("status", help="show the recorded servers, their memory and key counts")
    _add_runtime_dir_option(status)
    status.set_defaults(handler=_valkey_status)

    stop = valkey_commands.add_parser("stop", help="stop the recorded servers")
    stop.add_argument("--timeout-s", type=positive_float, default=5.0, help="grace period before SIGKILL")
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
    print_table(rows)
    return EXIT_OK


def _valkey_stop(args: argparse.Namespace) -> int:
    from range_connector.backends.valkey.servers import stop_servers

    runtime_dir = _runtime_dir(args)
    num_stopped = stop_servers(runtime_dir, timeout_s=args.timeout_s)
    print(f"stopped {num_stopped} Valkey server(s) in {runtime_dir}")
    return EXIT_OK

