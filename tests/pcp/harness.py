"""Multi-process harness for the PCP protocol (vLLM's own PCP needs its GPU model runner; it cannot run on CPU).

* :class:`RankPool`: ``world_size`` real rank processes (:mod:`tests.pcp.rank_process`, started with the ``spawn``
  method), joined by ``torch.distributed`` gloo on loopback, commanded through pipes; every wait has a timeout and
  the pool kills its own processes (by pid) if one does not answer. Groups of ranks ``[0, P)`` exist for every P up
  to ``world_size``, so one pool serves P = 2 and P = 4 scenarios.
* :class:`SchedulerSide`: the real :class:`~range_connector.scheduler.facade.RangeScheduler` over one
  :class:`~range_connector.backends.valkey.client.ValkeyBackend` per shard, driven the way vLLM 0.32's scheduler drives
  it (``v1/core/sched/scheduler.py``: ``get_num_new_matched_tokens`` L973-981, ``allocate_slots`` L1254-1271,
  ``update_state_after_alloc`` L1288-1293, ``num_computed_tokens`` = local + external L1367, ``build_connector_meta``
  L1530/L1561, ``update_connector_output`` with the workers' aggregated metadata L3219, ``request_finished`` L3051 and
  the id in the next step's ``finished_req_ids``). One scheduler per engine, as in vLLM (the engine-core process), sends
  the same metadata to every rank.
* :class:`PcpEngine`: a scheduler side plus the worker sides of P ranks in the pool: one engine step sends the
  step's metadata to every rank and aggregates their worker metadata.
"""

from __future__ import annotations

import contextlib
import math
import multiprocessing as mp
import os
import random
import signal
import tempfile
import time
from dataclasses import dataclass
from typing import Any

from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput

from range_connector.backends.valkey.client import ValkeyBackend
from range_connector.config import RangeConfig, TierConfig
from range_connector.kv.metadata import RangeConnectorMetadata, RangeWorkerMetadata
from range_connector.scheduler.facade import RangeScheduler
from tests.unit.scheduler_worker_harness import BLOCK, LAYER_BLOCK_BYTES, LAYERS, NAMESPACE, NUM_BLOCKS, FakeRequest

#: Seconds to wait for a rank's answer before the pool is declared hung (tests then fail, never hang).
ANSWER_TIMEOUT_S = 60.0


class RankPool:
    """``world_size`` rank processes (see module docstring).

    Args:
        world_size: number of rank processes.
        group_timeout_s: default timeout of the gloo groups (every collective of Range also has its own).
        start_timeout_s: how long to wait for the processes to import and join the group.

    Raises:
        RuntimeError: a rank failed to start (with its traceback) or did not start in time.
    """

    def __init__(self, world_size: int, group_timeout_s: float = 30.0, start_timeout_s: float = 120.0) -> None:
        from tests.pcp import rank_process

        ctx = mp.get_context("spawn")
        self.world_size = world_size
        fd, self._init_file = tempfile.mkstemp(prefix="range-pcp-gloo-")
        os.close(fd)
        os.unlink(self._init_file)  # gloo's file store creates it
        self.conns, self.procs = [], []
        for rank in range(world_size):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=rank_process.main, name=f"pcp-rank-{rank}", daemon=True,
                               args=(rank, world_size, self._init_file, child, group_timeout_s))
            proc.start()
            self.conns.append(parent)
            self.procs.append(proc)
        try:
            self.pids = [self._answer(r, start_timeout_s) for r in range(world_size)]
        except BaseException:
            self.kill()
            raise

    def _answer(self, rank: int, timeout_s: float) -> Any:
        conn = self.conns[rank]
        if not conn.poll(timeout_s):
            raise RuntimeError(f"rank {rank} did not answer within {timeout_s:.0f} s")
        status, value = conn.recv()
        if status != "ok":
            raise RuntimeError(f"rank {rank} failed:\n{value}")
        return value

    def send(self, ranks: list[int], op: str, per_rank: list[dict[str, Any]] | None = None, **kw: Any) -> None:
        """Send a command to ``ranks`` without waiting (``per_rank``: extra arguments of each, in ``ranks`` order)."""
        for i, r in enumerate(ranks):
            self.conns[r].send((op, {**kw, **(per_rank[i] if per_rank else {})}))

    def collect(self, ranks: list[int], timeout_s: float = ANSWER_TIMEOUT_S) -> list[Any]:
        """Answers of ``ranks`` to the last command, each within what is left of ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        return [self._answer(r, max(0.0, deadline - time.monotonic())) for r in ranks]

    def call(self, ranks: list[int], op: str, timeout_s: float = ANSWER_TIMEOUT_S, **kw: Any) -> list[Any]:
        self.send(ranks, op, **kw)
        return self.collect(ranks, timeout_s)

    def call_all(self, op: str, timeout_s: float = ANSWER_TIMEOUT_S, **kw: Any) -> list[Any]:
        return self.call(list(range(self.world_size)), op, timeout_s, **kw)

    def signal(self, rank: int, signum: signal.Signals) -> None:
        os.kill(self.pids[rank], signum)

    def close(self, timeout_s: float = 10.0) -> None:
        """Ask every rank to exit, then kill (by pid) any that is still running."""
        for conn in self.conns:
            with contextlib.suppress(OSError, ValueError):
                conn.send(("exit", {}))
        deadline = time.monotonic() + timeout_s
        for proc in self.procs:
            proc.join(max(0.0, deadline - time.monotonic()))
        self.kill()

    def kill(self) -> None:
        for proc in self.procs:
            if proc.is_alive():
                with contextlib.suppress(OSError):
                    os.kill(proc.pid, signal.SIGCONT)
                proc.kill()
                proc.join(5.0)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self._init_file)


@dataclass
class _Running:
    request: FakeRequest
    block_ids: list[int]
    num_computed_tokens: int


class SchedulerSide:
    """The real scheduler half of one engine with a shuffled block pool (see module docstring)."""

    def __init__(self, urls: list[str], chunk_tokens: int, seed: int, *, kind: str = "dense",
                 backend_timeout_s: float = 2.0, **config: Any) -> None:
        tier = TierConfig("valkey", servers=tuple(urls), timeout_s=backend_timeout_s)
        config.setdefault("save_mode", "sync")  # (as the ranks save: stored when their step returns)
        self.config = RangeConfig(tiers=(tier,), num_shards=len(urls), chunk_tokens=chunk_tokens,
                                  **config).resolve(BLOCK)
        self.backends = [ValkeyBackend(u, timeout_s=backend_timeout_s) for u in urls]
        self.sched = RangeScheduler(self.config, NAMESPACE, BLOCK, list(self.backends), can_load=True, can_save=True,
                                    num_layers=len(LAYERS), layer_block_bytes=LAYER_BLOCK_BYTES[kind])
        self.free = list(range(NUM_BLOCKS))
        random.Random(seed).shuffle(self.free)
        self.running: dict[str, _Running] = {}
        self.finished: set[str] = set()
        self._new: list[NewRequestData] = []
        self._cached: list[str] = []
        self._scheduled: dict[str, int] = {}

    def admit(self, request: FakeRequest, num_new_tokens: int | None = None) -> int:
        """Schedule a waiting request (its whole prompt, or ``num_new_tokens`` of it: chunked prefill); blocks for
        the whole prompt are allocated at once. Return the external tokens vLLM committed to."""
        ext, load_async = self.sched.get_num_new_matched_tokens(request, 0)
        assert ext is not None and load_async is False
        n = len(request.prompt_token_ids)
        block_ids, self.free = self.free[:math.ceil(n / BLOCK)], self.free[math.ceil(n / BLOCK):]
        assert len(block_ids) == math.ceil(n / BLOCK), "block pool exhausted"
        self.sched.update_state_after_alloc(request, block_ids, ext)
        self.running[request.request_id] = _Running(request, block_ids, ext)
        self._new.append(NewRequestData(req_id=request.request_id, prompt_token_ids=request.prompt_token_ids,
                                        mm_features=[], sampling_params=None, pooling_params=None,
                                        block_ids=(list(block_ids),), num_computed_tokens=ext, lora_request=None))
        self._scheduled[request.request_id] = min(n - ext, num_new_tokens or n)
        return ext

    def continue_(self, req_id: str) -> None:
        """Schedule the rest of a running request's prompt (a later chunked-prefill step)."""
        r = self.running[req_id]
        self._cached.append(req_id)
        self._scheduled[req_id] = len(r.request.prompt_token_ids) - r.num_computed_tokens

    def build(self) -> tuple[RangeConnectorMetadata, list[tuple[list[int], int, int]]]:
        """The step's metadata and, per scheduled request, ``(block ids, first token, end token)`` to compute."""
        cached = CachedRequestData(
            req_ids=list(self._cached), resumed_req_ids=set(), new_token_ids=[[] for _ in self._cached],
            all_token_ids={}, new_block_ids=[None for _ in self._cached],
            num_computed_tokens=[self.running[r].num_computed_tokens for r in self._cached],
            num_output_tokens=[0 for _ in self._cached])
        out = SchedulerOutput(scheduled_new_reqs=list(self._new), scheduled_cached_reqs=cached,
                              num_scheduled_tokens=dict(self._scheduled),
                              total_num_scheduled_tokens=sum(self._scheduled.values()),
                              scheduled_spec_decode_tokens={}, scheduled_encoder_inputs={},
                              finished_req_ids=set(self.finished), free_encoder_mm_hashes=[])
        meta = self.sched.build_connector_meta(out)
        scheduled = [(self.running[r].block_ids, self.running[r].num_computed_tokens,
                      self.running[r].num_computed_tokens + n) for r, n in self._scheduled.items()]
        return meta, scheduled

    def complete(self, worker_metas: list[RangeWorkerMetadata | None]) -> None:
        """The workers' aggregated metadata back to the scheduler; the step's tokens count as computed."""
        agg: RangeWorkerMetadata | None = None
        for m in worker_metas:
            if m is not None:
                agg = m if agg is None else agg.aggregate(m)  # type: ignore[assignment]
        self.sched.update_connector_output(agg)
        for r, n in self._scheduled.items():
            self.running[r].num_computed_tokens += n
        self._new, self._cached, self._scheduled, self.finished = [], [], {}, set()

    def finish(self, req_id: str) -> None:
        r = self.running.pop(req_id)
        assert self.sched.request_finished(r.request, list(r.block_ids)) == (False, None)
        self.free.extend(r.block_ids)
        self.finished.add(req_id)

    def close(self) -> None:
        self.sched.close()


class PcpEngine:
    """One engine of P PCP ranks: a :class:`SchedulerSide` here and worker sides on ranks ``[0, P)`` of ``pool``.

    Args:
        pool: the rank processes.
        name: the engine's name on the ranks (several engines share the pool).
        pcp_size: P.
        urls: one Valkey URL per shard (S = ``len(urls)``, a multiple of P).
        capacities: per shard, Range's byte budget on that shard as its writer configures it (``None``: none).
    """

    def __init__(self, pool: RankPool, name: str, pcp_size: int, urls: list[str], *, chunk_tokens: int = 64,
                 seed: int = 0, kind: str = "dense", capacities: list[int | None] | None = None,
                 backend_timeout_s: float = 2.0, load_deadline_s: float = 4.0, collective_timeout_s: float = 3.0,
                 **sched_config: Any) -> None:
        self.pool, self.name, self.ranks = pool, name, list(range(pcp_size))
        self.sched = SchedulerSide(urls, chunk_tokens, seed, kind=kind, backend_timeout_s=backend_timeout_s,
                                   **sched_config)
        self.step_idx = 0
        self.seed = seed
        self.pids = pool.call(self.ranks, "setup", engine=name, pcp_size=pcp_size, urls=urls, kind=kind,
                              chunk_tokens=chunk_tokens, seed=seed, capacities=capacities or [None] * len(urls),
                              backend_timeout_s=backend_timeout_s, load_deadline_s=load_deadline_s,
                              collective_timeout_s=collective_timeout_s)

    def start_step(self) -> RangeConnectorMetadata:
        """Build the step and send it to every rank (answers come with :meth:`finish_step`)."""
        meta, scheduled = self.sched.build()
        self.step_idx += 1
        self.pool.send(self.ranks, "step", engine=self.name, meta=meta, scheduled=scheduled,
                       forward_seed=self.seed * 100_003 + self.step_idx)
        return meta

    def finish_step(self, timeout_s: float = ANSWER_TIMEOUT_S) -> list[dict[str, Any]]:
        results = self.pool.collect(self.ranks, timeout_s)
        self.sched.complete([r["worker_meta"] for r in results])
        return results

    def step(self, timeout_s: float = ANSWER_TIMEOUT_S) -> tuple[RangeConnectorMetadata, list[dict[str, Any]]]:
        meta = self.start_step()
        return meta, self.finish_step(timeout_s)

    def blocks(self, block_ids: list[int]) -> list[bytes]:
        """The bytes of ``block_ids`` on every rank (layer-major)."""
        return self.pool.call(self.ranks, "read_blocks", engine=self.name, block_ids=block_ids)

    def close(self) -> None:
        self.pool.call(self.ranks, "close", engine=self.name)
        self.sched.close()
