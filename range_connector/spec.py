"""One spec builds both halves of the connector from vLLM's config and Range's: the resolved config, the shard plan,
the namespace, the backends, and then the scheduler half or the worker half (like vLLM's ``OffloadingSpec``).

:class:`RangeSpec` is built once per connector instance, in every process that builds one (engine core and each
worker); :meth:`RangeSpec.build_scheduler` and :meth:`RangeSpec.build_worker` open the backends that half needs.
The connector (:mod:`range_connector.connector`) only dispatches hooks.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

from range_connector import compat
from range_connector.backends.factory import open_scheduler_backends, open_worker_backends
from range_connector.config import RangeConfig
from range_connector.errors import ConfigError
from range_connector.kv.heads import RankLayout, group_view, rank_layout
from range_connector.kv.metadata import RangeConnectorMetadata
from range_connector.kv.namespace import FORMAT_VERSION, namespace_fingerprint
from range_connector.kv.sharding import ShardPlan, check_shard_count, shards_of_rank
from range_connector.scheduler.facade import RangeScheduler
from range_connector.worker.facade import RangeWorker
from range_connector.worker.pcp_router import PcpWorkerRouter

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

logger = logging.getLogger("vllm." + __name__)

#: test only: keep layer-pipelined loads even where MLA attention skips the per-layer hooks (to show the gap)
NO_MLA_FALLBACK_ENV = "RANGE_CONNECTOR_TEST_NO_MLA_FALLBACK"
#: vLLM's roles that load and that save
LOADING_ROLES = ("kv_both", "kv_consumer")
SAVING_ROLES = ("kv_both", "kv_producer")


def deployment_plan(config: RangeConfig, cp: compat.ContextParallel, block_size: int,
                    num_shards_set: bool) -> tuple[RangeConfig, ShardPlan]:
    """Resolve the config for this engine's context parallelism and build its shard plan.

    ``num_shards`` defaults to the writer count W (the PCP size P, or the DCP size D when DCP splits the cache)
    when neither ``num_shards`` nor the tier's servers are set; otherwise it must be a multiple of W. Under DCP the
    scheduler's block (and the chunk's unit) is ``block_size * D`` tokens (vLLM 0.32
    ``v1/core/single_type_kv_cache_manager.py`` L108). With W > 1 loads are synchronous (``load_mode`` "sync"):
    the ranks agree on what landed in ``start_load_kv``, before the forward (:mod:`range_connector.worker.pcp`).

    Args:
        config: the parsed config (``chunk_tokens`` may be unset).
        cp: the engine's context-parallel sizes (:func:`range_connector.compat.context_parallel`).
        block_size: the KV-cache spec's block size (tokens per physical block).
        num_shards_set: the user named ``num_shards`` or listed the tier's servers.

    Returns:
        ``(resolved config, plan)``.

    Raises:
        ConfigError: ``num_shards`` is not a positive multiple of W, ``chunk_tokens`` does not fit, the DRAM tier
            is asked to serve several ranks (its index cannot span processes), or the sizes are not served.
    """
    num_writers = cp.dcp_size if cp.dcp_size > 1 else cp.pcp_size
    if num_writers > 1:
        if config.has_memory_tier:
            raise ConfigError(config.tier.key_name("type"), f"the in-process DRAM tier cannot serve {num_writers} "
                                                            "context-parallel ranks; use valkey or file")
        if not num_shards_set:
            config = dataclasses.replace(config, num_shards=num_writers)
        check_shard_count(config.num_shards, num_writers)
        if config.load_mode != "sync":
            config = dataclasses.replace(config, load_mode="sync")
    scheduler_block = block_size * cp.dcp_size
    config = config.resolve(scheduler_block)
    assert config.chunk_tokens is not None
    try:
        plan = ShardPlan(config.chunk_tokens // scheduler_block, config.num_shards, cp.pcp_size, cp.dcp_size,
                         cp.cp_interleave_tokens)
    except ValueError as exc:
        raise ConfigError("num_shards", str(exc)) from exc
    return config, plan


def head_spec(group: compat.AttentionGroup, ranks: RankLayout) -> dict[str, str]:
    """The KV-cache spec's fields with the per-rank sizes replaced by the model's: ``num_kv_heads`` is the model's
    total and ``page_size_bytes`` becomes ``head_page_size_bytes`` (one block of one layer of one head), so that the
    namespace does not depend on the tensor-parallel size (the heads a ticket covers are in the ticket)."""
    spec = dict(group.spec_fields)
    local_heads = ranks.rank_slices[0].count
    spec["num_kv_heads"] = str(ranks.total_heads)
    spec["head_page_size_bytes"] = str(group.page_size_bytes // local_heads)
    del spec["page_size_bytes"]
    return spec


def build_namespace(vllm_config: VllmConfig, config: RangeConfig, group: compat.AttentionGroup,
                    plan: ShardPlan, ranks: RankLayout) -> tuple[bytes, dict]:
    """Fingerprint of everything that changes KV bytes for this deployment (see :mod:`range_connector.kv.namespace`);
    the slicing rule is the plan's (:attr:`~range_connector.kv.sharding.ShardPlan.rule`). The tensor-parallel size
    is not in it (:func:`head_spec`)."""
    fields = {
        "format_version": FORMAT_VERSION,
        "model": compat.model_identity(vllm_config),
        "kv_spec": head_spec(group, ranks),
        "num_layers": len(group.layer_names),
        "packing": compat.kv_packing(vllm_config, group),
        "block_size": group.block_size,
        "chunk_tokens": config.chunk_tokens,
        "num_shards": config.num_shards,
        "shard_rule": plan.rule,
        "salt": config.namespace_salt,
    }
    return namespace_fingerprint(fields), fields


def resolve_deployment(vllm_config: VllmConfig, group: compat.AttentionGroup, extra: dict, *, in_worker: bool
                       ) -> tuple[RangeConfig, RangeConfig, ShardPlan, compat.ContextParallel, RankLayout, bytes, dict]:
    """Everything the namespace follows from, resolved as every connector instance does (and, without an engine,
    :mod:`range_connector.ops.offline_spec`): the parsed and the resolved config, the shard plan, the
    context-parallel sizes, the ranks' head slices, the namespace and its fields.

    Args:
        vllm_config: vLLM's config of the engine.
        group: the KV-cache group Range serves (:func:`~range_connector.compat.attention_group`).
        extra: ``kv_connector_extra_config``.
        in_worker: this process is a worker (its context-parallel ranks are read).

    Returns:
        ``(parsed config, resolved config, plan, cp, ranks, namespace, namespace fields)``.

    Raises:
        ConfigError: a bad config, pipeline parallelism, or DCP with KV heads split over TP ranks (names the key).
    """
    cp = compat.context_parallel(vllm_config, in_worker=in_worker)
    parsed = RangeConfig.from_extra_config(extra)
    pp_size = compat.pipeline_parallel_size(vllm_config)
    if pp_size > 1:
        raise ConfigError("pipeline_parallel_size", f"is {pp_size}: a hit needs every stage's layers, and "
                                                    "RangeConnector stores one stage's; run it with "
                                                    "pipeline_parallel_size 1")
    config, plan = deployment_plan(parsed, cp, group.block_size,
                                   num_shards_set="num_shards" in extra or bool(parsed.tier.servers))
    total_heads, local_heads, tp_size = compat.kv_heads(vllm_config, group)
    ranks = rank_layout(total_heads, tp_size, local_heads=local_heads, process_local=config.has_memory_tier)
    if cp.dcp_size > 1 and ranks.num_groups > 1:
        raise ConfigError("decode_context_parallel_size", f"is {cp.dcp_size} with KV heads split over "
                                                          f"{tp_size} tensor-parallel ranks, which "
                                                          "RangeConnector does not serve (MLA models only)")
    namespace, fields = build_namespace(vllm_config, config, group, plan, ranks)
    return parsed, config, plan, cp, ranks, namespace, fields


def producer_settings(namespace_fields: dict) -> dict:
    """The settings a producer and a consumer must share, by name (sent in ``kv_transfer_params``; JSON-safe).

    Nested fields are flattened to dotted names (``kv_spec.dtype``, ``model.cache_dtype``), so that a mismatch
    names the very setting (the proxy's HTTP 409 and both engines' logs)."""
    keys = ("model", "block_size", "chunk_tokens", "num_shards", "num_layers", "kv_spec", "packing", "shard_rule",
            "format_version")
    out: dict = {}
    for k in keys:
        if k not in namespace_fields:
            continue
        value = json.loads(json.dumps(namespace_fields[k], default=str))
        if isinstance(value, dict):
            out.update({f"{k}.{sub}": v for sub, v in value.items()})
        else:
            out[k] = value
    return out


@dataclass(frozen=True)
class RangeSpec:
    """Everything both halves are built from, resolved once per connector instance.

    Attributes:
        config: the config resolved for this engine (``chunk_tokens`` set; ``load_mode`` "sync" with several
            context-parallel writers; ``save_mode`` "sync" for a ``kv_producer``).
        requested_load_mode: ``load_mode`` as the user wrote it (it differs from ``config.load_mode`` only where
            context parallelism forced "sync").
        plan: the shard plan (which blocks of a chunk each shard holds, which rank writes it).
        cp: the engine's context-parallel sizes and this process's ranks.
        group: the KV-cache group Range serves (its layers, block size and page bytes).
        num_blocks: blocks in the engine's KV cache.
        kv_role: vLLM's ``kv_role`` (``kv_both``, ``kv_producer`` or ``kv_consumer``).
        namespace: the fingerprint of everything that changes KV bytes (:func:`build_namespace`).
        namespace_fields: what went into it, by name.
        ranks: which KV heads each tensor-parallel rank holds, the ticket groups and their writers
            (:mod:`range_connector.kv.heads`).
        tp_rank: this process's tensor-parallel rank (0 in the engine core).

    Raises:
        ConfigError: from :meth:`from_vllm`, for bad config or a backend that does not answer (names the key).
    """

    config: RangeConfig
    requested_load_mode: str
    plan: ShardPlan
    cp: compat.ContextParallel
    group: compat.AttentionGroup
    num_blocks: int
    kv_role: str
    namespace: bytes
    namespace_fields: dict
    ranks: RankLayout
    tp_rank: int = 0

    @classmethod
    def from_vllm(cls, vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, *, in_worker: bool) -> RangeSpec:
        """Resolve the spec from vLLM's config (``kv_transfer_config``) and the engine's KV-cache config."""
        transfer = vllm_config.kv_transfer_config
        group = compat.attention_group(kv_cache_config)
        parsed, config, plan, cp, ranks, namespace, fields = resolve_deployment(
            vllm_config, group, transfer.kv_connector_extra_config or {}, in_worker=in_worker)
        if transfer.kv_role == "kv_producer" and config.save_mode == "async":
            # A prefill engine's answer (kv_transfer_params) promises KV that is stored: its saves end in the step.
            config = dataclasses.replace(config, save_mode="sync")
            if in_worker and "save_mode" in (transfer.kv_connector_extra_config or {}):  # (asked for, not the default)
                logger.info("Range: kv_producer saves synchronously (save_mode \"async\" ignored)")
        return cls(config, parsed.load_mode, plan, cp, group, kv_cache_config.num_blocks, transfer.kv_role,
                   namespace, fields, ranks, compat.tp_rank() if in_worker else 0)

    def build_scheduler(self) -> RangeScheduler:
        """The scheduler half (engine-core process); it opens the remote tiers' backends (the DRAM tier's index
        lives in it, its bytes in the workers)."""
        config = self.config
        backends = open_scheduler_backends(config)
        return RangeScheduler(
            config, self.namespace, self.group.block_size * self.cp.dcp_size, backends,
            can_load=self.kv_role in LOADING_ROLES, can_save=self.kv_role in SAVING_ROLES,
            num_layers=len(self.group.layer_names), layer_block_bytes=self.group.page_size_bytes,
            settings=producer_settings(self.namespace_fields), plan=self.plan, groups=self.ranks.groups,
            num_saving_ranks=sum(self.ranks.writers) * self.plan.num_writers)

    @property
    def far_writes(self) -> str:
        """How saves reach the tiers past the nearest: in the step for a producer (its answer promises KV on shared
        storage), else on each shard's far-writer thread."""
        return "sync" if self.kv_role == "kv_producer" else "async"

    @property
    def write_back(self) -> bool:
        """``write_policy`` ``"write-back"``, except on a producer (its saves must reach shared storage)."""
        return self.config.write_policy == "write-back" and self.kv_role != "kv_producer"

    def rank_view(self, meta: RangeConnectorMetadata) -> RangeConnectorMetadata:
        """The scheduler's metadata as this rank's worker sees it: each chunk's tickets cut to the rank's ticket
        group (:func:`range_connector.kv.heads.group_view`)."""
        return group_view(meta, self.ranks.rank_group[self.tp_rank], self.ranks.num_groups, self.config.num_shards)

    def build_worker(self) -> tuple[RangeWorker, PcpWorkerRouter | None]:
        """The worker half (one per worker process) and, on a context-parallel rank (several writers), the router
        that wraps the rank's own worker with the ranks' agreement and exchange."""
        config, plan, group = self.config, self.plan, self.group
        heads = {"head_slice": self.ranks.rank_slices[self.tp_rank],
                 "ticket_group": self.ranks.rank_group[self.tp_rank], "is_writer": self.ranks.writers[self.tp_rank]}
        if plan.num_writers > 1:
            rank = self.cp.dcp_rank if plan.splits_blocks else self.cp.pcp_rank
            router = PcpWorkerRouter(
                config, plan, rank, compat.cp_process_group(dcp=plan.splits_blocks), group.block_size,
                group.layer_names, self.num_blocks,
                open_worker_backends(config, shards_of_rank(rank, plan.num_writers, plan.num_shards),
                                     far_writes=self.far_writes, write_back=self.write_back),
                tp_rank=self.tp_rank, **heads)
            return router.worker, router
        worker = RangeWorker(config, group.block_size, group.layer_names, self.num_blocks,
                             open_worker_backends(config, far_writes=self.far_writes, write_back=self.write_back),
                             tp_rank=self.tp_rank, **heads)
        if compat.mla_layer_hooks_missing(group.is_mla) and os.environ.get(NO_MLA_FALLBACK_ENV) != "1":
            logger.warning("Range: MLA attention on this platform takes its direct-call branch, which does not "
                           "call the connector's per-layer hooks, and the engine patch is not applied "
                           "(`range-connector patch apply`): every load completes before the forward")
            worker.deliver_before_forward = True
        return worker, None
