"""``RangeConnector``: vLLM's KV-connector facade. It builds the scheduler or the worker half by role and every
hook is one delegating line, timed (``vllm:range_hook_seconds_total{hook}``: Range's own share of the engine's steps;
the halves are :class:`~range_connector.scheduler.facade.RangeScheduler` and
:class:`~range_connector.worker.facade.RangeWorker`). On a context-parallel rank (several writer ranks: PCP size P > 1,
or DCP size D > 1) the worker hooks go to :class:`~range_connector.worker.pcp_router.PcpWorkerRouter` instead, which
wraps the rank's own ``RangeWorker`` and the ranks' agreement and per-layer exchange
(:mod:`range_connector.worker.pcp`)."""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)

from range_connector import compat
from range_connector.connector.stats import RangeConnectorStats, RangePromMetrics
from range_connector.kv.metadata import RangeConnectorMetadata, RangeWorkerMetadata
from range_connector.metrics import hook_key, stats_delta
from range_connector.scheduler.facade import RangeScheduler
from range_connector.spec import NO_MLA_FALLBACK_ENV, RangeSpec
from range_connector.worker.facade import RangeWorker
from range_connector.worker.observe import bank_gauges
from range_connector.worker.pcp_router import PcpWorkerRouter

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

__all__ = ["NO_MLA_FALLBACK_ENV", "RangeConnector", "RangeStepMetadata", "RangeWorkerReport"]

logger = logging.getLogger("vllm." + __name__)


def _timed(method: Callable) -> Callable:
    """Add the seconds spent inside a connector hook to the connector's ``_hook_s`` (stats key
    :func:`~range_connector.metrics.hook_key` of the method's name). Two ``perf_counter`` calls per hook call."""
    key = hook_key(method.__name__)

    @functools.wraps(method)
    def timed(self: RangeConnector, *args: Any, **kwargs: Any) -> Any:
        start_s = time.perf_counter()
        try:
            return method(self, *args, **kwargs)
        finally:
            self._hook_s[key] = self._hook_s.get(key, 0.0) + (time.perf_counter() - start_s)
    return timed


@dataclass
class RangeStepMetadata(KVConnectorMetadata):
    """vLLM's carrier of one step's plan, scheduler -> workers
    (:class:`~range_connector.kv.metadata.RangeConnectorMetadata`)."""

    plan: RangeConnectorMetadata


@dataclass
class RangeWorkerReport(KVConnectorWorkerMetadata):
    """vLLM's carrier of one worker's step report, worker -> scheduler
    (:class:`~range_connector.kv.metadata.RangeWorkerMetadata`); vLLM aggregates it across workers."""

    report: RangeWorkerMetadata

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        if not isinstance(other, RangeWorkerReport):
            raise TypeError(f"cannot aggregate RangeWorkerReport with {type(other).__name__}")
        return RangeWorkerReport(self.report.aggregate(other.report))


class RangeConnector(KVConnectorBase_V1):
    """Loads a prompt's cached KV from Range's tiers instead of recomputing it.

    Enabled with ``--kv-transfer-config '{"kv_connector": "RangeConnector", "kv_role": "kv_both",
    "kv_load_failure_policy": "recompute", "kv_connector_extra_config": {...}}'`` (keys: docs/configuration.md).

    Raises:
        ConfigError: at construction, for bad config or a backend that does not answer (the message names the key).
    """

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        in_worker = role != KVConnectorRole.SCHEDULER
        self.spec = spec = RangeSpec.from_vllm(vllm_config, kv_cache_config, in_worker=in_worker)
        config, plan = spec.config, spec.plan
        if config.load_mode != spec.requested_load_mode:
            logger.warning("Range: load_mode %r becomes 'sync' with %d context-parallel ranks (they agree on what "
                           "landed before the forward); the cost-model gate is off", spec.requested_load_mode,
                           plan.num_writers)
        self._scheduler: RangeScheduler | None = None
        self._worker: RangeWorker | None = None
        self._pcp: PcpWorkerRouter | None = None  # set on a context-parallel rank (plan.num_writers > 1)
        self._last_stats: dict[str, int] = {}
        self._hook_s: dict[str, float] = {}  # stats key (hook_key) -> seconds inside that hook, cumulative
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler = spec.build_scheduler()
        else:
            self._worker, self._pcp = spec.build_worker()
        logger.info("RangeConnector %s: tier=%s shards=%d chunk_tokens=%d pcp=%d dcp=%d load_mode=%s "
                    "namespace=%s", role.name, config.tier.type, config.num_shards, config.chunk_tokens,
                    spec.cp.pcp_size, spec.cp.dcp_size, config.load_mode, spec.namespace.hex())

    # ------------------------------------------------------------ worker side
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        (self._pcp or self._worker).register_kv_caches(kv_caches)

    @_timed
    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        if self._pcp is not None:
            self._pcp.start_load_kv(self._bound_metadata())
        else:
            self._worker.start_load(self._bound_metadata())

    @_timed
    def wait_for_layer_load(self, layer_name: str) -> None:
        if self._pcp is not None:
            self._pcp.wait_for_layer_load(layer_name)
        else:
            self._worker.wait_for_layer(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        return None  # saves read the registered KV cache in wait_for_save, after every layer ran

    @_timed
    def wait_for_save(self) -> None:
        if self._pcp is not None:
            self._pcp.wait_for_save(self._bound_metadata())
        else:
            self._worker.save(self._bound_metadata())

    @_timed
    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return None, self._worker.get_finished(finished_req_ids) or None

    @_timed
    def get_block_ids_with_load_errors(self) -> set[int]:
        if self._pcp is not None:
            return self._pcp.get_block_ids_with_load_errors()
        return self._worker.take_failed_block_ids()

    @_timed
    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        report = self._pcp.build_connector_worker_meta() if self._pcp is not None else self._worker.build_worker_meta()
        return RangeWorkerReport(report) if report is not None else None

    def get_kv_connector_stats(self) -> RangeConnectorStats | None:
        current = ({**self._worker.stats.snapshot(), **bank_gauges(self._worker.banks)} if self._worker is not None
                   else dict(self._scheduler.counters()))
        # (in whole 10 ms steps of the cumulative time: a step whose hooks took a few microseconds then sends no
        # stats at all, as before hooks were timed, and the counter is never more than 5 ms behind)
        current.update({key: round(seconds, 2) for key, seconds in self._hook_s.items()})
        delta = stats_delta(current, self._last_stats)
        return RangeConnectorStats(data=delta) if delta else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> RangeConnectorStats:
        return RangeConnectorStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config: VllmConfig, metric_types: dict[type, type], labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> RangePromMetrics:
        return RangePromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: VllmConfig) -> str | None:
        """No layout of its own (None); first refuses models with recurrent state.

        vLLM 0.32 calls this in the engine core (``resolve_kv_cache_layout``, v1/engine/core.py:296) just before it
        groups the KV cache, where a hybrid model would fail with vLLM's own "Failed to promote local KV cache specs"
        (the connector is built only afterwards): the earliest hook of Range that sees the config.

        Raises:
            ConfigError: the model keeps recurrent state (:func:`~range_connector.compat.refuse_recurrent_state`).
        """
        compat.refuse_recurrent_state(vllm_config)
        return None

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.close()
        if self._scheduler is not None:
            self._scheduler.close()

    def _bound_metadata(self) -> RangeConnectorMetadata:
        meta = self._connector_metadata
        if not isinstance(meta, RangeStepMetadata):
            return RangeConnectorMetadata()
        return self.spec.rank_view(meta.plan)

    # ------------------------------------------------------------ scheduler side
    @_timed
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        return self._scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    @_timed
    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        self._scheduler.update_state_after_alloc(request, list(blocks.get_block_ids()[0]), num_external_tokens)

    @_timed
    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return RangeStepMetadata(self._scheduler.build_connector_meta(scheduler_output))

    @_timed
    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        meta = getattr(connector_output, "kv_connector_worker_meta", None)
        self._scheduler.update_connector_output(meta.report if isinstance(meta, RangeWorkerReport) else None,
                                                set(connector_output.finished_recving or ()))

    @_timed
    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self._scheduler.request_finished(request, block_ids)

    def reset_cache(self) -> bool | None:
        return self._scheduler.reset_cache() if self._scheduler is not None else None
