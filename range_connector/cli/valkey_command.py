"""``range-connector valkey start|status|stop``: the embedded Valkey servers, one per shard.

The servers themselves are run by :mod:`range_connector.backends.valkey.servers`; this module is the command's
parsers and handlers only. Every sub-command takes ``--runtime-dir``, the folder of the servers' record, lock,
password, logs and working dirs (``--data-dir`` is its deprecated old name: nothing persists there, the servers keep
no data on disk). Handlers return ``EXIT_OK`` (``status``: ``EXIT_SERVER_DEAD`` when a recorded server does not
answer); failures raise (the entry point turns them into exit codes). The options are checked before any server
is asked or started: a runtime dir that is not a directory (or, for ``start``, cannot be written) and a
``--maxmemory-bytes`` below the servers' minimum exit 2 naming the option. No URL is printed with its password: the
engine config printed by ``start`` names the runtime dir, where the engine finds the servers and their password.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from range_connector.cli.common import (
    EXIT_OK,
    EXIT_SERVER_DEAD,
    Parser,
    check_directory,
    positive_float,
    positive_int,
    print_table,
)
from range_connector.errors import ConfigError

__all__ = ["add_commands"]


def _add_runtime_dir_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--runtime-dir",
        dest="runtime_dir",
        type=Path,
        default=None,
        help="folder of the servers' record (servers.json), lock, password, logs and working dirs (default: "
        "$RANGE_CONNECTOR_RUNTIME_DIR, else $XDG_RUNTIME_DIR or the temp dir, /range-connector-<uid>)",
    )
    parser.add_argument("--data-dir", dest="deprecated_data_dir", type=Path, default=None,
                        help="deprecated name of --runtime-dir (the servers keep no data on disk: persistence is off)")


def _runtime_dir(args: argparse.Namespace, *, to_write: bool) -> Path:
    """The runtime dir the options name, checked before any server is asked or started.

    Args:
        to_write: the command creates files there (``start``); else it only reads the record there.

    Raises:
        ConfigError: the path (or, to write, its nearest existing ancestor) is not a directory, or cannot be
            written (names ``--runtime-dir``, or ``--data-dir`` when that named it).
    """
    from range_connector.config.paths import default_runtime_dir

    option = "--runtime-dir" if args.runtime_dir is not None or args.deprecated_data_dir is None else "--data-dir"
    path = args.runtime_dir or args.deprecated_data_dir
    if path is None:
        path, option = default_runtime_dir(), "--runtime-dir (its default)"
    if to_write:
        path = check_directory(path, option)
    elif path.exists() and not path.is_dir():
        raise ConfigError(option, f"{path} is not a directory")
    if args.deprecated_data_dir is not None:  # (after the check: a bad value is the one line)
        print("warning: --data-dir is deprecated, write --runtime-dir (the servers keep no data on disk: "
              "persistence is off, a stopped server loses its contents)", file=sys.stderr)
    return path


def add_commands(subparsers: argparse._SubParsersAction[Parser]) -> None:
    """Register ``valkey`` and its ``start``, ``status`` and ``stop`` sub-commands."""
    valkey_parser = subparsers.add_parser("valkey", help="manage the embedded Valkey servers (one per shard)")
    valkey_commands = valkey_parser.add_subparsers(dest="valkey_command", metavar="{start,status,stop}")
    valkey_commands.required = True

    start = valkey_commands.add_parser(
        "start", help="start the servers unless they are running; print their addresses and the config to use")
    start.add_argument("--shards", type=positive_int, required=True,
                       help="number of shards, one server each (with prefill context parallelism of size P: P, or a "
                       "multiple of P)")
    start.add_argument("--maxmemory-bytes", type=positive_int, default=None,
                       help="memory limit of each server, per shard (the node's total is this x --shards; default: "
                       "the running servers' limit, else 1073741824 = 1 GiB); the config key is "
                       "tiers[0].embedded_maxmemory_bytes")
    start.add_argument(
        "--start-timeout-s", type=positive_float, default=10.0, help="seconds to wait for each server to answer"
    )
    _add_runtime_dir_option(start)
    start.set_defaults(handler=_valkey_start)

    status = valkey_commands.add_parser(
        "status", help=f"show the recorded servers, their memory and key counts; exit {EXIT_SERVER_DEAD} when one is "
        "dead")
    _add_runtime_dir_option(status)
    status.set_defaults(handler=_valkey_status)

    stop = valkey_commands.add_parser("stop", help="stop the recorded servers (their contents are lost)")
    stop.add_argument("--timeout-s", type=positive_float, default=5.0, help="grace period before SIGKILL")
    _add_runtime_dir_option(stop)
    stop.set_defaults(handler=_valkey_stop)


def _valkey_start(args: argparse.Namespace) -> int:
    from range_connector.backends.factory import describe_limits, gib
    from range_connector.backends.valkey.records import PASSWORD_FILE_NAME
    from range_connector.backends.valkey.servers import server_status, start_embedded
    from range_connector.backends.valkey.urls import redact_url
    from range_connector.config.keys import embedded_budget_bytes

    from range_connector.config.keys import MIN_EMBEDDED_MAXMEMORY_BYTES

    if args.maxmemory_bytes is not None and args.maxmemory_bytes < MIN_EMBEDDED_MAXMEMORY_BYTES:
        raise ConfigError("--maxmemory-bytes", f"{args.maxmemory_bytes} is below the minimum "
                                               f"{MIN_EMBEDDED_MAXMEMORY_BYTES} (32 MiB)")
    runtime_dir = _runtime_dir(args, to_write=True)
    servers = start_embedded(args.shards, runtime_dir, start_timeout_s=args.start_timeout_s,
                             maxmemory_bytes=args.maxmemory_bytes)
    statuses = {status.shard_idx: status for status in server_status(runtime_dir)}
    started = "all started now" if len(servers.started_shard_idxs) == args.shards else (
        f"started now: shards {list(servers.started_shard_idxs)}" if servers.started_shard_idxs else "already running")
    print(f"{len(servers.urls)} Valkey server(s) running in {runtime_dir} ({started}); they never talk to each other:")
    for shard_idx, url in enumerate(servers.urls):
        working_dir = statuses[shard_idx].data_dir if shard_idx in statuses else "?"
        print(f"  shard {shard_idx}: {redact_url(url)}  working dir {working_dir}")
    budget = embedded_budget_bytes(servers.maxmemory_bytes)
    print(f"Memory: {describe_limits(len(servers.urls), servers.maxmemory_bytes)} (noeviction); Range's default budget "
          f"{gib(budget)} per shard, {gib(budget * len(servers.urls))} in all. Persistence is off: a stopped server "
          "loses its contents; a restarted one comes back on the same port.")
    print(f"Password: in {runtime_dir / PASSWORD_FILE_NAME} (clients: valkey-cli -p PORT --askpass)")
    print()
    extra = {"num_shards": args.shards, "runtime_dir": str(runtime_dir.resolve()), "tiers": [{"type": "valkey"}]}
    if args.maxmemory_bytes is not None:
        extra["tiers"][0]["embedded_maxmemory_bytes"] = args.maxmemory_bytes
    print("For kv_connector_extra_config (the engine finds the servers and their password in the runtime dir):")
    print(json.dumps(extra))
    print()
    print("Engine flag:")
    config = {"kv_connector": "RangeConnector", "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
              "kv_connector_extra_config": extra}
    print(f"--kv-transfer-config '{json.dumps(config)}'")
    return EXIT_OK


def _valkey_status(args: argparse.Namespace) -> int:
    from range_connector.backends.valkey.servers import server_status

    runtime_dir = _runtime_dir(args, to_write=False)
    statuses = server_status(runtime_dir)
    if not statuses:
        print(f"no Valkey servers recorded in {runtime_dir}")
        return EXIT_OK
    header = ("SHARD", "PID", "PORT", "URL", "ALIVE", "USED_MEMORY_BYTES", "MAXMEMORY_BYTES", "KEYS", "PASSWORD")
    rows = [header] + [
        (
            str(status.shard_idx),
            str(status.pid),
            str(status.port),
            status.url,
            "yes" if status.alive else "no",
            "-" if status.used_memory_bytes is None else str(status.used_memory_bytes),
            "-" if status.maxmemory_bytes is None else str(status.maxmemory_bytes),
            "-" if status.num_keys is None else str(status.num_keys),
            "yes" if status.password_protected else "no",
        )
        for status in statuses
    ]
    print(f"runtime dir {runtime_dir}")
    print_table(rows)
    dead = [status.shard_idx for status in statuses if not status.alive]
    if dead:
        print(f"dead: shard(s) {dead}; `range-connector valkey start --shards {len(statuses)}` (or the next engine) "
              "restarts them on the same ports, empty", file=sys.stderr)
        return EXIT_SERVER_DEAD
    return EXIT_OK


def _valkey_stop(args: argparse.Namespace) -> int:
    from range_connector.backends.valkey.servers import stop_servers

    runtime_dir = _runtime_dir(args, to_write=False)
    num_stopped = stop_servers(runtime_dir, timeout_s=args.timeout_s)
    print(f"stopped {num_stopped} Valkey server(s) in {runtime_dir}")
    return EXIT_OK
