"""The processes behind the demo and the fleet runner: engines, the proxy, their cleanup, and a primed replay.

Shared by :mod:`range_connector.bench.demo` (P/D and one engine) and :mod:`range_connector.bench.fleet` (engines
behind the prefix-aware or round-robin proxy), so both run their engines with the same settings: block size
:data:`BLOCK_TOKENS`, Range chunks of :data:`CHUNK_TOKENS` (one block per shard), ``max_model_len``
:data:`MAX_MODEL_LEN_TOKENS`, ``--enforce-eager``, cached tokens in the client's usage (:data:`ENGINE_ARGS`).
Everything a :class:`Cleanup` holds is stopped when it unwinds, also on a second Ctrl-C or SIGTERM.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from range_connector.testing.client import complete
from range_connector.testing.processes import free_port
from range_connector.testing.server_process import ServerProcess

if TYPE_CHECKING:
    from range_connector.bench.replay import ReplayReport, ReplayRequest
    from range_connector.bench.traces import Trace

__all__ = ["BLOCK_TOKENS", "CHUNK_TOKENS", "ENGINE_ARGS", "MAX_MODEL_LEN_TOKENS", "NUM_SHARDS", "PROXY_TIMEOUT_S",
           "REQUEST_TIMEOUT_S", "STARTUP_TIMEOUT_S", "Cleanup", "DemoError", "ProxyProcess", "engine_server", "log",
           "one_line", "replay_primed"]

NUM_SHARDS = 2
BLOCK_TOKENS = 64
CHUNK_TOKENS = NUM_SHARDS * BLOCK_TOKENS
MAX_MODEL_LEN_TOKENS = 4096
STARTUP_TIMEOUT_S = 600.0
PROXY_TIMEOUT_S = 60.0
REQUEST_TIMEOUT_S = 300.0
ENGINE_ARGS = ("--enable-prompt-tokens-details",)  # cached tokens per request in the client's usage

_T0 = time.monotonic()


class DemoError(RuntimeError):
    """A step of the demo or the fleet failed; the message is one line."""


def log(message: str) -> None:
    """Print one progress line, stamped with the clock and the seconds since this module was imported."""
    print(f"[{time.strftime('%H:%M:%S')} +{time.monotonic() - _T0:5.0f}s] {message}", flush=True)


def one_line(text: str, limit: int = 400) -> str:
    """``text`` with its whitespace runs as single spaces, cut to ``limit`` characters (``...`` marks a cut)."""
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[:limit] + "..."


class Cleanup(contextlib.ExitStack):
    """An ExitStack whose unwinding (stopping processes) is not cut short by a second Ctrl-C or SIGTERM."""

    def __exit__(self, *exc: Any) -> bool:
        previous = {s: signal.signal(s, signal.SIG_IGN) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            return super().__exit__(*exc)
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler)


class ProxyProcess:
    """``range-connector proxy`` as a subprocess in its own process group, logging to ``log_path``.

    Args:
        engine_args: The proxy's engine options, e.g. ``["--prefill", url, "--decode", url]`` or
            ``["--engine", url, "--engine", url, "--policy", "prefix_aware"]``.
        log_path: File for the proxy's output.
    """

    def __init__(self, engine_args: list[str], log_path: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self.command = [sys.executable, "-c", "import sys; from range_connector.cli import main; sys.exit(main())",
                        "proxy", *engine_args, "--port", str(self.port),
                        "--health-interval-s", "2", "--timeout-s", str(REQUEST_TIMEOUT_S)]
        self.process: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> ProxyProcess:
        with open(self.log_path, "ab") as log_file:
            self.process = subprocess.Popen(self.command, stdin=subprocess.DEVNULL, stdout=log_file,
                                            stderr=subprocess.STDOUT, start_new_session=True)
        return self

    def wait_ready(self, timeout_s: float) -> None:
        """Wait until ``GET /health`` answers 200.

        Raises:
            DemoError: The proxy exited, or did not answer within ``timeout_s`` seconds.
        """
        import httpx

        if self.process is None:
            raise RuntimeError("wait_ready() before the proxy was started")
        deadline_s = time.monotonic() + timeout_s
        while True:
            if self.process.poll() is not None:
                raise DemoError(f"proxy exited with code {self.process.returncode}: "
                                f"{one_line(self.log_path.read_text(errors='replace')[-400:])} (log {self.log_path})")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{self.url}/health", timeout=2.0).status_code == 200:
                    return
            if time.monotonic() > deadline_s:
                raise DemoError(f"proxy {self.url} not healthy within {timeout_s:g} s (log {self.log_path})")
            time.sleep(0.3)

    def __exit__(self, *exc: object) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGTERM)
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout=5)


def engine_server(model_dir: Path, run_dir: Path, name: str, core: str, kv_cache_gib: int,
                  kv_config: str | None) -> ServerProcess:
    """An engine with the shared settings (not started): work folder ``run_dir/name``, log ``run_dir/name.log``.

    Args:
        model_dir: The model.
        run_dir: Where its work folder and log go.
        name: Its name (``prefill``, ``decode``, ``none``, ``engine0``, ...).
        core: ``VLLM_CPU_OMP_THREADS_BIND`` (``"0"``: core 0).
        kv_cache_gib: Its KV cache, GiB.
        kv_config: ``--kv-transfer-config`` JSON (:func:`range_connector.testing.server_process.connector_config`),
            or ``None`` for no connector.
    """
    return ServerProcess(model_dir, work_dir=run_dir / name, block_size=BLOCK_TOKENS,
                         max_model_len=MAX_MODEL_LEN_TOKENS, kv_transfer_config=kv_config,
                         kvcache_space_gib=kv_cache_gib, omp_threads_bind=core, extra_args=ENGINE_ARGS,
                         log_path=run_dir / f"{name}.log")


def replay_primed(url: str, requests: list[ReplayRequest], trace: Trace, label: str, metrics_urls: list[str],
                  prime: list[int]) -> ReplayReport:
    """Send the priming prompt to ``url`` (one-off first-request costs), then replay ``requests`` through it
    (:func:`range_connector.bench.replay.run_replay`, with progress lines), reading ``metrics_urls`` around it.

    Returns:
        The :class:`range_connector.bench.replay.ReplayReport` labelled ``label``.
    """
    from range_connector.bench.replay import run_replay

    complete(url, prompt_token_ids=prime, max_tokens=2, timeout_s=REQUEST_TIMEOUT_S)  # one-off first-request costs
    log(f"{label}: replaying {len(requests)} requests over {trace.describe()['duration_s']:.0f} s of arrivals")
    return run_replay(url, requests, metrics_urls=metrics_urls, label=label, trace=trace,
                      request_timeout_s=REQUEST_TIMEOUT_S, progress=True)
