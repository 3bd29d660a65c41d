"""LMCache 0.5.6's multi-process (MP) cache server in a process group of its own, for the replay and the tests.

The server runs with the Python of LMCache's environment (``bash bench/setup_lmcache_env.sh`` builds
``.venv-lmcache``; LMCache never goes into the main environment: it downgrades numpy), with this checkout on its
``PYTHONPATH`` so that the Range L2 adapter (``range_connector.lmcache.adapter``) can be loaded by LMCache's
``plugin`` adapter type. vLLM reaches it through its ``LMCacheMPConnector``
(:meth:`LMCacheServer.kv_transfer_config`); the engine process needs LMCache's ``site-packages`` on its
``PYTHONPATH`` (:meth:`LMCacheServer.engine_pythonpath`).

Example::

    adapters = [range_l2_adapter(["valkey://127.0.0.1:6379"], deployment="bench")]
    with LMCacheServer(Path(".venv-lmcache"), run_dir / "mp.log", l1_size_gb=0.25, l2_adapters=adapters) as mp:
        kv_config = json.dumps(mp.kv_transfer_config())
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from range_connector.testing.processes import free_port

__all__ = ["LMCacheServer", "range_l2_adapter", "remove_orphan_kv_segments", "resp_l2_adapter"]

#: the line LMCache's MP server logs once it serves
READY_LINE = "cache server is running"
REPO = Path(__file__).resolve().parents[2]


def range_l2_adapter(urls: Sequence[str], *, deployment: str = "lmcache", **params: Any) -> dict[str, Any]:
    """LMCache's ``--l2-adapter`` mapping that selects the Range adapter on ``urls`` (one Valkey server per shard);
    ``params`` are more ``adapter_params`` (docs/lmcache.md)."""
    return {"type": "plugin", "module_path": "range_connector.lmcache.adapter", "class_name": "RangeL2Adapter",
            "adapter_params": {"type": "valkey", "servers": list(urls), "deployment": deployment, **params}}


def resp_l2_adapter(host: str, port: int, *, num_workers: int = 8, password: str = "") -> dict[str, Any]:
    """LMCache's ``--l2-adapter`` mapping of its own ``resp`` adapter (one Redis/Valkey server)."""
    return {"type": "resp", "host": host, "port": port, "num_workers": num_workers, "password": password}


class LMCacheServer:
    """``python -m lmcache.v1.multiprocess.server`` of ``venv`` on loopback, as a context manager.

    Args:
        venv: LMCache's environment (it has ``bin/python``).
        log_path: the server's stdout and stderr (appended).
        l1_size_gb: LMCache's L1 (its CPU memory tier) in GiB.
        l2_adapters: one ``--l2-adapter`` mapping per L2 adapter, in order (:func:`range_l2_adapter`,
            :func:`resp_l2_adapter`); empty: L1 only.
        chunk_tokens: LMCache's chunk size in tokens.
        timeout_s: longest wait for the server to serve, seconds.
        env: more environment variables of the server process.

    Raises:
        RuntimeError: ``venv`` has no ``bin/python`` (at construction), or the server exited or did not serve within
            ``timeout_s`` (on ``__enter__``: the message has its log's last lines).
    """

    def __init__(self, venv: Path, log_path: Path, *, l1_size_gb: float = 1.0,
                 l2_adapters: Sequence[Mapping[str, Any]] = (), chunk_tokens: int = 256, timeout_s: float = 120.0,
                 env: Mapping[str, str] | None = None) -> None:
        self.python = Path(venv) / "bin" / "python"
        if not self.python.exists():
            raise RuntimeError(f"{venv} has no bin/python (create it: bash bench/setup_lmcache_env.sh)")
        self.site_packages = next(iter(sorted((Path(venv) / "lib").glob("python3*/site-packages"))), None)
        self.port = free_port()
        self.log_path = Path(log_path)
        self.l1_size_gb = l1_size_gb
        self.l2_adapters = [dict(a) for a in l2_adapters]
        self.chunk_tokens = chunk_tokens
        self.timeout_s = timeout_s
        self.env = dict(env or {})
        self.process: subprocess.Popen[bytes] | None = None

    def command(self) -> list[str]:
        """The server's argument list (a Prometheus port of its own: LMCache's default, 9090, may be taken)."""
        cmd = [str(self.python), "-m", "lmcache.v1.multiprocess.server", "--host", "127.0.0.1", "--port",
               str(self.port), "--chunk-size", str(self.chunk_tokens), "--l1-size-gb", f"{self.l1_size_gb:g}",
               "--eviction-policy", "LRU", "--prometheus-port", str(free_port())]
        for adapter in self.l2_adapters:
            cmd += ["--l2-adapter", json.dumps(adapter)]
        return cmd

    def kv_transfer_config(self) -> dict[str, Any]:
        """vLLM's ``KVTransferConfig`` fields for ``LMCacheMPConnector`` against this server. ``lmcache_driven``
        transfers are the only mode LMCache's CPU server offers (with the default, ``auto``, vLLM's start-up times
        out in ``register_kv_caches``)."""
        return {"kv_connector": "LMCacheMPConnector", "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                "kv_connector_extra_config": {"lmcache.mp.host": "tcp://127.0.0.1", "lmcache.mp.port": self.port,
                                              "lmcache.mp.mq_timeout": 60,
                                              "lmcache.mp.mp_transfer_mode": "lmcache_driven"}}

    def engine_pythonpath(self) -> str:
        """``PYTHONPATH`` of a vLLM process that uses LMCache's connector: this checkout, then LMCache's
        ``site-packages`` (its packages, numpy 2.2 among them, then shadow the main environment's)."""
        return os.pathsep.join(str(p) for p in (REPO, self.site_packages) if p)

    def __enter__(self) -> LMCacheServer:
        remove_orphan_kv_segments()
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        env.update({"PYTHONPATH": str(REPO), **self.env})
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        start = self.log_path.stat().st_size if self.log_path.exists() else 0
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(self.command(), stdin=subprocess.DEVNULL, stdout=log,
                                            stderr=subprocess.STDOUT, env=env, start_new_session=True)
        deadline_s = time.monotonic() + self.timeout_s
        while READY_LINE not in self._log_since(start):
            if self.process.poll() is not None or time.monotonic() > deadline_s:
                rc = self.process.poll()
                self.stop()
                tail = " | ".join(self._log_since(start).splitlines()[-5:])
                raise RuntimeError(f"LMCache MP server not ready (exit {rc}): {tail}")
            time.sleep(0.25)
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self, timeout_s: float = 20.0) -> None:
        """SIGTERM to the server's process group; SIGKILL past ``timeout_s`` seconds; then remove the shared-memory
        segments that stopped LMCache engines left behind (:func:`remove_orphan_kv_segments`). Idempotent."""
        if self.process is None:
            return
        if self.process.poll() is None:
            try:
                os.killpg(self.process.pid, signal.SIGTERM)
                self.process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(timeout=5)
            except ProcessLookupError:
                pass
        remove_orphan_kv_segments()

    def _log_since(self, offset: int) -> str:
        with open(self.log_path, "rb") as f:
            f.seek(offset)
            return f.read().decode(errors="replace")


def remove_orphan_kv_segments(shm_dir: Path = Path("/dev/shm")) -> list[Path]:
    """Remove the ``lmcache_kv_<pid>_<n>`` segments of ``shm_dir`` whose process ``pid`` is gone.

    LMCache 0.5.6's CPU connector moves each engine worker's KV cache into POSIX shared memory named after the
    worker's pid (``lmcache/v1/platform/devices/cpu/shm.py``), so that its MP server maps the same pages, and unlinks
    it only from a finalizer, which never runs when the engine is killed. Measured here: one segment of the engine's
    KV-cache size left per killed engine (17 GiB after a day of benchmarks), until engines failed to allocate their
    KV cache. A segment of a live process is kept.

    Returns:
        The paths removed; one that cannot be removed is left (it is only memory).
    """
    removed = []
    for path in shm_dir.glob("lmcache_kv_*_*"):
        pid_text = path.name.split("_")[2]
        if not pid_text.isdigit() or _alive(int(pid_text)):
            continue
        try:
            path.unlink()
            removed.append(path)
        except OSError:
            pass
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True
