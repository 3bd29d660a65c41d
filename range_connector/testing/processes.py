"""Operating-system helpers of the launchers: free ports, process groups (a ``/proc`` scan) and SIGTERM.

:func:`free_port` finds a TCP port for a server to bind; :func:`process_group_pids` and :func:`group_has_any` tell
whether anything of a process group (a server and the processes it spawned) is left; :func:`unwind_on_sigterm` makes
a script's ``finally`` blocks run on SIGTERM as on Ctrl-C, so the servers it started are stopped. Linux only
(``/proc``); no project imports.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
from pathlib import Path

__all__ = ["LOOPBACK_HOST", "free_port", "group_has_any", "process_group_pids", "unwind_on_sigterm"]

LOOPBACK_HOST = "127.0.0.1"


def free_port(host: str = LOOPBACK_HOST) -> int:
    """Return a TCP port that was free on ``host`` a moment ago.

    Another program may take it before the server binds it;
    :meth:`~range_connector.testing.server_process.ServerProcess.wait_ready` then reports the server's exit with its
    log.

    Args:
        host: Interface to probe.

    Returns:
        A port number in the kernel's ephemeral range.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def process_group_pids(pgid: int) -> list[int]:
    """Return the live (non-zombie) processes whose process group is ``pgid`` (Linux ``/proc`` scan).

    Args:
        pgid: Process group id.

    Returns:
        Sorted pids; empty when no process of the group is left (or ``/proc`` is unavailable).
    """
    pids = []
    with contextlib.suppress(OSError):
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit():
                continue
            try:
                stat = Path(entry.path, "stat").read_text()
            except OSError:
                continue
            # Fields after "(comm)": state ppid pgrp ...
            fields = stat.rsplit(")", 1)[-1].split()
            if len(fields) >= 3 and int(fields[2]) == pgid and fields[0] not in ("Z", "X"):
                pids.append(int(entry.name))
    return sorted(pids)


def group_has_any(pgid: int) -> bool:
    """Whether any process, zombies included, still has process group ``pgid``."""
    with contextlib.suppress(OSError):
        for entry in os.scandir("/proc"):
            if entry.name.isdigit():
                try:
                    fields = Path(entry.path, "stat").read_text().rsplit(")", 1)[-1].split()
                except OSError:
                    continue
                if len(fields) >= 3 and int(fields[2]) == pgid:
                    return True
    return False


def _sigterm_as_keyboard_interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def unwind_on_sigterm() -> None:
    """Make SIGTERM unwind the main thread like Ctrl-C, so the ``finally`` blocks of a script (a benchmark) stop the
    servers it started instead of leaving them running."""
    signal.signal(signal.SIGTERM, _sigterm_as_keyboard_interrupt)
