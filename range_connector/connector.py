"""``RangeConnector``: vLLM's KV-connector facade. It builds the scheduler or the worker half by role and every
hook is one delegating line (the halves are :class:`~range_connector.scheduler.RangeScheduler` and
:class:`~range_connector.worker.RangeWorker`). On a context-parallel rank (several writer ranks: PCP size P > 1, or
DCP size D > 1) the worker hooks go to :class:`~range_connector.pcp_worker.PcpWorkerRouter` instead, which wraps the
rank's own ``RangeWorker`` and the ranks' agreement and per-layer exchange (:mod:`range_connector.pcp`)."""

from __future__ import annotations

import dataclasses

import json
import logging
import os
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)

from range_connector import compat
from range_connector.config import RangeConfig
from range_connector.metadata import RangeConnectorMetadata, RangeWorkerMetadata
from range_connector.metrics import RangeConnectorStats, RangePromMetrics, stats_delta
from range_connector.namespace import FORMAT_VERSION, namespace_fingerprint
from range_connector.scheduler import RangeScheduler
from range_connector.sharding import ShardPlan, deployment_plan, shards_of_rank
from range_connector.tiers import open_shard_backends
from range_connector.worker import RangeWorker

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

    from range_connector.pcp_worker import PcpWorkerRouter

logger = logging.getLogger("vllm." + __name__)

#: test only: keep layer-pipelined loads even where MLA attention skips the per-layer hooks (to show the gap)
NO_MLA_FALLBACK_ENV = "RANGE_CONNECTOR_TEST_NO_MLA_FALLBACK"


def build_namespace(vllm_config: VllmConfig, config: RangeConfig, group: compat.AttentionGroup,
                    plan: ShardPlan) -> tuple[bytes, dict]:
    """Fingerprint of everything that changes KV bytes for this deployment (see namespace.py); the slicing rule
    is the plan's (:attr:`~range_connector.sharding.ShardPlan.rule`)."""
    fields = {
        "format_version": FORMAT_VERSION,
        "model": compat.model_identity(vllm_config),
        "kv_spec": dict(group.spec_fields),
        "num_layers": len(group.layer_names),
        "packing": compat.kv_packing(vllm_config, group),
        "block_size": group.block_size,
        "chunk_tokens": config.chunk_tokens,
        "num_shards": config.num_shards,
        "shard_rule": plan.rule,
        "salt": config.namespace_salt,
    }
    return namespace_fingerprint(fields), fields


def producer_settings(namespace_fields: dict) -> dict:
    """The settings a producer and a consumer must share, by name (sent in ``kv_transfer_params``; JSON-safe)."""
    keys = ("model", "block_size", "chunk_tokens", "num_shards", "num_layers", "kv_spec", "packing", "shard_rule",
            "format_version")
    return {k: json.loads(json.dumps(namespace_fields[k], default=str)) for k in keys if k in namespace_fields}


class RangeConnector(KVConnectorBase_V1):
    """Loads a prompt's cached KV from Range's tiers instead of recomputing it.

    Enabled with ``--kv-transfer-config '{"kv_connector": "RangeConnector", "kv_role": "kv_both",
    "kv_load_failure_policy": "recompute", "kv_connector_extra_config": {...}}'`` (keys: README / config.py).

    Raises:
        ConfigError: at construction, for bad config or a backend that does not answer (the message names the key).
    """

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        group = compat.attention_group(kv_cache_config)
        extra = self._kv_transfer_config.kv_connector_extra_config or {}
        cp = compat.context_parallel(vllm_config, in_worker=role != KVConnectorRole.SCHEDULER)
        parsed = RangeConfig.from_extra_config(extra)
        config, plan = deployment_plan(parsed, cp, group.block_size,
                                       num_shards_set=bool({"num_shards", "valkey_urls"} & set(extra)))
        if config.load_mode != parsed.load_mode:
            logger.warning("Range: load_mode %r becomes 'sync' with %d context-parallel ranks (they agree on what "
                           "landed before the forward); the cost-model gate is off", parsed.load_mode,
                           plan.num_writers)
        self.range_config = config
        self.shard_plan = plan
        self.namespace, self.namespace_fields = build_namespace(vllm_config, config, group, plan)
        role_name = self._kv_transfer_config.kv_role
        if role_name == "kv_producer" and config.save_mode == "async":
            # A prefill engine's answer (kv_transfer_params) promises KV that is stored: its saves end in the step.
            config = self.range_config = dataclasses.replace(config, save_mode="sync")
            if role == KVConnectorRole.WORKER:
                logger.info("Range: kv_producer saves synchronously (save_mode \"async\" ignored)")
        self._scheduler: RangeScheduler | None = None
        self._worker: RangeWorker | None = None
        self._pcp: PcpWorkerRouter | None = None  # set on a context-parallel rank (plan.num_writers > 1)
        self._last_stats: dict[str, int] = {}
        if role == KVConnectorRole.SCHEDULER:
            backends = open_shard_backends(config) if config.backend != "memory" else None
            self._scheduler = RangeScheduler(
                config, self.namespace, group.block_size * cp.dcp_size, backends,
                can_load=role_name in ("kv_both", "kv_consumer"), can_save=role_name in ("kv_both", "kv_producer"),
                num_layers=len(group.layer_names), layer_block_bytes=group.page_size_bytes,
                settings=producer_settings(self.namespace_fields), plan=plan)
        elif plan.num_writers > 1:
            from range_connector.pcp_worker import PcpWorkerRouter

            rank = cp.dcp_rank if plan.splits_blocks else cp.pcp_rank
            self._pcp = PcpWorkerRouter(
                config, plan, rank, compat.cp_process_group(dcp=plan.splits_blocks), group.block_size,
                group.layer_names, kv_cache_config.num_blocks,
                open_shard_backends(config, shards_of_rank(rank, plan.num_writers, plan.num_shards)),
                tp_rank=compat.tp_rank())
            self._worker = self._pcp.worker
        else:
            self._worker = RangeWorker(config, group.block_size, group.layer_names, kv_cache_config.num_blocks,
                                       open_shard_backends(config), tp_rank=compat.tp_rank())
            if compat.mla_layer_hooks_missing(group.is_mla) and os.environ.get(NO_MLA_FALLBACK_ENV) != "1":
                logger.warning("Range: MLA attention on this platform takes its direct-call branch, which does not "
                               "call the connector's per-layer hooks, and the engine patch is not applied "
                               "(`range-connector patch apply`): every load completes before the forward")
                self._worker.deliver_before_forward = True
        logger.info("RangeConnector %s: backend=%s shards=%d chunk_tokens=%d pcp=%d dcp=%d load_mode=%s "
                    "namespace=%s", role.name, config.backend, config.num_shards, config.chunk_tokens, cp.pcp_size,
                    cp.dcp_size, config.load_mode, self.namespace.hex())

    # ------------------------------------------------------------ worker side
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        (self._pcp or self._worker).register_kv_caches(kv_caches)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        if self._pcp is not None:
            self._pcp.start_load_kv(self._bound_metadata())
        else:
            self._worker.start_load(self._bound_metadata())

    def wait_for_layer_load(self, layer_name: str) -> None:
        if self._pcp is not None:
            self._pcp.wait_for_layer_load(layer_name)
        else:
            self._worker.wait_for_layer(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        return None  # saves read the registered KV cache in wait_for_save, after every layer ran

    def wait_for_save(self) -> None:
        if self._pcp is not None:
            self._pcp.wait_for_save(self._bound_metadata())
        else:
            self._worker.save(self._bound_metadata())

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return None, self._worker.get_finished(finished_req_ids) or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        if self._pcp is not None:
            return self._pcp.get_block_ids_with_load_errors()
        return self._worker.take_failed_block_ids()

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        if self._pcp is not None:
            return self._pcp.build_connector_worker_meta()
        return self._worker.build_worker_meta()

    def get_kv_connector_stats(self) -> RangeConnectorStats | None:
        current = dict(self._worker.stats) if self._worker is not None else self._scheduler.counters()
        delta = stats_delta(current, self._last_stats)
        return RangeConnectorStats(data=delta) if delta else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> RangeConnectorStats:
        return RangeConnectorStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config: VllmConfig, metric_types: dict[type, type], labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> RangePromMetrics:
        return RangePromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.close()
        if self._scheduler is not None:
            self._scheduler.close()

    def _bound_metadata(self) -> RangeConnectorMetadata:
        meta = self._connector_metadata
        if not isinstance(meta, RangeConnectorMetadata):
            return RangeConnectorMetadata()
        return meta

    # ------------------------------------------------------------ scheduler side
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        return self._scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        self._scheduler.update_state_after_alloc(request, list(blocks.get_block_ids()[0]), num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return self._scheduler.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        meta = getattr(connector_output, "kv_connector_worker_meta", None)
        self._scheduler.update_connector_output(meta if isinstance(meta, RangeWorkerMetadata) else None,
                                                set(connector_output.finished_recving or ()))

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self._scheduler.request_finished(request, block_ids)
