"""Where a process keeps what outlives it: the runtime directory of embedded servers (no I/O at import)."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

#: Environment variable that overrides :func:`default_runtime_dir`.
RUNTIME_DIR_ENV = "RANGE_CONNECTOR_RUNTIME_DIR"


def default_runtime_dir() -> Path:
    """Return the directory that holds the server record, lock, logs and data dirs.

    Returns:
        ``$RANGE_CONNECTOR_RUNTIME_DIR`` if set and non-empty, else
        ``${XDG_RUNTIME_DIR:-<system temp dir>}/range-connector-<uid>``.
    """
    override = os.environ.get(RUNTIME_DIR_ENV)
    if override:
        return Path(override)
    base = os.environ.get("XDG_RUNTIME_DIR") or tempfile.gettempdir()
    return Path(base) / f"range-connector-{os.getuid()}"
