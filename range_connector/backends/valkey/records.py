"""The record of a runtime directory's embedded servers: ``servers.json``, the file lock that guards it, the last
ports by shard (``ports.json``), the servers' password (``password``) and config file (``server.conf``), and the
directory's ownership check.

Every change to the record happens under the lock (``<runtime_dir>/lock``), and the record is only ever replaced
atomically (written to a temp file, fsynced, renamed), so a reader needs no lock. A record that does not parse, or
whose shard indices do not fit its shard count, is an error naming the file, never silently replaced. Its users:
:mod:`range_connector.backends.valkey.servers`.

Format versions of ``servers.json``: 2 records each server's ``maxmemory_bytes`` and whether it requires the
password; 1 (before servers were bounded and closed) is still read, as servers with no memory limit
(``maxmemory_bytes == 0``) and no password, which :func:`~range_connector.backends.valkey.servers.ensure_servers`
replaces.

The password (``secrets.token_urlsafe``, 43 characters) is created once per runtime dir and kept across restarts, in
a file of mode 0600 in the 0700 directory. The servers read it from ``server.conf`` (mode 0600, the first argument of
``valkey-server``), never from their command line, which any local user can read in ``ps``.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import stat
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import filelock

from range_connector.config.paths import RUNTIME_DIR_ENV
from range_connector.errors import BackendError, BackendTimeoutError

SERVERS_FILE_NAME = "servers.json"
LOCK_FILE_NAME = "lock"
PORTS_FILE_NAME = "ports.json"
PASSWORD_FILE_NAME = "password"
SERVER_CONFIG_FILE_NAME = "server.conf"
_FORMAT_VERSION = 2
_READABLE_VERSIONS = (1, 2)
_PASSWORD_CHARS = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_")


@dataclass(frozen=True, slots=True)
class ServerRecord:
    """One entry of ``servers.json``."""

    shard_idx: int
    pid: int
    port: int
    url: str
    data_dir: str
    log_path: str
    started_at_unix_s: float
    #: the server's ``maxmemory`` (0: none, a format-1 record)
    maxmemory_bytes: int = 0
    #: whether the server requires the runtime dir's password
    password_protected: bool = False


def prepare_runtime_dir(runtime_dir: Path) -> None:
    """Create ``runtime_dir`` (mode 0700) if missing, and take group and other access away from an existing one.

    Raises:
        BackendError: it belongs to another user.
    """
    runtime_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    info = runtime_dir.stat()
    if info.st_uid != os.getuid():
        raise BackendError(
            f"runtime dir {runtime_dir} belongs to uid {info.st_uid}, not to this user (uid {os.getuid()}); "
            f"set {RUNTIME_DIR_ENV} to a directory of your own"
        )
    if stat.S_IMODE(info.st_mode) & 0o077:  # (mkdir's mode is cut by the umask only; an old dir may be 0755)
        os.chmod(runtime_dir, 0o700)


def runtime_password(runtime_dir: Path) -> str:
    """The runtime dir's server password: :func:`stored_password`, created (mode 0600) the first time. Hold the lock.

    Returns:
        43 URL-safe characters (``[A-Za-z0-9_-]``), usable as is in ``valkey://:PASSWORD@host:port``.

    Raises:
        BackendError: the file cannot be read or written, or holds something else.
    """
    password = stored_password(runtime_dir)
    if password is None:
        password = secrets.token_urlsafe(32)
        _write_private(runtime_dir / PASSWORD_FILE_NAME, password + "\n")
    return password


def stored_password(runtime_dir: Path) -> str | None:
    """The password in ``runtime_dir/password``; ``None`` when there is no such file.

    Raises:
        BackendError: the file cannot be read, or holds something else than URL-safe characters.
    """
    path = runtime_dir / PASSWORD_FILE_NAME
    try:
        password = path.read_text(encoding="ascii").strip()
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError) as exc:
        raise BackendError(f"cannot read {path}: {exc}") from exc
    if not password or not set(password) <= _PASSWORD_CHARS:
        raise BackendError(f"{path} does not hold a password of URL-safe characters; stop the servers and delete it "
                           "to get a new one")
    if stat.S_IMODE(path.stat().st_mode) & 0o077:
        os.chmod(path, 0o600)
    return password


def write_server_config(runtime_dir: Path, password: str) -> Path:
    """Write ``server.conf`` (mode 0600) with the settings a server must not take on its command line; return it."""
    path = runtime_dir / SERVER_CONFIG_FILE_NAME
    _write_private(path, f"# written by range-connector; read by the embedded valkey-server at start\n"
                         f"requirepass {password}\n")
    return path


def read_ports(runtime_dir: Path) -> dict[int, int]:
    """``{shard_idx: port}`` the servers of this runtime dir last listened on (empty when unknown or unreadable)."""
    try:
        document = json.loads((runtime_dir / PORTS_FILE_NAME).read_text(encoding="utf-8"))
        return {int(k): int(v) for k, v in document["ports"].items() if 0 < int(v) < 65536}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return {}  # (only a preference: a lost file costs new ports, nothing else)


def _write_private(path: Path, text: str) -> None:
    """Replace ``path`` atomically by a file of mode 0600 holding ``text``."""
    tmp_path = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.fchmod(fd, 0o600)
        with os.fdopen(fd, "w", encoding="ascii") as f:
            fd = -1
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
    finally:
        if fd >= 0:
            os.close(fd)
    os.replace(tmp_path, path)


@contextlib.contextmanager
def locked(runtime_dir: Path, timeout_s: float) -> Iterator[None]:
    """Hold the runtime dir's lock for a ``with`` block; BackendTimeoutError if not taken within ``timeout_s``."""
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


def read_records(runtime_dir: Path) -> tuple[int, list[ServerRecord]]:
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
        if document.get("format_version") not in _READABLE_VERSIONS:
            raise ValueError(f"format_version {document.get('format_version')!r} is not one of {_READABLE_VERSIONS}")
        num_shards = int(document["num_shards"])
        records = [
            ServerRecord(
                shard_idx=int(entry["shard_idx"]),
                pid=int(entry["pid"]),
                port=int(entry["port"]),
                url=str(entry["url"]),
                data_dir=str(entry["data_dir"]),
                log_path=str(entry["log_path"]),
                started_at_unix_s=float(entry["started_at_unix_s"]),
                maxmemory_bytes=int(entry.get("maxmemory_bytes", 0)),
                password_protected=bool(entry.get("password_protected", False)),
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


def write_records(runtime_dir: Path, num_shards: int, records: Sequence[ServerRecord]) -> None:
    """Replace ``servers.json`` atomically, and note the ports in ``ports.json`` (hold the lock)."""
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
    ports = {str(record.shard_idx): record.port for record in records}
    ports_tmp = runtime_dir / f".{PORTS_FILE_NAME}.{os.getpid()}.tmp"
    ports_tmp.write_text(json.dumps({"ports": ports}) + "\n", encoding="utf-8")
    os.replace(ports_tmp, runtime_dir / PORTS_FILE_NAME)
