"""Start and stop vLLM's OpenAI-compatible API server as a subprocess (demo, tests, benchmarks).

:class:`ServerProcess` runs ``python -m vllm.entrypoints.openai.api_server`` in its own process group (session),
so that :meth:`ServerProcess.stop` reaches the engine-core and worker processes vLLM spawns, and logs everything
to one file. :func:`connector_config` builds the ``--kv-transfer-config`` JSON that enables the Range connector;
:func:`check_model_dir` refuses, in one line, a local model directory vLLM could not serve. Requests to a running
server are :mod:`range_connector.testing.client`'s.

Example::

    with ServerProcess(model_dir, work_dir=tmp, kv_transfer_config=connector_config({})) as server:
        server.wait_ready(timeout_s=300)
        result = complete(server.base_url, prompt_token_ids=ids, max_tokens=16)
        hits = scrape_metrics(server.base_url).get("vllm:external_prefix_cache_hits_total", 0.0)
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

from range_connector.errors import ConfigError
from range_connector.plugin import CONNECTOR_NAME  # the name the plugin registers (``kv_connector``)
from range_connector.testing.processes import LOOPBACK_HOST, free_port, group_has_any, process_group_pids

__all__ = ["TOKENIZER_FILES", "ServerError", "ServerProcess", "check_model_dir", "connector_config"]


_HEALTH_POLL_INTERVAL_S = 0.5
_HEALTH_REQUEST_TIMEOUT_S = 2.0
_LOG_TAIL_LINES = 40
_STOP_POLL_INTERVAL_S = 0.1
_STOP_GRACE_READY_S = 30.0
_STOP_GRACE_STARTING_S = 5.0


class ServerError(RuntimeError):
    """The API server exited, or did not become ready in time; the message ends with the log's last lines."""


def connector_config(extra: Mapping[str, Any], role: str = "kv_both") -> str:
    """Build the JSON for ``--kv-transfer-config`` that enables the Range connector.

    Args:
        extra: ``kv_connector_extra_config`` (keys: docs/configuration.md).
        role: vLLM's ``kv_role``: ``"kv_both"``, ``"kv_producer"`` or ``"kv_consumer"``.

    Returns:
        Compact JSON text, with ``kv_load_failure_policy`` ``"recompute"`` (a failed load is recomputed, never
        fatal).
    """
    return json.dumps(
        {
            "kv_connector": CONNECTOR_NAME,
            "kv_role": role,
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": dict(extra),
        },
        separators=(",", ":"),
    )


TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "vocab.json")


def check_model_dir(model: str) -> None:
    """Fail early, in one line, for a local model directory vLLM could not serve (hub names pass unchecked).

    Raises:
        ConfigError: the directory has no ``config.json`` or no tokenizer file (names the directory).
    """
    path = Path(model).expanduser()
    if not path.exists():
        if model.startswith((".", "/", "~")) or os.sep in model and len(model.split("/")) != 2:
            raise ConfigError("model", f"{model}: no such directory")
        return  # a hub name like org/model: vLLM resolves it
    if not (path / "config.json").is_file():
        raise ConfigError("model", f"{path}: no config.json (not a Hugging Face model directory)")
    if not any((path / name).is_file() for name in TOKENIZER_FILES):
        raise ConfigError("model", f"{path}: no tokenizer ({', '.join(TOKENIZER_FILES)} all missing)")


class ServerProcess:
    """One ``vllm.entrypoints.openai.api_server`` subprocess.

    The server runs in a new session (its own process group) with ``--enforce-eager``, listening on ``host:port``,
    stdout and stderr appended to ``log_path``. Environment on top of this process's own: ``VLLM_CPU_KVCACHE_SPACE``,
    ``VLLM_CPU_NUM_OF_RESERVED_CPU=1`` (outputs with and without a connector are then bit-identical on CPU),
    optionally ``VLLM_CPU_OMP_THREADS_BIND``, and ``VLLM_CACHE_ROOT`` / ``TORCHINDUCTOR_CACHE_DIR`` under
    ``work_dir``.

    Args:
        model: Model directory (or name) passed to ``--model``.
        work_dir: Folder for the log and the vLLM/inductor caches; a new temporary folder when ``None``.
        port: TCP port; a free one when ``None``.
        host: Interface to bind.
        max_model_len: ``--max-model-len`` in tokens.
        block_size: ``--block-size`` in tokens (a multiple of 32 on CPU).
        kv_transfer_config: JSON for ``--kv-transfer-config`` (see :func:`connector_config`); no connector when
            ``None``.
        kvcache_space_gib: ``VLLM_CPU_KVCACHE_SPACE``, the KV-cache size in whole GiB.
        omp_threads_bind: ``VLLM_CPU_OMP_THREADS_BIND`` (e.g. ``"0"``); unset when ``None``.
        extra_args: More command-line arguments for the server.
        extra_env: More environment variables (e.g. ``{"VLLM_SERVER_DEV_MODE": "1"}``).
        log_path: Log file; ``<work_dir>/vllm-server-<port>.log`` when ``None``.
        python: Interpreter to run; this one when ``None``.

    The server starts on :meth:`start` (or on entering the ``with`` block); :meth:`wait_ready` waits for it and
    :meth:`stop` ends it and every process it started.
    """

    def __init__(
        self,
        model: str | os.PathLike[str],
        *,
        work_dir: str | os.PathLike[str] | None = None,
        port: int | None = None,
        host: str = LOOPBACK_HOST,
        max_model_len: int = 4096,
        block_size: int = 128,
        kv_transfer_config: str | None = None,
        kvcache_space_gib: int = 1,
        omp_threads_bind: str | None = None,
        extra_args: Sequence[str] = (),
        extra_env: Mapping[str, str] | None = None,
        log_path: str | os.PathLike[str] | None = None,
        python: str | None = None,
    ) -> None:
        self.model = str(model)
        check_model_dir(self.model)
        self.work_dir = Path(work_dir) if work_dir is not None else Path(tempfile.mkdtemp(prefix="range-vllm-"))
        self.host = host
        self.port = port if port is not None else free_port(host)
        self.max_model_len = max_model_len
        self.block_size = block_size
        self.kv_transfer_config = kv_transfer_config
        self.kvcache_space_gib = kvcache_space_gib
        self.omp_threads_bind = omp_threads_bind
        self.extra_args = list(extra_args)
        self.extra_env = dict(extra_env or {})
        self.log_path = Path(log_path) if log_path is not None else self.work_dir / f"vllm-server-{self.port}.log"
        self.python = python or sys.executable
        self.process: subprocess.Popen[bytes] | None = None
        self.started_at_s: float | None = None  # time.monotonic() at start
        self.ready = False  # set once /health answered 200

    # ------------------------------------------------------------------------------------------------ properties
    @property
    def base_url(self) -> str:
        """``http://host:port`` of the server."""
        return f"http://{self.host}:{self.port}"

    @property
    def pid(self) -> int | None:
        """Pid of the API server process (also its process group id); ``None`` before :meth:`start`."""
        return None if self.process is None else self.process.pid

    @property
    def returncode(self) -> int | None:
        """Exit status of the API server process; ``None`` while it runs or before :meth:`start`."""
        return None if self.process is None else self.process.poll()

    def command(self) -> list[str]:
        """The server's command line."""
        cmd = [
            self.python, "-m", "vllm.entrypoints.openai.api_server",
            "--model", self.model,
            "--host", self.host,
            "--port", str(self.port),
            "--enforce-eager",
            "--max-model-len", str(self.max_model_len),
            "--block-size", str(self.block_size),
        ]  # fmt: skip
        if self.kv_transfer_config is not None:
            cmd += ["--kv-transfer-config", self.kv_transfer_config]
        return cmd + self.extra_args

    def environment(self) -> dict[str, str]:
        """The server's environment: this process's plus the variables described in the class docstring."""
        env = dict(os.environ)
        env["VLLM_CPU_KVCACHE_SPACE"] = str(self.kvcache_space_gib)
        env["VLLM_CPU_NUM_OF_RESERVED_CPU"] = "1"
        if self.omp_threads_bind is not None:
            env["VLLM_CPU_OMP_THREADS_BIND"] = self.omp_threads_bind
        env["VLLM_CACHE_ROOT"] = str(self.work_dir / "vllm-cache")
        env["TORCHINDUCTOR_CACHE_DIR"] = str(self.work_dir / "torchinductor-cache")
        env.update(self.extra_env)
        return env

    # ------------------------------------------------------------------------------------------------ lifecycle
    def start(self) -> ServerProcess:
        """Start the server (returns at once; see :meth:`wait_ready`).

        Returns:
            ``self``.

        Raises:
            RuntimeError: Already started.
            OSError: The interpreter cannot be run or the log cannot be written.
        """
        if self.process is not None:
            raise RuntimeError(f"server on port {self.port} already started (pid {self.process.pid})")
        self.work_dir.mkdir(parents=True, exist_ok=True)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log_file:
            log_file.write(f"$ {' '.join(self.command())}\n".encode())
            log_file.flush()
            self.process = subprocess.Popen(
                self.command(),
                stdin=subprocess.DEVNULL,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                env=self.environment(),
                start_new_session=True,  # own process group: stop() signals engine core and workers too
                close_fds=True,
            )
        self.started_at_s = time.monotonic()
        return self

    def wait_ready(self, timeout_s: float = 300.0) -> float:
        """Wait until ``GET /health`` answers 200.

        Args:
            timeout_s: Longest wait in seconds, counted from this call.

        Returns:
            Seconds since :meth:`start` (start-up time).

        Raises:
            ServerError: The process exited, or ``timeout_s`` passed; the message holds the log's last 40 lines.
        """
        import httpx

        if self.process is None:
            raise RuntimeError("wait_ready() before start()")
        deadline_s = time.monotonic() + timeout_s
        with httpx.Client(timeout=_HEALTH_REQUEST_TIMEOUT_S) as client:
            while True:
                code = self.process.poll()
                if code is not None:
                    raise ServerError(
                        f"vLLM server on port {self.port} exited with code {code} before it was ready; "
                        f"log {self.log_path}, last lines:\n{self.log_tail()}"
                    )
                try:
                    if client.get(f"{self.base_url}/health").status_code == 200:
                        assert self.started_at_s is not None
                        self.ready = True
                        return time.monotonic() - self.started_at_s
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline_s:
                    raise ServerError(
                        f"vLLM server on port {self.port} (pid {self.process.pid}) not ready within {timeout_s:g} s; "
                        f"log {self.log_path}, last lines:\n{self.log_tail()}"
                    )
                time.sleep(_HEALTH_POLL_INTERVAL_S)

    def wait_exit(self, timeout_s: float) -> int | None:
        """Wait for the API server process to exit on its own.

        Args:
            timeout_s: Longest wait in seconds.

        Returns:
            Its exit status, or ``None`` if it still runs after ``timeout_s``.
        """
        if self.process is None:
            raise RuntimeError("wait_exit() before start()")
        try:
            return self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return None

    def stop(self, timeout_s: float | None = None) -> int | None:
        """Stop the server and every process of its group; idempotent.

        Sends SIGTERM to the process group, waits up to ``timeout_s`` for the whole group to exit, then sends
        SIGKILL to whatever is left and waits again (5 s).

        Args:
            timeout_s: Grace period after SIGTERM, in seconds. Default: 30 s for a server that answered
                ``/health``, 5 s for one still starting (vLLM's API server ignores SIGTERM until its engine is up;
                the engine processes themselves exit on the SIGTERM at once).

        Returns:
            The API server's exit status (``None`` if never started).

        Raises:
            ServerError: Processes of the group survived SIGKILL (their pids are named).
        """
        if self.process is None:
            return None
        if timeout_s is None:
            timeout_s = _STOP_GRACE_READY_S if self.ready else _STOP_GRACE_STARTING_S
        pgid = self.process.pid
        if self.process.poll() is None or process_group_pids(pgid):
            self._signal_group(pgid, signal.SIGTERM)
            if not self._wait_group_gone(pgid, timeout_s):
                self._signal_group(pgid, signal.SIGKILL)
                if not self._wait_group_gone(pgid, 5.0):
                    raise ServerError(
                        f"processes {process_group_pids(pgid)} of vLLM server group {pgid} survived SIGKILL"
                    )
        self._wait_zombies_reaped(pgid, 2.0)
        return self.process.wait()

    @staticmethod
    def _wait_zombies_reaped(pgid: int, timeout_s: float) -> None:
        """Give init a moment to reap exited group members (cosmetic: ``ps`` then shows nothing at all)."""
        deadline_s = time.monotonic() + timeout_s
        while group_has_any(pgid) and time.monotonic() < deadline_s:
            time.sleep(_STOP_POLL_INTERVAL_S)

    def _wait_group_gone(self, pgid: int, timeout_s: float) -> bool:
        assert self.process is not None
        deadline_s = time.monotonic() + timeout_s
        while True:
            self.process.poll()  # reap the leader so that it does not linger as a zombie
            if self.process.returncode is not None and not process_group_pids(pgid):
                return True
            if time.monotonic() > deadline_s:
                return False
            time.sleep(_STOP_POLL_INTERVAL_S)

    @staticmethod
    def _signal_group(pgid: int, signum: signal.Signals) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signum)

    def log_tail(self, num_lines: int = _LOG_TAIL_LINES) -> str:
        """Return the last ``num_lines`` lines of the log ("" when unreadable)."""
        try:
            with open(self.log_path, "rb") as log_file:
                lines = collections.deque(log_file, maxlen=num_lines)
        except OSError:
            return ""
        return b"".join(lines).decode("utf-8", errors="replace")

    def log_text(self) -> str:
        """Return the whole log ("" when unreadable)."""
        try:
            return self.log_path.read_text(encoding="utf-8", errors="replace")
        except OSError:
            return ""

    def __enter__(self) -> ServerProcess:
        if self.process is None:
            self.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

