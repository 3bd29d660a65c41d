"""Scratch file systems for the tests that need a particular kind: a small tmpfs that fills up (``ENOSPC``), one that
refuses ``O_DIRECT``, and a probe of whether a directory's file system accepts ``O_DIRECT``.

Mounting needs root (``CAP_SYS_ADMIN``); where it is not permitted, :func:`mounted` raises :class:`CannotMount` and
the fixtures (``tests/conftest.py``) skip the test with the reason. Nothing here is a test.
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

PAGE_BYTES = 4096


class CannotMount(Exception):
    """The file system could not be mounted here (the message says why)."""


@contextlib.contextmanager
def mounted(fstype: str, mount_dir: Path, size_bytes: int | None = None) -> Iterator[Path]:
    """Mount a fresh, empty ``fstype`` (``tmpfs``, ``ramfs``) on ``mount_dir`` (created) for the ``with`` block.

    Args:
        fstype: the file system type given to ``mount -t``.
        mount_dir: where to mount it.
        size_bytes: the tmpfs ``size`` option (bytes; a multiple of the page); ``None``: the default.

    Raises:
        CannotMount: ``mount`` failed or is missing (not root, no such file system, a container that forbids it).
    """
    mount_dir.mkdir(parents=True, exist_ok=True)
    options = ["-o", f"size={size_bytes}"] if size_bytes is not None else []
    try:
        out = subprocess.run(["mount", "-t", fstype, *options, fstype, str(mount_dir)], capture_output=True,
                             text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise CannotMount(f"mount -t {fstype}: {exc}") from exc
    if out.returncode != 0:
        raise CannotMount(f"mount -t {fstype} exited {out.returncode}: {out.stderr.strip()}")
    try:
        yield mount_dir
    finally:
        if subprocess.run(["umount", str(mount_dir)], capture_output=True, timeout=30).returncode != 0:
            subprocess.run(["umount", "-l", str(mount_dir)], capture_output=True, timeout=30)  # (a file left open)


def free_bytes(path: Path) -> int:
    """Bytes the file system under ``path`` can still allocate (``statvfs``)."""
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def fill_up(path: Path, leave_bytes: int = 0) -> Path:
    """Write the file ``path`` until its file system is full, then give back ``leave_bytes`` (a multiple of the
    page) by truncating it: afterwards exactly that much can be allocated. Returns ``path``."""
    chunk = bytes(64 * 1024)
    with open(path, "wb", buffering=0) as f:
        for size in (len(chunk), PAGE_BYTES):
            with contextlib.suppress(OSError):
                while True:
                    if f.write(chunk[:size]) != size:
                        break
        f.truncate(f.seek(0, os.SEEK_END) // PAGE_BYTES * PAGE_BYTES - leave_bytes)
    return path


def odirect_refusal(path: Path) -> str | None:
    """Why the file system under ``path`` refuses an aligned ``O_DIRECT`` read, or ``None`` if it accepts one."""
    if not hasattr(os, "O_DIRECT"):
        return "no O_DIRECT on this platform"
    probe = path / "odirect-probe"
    probe.write_bytes(bytes(2 * PAGE_BYTES))
    try:
        fd = os.open(probe, os.O_RDONLY | os.O_DIRECT)
        try:
            os.preadv(fd, [mmap.mmap(-1, PAGE_BYTES)], 0)
        finally:
            os.close(fd)
    except OSError as exc:
        if exc.errno != errno.EINVAL:
            raise
        return f"the file system under {path} refuses O_DIRECT ({exc})"
    finally:
        probe.unlink()
    return None
