"""One PCP rank of the multi-process harness: a process of its own, joined to the others by ``torch.distributed``
(gloo on loopback), holding its own KV tensors in the engine's CPU layout, its own connections to its own shards'
Valkey servers, a real :class:`~range_connector.worker.facade.RangeWorker` over its
:class:`~range_connector.kv.sharding.RankSlice`, and a :class:`~range_connector.worker.pcp.PcpExchange`.

The test process sends commands through a pipe; :meth:`Rank.step` runs one engine step's worker hooks in the order
vLLM 0.32's worker calls them:

* ``vllm/v1/worker/kv_connector_model_runner_mixin.py`` ``_get_kv_connector_output``: bind the metadata (L77),
  ``start_load_kv`` before the forward when a request loads synchronously (L83-85), else after it (L89-90), the
  forward (L87, ``yield``),
  ``wait_for_save`` (L91-92), ``get_block_ids_with_load_errors`` (L100), ``build_connector_worker_meta`` (L104);
* ``vllm/model_executor/layers/attention/kv_transfer_utils.py`` ``maybe_transfer_kv_layer``, which wraps every
  attention layer (``attention.py`` L766, ``mla_attention.py`` L1463): ``wait_for_layer_load(layer_name)`` on entry
  (L51), the attention (which writes this step's KV of the layer), ``save_kv_layer`` on exit (L57; Range saves in
  ``wait_for_save`` instead, so it does nothing).

Each hook is a call of :class:`~range_connector.worker.pcp_router.PcpWorkerRouter`, the class the connector facade
delegates to on a PCP rank (``RangeConnector`` builds it when the writer count is above 1), so the harness runs
the product's worker-side routing; only vLLM's model runner around it is replaced.
"""

from __future__ import annotations

import os
import time
import traceback
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

#: A rank exits when the test process has sent nothing for this long (it died without saying goodbye).
IDLE_EXIT_S = 300.0


def main(rank: int, world_size: int, init_file: str, conn: Any, group_timeout_s: float) -> None:
    """Entry point of a rank process (``multiprocessing`` spawn target)."""
    torch.set_num_threads(1)
    import range_connector.worker.facade  # noqa: F401  (the heavy imports, vLLM's included, before the group forms)
    import tests.unit.scheduler_worker_harness  # noqa: F401

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=group_timeout_s))
    state = Rank(rank, world_size, group_timeout_s)
    conn.send(("ok", os.getpid()))
    while conn.poll(IDLE_EXIT_S):
        op, kwargs = conn.recv()
        if op == "exit":
            break
        try:
            conn.send(("ok", getattr(state, op)(**kwargs)))
        except Exception:  # reported to the test process, which fails the test with it
            conn.send(("error", traceback.format_exc()))
    state.close_all()
    # Leave without interpreter teardown: destroying gloo groups that saw a timed-out collective can block.
    os._exit(0)


class Rank:
    """The engines of one rank (a producer and a consumer may live in the same process), by name."""

    def __init__(self, rank: int, world_size: int, group_timeout_s: float) -> None:
        self.rank, self.world_size, self.group_timeout_s = rank, world_size, group_timeout_s
        self.groups: dict[int, Any] = {}
        self.engines: dict[str, _RankEngine] = {}
        self.regroup()

    def regroup(self) -> None:
        """Fresh process groups of sizes 1, 2, ... (ranks ``[0, n)``); every rank of the world must call it."""
        self.groups = {}
        for n in range(1, self.world_size + 1):
            group = dist.new_group(list(range(n)), timeout=timedelta(seconds=self.group_timeout_s))
            if self.rank < n:
                self.groups[n] = group
        for engine in self.engines.values():
            if engine.pcp_size in self.groups:
                engine.exchange.regroup(self.groups[engine.pcp_size])

    def setup(self, engine: str, pcp_size: int, **kw: Any) -> int | None:
        """Build engine ``engine`` on this rank if the rank is in its PCP group; return this process's pid."""
        if self.rank >= pcp_size:
            return None
        if engine in self.engines:
            self.engines.pop(engine).close()
        self.engines[engine] = _RankEngine(self.rank, pcp_size, self.groups[pcp_size], **kw)
        return os.getpid()

    def step(self, engine: str, **kw: Any) -> dict[str, Any]:
        return self.engines[engine].step(**kw)

    def read_blocks(self, engine: str, block_ids: list[int]) -> bytes:
        return self.engines[engine].read_blocks(block_ids)

    def close(self, engine: str) -> None:
        if engine in self.engines:
            self.engines.pop(engine).close()

    def close_all(self) -> None:
        for name in list(self.engines):
            self.close(name)


class _RankEngine:
    """One engine's worker side on one rank."""

    def __init__(self, rank: int, pcp_size: int, group: Any, *, urls: list[str], kind: str, chunk_tokens: int,
                 seed: int, capacities: list[int | None], backend_timeout_s: float, load_deadline_s: float,
                 collective_timeout_s: float) -> None:
        from range_connector.backends.valkey.client import ValkeyBackend
        from range_connector.config import RangeConfig, TierConfig
        from range_connector.kv.sharding import ShardPlan, shards_of_rank
        from range_connector.worker.pcp_router import PcpWorkerRouter
        from tests.unit.scheduler_worker_harness import BLOCK, LAYERS, NUM_BLOCKS, make_kv

        num_shards = len(urls)
        self.pcp_size, self.kind = pcp_size, kind
        self.block_size, self.layers, self.num_blocks = BLOCK, LAYERS, NUM_BLOCKS
        self.plan = ShardPlan(chunk_tokens // BLOCK, num_shards, pcp_size=pcp_size)
        tier = TierConfig("valkey", servers=tuple(urls), timeout_s=backend_timeout_s, retry_s=0.5)
        # (save_mode "sync": a rank's saves are stored when its step returns, which the protocol's checks read)
        config = RangeConfig(tiers=(tier,), num_shards=num_shards, chunk_tokens=chunk_tokens,
                             load_deadline_s=load_deadline_s, save_mode="sync").resolve(BLOCK)
        own = [ValkeyBackend(urls[s], timeout_s=backend_timeout_s, capacity_bytes=capacities[s])
               for s in shards_of_rank(rank, pcp_size, num_shards)]
        # The connector's own worker-side router (what RangeConnector runs on a PCP rank), over this rank's servers.
        self.router = PcpWorkerRouter(config, self.plan, rank, group, BLOCK, LAYERS, NUM_BLOCKS, own,
                                      collective_timeout_s=collective_timeout_s)
        self.worker, self.exchange = self.router.worker, self.router.exchange
        self.kv = make_kv(kind, seed)
        self.router.register_kv_caches(self.kv)

    def step(self, meta: Any, scheduled: list[tuple[list[int], int, int]], forward_seed: int) -> dict[str, Any]:
        """One engine step's worker hooks in vLLM's order (module docstring), through the connector's router.
        ``scheduled``: ``(block ids, first token, end token)`` of each request computed in the step."""
        t0 = time.monotonic()
        router = self.router                                        # bind_connector_metadata (mixin L77)
        # Every load is synchronous on a PCP rank, so a step has synchronous loads iff it loads: vLLM then starts
        # them before the forward (mixin L82-85), otherwise after it (L89-90).
        sync_loads = bool(meta.loads)
        agreement = router.start_load_kv(meta) if sync_loads else None   # start_load_kv (mixin L85)
        exchanged = 0
        gen = torch.Generator().manual_seed(forward_seed)          # the same "attention output" on every replica
        for name in self.layers:                                    # the forward, layer by layer
            exchanged += router.wait_for_layer_load(name)           # wait_for_layer_load (L51)
            self._attention(name, scheduled, gen)                   # attention writes this step's KV of the layer
            # save_kv_layer (L57): Range saves in wait_for_save.
        if not sync_loads:
            agreement = router.start_load_kv(meta)                  # start_load_kv after the forward (mixin L90)
        router.wait_for_save(meta)                                  # wait_for_save (mixin L92)
        failed = router.get_block_ids_with_load_errors()            # get_block_ids_with_load_errors (mixin L100)
        worker_meta = router.build_connector_worker_meta()          # build_connector_worker_meta (mixin L104)
        return {"failed": sorted(failed), "local_failed": sorted(router.last_local_failed),
                "worker_meta": worker_meta, "load_s": router.last_load_s, "step_s": time.monotonic() - t0,
                "exchanged_blocks": exchanged, "consistent": agreement.consistent, "broken": self.exchange.broken,
                "loaded_blocks": self.worker.take_loaded_block_log(), "stats": dict(self.worker.stats)}

    def _attention(self, name: str, scheduled: list[tuple[list[int], int, int]], gen: torch.Generator) -> None:
        t = self.kv[name]
        for block_ids, start, end in scheduled:
            pos = torch.arange(start, end)
            blocks = torch.tensor(block_ids)[pos // self.block_size]
            slots = pos % self.block_size
            vals = torch.randn((len(pos), t.shape[1], t.shape[3]), generator=gen).to(t.dtype)
            t[blocks, :, slots, :] = vals

    def read_blocks(self, block_ids: list[int]) -> bytes:
        """Bytes of the given blocks in every layer (layer-major)."""
        idx = torch.tensor(block_ids, dtype=torch.long)
        return b"".join(t.index_select(0, idx).contiguous().view(torch.uint8).numpy().tobytes()
                        for t in self.kv.values())

    def close(self) -> None:
        self.router.close()
