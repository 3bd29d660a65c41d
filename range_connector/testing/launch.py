"""Start and drive vLLM's OpenAI-compatible API server as a subprocess (demo, tests, benchmarks).

:class:`ServerProcess` runs ``python -m vllm.entrypoints.openai.api_server`` in its own process group (session),
so that :meth:`ServerProcess.stop` reaches the engine-core and worker processes vLLM spawns, and logs everything
to one file. :func:`connector_config` builds the ``--kv-transfer-config`` JSON that enables the Range connector.
:func:`complete` sends one streamed completion and measures time to first token; :func:`scrape_metrics` reads
vLLM's Prometheus ``/metrics``.

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
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

from range_connector.errors import ConfigError
from range_connector.plugin import CONNECTOR_NAME  # the name the plugin registers (``kv_connector``)

__all__ = [
    "CONNECTOR_NAME",
    "CompletionResult",
    "ServerError",
    "ServerProcess",
    "complete",
    "connector_config",
    "free_port",
    "process_group_pids",
    "reset_prefix_cache",
    "scrape_metrics",
    "wait_for_metric",
]


_LOOPBACK_HOST = "127.0.0.1"
_HEALTH_POLL_INTERVAL_S = 0.5
_HEALTH_REQUEST_TIMEOUT_S = 2.0
_LOG_TAIL_LINES = 40
_STOP_POLL_INTERVAL_S = 0.1
_STOP_GRACE_READY_S = 30.0
_STOP_GRACE_STARTING_S = 5.0


class ServerError(RuntimeError):
    """The API server exited, or did not become ready in time; the message ends with the log's last lines."""


def free_port(host: str = _LOOPBACK_HOST) -> int:
    """Return a TCP port that was free on ``host`` a moment ago.

    Another program may take it before the server binds it; :meth:`ServerProcess.wait_ready` then reports the
    server's exit with its log.

    Args:
        host: Interface to probe.

    Returns:
        A port number in the kernel's ephemeral range.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def connector_config(extra: Mapping[str, Any], role: str = "kv_both") -> str:
    """Build the JSON for ``--kv-transfer-config`` that enables the Range connector.

    Args:
        extra: ``kv_connector_extra_config`` (keys: :data:`range_connector.config.CONFIG_KEYS`).
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


def _group_has_any(pgid: int) -> bool:
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
        host: str = _LOOPBACK_HOST,
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
        while _group_has_any(pgid) and time.monotonic() < deadline_s:
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


# ---------------------------------------------------------------------------------------------------- requests
@dataclass
class CompletionResult:
    """One completion as seen by the client.

    Attributes:
        text: Generated text (all choices' text joined, normally one choice).
        token_ids: Generated token ids, when the server returned them (``return_token_ids``); else ``None``.
        token_texts: Text of each streamed chunk that carried output (one per token when streaming, one in all
            otherwise).
        ttft_s: Seconds from sending the request to the first streamed chunk with output (for ``stream=False``,
            the whole latency).
        latency_s: Seconds from sending the request to the end of the response.
        prompt_tokens: Prompt length in tokens reported in ``usage``; ``None`` if absent.
        completion_tokens: Generated tokens reported in ``usage``; ``None`` if absent.
        cached_tokens: ``usage.prompt_tokens_details.cached_tokens`` (only with
            ``--enable-prompt-tokens-details``); ``None`` if absent.
        finish_reason: ``"length"``, ``"stop"``, ... of the (last) choice.
        prompt_token_ids: Prompt token ids echoed by the server (``return_token_ids``); ``None`` if absent.
    """

    text: str
    token_ids: list[int] | None
    token_texts: list[str]
    ttft_s: float
    latency_s: float
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None
    finish_reason: str | None = None
    prompt_token_ids: list[int] | None = field(default=None, repr=False)


def complete(
    base_url: str,
    prompt_token_ids: Sequence[int] | None = None,
    prompt: str | None = None,
    max_tokens: int = 16,
    stream: bool = True,
    *,
    temperature: float = 0.0,
    ignore_eos: bool = False,
    model: str | None = None,
    timeout_s: float = 600.0,
    extra_body: Mapping[str, Any] | None = None,
) -> CompletionResult:
    """Send one ``/v1/completions`` request (greedy by default) and time it.

    Args:
        base_url: ``http://host:port`` of the server.
        prompt_token_ids: Prompt as token ids (preferred: no tokenizer round trip); exclusive with ``prompt``.
        prompt: Prompt as text.
        max_tokens: Tokens to generate.
        stream: Stream the answer (server-sent events) to measure time to first token.
        temperature: Sampling temperature; 0 is greedy.
        ignore_eos: Keep generating past the end-of-sequence token (a fixed number of tokens).
        model: ``model`` field; the server's only model when ``None``.
        timeout_s: Read timeout of the request in seconds.
        extra_body: More request fields (vLLM sampling extensions, ...).

    Returns:
        The generated text and token ids with client-side timings in seconds.

    Raises:
        ValueError: Neither or both of ``prompt_token_ids`` and ``prompt`` given.
        httpx.HTTPStatusError: The server answered with an error status (the body is in the message).
        httpx.HTTPError: Connection or protocol failure.
    """
    import httpx

    if (prompt_token_ids is None) == (prompt is None):
        raise ValueError("give exactly one of prompt_token_ids and prompt")
    body: dict[str, Any] = {
        "prompt": list(prompt_token_ids) if prompt_token_ids is not None else prompt,
        "max_tokens": max_tokens,
        "temperature": temperature,
        "stream": stream,
        "return_token_ids": True,
    }
    if ignore_eos:
        body["ignore_eos"] = True
    if model is not None:
        body["model"] = model
    if stream:
        body["stream_options"] = {"include_usage": True}
    body.update(extra_body or {})
    url = f"{base_url.rstrip('/')}/v1/completions"
    timeout = httpx.Timeout(timeout_s, connect=10.0)
    texts: list[str] = []
    token_ids: list[int] = []
    saw_token_ids = False
    usage: dict[str, Any] = {}
    finish_reason: str | None = None
    echoed_prompt_ids: list[int] | None = None
    ttft_s: float | None = None
    with httpx.Client(timeout=timeout) as client:
        t0 = time.perf_counter()
        if not stream:
            response = client.post(url, json=body)
            _raise_for_status(response)
            latency_s = time.perf_counter() - t0
            doc = response.json()
            for choice in doc.get("choices", []):
                texts.append(choice.get("text") or "")
                if choice.get("token_ids") is not None:
                    saw_token_ids = True
                    token_ids.extend(choice["token_ids"])
                if choice.get("prompt_token_ids") is not None:
                    echoed_prompt_ids = list(choice["prompt_token_ids"])
                finish_reason = choice.get("finish_reason") or finish_reason
            usage = doc.get("usage") or {}
            ttft_s = latency_s
        else:
            with client.stream("POST", url, json=body) as response:
                if response.status_code >= 400:
                    response.read()
                    _raise_for_status(response)
                for line in response.iter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[len("data:"):].strip()
                    if data == "[DONE]":
                        break
                    chunk = json.loads(data)
                    if chunk.get("usage"):
                        usage = chunk["usage"]
                    for choice in chunk.get("choices") or []:
                        text = choice.get("text") or ""
                        ids = choice.get("token_ids")
                        if choice.get("prompt_token_ids") is not None:
                            echoed_prompt_ids = list(choice["prompt_token_ids"])
                        if text or ids:
                            if ttft_s is None:
                                ttft_s = time.perf_counter() - t0
                            texts.append(text)
                        if ids is not None:
                            saw_token_ids = True
                            token_ids.extend(ids)
                        finish_reason = choice.get("finish_reason") or finish_reason
            latency_s = time.perf_counter() - t0
            if ttft_s is None:
                ttft_s = latency_s
    details = usage.get("prompt_tokens_details") or {}
    return CompletionResult(
        text="".join(texts),
        token_ids=token_ids if saw_token_ids else None,
        token_texts=texts,
        ttft_s=ttft_s,
        latency_s=latency_s,
        prompt_tokens=usage.get("prompt_tokens"),
        completion_tokens=usage.get("completion_tokens"),
        cached_tokens=details.get("cached_tokens"),
        finish_reason=finish_reason,
        prompt_token_ids=echoed_prompt_ids,
    )


def _raise_for_status(response: Any) -> None:
    import httpx

    if response.status_code >= 400:
        raise httpx.HTTPStatusError(
            f"{response.request.method} {response.request.url} -> {response.status_code}: {response.text[:2000]}",
            request=response.request,
            response=response,
        )


def scrape_metrics(base_url: str, timeout_s: float = 10.0) -> dict[str, float]:
    """Read vLLM's Prometheus ``/metrics`` and sum the samples of each sample name over all label sets.

    Args:
        base_url: ``http://host:port`` of the server.
        timeout_s: Request timeout in seconds.

    Returns:
        Sample name (e.g. ``"vllm:external_prefix_cache_hits_total"``, ``"vllm:prompt_tokens_total"``) -> sum of
        its values (counters in their own unit: tokens for the prefix-cache counters).

    Raises:
        httpx.HTTPError: The server could not be reached or answered with an error status.
    """
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    response = httpx.get(f"{base_url.rstrip('/')}/metrics", timeout=timeout_s)
    response.raise_for_status()
    totals: dict[str, float] = collections.defaultdict(float)
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            if sample.name.endswith("_created"):  # creation timestamps: summing them means nothing
                continue
            totals[sample.name] += float(sample.value)
    return dict(totals)


def wait_for_metric(
    base_url: str, name: str, at_least: float, *, timeout_s: float = 10.0, poll_interval_s: float = 0.2
) -> dict[str, float]:
    """Scrape ``/metrics`` until sample ``name`` reaches ``at_least`` (vLLM publishes step stats asynchronously).

    Args:
        base_url: ``http://host:port`` of the server.
        name: Sample name, e.g. ``"vllm:prompt_tokens_total"``.
        at_least: Value to wait for.
        timeout_s: Longest wait in seconds; the last scrape is returned when it passes.
        poll_interval_s: Pause between scrapes in seconds.

    Returns:
        The last scrape (see :func:`scrape_metrics`), whether or not ``name`` reached ``at_least``.
    """
    deadline_s = time.monotonic() + timeout_s
    while True:
        metrics = scrape_metrics(base_url)
        if metrics.get(name, 0.0) >= at_least or time.monotonic() > deadline_s:
            return metrics
        time.sleep(poll_interval_s)


def reset_prefix_cache(base_url: str, *, reset_external: bool = False, timeout_s: float = 30.0) -> bool:
    """Empty vLLM's own (local) prefix cache through ``POST /reset_prefix_cache``.

    The route exists only when the server runs with ``VLLM_SERVER_DEV_MODE=1``.

    Args:
        base_url: ``http://host:port`` of the server.
        reset_external: Also ask the KV connector to reset its cache (``?reset_external=true``).
        timeout_s: Request timeout in seconds.

    Returns:
        The server's ``success`` flag (``False`` while blocks are still held by running requests).

    Raises:
        httpx.HTTPStatusError: The route is missing (404: no dev mode) or failed.
    """
    import httpx

    response = httpx.post(
        f"{base_url.rstrip('/')}/reset_prefix_cache",
        params={"reset_external": "true" if reset_external else "false"},
        timeout=timeout_s,
    )
    response.raise_for_status()
    try:
        return bool(response.json().get("success", True))
    except ValueError:  # older servers answer 200 with an empty body
        return True


def _sigterm_as_keyboard_interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def unwind_on_sigterm() -> None:
    """Make SIGTERM unwind the main thread like Ctrl-C, so the ``finally`` blocks of a script (a benchmark) stop the
    servers it started instead of leaving them running."""
    signal.signal(signal.SIGTERM, _sigterm_as_keyboard_interrupt)
