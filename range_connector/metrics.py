"""Counters both halves keep, the token tally, and the names of Range's Prometheus counters.

The vLLM-typed carriers (``RangeConnectorStats``, ``RangePromMetrics``) are in :mod:`range_connector.connector.stats`;
this module imports no vLLM.

How the counters travel (vLLM 0.32): each worker's ``get_kv_connector_stats`` is called at the end of every step
(``v1/worker/kv_connector_model_runner_mixin.py``), the workers' stats are summed by ``KVOutputAggregator``
(``kv_connector/utils.py``), the scheduler adds its own (``Scheduler.update_from_output``, after
``update_connector_output``), and the sum rides in ``SchedulerStats.kv_connector_stats`` to the front end, where
``PrometheusStatLogger`` hands it to :meth:`range_connector.connector.stats.RangePromMetrics.observe` with the engine's
index.

Tokens are counted once per engine, on the scheduler side (:class:`LoadTally`): a load is settled when the
workers' metadata says how it ended, with failures from every worker merged the way vLLM merges invalid blocks.
Blocks and bytes are counted by each worker (the sum over workers is the engine's traffic).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from range_connector.kv.metadata import ChunkTransfer


def stats_delta(current: dict[str, Any], last: dict[str, Any]) -> dict[str, Any]:
    """Counters that changed since ``last`` (which is updated in place)."""
    delta = {k: v - last.get(k, 0) for k, v in current.items() if v != last.get(k, 0)}
    last.update(current)
    return delta


# ------------------------------------------------------------------------------------------ tokens, once per engine
def tokens_per_chunk(chunks: Sequence[ChunkTransfer], first_token: int, num_tokens: int, block_size: int,
                     blocks_per_chunk: int) -> list[tuple[int, int]]:
    """``[(chunk_idx, tokens)]``: the promised tokens ``[first_token, first_token + num_tokens)`` that fall in each
    chunk's blocks (block ``p`` of chunk ``c`` holds tokens ``[(c * blocks_per_chunk + p) * block_size, ... +
    block_size)``; a load that ends inside a block, a stored tail, counts only the promised tokens of it)."""
    end_token = first_token + num_tokens
    out = []
    for c in chunks:
        n = 0
        for pos in c.block_positions:
            start = (c.chunk_idx * blocks_per_chunk + pos) * block_size
            n += max(0, min(end_token, start + block_size) - max(first_token, start))
        out.append((c.chunk_idx, n))
    return out


@dataclass
class _Planned:
    chunk_tokens: list[tuple[int, int]]  # (chunk_idx, promised tokens in it)
    is_async: bool
    preempted: bool
    finished: bool = False  # vLLM finished the request before the load was reported
    failed_from: int | None = None
    chunk_tiers: dict[int, str] = field(default_factory=dict)  # chunk_idx -> the tier type it is loaded from


def tier_key(key: str, tier: str) -> str:
    """The stats key of counter ``key`` for one tier (``loaded_tokens@memory``): a labelled Prometheus child."""
    return f"{key}@{tier}"


@dataclass
class LoadTally:
    """Settles every planned load's promised tokens as loaded (every block landed and verified), failed (reported
    as load errors: vLLM recomputes them) or aborted (an asynchronous load whose request vLLM finished first).

    vLLM counts a request's external hit tokens when it commits to the load (``vllm:external_prefix_cache_hits``,
    left out for requests it had preempted before), so once every load is settled:
    ``external hits == loaded + failed + aborted - preempted_load`` (tokens), per engine.

    When a load is settled: a layer-pipelined or synchronous load in the step that ran it (every worker reports it in
    that step's metadata, ``loaded``); an asynchronous one when vLLM reports it finished (``finished_recving``:
    every worker is done). Failures of all workers are merged: the request fails from its earliest failed chunk on,
    as vLLM recomputes from the first invalid block.

    Attributes:
        counts: ``loaded_tokens``, ``failed_tokens``, ``aborted_tokens`` and ``preempted_load_tokens`` (tokens of
            settled loads whose request vLLM had preempted before), cumulative.
    """

    counts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(
        ("loaded_tokens", "failed_tokens", "aborted_tokens", "preempted_load_tokens"), 0))
    _planned: dict[str, _Planned] = field(default_factory=dict)

    def plan(self, req_id: str, chunk_tokens: list[tuple[int, int]], *, is_async: bool, preempted: bool,
             chunk_tiers: dict[int, str] | None = None) -> None:
        """Record the load vLLM committed to (``chunk_tokens`` from :func:`tokens_per_chunk`; ``chunk_tiers``: the
        tier type each chunk comes from, counted under :func:`tier_key` ``("loaded_tokens", tier)`` as well)."""
        self._planned[req_id] = _Planned(chunk_tokens, is_async, preempted, chunk_tiers=dict(chunk_tiers or {}))

    def request_finished(self, req_id: str) -> None:
        """vLLM finished the request; an asynchronous load not yet reported was aborted."""
        planned = self._planned.get(req_id)
        if planned is not None:
            planned.finished = True

    def settle(self, loaded_req_ids: Iterable[str], failed_loads: Iterable[tuple[str, int]],
               finished_recving: Iterable[str] = ()) -> None:
        """Take one step's reports: the workers' merged ``failed_loads`` ``(req_id, chunk_idx)`` and ``loaded``
        request ids (metadata), and vLLM's ``finished_recving`` (asynchronous loads every worker finished)."""
        for req_id, chunk_idx in failed_loads:
            planned = self._planned.get(req_id)
            if planned is not None:
                planned.failed_from = chunk_idx if planned.failed_from is None else min(planned.failed_from, chunk_idx)
        ended = [r for r in loaded_req_ids if r in self._planned and not self._planned[r].is_async]
        ended += [r for r in finished_recving if r in self._planned and self._planned[r].is_async]
        for req_id in ended:
            planned = self._planned.pop(req_id)
            total = sum(n for _, n in planned.chunk_tokens)
            if planned.is_async and planned.finished:
                self.counts["aborted_tokens"] += total
            else:
                failed = 0 if planned.failed_from is None else \
                    sum(n for c, n in planned.chunk_tokens if c >= planned.failed_from)
                self.counts["failed_tokens"] += failed
                self.counts["loaded_tokens"] += total - failed
                for c, n in planned.chunk_tokens:
                    tier = planned.chunk_tiers.get(c)
                    if tier is not None and (planned.failed_from is None or c < planned.failed_from):
                        key = tier_key("loaded_tokens", tier)
                        self.counts[key] = self.counts.get(key, 0) + n
            if planned.preempted:
                self.counts["preempted_load_tokens"] += total

    @property
    def num_unsettled(self) -> int:
        """Planned loads not yet settled (0 when idle)."""
        return len(self._planned)


# ------------------------------------------------------------------------------------------ Prometheus
#: stats key -> (Prometheus name, help). Names start with ``vllm:`` because vLLM's metric reader
#: (``LLM.get_metrics``) shows only those and ``unregister_vllm_metrics`` drops only those before a stats logger
#: registers its metrics again (another prefix would raise "Duplicated timeseries" on the second engine in one
#: process). prometheus_client exports each counter with ``_total`` appended.
PROM_COUNTERS: dict[str, tuple[str, str]] = {
    "loaded_tokens": ("vllm:range_loaded_tokens",
                      "Prompt tokens whose KV Range loaded and verified (every block landed, checksums matched)."),
    "failed_tokens": ("vllm:range_failed_tokens",
                      "Prompt tokens Range promised but reported as load errors; vLLM recomputed them."),
    "aborted_tokens": ("vllm:range_aborted_tokens",
                       "Prompt tokens of asynchronous loads whose request was finished (aborted) before they landed."),
    "preempted_load_tokens": ("vllm:range_preempted_load_tokens",
                              "Prompt tokens loaded (or failed) for requests vLLM had preempted before; vLLM leaves "
                              "them out of vllm:external_prefix_cache_hits."),
    "loaded_bytes": ("vllm:range_loaded_bytes", "Bytes of KV Range copied into the KV cache (all workers)."),
    "saved_chunks": ("vllm:range_saved_chunks", "Chunks Range saved on every shard."),
    "load_deadline_misses": ("vllm:range_load_deadline_misses",
                             "Loads (or layer groups of them) given up at their deadline; their blocks recomputed."),
    "load_integrity_errors": ("vllm:range_load_integrity_errors",
                              "Stored values that failed their size or checksum check on load; their chunks "
                              "recomputed and forgotten."),
    "load_backend_errors": ("vllm:range_load_backend_errors",
                            "Tier calls of loads that failed or timed out; their chunks recomputed."),
    "save_waits": ("vllm:range_save_waits",
                   "Times a request was asked again at the next step because a chunk of its prompt past its local "
                   "hit was still being saved in the background (save_mode async): it waits rather than miss it."),
    "save_wait_timeouts": ("vllm:range_save_wait_timeouts",
                           "Requests that waited lookup_wait_s for the background saves of their prefix and went on "
                           "with what was stored by then."),
    "lookups_not_read": ("vllm:range_lookups_not_read",
                         "Requests whose lookup answer vLLM does not read (skip_reading_prefix_cache: prompt "
                         "logprobs, token-level pooling; vllm#57596): counted neither as hits nor as left-out hit "
                         "tokens, and not weighed by the gate."),
}
#: saves not written, one counter with a ``reason`` label (label -> the workers' stats key,
#: :mod:`range_connector.worker.saves`); a skipped save is a future miss, never an error in the step
PROM_SAVES_SKIPPED = ("vllm:range_saves_skipped",
                      "Saves (one step's new chunks, per shard) Range did not write, by reason: tier_down (the "
                      "tier's retry_s after a failure), backlog (save_mode async: save_backlog_bytes already "
                      "waiting), capacity (the tier refused the stripe), no_space (the file system was full), reset "
                      "(reset_external came first), error (the write failed). Each is a future miss.")
SAVES_SKIPPED_STATS: dict[str, str] = {"tier_down": "saves_skipped", "backlog": "saves_skipped_backlog",
                                       "capacity": "saves_skipped_capacity", "no_space": "saves_skipped_no_space",
                                       "reset": "saves_skipped_reset", "error": "save_errors"}
#: the cost-model gate's decisions, one counter with a ``decision`` label (stats key -> label value)
PROM_GATE = ("vllm:range_gate_decisions", "Hits the cost-model gate took, shortened or refused, and its probes; "
             "late: hits of a fixed load_mode cut (a far run) or not started because the predicted load would "
             "pass its own deadline.")
#: client input Range dropped (range_connector.scheduler.request_input), one counter with a ``kind`` label
PROM_REJECTED = ("vllm:range_rejected_request_inputs",
                 "Requests whose kv_transfer_params, cache salt, media ids or LoRA name Range dropped (wrong type or "
                 "over its bound), by kind: the request was served without that part (docs/security.md).")
#: counters with a ``tier`` label: stats key (per tier: :func:`tier_key`) -> (Prometheus name, help)
PROM_TIER_COUNTERS: dict[str, tuple[str, str]] = {
    "loaded_tokens": ("vllm:range_tier_loaded_tokens",
                      "Prompt tokens Range loaded and verified, by the tier they came from (tiers[i].type)."),
    "loaded_bytes": ("vllm:range_tier_loaded_bytes",
                     "Bytes of KV Range copied into the KV cache, by the tier they came from (all workers)."),
    "loads": ("vllm:range_tier_loads",
              "Load jobs that finished, by the farthest tier they read (the slowest rank's, once per job)."),
    "load_seconds": ("vllm:range_tier_load_seconds",
                     "Seconds of the load jobs in vllm:range_tier_loads, from their start until their last byte was "
                     "in reach (the slowest rank's), by the farthest tier they read."),
    "hit_tokens_taken": ("vllm:range_tier_hit_tokens_taken",
                         "Hit tokens of each tier's run that vLLM committed to load (the gate and the deadlines "
                         "took them), by tier."),
    "hit_tokens_left_out": ("vllm:range_tier_hit_tokens_left_out",
                            "Hit tokens of each tier's run that were found but not loaded (refused or cut by the "
                            "cost-model gate or a run's deadline), by tier: they were recomputed."),
    "promoted_chunks": ("vllm:range_tier_promoted_chunks",
                        "Chunks loaded from a farther tier that Range planned to copy into this tier (DRAM)."),
    "evicted_chunks": ("vllm:range_tier_evicted_chunks",
                       "Chunks the tier evicted to stay within its byte budget (the DRAM tier, each worker)."),
    "demoted_chunks": ("vllm:range_tier_demoted_chunks",
                       "Chunks the tier evicted and wrote to the next tier (write_policy write-back; each worker)."),
    "far_copies_skipped": ("vllm:range_tier_far_copies_skipped",
                           "Stripe copies a tier hierarchy did not write to this farther tier (write-through or "
                           "write-back): its far-write backlog (save_backlog_bytes) was full, or the write failed. "
                           "Those chunks stay in the nearer tier only; each worker."),
    "gate_predicted_load_seconds": ("vllm:range_gate_predicted_load_seconds",
                                    "Seconds the cost-model gate predicted for the loads it admitted (load_mode "
                                    "auto) whose realised time came back, by the farthest tier they read."),
    "gate_realised_load_seconds": ("vllm:range_gate_realised_load_seconds",
                                   "Seconds those loads took (the slowest rank's), by the farthest tier they read; "
                                   "over vllm:range_gate_predicted_load_seconds_total it is the gate's bias."),
}
#: seconds inside each connector hook, one counter with a ``hook`` label (stats key ``hook_s@<hook>`` -> label)
PROM_HOOKS = ("vllm:range_hook_seconds",
              "Seconds the engine spent inside each of Range's connector hooks (the scheduler's in the engine core, "
              "each worker's summed): Range's own share of the engine's steps.")
#: the connector hooks that are timed (vLLM's KVConnectorBase_V1 method names)
HOOKS = ("get_num_new_matched_tokens", "update_state_after_alloc", "build_connector_meta", "update_connector_output",
         "request_finished", "start_load_kv", "wait_for_layer_load", "wait_for_save", "get_finished",
         "get_block_ids_with_load_errors", "build_connector_worker_meta")


def hook_key(hook: str) -> str:
    """The stats key of the seconds spent in connector hook ``hook`` (a labelled Prometheus child)."""
    return f"hook_s@{hook}"


GATE_DECISIONS: dict[str, str] = {"decisions_taken": "taken", "decisions_shortened": "shortened",
                                  "decisions_refused": "refused", "decisions_probes": "probe",
                                  "loads_not_started_late": "late"}
