"""``RangeL2Adapter``: LMCache 0.5.6's ``L2AdapterInterface`` on Range's stripes, tickets, leases and budgets.

Selected in LMCache's MP server with ``--l2-adapter '{"type": "plugin", "module_path":
"range_connector.lmcache.adapter", "class_name": "RangeL2Adapter", "adapter_params": {...}}'`` (docs/lmcache.md;
the parameters: :class:`~range_connector.lmcache.config.RangeL2Config`). This module imports LMCache, never vLLM.

Contract kept (``lmcache/v1/distributed/l2_adapters/base.py``):

* every ``submit_*`` returns at once; the task runs on the adapter's threads and its completion is signalled on
  the operation's own event fd (three distinct fds); ``pop_completed_store_tasks`` and the ``query_*`` calls
  return each result once.
* store: one ``L2StoreResult`` per task (successful only if every object was stored; its bytes are those stored).
* lookup-and-lock, load: a ``Bitmap`` of ``[num_keys]`` bits, 1 where the object was found and leased (lookup)
  or loaded with its checksum verified (load). A missing, wrongly sized or corrupt object is a 0 bit, never an
  exception and never a 1 over wrong bytes.
* unlock: releases one lock per key (a key locked twice needs two unlocks); the lease of a stripe is released
  once no locked key points into it; a release that fails is retried, and a lease never released expires after
  ``lease_ttl_s``.
* thread-safe: LMCache's store and prefetch controllers call it at once.
* usage: ``get_usage`` reports Range's bytes and budget over all shards; the adapter declares no capacity to
  LMCache (``supports_global_eviction`` is false), because Range evicts by its own budget (LRU of unleased
  stripes) and LMCache must not evict a second time.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import torch
from lmcache.lmcache_native import Bitmap
from lmcache.v1.distributed.api import MemoryLayoutDesc, ObjectKey
from lmcache.v1.distributed.internal_api import L2StoreResult
from lmcache.v1.distributed.l2_adapters.base import AdapterUsage, L2AdapterInterface, L2TaskId
from lmcache.v1.memory_management import MemoryObj
from lmcache.v1.platform import create_event_notifier

from range_connector.backends.base import Backend
from range_connector.errors import BackendError, ConfigError
from range_connector.kv.tickets import Ticket
from range_connector.lmcache.config import RangeL2Config
from range_connector.lmcache.objects import ObjectId, ObjectLease, ObjectStore, object_id

logger = logging.getLogger(__name__)

#: tries of one lease release before it is left to expire
RELEASE_TRIES = 3
RELEASE_RETRY_S = 0.05


@dataclass(eq=False)
class _HeldLease:
    """A lookup's lease on one shard and how many locked keys point into each of its stripes (under the adapter's
    lock)."""

    lease: ObjectLease
    refs: dict[str, int] = field(default_factory=dict)


def open_backends(config: RangeL2Config) -> list[Backend]:
    """``[num_shards]`` backends of the configured tier.

    Raises:
        ConfigError: a server does not answer or a directory cannot be created (names ``adapter_params.servers``
            or ``adapter_params.directory``).
    """
    cap = config.capacity_bytes or None
    if config.type == "memory":
        from range_connector.backends.memory import MemoryBackend

        return [MemoryBackend(cap, name="memory")]
    if config.type == "file":
        import os

        from range_connector.backends.file.backend import FileBackend

        try:
            return [FileBackend(os.path.join(os.path.expanduser(config.directory), config.deployment, f"shard-{s}"),
                                cap, timeout_s=config.timeout_s) for s in range(config.num_shards)]
        except (OSError, BackendError) as exc:
            raise ConfigError("adapter_params.directory", f"{config.directory}: {exc}") from exc
    from range_connector.backends.valkey.client import ValkeyBackend
    from range_connector.backends.valkey.urls import redact_url

    backends: list[Backend] = []
    for url in config.servers:
        try:
            backends.append(ValkeyBackend(url, timeout_s=config.timeout_s, capacity_bytes=cap,
                                          deployment=config.deployment))
        except BackendError as exc:
            for b in backends:
                b.close()
            raise ConfigError("adapter_params.servers", str(exc).replace(url, redact_url(url))) from None
    return backends


def byte_view(obj: MemoryObj) -> memoryview:
    """A flat unsigned-byte view of a memory object's logical bytes (``get_size()`` bytes, no copy)."""
    return memoryview(obj.byte_array).cast("B")


def object_views(objects: Sequence[MemoryObj]) -> list[memoryview]:
    """``[num_objects]`` flat unsigned-byte views of the objects' logical bytes (``get_size()`` bytes each, no copy),
    valid while the objects are.

    LMCache's L1 objects are slices of one arena tensor: one view of the arena's storage is made per call (it keeps
    the storage alive), and each object's view is a slice of it (a pointer and a size per object).
    ``MemoryObj.byte_array`` builds a ctypes array per object instead, about 3 us each (12 ms for 4,096 objects
    here); it remains the way for an object that is not a CPU tensor slice or lies outside the first one's storage.
    """
    arena: memoryview | None = None
    base = 0
    views = []
    for obj in objects:
        raw = getattr(obj, "raw_data", None)
        if arena is None and isinstance(raw, torch.Tensor) and raw.device.type == "cpu":
            storage = raw.untyped_storage()
            base = storage.data_ptr()
            whole = torch.empty(0, dtype=torch.uint8).set_(storage, 0, (storage.nbytes(),))  # (holds the storage)
            arena = memoryview(whole.numpy()).cast("B")
        start = raw.data_ptr() - base if arena is not None and isinstance(raw, torch.Tensor) else -1
        size = obj.get_size()
        if 0 <= start and start + size <= arena.nbytes:  # type: ignore[union-attr]
            views.append(arena[start:start + size])  # type: ignore[index]
        else:
            views.append(byte_view(obj))
    return views


class RangeL2Adapter(L2AdapterInterface):
    """LMCache L2 adapter over Range's per-shard backends.

    Args:
        params: LMCache's ``adapter_params`` (:meth:`RangeL2Config.from_params`), or a :class:`RangeL2Config`.
        l1_memory_desc: LMCache's L1 description (unused: objects are read and written through their buffers).
        backends: ``[num_shards]`` backends to use instead of opening the configured ones (tests); the adapter
            owns them.

    Raises:
        ConfigError: bad parameters, or a tier that cannot be opened (names the key).
    """

    def __init__(self, params: dict[str, Any] | RangeL2Config, l1_memory_desc: Any = None, *,
                 backends: list[Backend] | None = None) -> None:
        super().__init__(max_capacity_bytes=0)
        self.config = params if isinstance(params, RangeL2Config) else RangeL2Config.from_params(params)
        self.objects = ObjectStore(backends if backends is not None else open_backends(self.config),
                                   lease_ttl_s=self.config.lease_ttl_s)
        self._pool = ThreadPoolExecutor(self.config.num_workers, thread_name_prefix="range-lmcache")
        self._store_efd = create_event_notifier()
        self._lookup_efd = create_event_notifier()
        self._load_efd = create_event_notifier()
        self._lock = threading.Lock()
        self._task_ids = itertools.count()
        self._completed_stores: dict[L2TaskId, L2StoreResult] = {}
        self._completed_lookups: dict[L2TaskId, Bitmap] = {}
        self._completed_loads: dict[L2TaskId, Bitmap] = {}
        #: key -> its locks, oldest first: (the lease it holds a reference of, its ticket, its object id)
        self._locks: dict[ObjectKey, list[tuple[_HeldLease, Ticket, ObjectId]]] = {}
        #: tasks that raised, by kind (their keys failed): report_status()["task_failures"]
        self._task_failures: dict[str, int] = {}
        #: key -> bytes as stored (LMCache's usage accounting and listeners)
        self._sizes_bytes: dict[ObjectKey, int] = {}
        self._closed = False

    # ------------------------------------------------------------------------------------------------- event fds
    def get_store_event_fd(self) -> int:
        return self._store_efd.fileno()

    def get_lookup_and_lock_event_fd(self) -> int:
        return self._lookup_efd.fileno()

    def get_load_event_fd(self) -> int:
        return self._load_efd.fileno()

    # ----------------------------------------------------------------------------------------------------- store
    def submit_store_task(self, keys: list[ObjectKey], objects: list[MemoryObj]) -> L2TaskId:
        """Store ``objects[i]`` under ``keys[i]`` (one stripe write per shard); completion on the store fd."""
        if len(keys) != len(objects):
            raise ValueError(f"{len(keys)} keys but {len(objects)} objects")
        task_id = self._next_task_id()
        self._submit(self._run_store, task_id, list(keys), list(objects))
        return task_id

    def _run_store(self, task_id: L2TaskId, keys: list[ObjectKey], objects: list[MemoryObj]) -> None:
        try:
            result = self.objects.store([key_object_id(k) for k in keys], object_views(objects))
            ok, num_bytes, stored = all(result.stored), result.bytes_stored, result.stored
        except Exception:  # (a bug or a bad object: the task fails, the controller carries on)
            logger.exception("store task %d failed", task_id)
            self._count_failure("store")
            ok, num_bytes, stored = False, 0, [False] * len(keys)
        new_keys, new_sizes = [], []
        with self._lock:
            for key, obj, was_stored in zip(keys, objects, stored):
                if was_stored:
                    size = obj.get_size()
                    new_keys.append(key)
                    new_sizes.append(0 if key in self._sizes_bytes else size)
                    self._sizes_bytes[key] = size
            self._completed_stores[task_id] = L2StoreResult(ok, num_bytes)
        if new_keys:
            self._notify_keys_stored(new_keys, new_sizes)
        self._store_efd.notify()

    def pop_completed_store_tasks(self) -> dict[L2TaskId, L2StoreResult]:
        with self._lock:
            done, self._completed_stores = self._completed_stores, {}
        return done

    # -------------------------------------------------------------------------------------------- lookup + lock
    def submit_lookup_and_lock_task(self, keys: list[ObjectKey],
                                    group_layout_descs: dict[int, MemoryLayoutDesc]) -> L2TaskId:
        """Find and lease ``keys`` (one ticket read and one lease per shard); completion on the lookup fd.
        ``group_layout_descs`` is LMCache's advisory hint, not used."""
        task_id = self._next_task_id()
        self._submit(self._run_lookup, task_id, list(keys))
        return task_id

    def _run_lookup(self, task_id: L2TaskId, keys: list[ObjectKey]) -> None:
        bitmap = Bitmap(len(keys))
        oids = [key_object_id(k) for k in keys]
        try:
            tickets, leases = self.objects.lookup(oids, lease=True)
        except Exception:  # (every key a miss; counted in report_status)
            logger.exception("lookup task %d failed", task_id)
            self._count_failure("lookup")
            tickets, leases = [None] * len(keys), []
        by_lease = {id(lease): _HeldLease(lease) for lease in leases}
        held = {(lease.shard_idx, s): by_lease[id(lease)] for lease in leases for s in lease.stripe_ids}
        shard_of = self.objects.shard_of
        with self._lock:
            for i, (key, ticket, oid) in enumerate(zip(keys, tickets, oids)):
                h = held.get((shard_of(oid), ticket.stripe_id)) if ticket is not None else None
                if h is None:
                    continue
                h.refs[ticket.stripe_id] = h.refs.get(ticket.stripe_id, 0) + 1
                self._locks.setdefault(key, []).append((h, ticket, oid))
                bitmap.set(i)
            self._completed_lookups[task_id] = bitmap
        self._lookup_efd.notify()

    def query_lookup_and_lock_result(self, task_id: L2TaskId) -> Bitmap | None:
        with self._lock:
            return self._completed_lookups.pop(task_id, None)

    def submit_unlock(self, keys: list[ObjectKey]) -> None:
        """Drop one lock of each key; leases no locked key points into are released in the background (retried,
        else they expire after ``lease_ttl_s``). Keys not locked are ignored."""
        releases: dict[int, tuple[ObjectLease, list[str]]] = {}
        with self._lock:
            for key in keys:
                locks = self._locks.get(key)
                if not locks:
                    continue
                h, ticket, _ = locks.pop(0)
                if not locks:
                    del self._locks[key]
                h.refs[ticket.stripe_id] -= 1
                if h.refs[ticket.stripe_id] == 0:
                    del h.refs[ticket.stripe_id]
                    releases.setdefault(id(h), (h.lease, []))[1].append(ticket.stripe_id)
        if releases and not self._closed:
            self._submit(self._run_release, [ObjectLease(lease.shard_idx, lease.token, tuple(stripes))
                                             for lease, stripes in releases.values()])

    def _run_release(self, leases: list[ObjectLease]) -> None:
        for attempt in range(RELEASE_TRIES):
            if self.objects.release(leases):
                return
            time.sleep(RELEASE_RETRY_S * (attempt + 1))
        logger.warning("%d leases not released after %d tries; they expire after %.0f s", len(leases),
                       RELEASE_TRIES, self.config.lease_ttl_s)

    # ------------------------------------------------------------------------------------------------------- load
    def submit_load_task(self, keys: list[ObjectKey], objects: list[MemoryObj]) -> L2TaskId:
        """Read ``keys`` into ``objects`` (one ranged read per shard, checksums verified); completion on the load
        fd. A locked key is read through its lookup's ticket, others after one ticket read per shard."""
        if len(keys) != len(objects):
            raise ValueError(f"{len(keys)} keys but {len(objects)} objects")
        task_id = self._next_task_id()
        self._submit(self._run_load, task_id, list(keys), list(objects))
        return task_id

    def _run_load(self, task_id: L2TaskId, keys: list[ObjectKey], objects: list[MemoryObj]) -> None:
        bitmap = Bitmap(len(keys))
        with self._lock:  # (a locked key's ticket and id come from its lookup: no per-key hashing here)
            held = [locks[-1] if (locks := self._locks.get(k)) else None for k in keys]
        tickets = [h[1] if h is not None else None for h in held]
        loaded_keys = []
        try:
            oids = [h[2] if h is not None else key_object_id(k) for h, k in zip(held, keys)]
            loaded = self.objects.load(oids, object_views(objects), tickets)
        except Exception:  # (every key a failed bit; counted in report_status)
            logger.exception("load task %d failed", task_id)
            self._count_failure("load")
            loaded = [False] * len(keys)
        for i, ok in enumerate(loaded):
            if ok:
                bitmap.set(i)
                loaded_keys.append(keys[i])
        with self._lock:
            self._completed_loads[task_id] = bitmap
        if loaded_keys:
            self._notify_keys_accessed(loaded_keys)
        self._load_efd.notify()

    def query_load_result(self, task_id: L2TaskId) -> Bitmap | None:
        with self._lock:
            return self._completed_loads.pop(task_id, None)

    # ---------------------------------------------------------------------------------------------------- admin
    def delete(self, keys: list[ObjectKey]) -> None:
        """Forget ``keys`` (LMCache's own eviction policies call this; blocking, one call per shard)."""
        self.objects.delete([key_object_id(k) for k in keys])
        with self._lock:
            gone = [(k, self._sizes_bytes.pop(k)) for k in keys if k in self._sizes_bytes]
        if gone:
            self._notify_keys_deleted([k for k, _ in gone], [n for _, n in gone])

    def get_usage(self) -> AdapterUsage:
        """Range's stored bytes and byte budget over all shards (one call per shard); ``bytes_by_cache_salt`` is
        what this adapter stored per salt (Range's own evictions are not subtracted from it).

        Raises:
            BackendError: a shard does not answer (LMCache skips the adapter in that snapshot).
        """
        base = super().get_usage()
        return AdapterUsage(total_bytes_used=self.objects.used_bytes(),
                            total_capacity_bytes=self.objects.capacity_bytes(),
                            bytes_by_cache_salt=MappingProxyType(dict(base.bytes_by_cache_salt)))

    def report_status(self) -> dict[str, Any]:
        with self._lock:
            num_locked = sum(len(v) for v in self._locks.values())
        return {"is_healthy": not self._closed, "type": "range", "tier": self.config.type,
                "num_shards": self.objects.num_shards, "deployment": self.config.deployment,
                "num_locks_held": num_locked, "task_failures": dict(self._task_failures)}

    def close(self) -> None:
        """Finish the tasks in flight, release every lease still held, close the backends and the event fds."""
        if self._closed:
            return
        self._closed = True
        self._pool.shutdown(wait=True)
        with self._lock:
            held = {id(h): h for locks in self._locks.values() for h, _, _ in locks}
            self._locks.clear()
        self.objects.release([h.lease for h in held.values()])
        self.objects.close()
        for efd in (self._store_efd, self._lookup_efd, self._load_efd):
            efd.close()

    # --------------------------------------------------------------------------------------------------- helpers
    def _count_failure(self, kind: str) -> None:
        """A task that raised (``kind``: ``store``, ``lookup`` or ``load``): its keys failed; counted for
        :meth:`report_status` (``task_failures``), next to the log line."""
        with self._lock:
            self._task_failures[kind] = self._task_failures.get(kind, 0) + 1

    def _next_task_id(self) -> L2TaskId:
        with self._lock:
            return next(self._task_ids)

    def _submit(self, fn: Callable[..., None], *args: Any) -> None:
        if self._closed:
            raise RuntimeError("the Range L2 adapter is closed")
        self._pool.submit(fn, *args)


def key_object_id(key: ObjectKey) -> ObjectId:
    """The Range object id of LMCache's ``ObjectKey`` (:func:`~range_connector.lmcache.objects.object_id`)."""
    return object_id(key.model_name, key.kv_rank, key.object_group_id, key.chunk_hash, key.cache_salt)
