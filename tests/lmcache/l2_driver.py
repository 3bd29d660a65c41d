"""Helpers of ``l2_adapter_checks.py`` (run in LMCache's environment): LMCache objects in a real L1 arena, keys,
their contents, and the submit / wait-on-the-event-fd / query cycle of each adapter call."""

from __future__ import annotations

import select
import threading
import uuid
from collections.abc import Callable
from pathlib import Path

import torch
import valkey
from lmcache.v1.distributed.api import MemoryLayoutDesc, ObjectKey
from lmcache.v1.distributed.config import L1MemoryManagerConfig
from lmcache.v1.distributed.memory_manager.l1_memory_manager import L1MemoryManager
from lmcache.v1.platform.event_notifier import consume_fd

from range_connector.lmcache.adapter import RangeL2Adapter

#: longest wait for one task's completion, seconds (a deadline against a hang, not a performance bound)
TASK_DEADLINE_S = 30.0
SHAPE = torch.Size([2, 2, 16, 64])  # one object: [kv, layers, tokens, hidden] bf16 = 8 KiB
LAYOUT = MemoryLayoutDesc(shapes=[SHAPE], dtypes=[torch.bfloat16])
OBJECT_BYTES = SHAPE.numel() * 2


class Env:
    """What every check gets: the servers, a scratch directory, one L1 arena and helpers around LMCache's calls."""

    def __init__(self, urls: list[str], scratch: Path, docs: Path | None) -> None:
        self.urls = urls
        self.scratch = scratch
        self.docs = docs
        self.l1 = L1MemoryManager(L1MemoryManagerConfig(size_in_bytes=256 << 20, use_lazy=False, shm_name=""))
        self.admin = [valkey.Valkey.from_url(u) for u in urls]

    def adapter(self, **params) -> tuple[RangeL2Adapter, str]:
        deployment = "lmc" + uuid.uuid4().hex[:12]
        params.setdefault("servers", self.urls)
        return RangeL2Adapter({"deployment": deployment, **params}), deployment

    def objects(self, keys: list[ObjectKey], fill: bool = True, layout: MemoryLayoutDesc = LAYOUT) -> list:
        err, objs = self.l1.allocate(layout, len(keys))
        assert objs is not None and len(objs) == len(keys), f"L1 allocate failed: {err}"
        if fill:
            for key, obj in zip(keys, objs):
                obj.tensor.view(torch.uint8).view(-1).copy_(content(key, obj.get_size()))
        return objs

    def free(self, objs: list) -> None:
        self.l1.free(objs)

    def close(self) -> None:
        for a in self.admin:
            a.close()
        self.l1.close()


def keys_of(prefix: str, n: int, salt: str = "") -> list[ObjectKey]:
    return [ObjectKey(chunk_hash=f"{prefix}:{i}".encode().ljust(32, b"\0"), model_name="tiny/model", kv_rank=0,
                      cache_salt=salt) for i in range(n)]


def content(key: ObjectKey, nbytes: int) -> torch.Tensor:
    """The bytes an object of ``key`` holds: random, derived from the key (``[nbytes]`` uint8)."""
    g = torch.Generator().manual_seed(int.from_bytes(key.chunk_hash[:8], "little") ^ hash(key.cache_salt) & 0xFFFF)
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)


def holds(obj, key: ObjectKey) -> bool:
    return torch.equal(obj.tensor.view(torch.uint8).reshape(-1), content(key, obj.get_size()))


def wait(fd: int, query: Callable[[], object]) -> object:
    """Poll ``fd`` until ``query()`` answers (each wake-up consumes the fd); raise past :data:`TASK_DEADLINE_S`."""
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    for _ in range(int(TASK_DEADLINE_S * 10)):
        r = query()
        if r is not None:
            return r
        if poller.poll(100):
            consume_fd(fd)
    raise TimeoutError(f"no completion on fd {fd} within {TASK_DEADLINE_S} s")


#: store results popped but not yet claimed, ``{(id(adapter), task id): result}``: ``pop_completed_store_tasks``
#: pops every task's result, so a thread may pop another's (LMCache's store controller keeps them the same way)
_POPPED: dict = {}
_POPPED_LOCK = threading.Lock()


def store(a: RangeL2Adapter, keys, objs):
    tid = a.submit_store_task(keys, objs)

    def popped():
        with _POPPED_LOCK:
            _POPPED.update({(id(a), t): r for t, r in a.pop_completed_store_tasks().items()})
            return _POPPED.pop((id(a), tid), None)

    return wait(a.get_store_event_fd(), popped)


def lookup(a: RangeL2Adapter, keys) -> list[int]:
    tid = a.submit_lookup_and_lock_task(keys, {0: LAYOUT})
    bm = wait(a.get_lookup_and_lock_event_fd(), lambda: a.query_lookup_and_lock_result(tid))
    return [int(bm.test(i)) for i in range(len(keys))]


def load(a: RangeL2Adapter, keys, objs) -> list[int]:
    tid = a.submit_load_task(keys, objs)
    bm = wait(a.get_load_event_fd(), lambda: a.query_load_result(tid))
    return [int(bm.test(i)) for i in range(len(keys))]


def lease_keys(env: Env, deployment: str) -> int:
    return sum(len(list(c.scan_iter(f"rc3:{deployment}:l:*"))) for c in env.admin)


def round_trips(a: RangeL2Adapter) -> list[int]:
    return [b.counters.round_trips for b in a.objects.backends]
