"""GPUDirect Storage for the file tier: whether kvikio's ``CuFile`` can read stripes into device memory here, checked
once at start-up.

:func:`probe_gds` runs when the worker registers a KV cache in device memory (``worker/device_reads.py``): it imports
kvikio, asks whether kvikio runs in its compatibility mode (POSIX reads into a host bounce buffer, then a copy to the
device) or with cuFile (GPUDirect Storage), opens the cuFile driver in the latter case, and reads a probe file it
just wrote, through ``CuFile`` into a device buffer, comparing what lands with what was written. Any failure (kvikio
missing, the driver refused, the read raising, or bytes that differ: dynamo#15079 served the previous request's KV
after a set-up that failed quietly) gives ``io_path == "posix"`` and the reason; the caller logs it and loads with
POSIX reads into pinned banks. The device memory itself belongs to the caller's device seam: the probe gets an
allocator and a read-back.
"""

from __future__ import annotations

import functools
import os
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: the probe file: one page, a second page, and a ragged tail (reads at unaligned offsets and lengths too)
_PROBE_BYTES = 2 * 4096 + 123
#: ``(file offset, length)`` of the probe's reads
_PROBE_READS = ((0, _PROBE_BYTES), (4096 + 17, 4096 + 50), (_PROBE_BYTES - 5, 5))


@functools.cache
def gds_status() -> tuple[bool, str]:
    """``(True, "")`` when kvikio is importable and a CUDA device is present, else ``(False, reason)``."""
    try:
        import kvikio  # noqa: F401
    except ImportError as exc:
        return False, f"kvikio not installed ({exc})"
    try:
        import torch
        if torch.cuda.is_available():
            return True, ""
    except ImportError:
        pass
    return False, "no CUDA device"


@dataclass(frozen=True, slots=True)
class GdsSetup:
    """What the start-up probe found.

    Attributes:
        io_path: ``"gds"`` (cuFile reads into device memory), ``"compat"`` (kvikio's compatibility mode: POSIX into
            its host bounce buffer, then a copy to the device) or ``"posix"`` (the probe failed: the file tier reads
            with POSIX into pinned banks).
        reason: why the path is ``"posix"`` (or a note), ``""`` otherwise.
        device_loads: loads read straight into device memory (``io_path == "gds"``, or ``"compat"`` when the
            caller allowed it: see docs/tiers.md, "Files into GPU memory", for why compatibility mode is not used by
            default).
        kvikio_version: kvikio's ``__version__``, if it was imported.
    """

    io_path: str
    reason: str = ""
    device_loads: bool = False
    kvikio_version: str | None = None

    def describe(self) -> str:
        """One line for the start-up log and ``range-connector doctor``."""
        version = f"kvikio {self.kvikio_version}" if self.kvikio_version else "kvikio"
        if self.io_path == "posix":
            return f"GPUDirect set-up failed ({self.reason}): loads read with POSIX into pinned banks"
        how = "straight into device memory" if self.device_loads else "with POSIX into pinned banks"
        mode = "GPUDirect Storage" if self.io_path == "gds" else "compatibility mode"
        return f"{version} in {mode}: loads read {how}" + (f" ({self.reason})" if self.reason else "")


def compat_mode(kvikio: Any) -> bool:
    """Whether kvikio runs in its compatibility mode (``kvikio.defaults.is_compat_mode_preferred()`` from 24.x,
    ``compat_mode()`` before; unknown counts as compatibility mode)."""
    defaults = getattr(kvikio, "defaults", None)
    for name in ("is_compat_mode_preferred", "compat_mode"):
        fn = getattr(defaults, name, None)
        if fn is not None:
            return bool(fn())
    return True


def probe_gds(root: str | Path, *, empty: Callable[[int], Any], read_back: Callable[[Any], Any],
              allow_compat: bool = False, kvikio: Any = None) -> GdsSetup:
    """Check that ``kvikio.CuFile`` reads files under ``root`` into device memory correctly. Never raises.

    Args:
        root: a directory of the tier (the probe file is written there and removed).
        empty: ``empty(nbytes)`` -> a contiguous ``[nbytes]`` uint8 device buffer (the device seam's).
        read_back: ``read_back(buffer)`` -> its bytes in host memory (a tensor or anything ``bytes()`` takes).
        allow_compat: load straight into device memory in kvikio's compatibility mode too.
        kvikio: the module to use (default: ``import kvikio``).

    Returns:
        The :class:`GdsSetup` (``io_path == "posix"`` with the reason on any failure).
    """
    try:
        if kvikio is None:
            import kvikio
    except ImportError as exc:
        return GdsSetup("posix", f"kvikio not installed: {exc}")
    version = str(getattr(kvikio, "__version__", "")) or None
    try:
        compat = compat_mode(kvikio)
        if not compat and (driver := getattr(kvikio, "cufile_driver", None)) is not None \
                and hasattr(driver, "driver_open"):
            driver.driver_open()
    except Exception as exc:  # (a refused driver raises kvikio's own error types)
        return GdsSetup("posix", f"cuFile driver open failed: {type(exc).__name__}: {exc}", kvikio_version=version)
    path = Path(root) / f".gds-probe-{uuid.uuid4().hex}"
    data = os.urandom(_PROBE_BYTES)
    try:
        path.write_bytes(data)
        with kvikio.CuFile(str(path), "r") as f:
            for off, n in _PROBE_READS:
                buf = empty(n)
                got = f.pread(buf, n, off).get()
                landed = bytes(memoryview(_host_bytes(read_back(buf))))
                if got != n or landed != data[off:off + n]:
                    return GdsSetup("posix", f"probe read of {n} bytes at offset {off} returned {got} bytes that "
                                             "differ from the file", kvikio_version=version)
    except Exception as exc:
        return GdsSetup("posix", f"probe read failed: {type(exc).__name__}: {exc}", kvikio_version=version)
    finally:
        path.unlink(missing_ok=True)
    io_path = "compat" if compat else "gds"
    note = "" if not compat or allow_compat else "the POSIX bank path is as fast here and checks bytes without a copy back"
    return GdsSetup(io_path, note, device_loads=not compat or allow_compat, kvikio_version=version)


def gds_report(root: str | Path) -> dict[str, Any]:
    """What a worker with its KV cache on CUDA would find here, for ``range-connector doctor``: ``{"io_path",
    "reason", "line"}`` (``line``: :meth:`GdsSetup.describe`). Runs :func:`probe_gds` in ``root`` when kvikio and
    a CUDA device are present (on the first device, through torch), else reports why not. Never raises."""
    ok, reason = gds_status()
    if not ok:
        return {"io_path": "posix", "reason": reason,
                "line": f"off ({reason}): a KV cache on CUDA loads with POSIX into pinned banks"}
    import torch

    setup = probe_gds(root, empty=lambda n: torch.empty(n, dtype=torch.uint8, device="cuda"),
                      read_back=lambda buf: buf.cpu())
    return {"io_path": setup.io_path, "reason": setup.reason, "line": setup.describe()}


def _host_bytes(value: Any) -> Any:
    """A host tensor's bytes as a buffer (``numpy()`` of a uint8 tensor), or ``value`` itself."""
    numpy = getattr(value, "numpy", None)
    return numpy() if numpy is not None else value
