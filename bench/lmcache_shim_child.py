"""The child side of ``bench/lmcache_shim.py``: one path, in a process of its own, under a watchdog.

:func:`_child_main` runs the path that its spec names (the parent passes the spec as JSON in ``--child-spec``),
saves the result JSON after every phase and every repeat (so a child that is killed leaves a partial result), and
ends the process with ``os._exit`` (LMCache leaves non-daemon threads behind). :class:`_PathBench` holds the KV
tensors, the shim's final copy into the destination blocks, verification and the timing loop; a path is an object
with ``layered``, ``describe()``, ``setup()``, ``store()``, ``lookup()`` (tokens found), ``restore()`` (client
counts), ``release()`` and ``close()`` (a status string), from ``bench/lmcache_shim_lmcache_paths.py`` and
``bench/lmcache_shim_reference_paths.py``.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
import traceback
from typing import Any

from lmcache_shim_common import _aggregate, _Unsupported, _ValkeyStats
from lmcache_shim_lmcache_paths import _LMCacheEngineImpl, _MPL2Impl, _MPL2RangeImpl
from lmcache_shim_reference_paths import _PlainValkeyImpl, _ResidentImpl

# --------------------------------------------------------------------------------------------------------------
# Child side: one path.
# --------------------------------------------------------------------------------------------------------------


class _Watchdog:
    """Ends the process (after saving the partial result) when a phase outlives its deadline."""

    def __init__(self, report: "_Report", timeout_s: float) -> None:
        self._report = report
        self._timeout_s = timeout_s
        self._deadline: float | None = None
        self._lock = threading.Lock()
        threading.Thread(target=self._run, daemon=True, name="shim-watchdog").start()

    def phase(self, name: str) -> None:
        with self._lock:
            self._report.doc["phase"] = name
            self._deadline = time.monotonic() + self._timeout_s
        self._report.save()

    def idle(self) -> None:
        with self._lock:
            self._deadline = None

    def _run(self) -> None:
        while True:
            time.sleep(0.2)
            with self._lock:
                expired = self._deadline is not None and time.monotonic() > self._deadline
            if expired:
                phase = self._report.doc.get("phase")
                if phase == "close" and self._report.doc.get("status") == "ok":
                    self._report.doc["close"] = f"timeout after {self._timeout_s} s"
                else:
                    self._report.doc["status"] = "timeout"
                    self._report.doc["reason"] = f"phase {phase} exceeded {self._timeout_s} s (op timeout)"
                for _ in range(5):  # the main thread may be changing the doc right now
                    try:
                        self._report.save()
                        break
                    except RuntimeError:
                        time.sleep(0.01)
                os._exit(3)


class _Report:
    def __init__(self, out: str, base: dict[str, Any]) -> None:
        self.out = out
        self.doc = dict(base)
        self._lock = threading.Lock()

    def save(self) -> None:
        with self._lock:
            tmp = self.out + ".tmp"
            with open(tmp, "w") as f:
                json.dump(self.doc, f, indent=1)
            os.replace(tmp, self.out)


def _child_main(spec: dict[str, Any]) -> int:
    layout = spec["layout"]
    report = _Report(spec["out"], {
        "path": spec["path"], "status": "running", "phase": "start", "granularity": layout["granularity"],
        "chunk_tokens": layout["chunk_tokens"], "num_objects": layout["num_objects"],
        "object_bytes": layout["object_bytes"], "payload_bytes": layout["payload_bytes"],
    })
    watchdog = _Watchdog(report, spec["op_timeout_s"])
    watchdog.phase("import")
    try:
        bench = _PathBench(spec, report, watchdog)
        bench.run()
        report.doc["status"] = report.doc.get("status") if report.doc.get("status") != "running" else "ok"
    except _Unsupported as exc:
        report.doc["status"] = "unsupported"
        report.doc["reason"] = str(exc)
    except Exception as exc:  # report, do not hang
        report.doc["status"] = "error"
        report.doc["reason"] = f"{type(exc).__name__}: {exc}"
        report.doc["traceback"] = traceback.format_exc()[-4000:]
    watchdog.idle()
    report.save()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # LMCache leaves non-daemon threads behind; never wait for them


class _PathBench:
    """Shared machinery: KV tensors, destination scatter, verification, timing loop."""

    def __init__(self, spec: dict[str, Any], report: _Report, watchdog: _Watchdog) -> None:
        import torch

        self.torch = torch
        if spec.get("torch_threads"):
            torch.set_num_threads(spec["torch_threads"])
        report.doc["torch_threads"] = torch.get_num_threads()
        self.spec = spec
        self.report = report
        self.wd = watchdog
        self.lay = lay = spec["layout"]
        self.path = spec["path"]
        self.L = lay["num_layers"]
        self.B = lay["kv_bytes_per_token_per_layer"]
        self.C = lay["chunk_tokens"]
        self.T = lay["payload_tokens"]
        self.nb = lay["payload_blocks"]
        self.block_words = lay["block_bytes_per_layer"] // 8  # int64 words per block per layer
        self.tag = f"lmcshim{os.getpid()}"
        torch.manual_seed(spec["seed"])
        self.gen = torch.Generator().manual_seed(spec["seed"])
        heads, bs, last = lay["num_kv_heads"], lay["block_size"], 2 * lay["head_size"]
        self.view_shape = (heads, bs, last)

        # Source: the payload in blocks 0..nb-1 of every layer; one shared layer-major buffer.
        self.src_buf, self.src_layers = self._alloc_kv(self.nb)
        self.src_buf.view(torch.int64).random_(generator=self.gen)
        # The payload as [L, T*B/8] int64: layer l, tokens in block order (blocks 0..nb-1 are contiguous).
        self.src_image = self.src_buf.view(torch.int64).view(self.L, self.nb * self.block_words)
        # Destination: fresh tensors with dst_block_factor * nb blocks; the payload lands on shuffled block ids.
        self.dst_nb = self.nb * spec["dst_block_factor"]
        self.dst_buf, self.dst_layers = self._alloc_kv(self.dst_nb)
        self.dst_rows = [t.view(torch.int64).view(self.dst_nb, self.block_words) for t in self.dst_layers]
        self.dst_ids = torch.arange(self.nb)
        # Per-layer staging (one layer of the payload), reused layer after layer.
        self.stage_layer = torch.empty(self.nb * self.block_words, dtype=torch.int64)
        self.stage_all: Any = None
        self.copy_mode = spec["copy_mode"]
        report.doc["copy_mode"] = self.copy_mode
        self.layer_done: list[float] = []
        self.copy_s = 0.0
        self.copy_ops = 0

    # ---- KV tensors -------------------------------------------------------------------------------------

    def _alloc_kv(self, num_blocks: int):
        torch = self.torch
        per_layer = num_blocks * self.block_words * 8
        buf = torch.zeros(self.L * per_layer, dtype=torch.uint8)
        layers = [
            buf[l * per_layer:(l + 1) * per_layer].view(torch.bfloat16).view(num_blocks, *self.view_shape)
            for l in range(self.L)
        ]
        return buf, layers

    def new_destination(self, repeat: int) -> None:
        torch = self.torch
        self.dst_buf.zero_()
        g = torch.Generator().manual_seed(self.spec["seed"] + 1000 + repeat)
        self.dst_ids = torch.randperm(self.dst_nb, generator=g)[: self.nb].contiguous()
        self.layer_done = []
        self.copy_s = 0.0
        self.copy_ops = 0

    # ---- the shim's final copy: one index copy per layer --------------------------------------------------

    def scatter_layer(self, layer: int, rows) -> None:
        """rows: [nb, block_words] int64 in payload block order -> destination blocks dst_ids of `layer`."""
        t = time.perf_counter()
        self.dst_rows[layer].index_copy_(0, self.dst_ids, rows)
        self.copy_s += time.perf_counter() - t
        self.copy_ops += 1
        self.layer_done.append(time.perf_counter())

    def deliver_layer_from_pieces(self, layer: int, pieces: list) -> None:
        """pieces: int64 1-D tensors of one layer, equal sizes, in token order.

        staged: one cat into a staging buffer, then one index copy (like LMCache's GPU connector with its
        intermediate buffer). direct: one copy per piece straight into its destination block(s) (like LMCache's
        GPU connector without the buffer: one transfer per memory object).
        """
        if self.copy_mode == "staged":
            t = time.perf_counter()
            self.torch.cat(pieces, out=self.stage_layer)
            self.copy_s += time.perf_counter() - t
            self.copy_ops += 1
            self.scatter_layer(layer, self.stage_layer.view(self.nb, self.block_words))
            return
        t = time.perf_counter()
        rows, ids, bw = self.dst_rows[layer], self.dst_ids, self.block_words
        words = pieces[0].numel()
        if words >= bw:  # a piece is k whole blocks
            k = words // bw
            for i, piece in enumerate(pieces):
                rows.index_copy_(0, ids[i * k:(i + 1) * k], piece.view(k, bw))
        else:  # m pieces per block
            m = bw // words
            id_list = ids.tolist()
            for i, piece in enumerate(pieces):
                off = (i % m) * words
                rows[id_list[i // m], off:off + words].copy_(piece)
        self.copy_ops += len(pieces)
        self.copy_s += time.perf_counter() - t
        self.layer_done.append(time.perf_counter())

    def deliver_all_from_chunk_objects(self, objs: list) -> None:
        """objs: int64 views [L, words] of all-layer chunk objects in token order.

        staged: one stack into a staging image, then L index copies. direct: one strided copy per object covering
        all layers (the destination is layer-major with a uniform layer stride).
        """
        torch = self.torch
        if self.copy_mode == "direct":
            t = time.perf_counter()
            dst_all = self.dst_buf.view(torch.int64).view(self.L, self.dst_nb, self.block_words)
            bw, words = self.block_words, objs[0].shape[1]
            if words >= bw:
                k = words // bw
                for i, obj in enumerate(objs):
                    dst_all.index_copy_(1, self.dst_ids[i * k:(i + 1) * k], obj.view(self.L, k, bw))
            else:
                m = bw // words
                id_list = self.dst_ids.tolist()
                for i, obj in enumerate(objs):
                    off = (i % m) * words
                    dst_all[:, id_list[i // m], off:off + words].copy_(obj)
            self.copy_ops += len(objs)
            self.copy_s += time.perf_counter() - t
            now = time.perf_counter()
            self.layer_done.extend([now] * self.L)
            return
        if self.stage_all is None:
            self.stage_all = torch.empty(self.L * self.nb * self.block_words, dtype=torch.int64)
        n = len(objs)
        t = time.perf_counter()
        torch.stack(objs, dim=1, out=self.stage_all.view(self.L, n, -1))
        self.copy_s += time.perf_counter() - t
        self.copy_ops += 1
        image = self.stage_all.view(self.L, self.nb, self.block_words)
        for layer in range(self.L):
            self.scatter_layer(layer, image[layer])

    def verify(self) -> bool:
        for layer in range(self.L):
            got = self.dst_rows[layer].index_select(0, self.dst_ids)
            want = self.src_image[layer].view(self.nb, self.block_words)
            if not self.torch.equal(got, want):
                return False
        return True

    def word_range(self, start_tok: int, end_tok: int) -> tuple[int, int]:
        return start_tok * self.B // 8, end_tok * self.B // 8

    # ---- driver -----------------------------------------------------------------------------------------

    def run(self) -> None:
        impl = {
            "local_cpu": _LMCacheEngineImpl,
            "resp": _LMCacheEngineImpl,
            "valkey": _LMCacheEngineImpl,
            "mp_l2_resp": _MPL2Impl,
            "mp_l2_range": _MPL2RangeImpl,
            "plain_valkey_per_object": _PlainValkeyImpl,
            "resident": _ResidentImpl,
        }[self.path](self)
        doc = self.report.doc
        stats = _ValkeyStats(self.spec["valkey_url"]) if self.spec.get("valkey_url") else None
        doc["valkey_url"] = self.spec.get("valkey_url")
        try:
            self.wd.phase("setup")
            impl.setup()
            doc.update(impl.describe())
            self.wd.phase("store")
            t = time.perf_counter()
            impl.store()
            doc["store_s"] = time.perf_counter() - t
            if stats is not None:
                doc["server_dbsize_after_store"] = int(stats.client.dbsize())
            warm: list[float] = []
            per_rep: list[dict[str, Any]] = []
            total = self.spec["warmup"] + self.spec["repeats"]
            for rep in range(total):
                timed = rep >= self.spec["warmup"]
                self.wd.phase(f"prepare {rep}")
                self.new_destination(rep)
                before = stats.snapshot() if stats else None
                self.wd.phase(f"lookup {rep}")
                t0 = time.perf_counter()
                hit_tokens = impl.lookup()
                t1 = time.perf_counter()
                mid = stats.snapshot() if stats else None
                if hit_tokens != self.T:
                    raise RuntimeError(f"lookup found {hit_tokens} of {self.T} tokens")
                self.wd.phase(f"restore {rep}")
                t2 = time.perf_counter()
                client_counts = impl.restore()
                t3 = time.perf_counter()
                after = stats.snapshot() if stats else None
                self.wd.phase(f"release {rep}")
                impl.release()
                self.wd.phase(f"verify {rep}")
                tv = time.perf_counter()
                ok = self.verify()
                verify_s = time.perf_counter() - tv
                if not ok:
                    raise RuntimeError(f"restored bytes differ from the source (repeat {rep})")
                if len(self.layer_done) < self.L:
                    raise RuntimeError(f"only {len(self.layer_done)} of {self.L} layers delivered")
                rec = {
                    "restore_s": t3 - t2,
                    "first_layer_s": (self.layer_done[0] - t2) if impl.layered else (t3 - t2),
                    "lookup_s": t1 - t0,
                    "shim_copy_s": self.copy_s,
                    "verify_s": verify_s,
                    "client": dict(client_counts, shim_copy_ops=self.copy_ops),
                }
                if stats is not None:
                    rec["server_commands_lookup"] = _ValkeyStats.delta(before, mid)
                    rec["server_commands_restore"] = _ValkeyStats.delta(mid, after)
                if timed:
                    per_rep.append(rec)
                else:
                    warm.append(rec["restore_s"])
                doc.update(_aggregate(per_rep, self.lay["payload_bytes"]))
                doc.update({"per_repeat": per_rep, "warmup_restore_s": warm, "verified": True,
                            "layered_delivery": impl.layered})
                self.report.save()
            doc["status"] = "ok"
        finally:
            self.wd.phase("close")
            try:
                doc["close"] = impl.close()
            except Exception as exc:
                doc["close"] = f"error: {type(exc).__name__}: {exc}"
            if stats is not None:
                try:
                    doc["server_keys_deleted"] = stats.delete_matching(f"*{self.tag}*")
                except Exception as exc:
                    doc["server_keys_deleted"] = f"error: {exc}"
            self.report.save()
