"""Embedded servers' processes: started detached on free loopback ports, probed, signalled and waited for.

:func:`start_servers` starts one ``valkey-server`` per shard in parallel (double-forked, so it outlives the process
that starts it) with a memory limit (``--maxmemory``, ``noeviction``) and, when given, the runtime dir's
``server.conf`` as its first argument (the password, kept off the command line). Each shard's server first tries the
port it last had (``ports.json``), so a running engine that retries the old URL finds it again; another port is
picked when that one is taken, and a port another program took first is retried; it waits until each answers with
its own pid; all or none of them survive. The probes ask ``INFO server`` for the ``process_id``, so a server that took the port after
ours died is not mistaken for ours. :mod:`range_connector.backends.valkey.servers` holds the runtime directory's lock
while it starts or stops servers.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from range_connector.backends.valkey.records import ServerRecord
from range_connector.errors import ServerStartError

if TYPE_CHECKING:
    import valkey

MAX_START_ATTEMPTS = 5
"""Ports tried per shard before a start fails (another program may take a free port before the server binds it)."""
KILL_WAIT_S = 2.0
"""How long to wait for a process to go after SIGKILL, seconds."""
_LOOPBACK_HOST = "127.0.0.1"
_PROBE_TIMEOUT_S = 1.0
_POLL_INTERVAL_S = 0.02
_LOG_TAIL_BYTES = 2048


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


@dataclass(frozen=True, slots=True)
class ServerSettings:
    """How :func:`start_servers` starts each server.

    Attributes:
        maxmemory_bytes: the server's ``maxmemory`` (bytes, per server), > 0.
        config_file: ``server.conf`` holding ``requirepass`` (``None``: no password, an open server).
        password: the password in ``config_file`` (probes authenticate with it); ``None`` without one.
        preferred_ports: ``{shard_idx: port}`` to try first (the ports the shards last had).
    """

    maxmemory_bytes: int
    config_file: Path | None = None
    password: str | None = None
    preferred_ports: dict[int, int] | None = None


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


def start_servers(
    binary: Path, runtime_dir: Path, shard_idxs: Sequence[int], start_timeout_s: float, settings: ServerSettings
) -> list[ServerRecord]:
    """Start one server per shard index in parallel; all or none of them survive."""
    launches: list[_Launch] = []  # every process started, for cleanup on failure
    ready: list[ServerRecord] = []
    try:
        pending = [_launch(binary, runtime_dir, shard_idx, 1, start_timeout_s, settings, launches)
                   for shard_idx in shard_idxs]
        while pending:
            still_pending = []
            for launch in pending:
                if launch.process.poll() is not None:
                    log_tail = _read_log_tail(launch.log_path, launch.log_offset_bytes)
                    if "Address already in use" in log_tail and launch.attempt < MAX_START_ATTEMPTS:
                        # Lost the race for the free port to another program: pick another.
                        still_pending.append(
                            _launch(binary, runtime_dir, launch.shard_idx, launch.attempt + 1, start_timeout_s,
                                    settings, launches)
                        )
                        continue
                    raise ServerStartError(
                        f"valkey-server for shard {launch.shard_idx} on port {launch.port} exited with code "
                        f"{launch.process.returncode}; see {launch.log_path}: {log_tail.strip()[-500:]!r}"
                    )
                if _probe_pid(launch.port, settings.password) == launch.process.pid:
                    ready.append(_record_of(launch, settings))
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
            send_signal(record.pid, signal.SIGKILL)
        wait_gone([record.pid for record in ready], KILL_WAIT_S)
        raise
    return ready


def _launch(binary: Path, runtime_dir: Path, shard_idx: int, attempt: int, start_timeout_s: float,
            settings: ServerSettings, launches: list[_Launch]) -> _Launch:
    preferred = (settings.preferred_ports or {}).get(shard_idx) if attempt == 1 else None
    port = preferred if preferred is not None and _port_is_free(preferred) else _pick_free_port()
    data_dir = runtime_dir / f"shard-{shard_idx}-data"
    data_dir.mkdir(mode=0o700, exist_ok=True)
    log_path = runtime_dir / f"shard-{shard_idx}.log"
    command = [
        str(binary),
        *([str(settings.config_file)] if settings.config_file is not None else []),  # must come first
        "--port", str(port),
        "--bind", _LOOPBACK_HOST,
        "--protected-mode", "yes",
        "--save", "",
        "--appendonly", "no",
        "--maxmemory", str(settings.maxmemory_bytes),
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


def _record_of(launch: _Launch, settings: ServerSettings) -> ServerRecord:
    # The server outlives this Popen object; mark it as "handled" so that garbage-collecting the object neither
    # warns ("subprocess N is still running") nor keeps it on subprocess's reap list.
    launch.process.returncode = 0
    return ServerRecord(
        shard_idx=launch.shard_idx,
        pid=launch.process.pid,
        port=launch.port,
        url=f"valkey://{_LOOPBACK_HOST}:{launch.port}",
        data_dir=str(launch.data_dir),
        log_path=str(launch.log_path),
        started_at_unix_s=launch.started_at_unix_s,
        maxmemory_bytes=settings.maxmemory_bytes,
        password_protected=settings.password is not None,
    )


def _kill_launch(launch: _Launch) -> None:
    with contextlib.suppress(OSError):
        launch.process.kill()
    with contextlib.suppress(subprocess.TimeoutExpired):
        launch.process.wait(timeout=KILL_WAIT_S)


def _pick_free_port() -> int:
    """A port that was free on 127.0.0.1 a moment ago (the caller retries if another program takes it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((_LOOPBACK_HOST, 0))
        return int(sock.getsockname()[1])


def _port_is_free(port: int) -> bool:
    """Whether nothing listens on ``port`` of 127.0.0.1 (connections of a stopped server in TIME_WAIT do not count:
    valkey-server binds with SO_REUSEADDR too)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((_LOOPBACK_HOST, port))
        except OSError:
            return False
        return True


def _read_log_tail(log_path: Path, offset_bytes: int) -> str:
    try:
        with open(log_path, "rb") as log_file:
            log_file.seek(max(offset_bytes, os.path.getsize(log_path) - _LOG_TAIL_BYTES))
            return log_file.read().decode("utf-8", errors="replace")
    except OSError:
        return ""


# --------------------------------------------------------------------------------------------------------------
# Probing and stopping


def _client(port: int, password: str | None) -> valkey.Valkey:
    import valkey  # imported lazily: the CLI's --help and bad-input paths need no client

    return valkey.Valkey(
        host=_LOOPBACK_HOST,
        port=port,
        password=password,
        socket_timeout=_PROBE_TIMEOUT_S,
        socket_connect_timeout=_PROBE_TIMEOUT_S,
        retry_on_timeout=False,
    )


def _probe_pid(port: int, password: str | None) -> int | None:
    """The ``process_id`` of the server answering on ``port`` (authenticated with ``password`` unless ``None``), or
    ``None`` if none answers (or it refuses the password)."""
    import valkey

    client = _client(port, password)
    try:
        return int(client.info("server")["process_id"])
    except (valkey.exceptions.ValkeyError, OSError, KeyError, ValueError):
        return None
    finally:
        client.close()


def probe_stats(record: ServerRecord, password: str | None) -> tuple[int, int, int] | None:
    """``(used_memory_bytes, maxmemory_bytes, num_keys)`` if ``record``'s server is alive, else ``None``.

    ``password`` is used only if the record says the server requires it."""
    import valkey

    client = _client(record.port, password if record.password_protected else None)
    try:
        if int(client.info("server")["process_id"]) != record.pid:
            return None
        memory = client.info("memory")
        return int(memory["used_memory"]), int(memory["maxmemory"]), int(client.dbsize())
    except (valkey.exceptions.ValkeyError, OSError, KeyError, ValueError):
        return None
    finally:
        client.close()


def is_alive(record: ServerRecord, password: str | None) -> bool:
    """Whether ``record``'s server answers on its port with its recorded pid (authenticated with ``password`` if the
    record says the server requires it)."""
    return _probe_pid(record.port, password if record.password_protected else None) == record.pid


def pid_is_valkey_server(pid: int, port: int, password: str | None) -> bool:
    """Whether ``pid`` is (still) a running valkey-server, not a recycled pid of another program (``password``: for
    the probe where there is no ``/proc``)."""
    proc_dir = Path(f"/proc/{pid}")
    if Path("/proc/self").exists():
        try:
            comm = (proc_dir / "comm").read_text().strip()
            cmdline = (proc_dir / "cmdline").read_bytes()
        except OSError:
            return False
        # valkey-server rewrites its title to "<binary> 127.0.0.1:<port>"; a zombie has an empty cmdline.
        return bool(cmdline) and (comm.startswith("valkey-server") or b"valkey-server" in cmdline)
    return _probe_pid(port, password) == pid  # no /proc (macOS): trust the server's own answer


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


def wait_gone(pids: Sequence[int], timeout_s: float) -> list[int]:
    """Wait until every pid has exited; return those still running after ``timeout_s``."""
    deadline_s = time.monotonic() + timeout_s
    remaining = [pid for pid in pids if not _pid_gone(pid)]
    while remaining and time.monotonic() < deadline_s:
        time.sleep(_POLL_INTERVAL_S)
        remaining = [pid for pid in remaining if not _pid_gone(pid)]
    return remaining


def send_signal(pid: int, signum: signal.Signals) -> None:
    """Send ``signum`` to ``pid`` unless it is already gone."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signum)
