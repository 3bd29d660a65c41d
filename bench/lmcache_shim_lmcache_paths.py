"""The shim's LMCache 0.5.6 paths: the in-process engine (``local_cpu``, ``resp``, ``valkey``), ``mp_l2_resp`` and
``mp_l2_range`` (LMCache's L2 interface over its ``resp`` adapter, and over the Range adapter).

:class:`_LMCacheEngineImpl` drives ``LMCacheEngine`` (layerwise ``store_layer`` / ``retrieve_layer`` for
``local_cpu``, chunked ``store`` / ``retrieve`` for the remote connectors, see ``bench/lmcache_shim.py``'s docstring
for why), with :func:`_make_connector`'s stand-in for LMCache's vLLM GPU connector doing the paged copy through the
:class:`~lmcache_shim_child._PathBench`. :class:`_MPL2Impl` drives the multi-process mode's ``resp`` L2 adapter
directly with L1 objects. LMCache and torch are imported inside the methods, so this module imports without them.
"""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING, Any

from lmcache_shim_common import GIB, MIB, _host_port, _int64_flat, _run_with_timeout, _Unsupported

if TYPE_CHECKING:
    from lmcache_shim_child import _PathBench


# ---- LMCache in-process engine: local CPU backend, resp:// and valkey:// remote connectors -------------------


class _LMCacheEngineImpl:
    def __init__(self, b: _PathBench) -> None:
        self.b = b
        self.engine = None
        self.instance_id = f"shim-{b.path}-{os.getpid()}"
        path, L, C = b.path, b.L, b.C
        self.remote = path in ("resp", "valkey")
        gran = b.lay["granularity"]
        if b.spec.get("force_layerwise"):  # diagnostic: LMCache's layerwise mode even for remote connectors
            self.layerwise, self.lmc_chunk = True, C
        elif gran == "per_layer" and not self.remote:
            self.layerwise, self.lmc_chunk = True, C
        elif gran == "per_layer":
            if C % L:
                raise _Unsupported(
                    f"LMCache 0.5.6 remote connectors cannot store per-layer objects; emulating them needs "
                    f"chunk_tokens ({C}) divisible by num_layers ({L})"
                )
            self.layerwise, self.lmc_chunk = False, C // L
        else:
            self.layerwise, self.lmc_chunk = False, C
        self.layered = self.layerwise
        self.alloc_calls = 0
        self.alloc_objs = 0

    def describe(self) -> dict[str, Any]:
        b = self.b
        n_lmc_chunks = b.T // self.lmc_chunk
        return {
            "lmcache_use_layerwise": self.layerwise,
            "lmcache_chunk_size": self.lmc_chunk,
            "lmcache_keys": n_lmc_chunks * (b.L if self.layerwise else 1),
            "driven_by": (
                "LMCacheEngineBuilder.get_or_create + post_init; "
                + ("store_layer/retrieve_layer (layerwise)" if self.layerwise else "store/retrieve (chunked)")
                + "; lookup(tokens, lookup_id, pin=True) then lookup_unpin; shim GPU-connector subclass does the "
                "paged copy"
            ),
            "remote_url": self.url if self.remote else None,
        }

    def setup(self) -> None:
        import torch
        from lmcache.v1.cache_engine import LMCacheEngineBuilder
        from lmcache.v1.config import LMCacheEngineConfig
        from lmcache.v1.metadata import LMCacheMetadata

        b = self.b
        host, port = _host_port(b.spec["valkey_url"]) if self.remote else (None, None)
        self.url = f"{b.path}://{host}:{port}" if self.remote else None
        # L1 pool: the payload plus headroom (remote paths allocate one receive buffer per object).
        cpu_gib = round(b.lay["payload_bytes"] * 1.5 / GIB + 0.25, 2)
        extra: dict[str, Any] = {"save_chunk_meta": False}
        if b.path == "resp":
            extra["resp_num_threads"] = b.spec["num_workers"]
        if b.path == "valkey":
            extra["valkey_num_workers"] = b.spec["num_workers"]
        cfg = LMCacheEngineConfig.from_defaults(
            chunk_size=self.lmc_chunk,
            local_cpu=not self.remote,
            max_local_cpu_size=cpu_gib,
            remote_url=self.url,
            remote_serde="naive",
            use_layerwise=self.layerwise,
            save_unfull_chunk=False,
            extra_config=extra,
            blocking_timeout_secs=int(b.spec["op_timeout_s"]),
            lmcache_instance_id=self.instance_id,
        )
        heads, head_size = b.lay["num_kv_heads"], b.lay["head_size"]
        meta = LMCacheMetadata(
            model_name=b.tag, world_size=1, local_world_size=1, worker_id=0, local_worker_id=0,
            kv_dtype=torch.bfloat16, kv_shape=(b.L, 2, self.lmc_chunk, heads, head_size), use_mla=False,
            role="worker", chunk_size=self.lmc_chunk,
        )
        conn = _make_connector(b, self.layerwise, heads * head_size)
        self.engine = LMCacheEngineBuilder.get_or_create(
            self.instance_id, cfg, meta, conn, lambda t, r: None, lambda o, r: o
        )
        self.engine.post_init()
        sm = self.engine.storage_manager
        self.local = sm.storage_backends.get("LocalCPUBackend")
        self.remote_backend = next(
            (be for name, be in sm.storage_backends.items() if name.startswith("RemoteBackend")), None
        )
        if self.remote and (self.remote_backend is None or self.remote_backend.connection is None):
            raise RuntimeError(f"LMCache did not connect to {self.url}")
        # Count allocations from the L1 (LocalCPUBackend) pool: instance-level wrappers, no behaviour change.
        orig_alloc, orig_batched = self.local.allocate, self.local.batched_allocate

        def allocate(*a, **k):
            self.alloc_calls += 1
            self.alloc_objs += 1
            return orig_alloc(*a, **k)

        def batched_allocate(*a, **k):
            self.alloc_calls += 1
            self.alloc_objs += int(k.get("batch_size", a[2] if len(a) > 2 else 1))
            return orig_batched(*a, **k)

        self.local.allocate, self.local.batched_allocate = allocate, batched_allocate
        g = torch.Generator().manual_seed(b.spec["seed"] + 7)
        self.tokens = torch.randint(0, 32000, (b.T,), generator=g, dtype=torch.long)
        self.req = 0

    def store(self) -> None:
        b = self.b
        if self.layerwise:
            for _ in self.engine.store_layer(self.tokens, req_id="store", sync=True):
                pass
        else:
            self.engine.store(self.tokens, req_id="store")
        # Remote puts are asynchronous (batched puts leave no trace in RemoteBackend.put_tasks): poll the lookup.
        deadline = time.monotonic() + b.spec["op_timeout_s"]
        n = self.engine.lookup(self.tokens)
        while n != b.T and time.monotonic() < deadline:
            time.sleep(0.05)
            n = self.engine.lookup(self.tokens)
        if n != b.T:
            raise RuntimeError(f"after store, lookup finds {n} of {b.T} tokens")

    def lookup(self) -> int:
        self.req += 1
        self.req_id = f"r{self.req}"
        return int(self.engine.lookup(self.tokens, lookup_id=self.req_id, pin=True))

    def restore(self) -> dict[str, Any]:
        a0, o0 = self.alloc_calls, self.alloc_objs
        if self.layerwise:
            last = None
            for last in self.engine.retrieve_layer(self.tokens, req_id=self.req_id, sync=True):
                pass
            got = int(last.sum())
        else:
            got = int(self.engine.retrieve(self.tokens, req_id=self.req_id).sum())
        if got != self.b.T:
            raise RuntimeError(f"retrieve returned {got} of {self.b.T} tokens")
        keys = (self.b.T // self.lmc_chunk) * (self.b.L if self.layerwise else 1)
        return {"objects_requested": keys, "l1_allocate_calls": self.alloc_calls - a0,
                "l1_objects_allocated": self.alloc_objs - o0}

    def release(self) -> None:
        self.engine.lookup_unpin(self.req_id)

    def close(self) -> str:
        from lmcache.v1.cache_engine import LMCacheEngineBuilder

        if self.engine is None:
            return "not started"
        return _run_with_timeout(
            lambda: LMCacheEngineBuilder.destroy(self.instance_id), self.b.spec["close_timeout_s"]
        )


def _make_connector(b: _PathBench, layerwise: bool, hidden: int):
    """The shim's stand-in for LMCache's vLLM GPU connector: moves bytes between LMCache memory objects and the
    CPU paged KV tensors (LMCache 0.5.6 has no CPU connector for vLLM's paged layout)."""
    import torch
    from lmcache.v1.gpu_connector.gpu_connectors import GPUConnectorInterface, VLLMPagedMemLayerwiseGPUConnector

    L = b.L

    class ShimLayerwiseConnector(VLLMPagedMemLayerwiseGPUConnector):
        # Subclassed only so LMCache's retrieve_layer/store_layer accept it (assert_layerwise_gpu_connector);
        # the parent's __init__ creates CUDA streams, so it is not called.
        def __init__(self) -> None:  # noqa: D107
            self.hidden_dim_size = hidden
            self.num_layers = L
            self.use_gpu = False
            self.use_mla = False
            self.dtype = torch.bfloat16
            self.kvcaches = None

        def initialize_kvcaches_ptr(self, **kwargs) -> None:
            pass

        def get_shape(self, num_tokens: int) -> torch.Size:
            return torch.Size([num_tokens, 2, hidden])

        def batched_from_gpu(self, memory_objs, starts, ends, **kwargs):
            # memory_objs[layer][chunk]; same yield protocol as LMCache's layerwise connector.
            for layer in range(L):
                for start, end, obj in zip(starts, ends, memory_objs[layer], strict=True):
                    w0, w1 = b.word_range(start, end)
                    _int64_flat(obj.tensor).copy_(b.src_image[layer, w0:w1])
                yield
            yield

        def batched_to_gpu(self, starts, ends, **kwargs):
            for layer in range(L):
                objs = yield
                pieces = [_int64_flat(o.tensor) for o in objs]
                want = (len(starts), (ends[0] - starts[0]) * b.B // 8)
                if len(pieces) != want[0] or any(p.numel() != want[1] for p in pieces):
                    raise RuntimeError(
                        f"LMCache delivered {len(pieces)} objects of {sorted({p.numel() * 8 for p in pieces})} bytes "
                        f"for layer {layer}; expected {want[0]} of {want[1] * 8} bytes"
                    )
                b.deliver_layer_from_pieces(layer, pieces)
            yield
            yield

    class ShimChunkConnector(GPUConnectorInterface):
        def __init__(self) -> None:  # noqa: D107
            self.num_layers = L
            self.kvcaches = None

        def initialize_kvcaches_ptr(self, **kwargs) -> None:
            pass

        def get_shape(self, num_tokens: int) -> torch.Size:
            return torch.Size([2, L, num_tokens, hidden])

        def to_gpu(self, memory_obj, start, end, **kwargs):
            raise NotImplementedError

        def from_gpu(self, memory_obj, start, end, **kwargs):
            raise NotImplementedError

        def batched_from_gpu(self, memory_objs, starts, ends, **kwargs):
            for start, end, obj in zip(starts, ends, memory_objs, strict=True):
                w0, w1 = b.word_range(start, end)
                _int64_flat(obj.tensor).view(L, -1).copy_(b.src_image[:, w0:w1])

        def batched_to_gpu(self, memory_objs, starts, ends, **kwargs):
            order = sorted(range(len(starts)), key=lambda i: starts[i])
            if [starts[i] for i in order] != [i * (ends[0] - starts[0]) for i in range(len(order))]:
                raise RuntimeError("retrieved chunks do not cover the payload contiguously")
            b.deliver_all_from_chunk_objects([_int64_flat(memory_objs[i].tensor).view(L, -1) for i in order])

    return ShimLayerwiseConnector() if layerwise else ShimChunkConnector()


# ---- LMCache multi-process mode: the `resp` L2 adapter, driven directly with L1 objects -----------------------


class _MPL2Impl:
    layered = False

    def __init__(self, b: _PathBench) -> None:
        self.b = b
        self.adapter = None
        self.l1 = None
        self.per_layer = b.lay["granularity"] == "per_layer"

    def describe(self) -> dict[str, Any]:
        return {
            "driven_by": (
                "lmcache.v1.distributed: L1MemoryManager(L1MemoryManagerConfig(use_lazy=False, shm_name='')) for "
                "the buffers; create_l2_adapter(RESPL2AdapterConfig(host, port, num_workers)) -> "
                "NativeConnectorL2Adapter over the C++ LMCacheRedisClient; submit_store_task / "
                "submit_lookup_and_lock_task / submit_load_task (one batch of all N keys) with their event fds; "
                "restore = L1 allocate + load + shim copy"
            ),
            "mp_object_shape": list(self.shape),
        }

    def setup(self) -> None:
        import torch
        from lmcache.v1.distributed.api import MemoryLayoutDesc, ObjectKey
        from lmcache.v1.distributed.config import L1MemoryManagerConfig
        from lmcache.v1.distributed.memory_manager.l1_memory_manager import L1MemoryManager

        b = self.b
        host, port = _host_port(b.spec["valkey_url"])
        heads, head_size = b.lay["num_kv_heads"], b.lay["head_size"]
        self.shape = torch.Size([2, 1 if self.per_layer else b.L, b.C, heads * head_size])
        self.layout = MemoryLayoutDesc(shapes=[self.shape], dtypes=[torch.bfloat16])
        size = int(b.lay["payload_bytes"] * 1.5) + 64 * MIB
        self.l1 = L1MemoryManager(L1MemoryManagerConfig(size_in_bytes=size, use_lazy=False, shm_name=""))
        self.adapter = self._make_adapter(host, port)
        n_chunks = b.T // b.C
        # Object i: chunk c of layer l, ordered layer-major (per_layer), or chunk c (per_chunk).
        self.keys = []
        self.ranges = []
        for layer in range(b.L if self.per_layer else 1):
            for c in range(n_chunks):
                h = (f"{layer}:{c}:{b.spec['seed']}").encode()
                self.keys.append(ObjectKey(chunk_hash=h.ljust(32, b"\0"), model_name=b.tag, kv_rank=0))
                self.ranges.append((layer, *b.word_range(c * b.C, (c + 1) * b.C)))

    def _make_adapter(self, host: str, port: int) -> Any:
        from lmcache.v1.distributed.l2_adapters import create_l2_adapter
        from lmcache.v1.distributed.l2_adapters.resp_l2_adapter import RESPL2AdapterConfig

        cfg = RESPL2AdapterConfig.from_dict({"host": host, "port": port, "num_workers": self.b.spec["num_workers"]})
        return create_l2_adapter(cfg)

    def _wait(self, fd: int, query, task_id) -> Any:
        import select

        from lmcache.v1.platform.event_notifier import consume_fd

        poller = select.poll()
        poller.register(fd, select.POLLIN)
        while True:
            res = query(task_id)
            if res is not None:
                return res
            if poller.poll(1000):
                consume_fd(fd)

    def _alloc(self) -> list:
        from lmcache.v1.distributed.error import L1Error

        err, objs = self.l1.allocate(self.layout, len(self.keys))
        if err != L1Error.SUCCESS:
            raise RuntimeError(f"L1 allocate failed: {err}")
        return objs

    def store(self) -> None:
        b = self.b
        objs = self._alloc()
        for obj, (layer, w0, w1) in zip(objs, self.ranges, strict=True):
            flat = _int64_flat(obj.tensor)
            if self.per_layer:
                flat.copy_(b.src_image[layer, w0:w1])
            else:
                flat.view(b.L, -1).copy_(b.src_image[:, w0:w1])
        tid = self.adapter.submit_store_task(self.keys, objs)
        done: dict = {}

        def popped(task_id):
            done.update(self.adapter.pop_completed_store_tasks())
            return done.get(task_id)

        res = self._wait(self.adapter.get_store_event_fd(), popped, tid)
        if not res.is_successful():
            raise RuntimeError("MP L2 store failed")
        self.l1.free(objs)

    def lookup(self) -> int:
        tid = self.adapter.submit_lookup_and_lock_task(self.keys, {0: self.layout})
        bm = self._wait(self.adapter.get_lookup_and_lock_event_fd(), self.adapter.query_lookup_and_lock_result, tid)
        hit = bm.count_leading_ones()
        return self.b.T if hit == len(self.keys) else hit

    def restore(self) -> dict[str, Any]:
        b = self.b
        t0 = time.perf_counter()
        objs = self._alloc()
        self.objs = objs
        t1 = time.perf_counter()
        tid = self.adapter.submit_load_task(self.keys, objs)
        t2 = time.perf_counter()
        bm = self._wait(self.adapter.get_load_event_fd(), self.adapter.query_load_result, tid)
        t3 = time.perf_counter()
        if bm.popcount() != len(self.keys):
            raise RuntimeError(f"MP L2 load got {bm.popcount()} of {len(self.keys)} objects")
        if self.per_layer:
            per_layer = len(self.keys) // b.L
            for layer in range(b.L):
                b.deliver_layer_from_pieces(
                    layer, [_int64_flat(o.tensor) for o in objs[layer * per_layer:(layer + 1) * per_layer]]
                )
        else:
            b.deliver_all_from_chunk_objects([_int64_flat(o.tensor).view(b.L, -1) for o in objs])
        return {"objects_requested": len(self.keys), "l1_allocate_calls": 1, "l1_objects_allocated": len(objs),
                "load_tasks": 1, "l1_allocate_s": t1 - t0, "submit_load_s": t2 - t1, "load_wait_s": t3 - t2}

    def release(self) -> None:
        self.adapter.submit_unlock(self.keys)
        self.l1.free(self.objs)
        self.objs = []

    def close(self) -> str:
        r = "not started"
        if self.adapter is not None:
            r = _run_with_timeout(self.adapter.close, self.b.spec["close_timeout_s"])
        if self.l1 is not None:
            _run_with_timeout(self.l1.close, 10)
        return r


class _MPL2RangeImpl(_MPL2Impl):
    """``mp_l2_range``: the same L1 objects and calls as ``mp_l2_resp``, through the Range L2 adapter
    (``range_connector.lmcache.adapter.RangeL2Adapter``, docs/lmcache.md) on the same Valkey server (one shard),
    built through LMCache's own ``plugin`` adapter type as the MP server builds it. Its keys are under the
    deployment named after the shim's tag, so the shim's clean-up (``*<tag>*``) removes them."""

    def describe(self) -> dict[str, Any]:
        doc = super().describe()
        doc["driven_by"] = doc["driven_by"].replace(
            "create_l2_adapter(RESPL2AdapterConfig(host, port, num_workers)) -> NativeConnectorL2Adapter over the "
            "C++ LMCacheRedisClient",
            "create_l2_adapter(PluginL2AdapterConfig(module_path='range_connector.lmcache.adapter', "
            "class_name='RangeL2Adapter', adapter_params={type: valkey, servers: [url], deployment: <tag>})) -> "
            "RangeL2Adapter (Range stripes, tickets and leases; one shard)")
        return doc

    def _make_adapter(self, host: str, port: int) -> Any:
        import sys
        from pathlib import Path

        from lmcache.v1.distributed.l2_adapters import create_l2_adapter
        from lmcache.v1.distributed.l2_adapters.plugin_l2_adapter import PluginL2AdapterConfig

        repo = str(Path(__file__).resolve().parents[1])  # (the checkout's range_connector, as the docs say)
        if repo not in sys.path:
            sys.path.insert(0, repo)
        params = {"type": "valkey", "servers": [self.b.spec["valkey_url"]], "deployment": self.b.tag,
                  "num_workers": self.b.spec["num_workers"]}
        cfg = PluginL2AdapterConfig.from_dict({"module_path": "range_connector.lmcache.adapter",
                                               "class_name": "RangeL2Adapter", "adapter_params": params})
        return create_l2_adapter(cfg)
