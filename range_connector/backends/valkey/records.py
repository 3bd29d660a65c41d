"""The record of a runtime directory's embedded servers: ``servers.json``, the file lock that guards it, and the
directory's ownership check.

Every change to the record happens under the lock (``<runtime_dir>/lock``), and the record is only ever replaced
atomically (written to a temp file, fsynced, renamed), so a reader needs no lock. A record that does not parse, or
whose shard indices do not fit its shard count, is an error naming the file, never silently replaced. Its users:
:mod:`range_connector.backends.valkey.servers`.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import filelock

from range_connector.config.paths import RUNTIME_DIR_ENV
from range_connector.errors import BackendError, BackendTimeoutError

SERVERS_FILE_NAME = "servers.json"
LOCK_FILE_NAME = "lock"
_FORMAT_VERSION = 1


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


def prepare_runtime_dir(runtime_dir: Path) -> None:
    """Create ``runtime_dir`` (mode 0700) if missing; BackendError if it belongs to another user."""
    runtime_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    owner_uid = runtime_dir.stat().st_uid
    if owner_uid != os.getuid():
        raise BackendError(
            f"runtime dir {runtime_dir} belongs to uid {owner_uid}, not to this user (uid {os.getuid()}); "
            f"set {RUNTIME_DIR_ENV} to a directory of your own"
        )


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
        if document.get("format_version") != _FORMAT_VERSION:
            raise ValueError(f"format_version {document.get('format_version')!r} != {_FORMAT_VERSION}")
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
    """Replace ``servers.json`` atomically (hold the lock)."""
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
