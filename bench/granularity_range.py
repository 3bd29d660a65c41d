"""Range's rows of the object-count sweep (``bench/granularity.py``): one :class:`RangeCase` per (tier, chunk size).

A case saves the payload once through a real ``RangeWorker`` registered on the source KV, looks the tickets up with a
real ``RangeScheduler`` and restores into the destination KV through a second ``RangeWorker``; each ``restore`` adds
one record to the case's row for that path (what is timed: the sweep's docstring). The sweep drives every case
through ``setup()``, ``restore(path, kind, cold)`` (``kind``: ``warmup``, ``timed`` or ``breakdown``) and
``close()``, and reads ``rows`` and ``error``. Also here: the Valkey server's command counts (:class:`ServerStats`),
which client the Valkey backend's data path uses, the file tier's backend factory and page-cache eviction, and the
hooks of the instrumented (breakdown) restore, which wrap Range's methods for that one restore and are removed after.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import bench_common  # noqa: F401  (puts the repository on sys.path)
import torch
from bench_kv_layout import BLOCK_SIZE, BYTES_PER_TOKEN_PER_LAYER, HEAD_SIZE, KV, NUM_KV_HEADS, NUM_LAYERS, Payload

from range_connector.backends.base import Backend
from range_connector.backends.memory import MemoryBackend
from range_connector.config import RangeConfig, TierConfig
from range_connector.kv.metadata import ChunkTransfer, RangeConnectorMetadata, RequestTransfer
from range_connector.kv.namespace import namespace_fingerprint, prefix_hash_chain
from range_connector.kv.tickets import ticket_key
from range_connector.scheduler.facade import RangeScheduler
from range_connector.worker.facade import RangeWorker

SERVER_IGNORED_COMMANDS = ("info", "config|get", "config", "ping", "flushall", "dbsize")


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
        tier = TierConfig(self.backend, timeout_s=300.0, capacity_bytes=0)
        # (save_mode "sync": the save batch is timed until it is stored, and the load reads what it reported)
        config = RangeConfig(tiers=(tier,), chunk_tokens=C, num_shards=1, load_deadline_s=600.0,
                             verify_checksums=True, save_mode="sync")
        info: dict[str, Any] = {}
        if self.backend == "memory":
            mem = MemoryBackend(capacity_bytes=None)
            saver_b, loader_b, lookup_b = mem, mem, None
            self.driven_by = ("RangeWorker.save / RangeScheduler.stored_prefix (DRAM index learnt from the saver's "
                              "build_worker_meta via update_connector_output) / RangeWorker.start_load; saver and "
                              "loader share one in-process MemoryBackend")
        elif self.backend == "valkey":
            from range_connector.backends.valkey.client import ValkeyBackend
            from range_connector.backends.valkey.urls import redact_url

            assert self.valkey_url
            access = getattr(self, "valkey_access", None)  # (set by --security: credentials, TLS files)
            saver_b = ValkeyBackend(self.valkey_url, timeout_s=300.0, access=access)
            loader_b = ValkeyBackend(self.valkey_url, timeout_s=300.0, access=access)
            lookup_b = ValkeyBackend(self.valkey_url, timeout_s=300.0, access=access)
            self.closers += [saver_b.close, loader_b.close]
            self.stats = ServerStats(getattr(self, "stats_url", None) or self.valkey_url)  # (the server itself)
            self.closers.append(self.stats.close)
            info = {"valkey_url": redact_url(self.valkey_url), "valkey_data_path": valkey_data_path()}
            self.driven_by = ("RangeWorker.save / RangeScheduler.stored_prefix (MGET of tickets) / "
                              "RangeWorker.start_load; saver, loader and scheduler each own a ValkeyBackend")
        elif self.backend == "file":
            saver_b, loader_b, lookup_b = self.file_factory(), self.file_factory(), self.file_factory()
            self.closers += [saver_b.close, loader_b.close]
            info = {"file_root": str(self.file_root)}
            self.driven_by = ("RangeWorker.save / RangeScheduler.stored_prefix / RangeWorker.start_load over "
                              "FileBackend instances on one directory")
        elif self.backend == "memory+valkey":  # a tier hierarchy: DRAM in front of the Valkey server
            from range_connector.backends.tiered import TieredBackend
            from range_connector.backends.valkey.client import ValkeyBackend

            assert self.valkey_url
            mem = MemoryBackend(capacity_bytes=None)
            far = [ValkeyBackend(self.valkey_url, timeout_s=300.0) for _ in range(3)]
            saver_b = TieredBackend([mem, far[0]], far_writes="sync")  # (every copy written before the restores)
            loader_b = TieredBackend([mem, far[1]])
            lookup_b = TieredBackend([None, far[2]])
            self.closers += [saver_b.close, loader_b.close]
            self.stats = ServerStats(self.valkey_url)
            self.closers.append(self.stats.close)
            config = dataclasses.replace(config, tiers=(TierConfig("memory", timeout_s=300.0, capacity_bytes=0),
                                                        TierConfig("valkey", timeout_s=300.0, capacity_bytes=0,
                                                                   index=1)), promote_after_hits=0)
            self.driven_by = ("RangeWorker.save (write-through) / RangeScheduler.stored_prefix (TieredLookup: the "
                              "DRAM index, then MGET of the tickets past it) / RangeWorker.start_load through one "
                              "TieredBackend per worker; the second half of the chunks is forgotten by DRAM")
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
        if self.backend == "memory+valkey":  # the second half leaves DRAM (its tickets; Valkey keeps it)
            half = self.hashes[self.n_chunks // 2:]
            mem.delete_tickets([ticket_key(h, 0) for h in half])
            self.sched.lookup.learn([], half)
        self.setup_info = info
        self.gen = torch.Generator().manual_seed(args.seed + 99)

    def restore(self, path: str, kind: str, cold: bool = False, chunk_range: tuple[int, int] | None = None) -> None:
        """One restore; ``kind``: ``warmup``, ``timed`` or ``breakdown`` (instrumented, not in the medians);
        ``chunk_range``: restore only chunks ``[lo, hi)`` (default all)."""
        lo, hi = chunk_range or (0, self.n_chunks)
        row = self.rows.get(path)
        if row is None:
            row = self.new_row(path)
            row["payload_bytes"] = self.args.payload_bytes * (hi - lo) // self.n_chunks
            row["chunk_range"] = [lo, hi]
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
                                     tickets[i]) for i in range(lo, hi))
        meta = RangeConnectorMetadata(loads=[RequestTransfer(f"load-{time.monotonic_ns()}", chunks,
                                                             (hi - lo) * self.C)])
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
        if not self.payload.equal_at(dst, dst_ids, lo * bpc, hi * bpc):
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
                busy_s = timers.get("verify_group_s", 0.0) + timers.get("copy_rows_s", 0.0)
                parts["consumer_wait_s"] = deliver_s - busy_s
                rest_s = t4 - t3 - deliver_s
            else:
                rest_s = t4 - t3 - sum(timers.values())
            row["breakdown"] = {"restore_s": t4 - t3, **parts, "rest_s": rest_s,
                                "note": "one extra instrumented restore, not part of the medians; read_ranges runs in "
                                        "Range's reader thread, beside the consumer's checksum (verify_group), "
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


#: (owner, method) timed by the instrumented round: the tier's reads (Range's reader thread: the socket receive,
#: into a bank or straight into the KV blocks), lent views, the checksum pass and the bank -> KV index copies (the
#: consumer: whoever calls ``wait_for_layer``), and the consumer's whole delivery (its waits for the reader are
#: ``deliver_through`` minus the other two). ``job`` and ``context`` hooks are set on the LoadJob and LoadContext
#: classes for the instrumented restore.
_HOOKS = (("backend", "read_ranges"), ("backend", "view_stripes"), ("loads", "verify_group"),
          ("context", "copy_rows"), ("job", "deliver_through"))
#: owners whose hooks are set on the class (LoadJob, LoadContext) or module (the checksum pass that loads.py calls),
#: not on one instance
_CLASS_OWNERS = ("job", "context", "loads")


def _hook_owner(owner_name: str, worker: RangeWorker, backend: Backend):
    if owner_name == "loads":
        import range_connector.worker.loads as loads_module

        return loads_module
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


class TieredCase(RangeCase):
    """DRAM in front of Valkey (``--tiers``): the payload saved through both tiers, its second half then forgotten
    by DRAM. Each round restores, in rotated order, the first half alone (from DRAM), the second half alone (from
    Valkey) and the whole payload (half from each, ``range_dram_valkey``), into the same destination."""

    PARTS = ("range_dram_half", "range_valkey_half", "range_dram_valkey")

    def __init__(self, chunk_tokens: int, args: argparse.Namespace, payload: Payload, valkey_url: str) -> None:
        super().__init__("memory+valkey", chunk_tokens, args, payload, valkey_url, None, None)
        self._round = 0

    def setup(self) -> None:
        if self.n_chunks < 2:
            raise ValueError(f"{self.n_chunks} chunk(s) of {self.C} tokens: no halves to restore (a larger payload)")
        super().setup()

    def restore(self, path: str, kind: str, cold: bool = False, chunk_range: tuple[int, int] | None = None) -> None:
        half = self.n_chunks // 2
        ranges = {"range_dram_half": (0, half), "range_valkey_half": (half, self.n_chunks),
                  "range_dram_valkey": (0, self.n_chunks)}
        k = self._round % 3
        self._round += 1
        for part in self.PARTS[k:] + self.PARTS[:k]:
            super().restore(part, kind, cold, chunk_range=ranges[part])
