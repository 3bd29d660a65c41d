"""The fake model runner of the real-scheduler harness (:mod:`tests.scheduler.real_scheduler`), and its oracle.

:class:`FakeModelRunner` plays vLLM's model runner and ``KVConnectorModelRunnerMixin._get_kv_connector_output``
(vLLM 0.32 ``v1/worker/kv_connector_model_runner_mixin.py`` L67-107) for one worker: it follows the scheduler's
output as the GPU model runner's ``_update_states`` does, binds the connector metadata, calls ``start_load_kv``
before the forward when the step has synchronous loads (else after it), per layer ``wait_for_layer_load`` then
attention, then ``wait_for_save``, ``get_transfer_results``, ``get_block_ids_with_load_errors``, the stats and
``build_connector_worker_meta`` into a ``KVConnectorOutput`` (``v1/outputs.py`` L215) inside a ``ModelRunnerOutput``
(L267). The KV cache is what vLLM's CPU attention registers: ``[num_blocks, num_kv_heads, block_size,
2 * head_size]`` bf16 views of one layer-major buffer.

The oracle. The forward writes, for every scheduled token, KV bytes that are a function of the token's whole prefix
and the layer only (:func:`kv_bits`), so a block loaded from the tier and the same block recomputed must be
byte-identical. "Attention" checks it: in every step, for every scheduled request and every layer, after
``wait_for_layer_load`` returned, the KV of all the tokens the request has computed must be exactly those bytes;
otherwise it raises :class:`KVMismatch` (an ``AssertionError``). KV computed on top of wrong KV is tainted, as a
real model's would be, so a chunk saved from it is caught when it is loaded. Wrong KV is excused only at or after
the first block the worker reported as a load error, until vLLM rewinds the request (it recomputes from there, or,
for a request that shares a failed block with another one, from its tokens before the failed step).
"""

from __future__ import annotations

import concurrent.futures
import random
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import torch
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

from range_connector.connector import RangeConnector
from range_connector.worker.facade import RangeWorker

BLOCK_SIZE = 16
#: the tiny GQA model's attention layers and KV geometry (range_connector.testing.tiny_models, ("gqa", "tiny"))
LAYER_NAMES = tuple(f"model.layers.{i}.self_attn.attn" for i in range(4))
NUM_KV_HEADS, HEAD_SIZE, VOCAB_SIZE = 2, 64, 4096
ROW_ELEMS = NUM_KV_HEADS * 2 * HEAD_SIZE  # bf16 elements of one token of one layer
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
    #: :func:`kv_bits` of the first tokens, extended as the request grows (each token's KV is its own prefix's)
    kv: torch.Tensor | None = None

    def seeds_through(self, n: int) -> list[int]:
        if len(self.seeds) < n:
            self.seeds += prefix_seeds(self.token_ids[:n], len(self.seeds),
                                       self.seeds[-1] if self.seeds else 0x2545F491)
        return self.seeds[:n]

    def kv_through(self, n: int) -> torch.Tensor:
        """``kv_bits(self.seeds_through(n))``, computed once per token."""
        have = 0 if self.kv is None else self.kv.shape[0]
        if n > have:
            new = kv_bits(self.seeds_through(n)[have:])
            self.kv = new if self.kv is None else torch.cat([self.kv, new])
        assert self.kv is not None
        return self.kv[:n]


class FakeModelRunner:
    """One worker: the KV cache, Range's worker half, and a forward that writes and checks the KV of prefixes.

    Args:
        connector: Range's connector in the worker role.
        num_blocks: blocks of the KV cache.
        reads_held: whether a read is held at the tier (see :attr:`drain_async_loads`).

    Attributes:
        kv: ``{layer_name: [num_blocks, num_kv_heads, block_size, 2 * head_size]}`` bf16 views of one layer-major
            buffer (what vLLM's CPU attention registers); unwritten blocks hold noise.
        drain_async_loads: before ``get_finished``, wait for the worker's asynchronous loads unless a read is held
            at the tier, so that every run takes the same steps.
    """

    def __init__(self, connector: RangeConnector, num_blocks: int,
                 reads_held: Callable[[], bool] = lambda: False) -> None:
        self.connector = connector
        gen = torch.Generator().manual_seed(1234)
        self.buffer = torch.randint(0, 0x4000, (len(LAYER_NAMES), num_blocks, NUM_KV_HEADS, BLOCK_SIZE,
                                                2 * HEAD_SIZE), dtype=torch.int16, generator=gen)
        self.kv = {name: self.buffer[i].view(torch.bfloat16) for i, name in enumerate(LAYER_NAMES)}
        connector.register_kv_caches(self.kv)
        self.requests: dict[str, RunnerRequest] = {}
        self.drain_async_loads = True
        self.reads_held = reads_held

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
            rewound = cached.num_computed_tokens[i] < r.num_computed_tokens
            r.num_computed_tokens = cached.num_computed_tokens[i]
            if r.suspect_from is not None and (rewound or r.num_computed_tokens <= r.suspect_from):
                # vLLM rewound the request: it recomputes from there (a request that shares a failed block with
                # one vLLM makes recompute it only drops the tokens of the failed step: Scheduler.
                # _update_requests_with_invalid_blocks)
                r.suspect_from = None
            if new_ids:
                r.block_ids.extend(new_ids[0])

    def _slots(self, r: RunnerRequest, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        pos = torch.arange(start, end)
        return torch.tensor(r.block_ids, dtype=torch.long)[pos // BLOCK_SIZE], pos % BLOCK_SIZE

    def _write_new(self, layer_idx: int, r: RunnerRequest, expected: torch.Tensor, num_new: int,
                   tainted: bool) -> None:
        """Write the KV of the request's new tokens in one layer (``tainted``: computed on top of wrong KV in an
        earlier layer, so not the prefix's KV)."""
        start = r.num_computed_tokens
        blocks, slots = self._slots(r, start, start + num_new)
        new = expected[start:start + num_new, layer_idx]
        self.buffer[layer_idx][blocks, :, slots, :] = new ^ TAINT if tainted else new

    def _check(self, layer_idx: int, r: RunnerRequest, expected: torch.Tensor) -> int | None:
        """Check the request's computed KV in one layer; returns the first position whose KV was wrong, if any."""
        start = r.num_computed_tokens
        if not start:
            return None
        num = -(-start // BLOCK_SIZE)
        got = self.buffer[layer_idx].index_select(0, torch.tensor(r.block_ids[:num], dtype=torch.long)).transpose(
            1, 2).reshape(num * BLOCK_SIZE, NUM_KV_HEADS, 2 * HEAD_SIZE)[:start]
        want = expected[:start, layer_idx]
        if torch.equal(got, want):
            return None
        return int((got != want).flatten(1).any(1).nonzero()[0])

    def _drain(self) -> None:
        if not self.drain_async_loads or self.reads_held():
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
                expected[req_id] = r.kv_through(r.num_computed_tokens + n)
            for layer_idx, name in enumerate(LAYER_NAMES):
                c.wait_for_layer_load(name)  # attention of layer l waits for layer l's load
                # As vLLM's attention layers do: the batch's new KV is written into the cache, then attention reads
                # (a block that vLLM's prefix cache shares is then seen as another request wrote it in this layer).
                for req_id, n in so.num_scheduled_tokens.items():
                    self._write_new(layer_idx, self.requests[req_id], expected[req_id], n,
                                    tainted=req_id in first_bad)
                for req_id in so.num_scheduled_tokens:
                    bad = self._check(layer_idx, self.requests[req_id], expected[req_id])
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
