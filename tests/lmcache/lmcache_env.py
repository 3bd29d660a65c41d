"""Where LMCache's environment is and whether it can run the adapter (shared by the tests of this directory)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
LMCACHE_PYTHON = REPO / ".venv-lmcache" / "bin" / "python"


def lmcache_unavailable_reason() -> str | None:
    """Why LMCache's environment cannot run the Range adapter, or ``None``."""
    if not LMCACHE_PYTHON.exists():
        return (f"{LMCACHE_PYTHON.relative_to(REPO)} is missing: create it with `bash bench/setup_lmcache_env.sh` "
                f"(LMCache 0.5.6 in a separate venv)")
    r = subprocess.run([str(LMCACHE_PYTHON), "-c", "import lmcache, torch, valkey, msgpack, xxhash"],
                       capture_output=True, text=True, timeout=120)
    if r.returncode != 0:
        return f"{LMCACHE_PYTHON} cannot import what the adapter needs ({r.stderr.strip()[-300:]}): rerun the setup"
    return None


def lmcache_env() -> dict[str, str]:
    """The environment of a process run with :data:`LMCACHE_PYTHON`: this checkout on ``PYTHONPATH``."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(REPO)
    return env
