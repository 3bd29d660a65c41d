"""The namespace and prefix hash chain an engine would compute, without starting one.

:func:`offline_namespace` resolves vLLM's config for a model (``EngineArgs(...).create_engine_config()``: vLLM's
own defaults and platform rules, e.g. the CPU block size), derives the KV-cache group its attention layers would
register (:func:`range_connector.compat.offline_attention_group`: KV heads per rank, head size, KV dtype, page bytes,
layer count) and then resolves the deployment with the very function every connector instance runs
(:func:`range_connector.spec.resolve_deployment`: shard plan, ranks' head slices, CPU instruction-set packing,
namespace). So the fingerprint equals the one a real engine with the same model, config, tensor-parallel size, block
size and KV dtype logs (``RangeConnector ... namespace=<hex>``) and reports in its ``range_describe`` answer.

:func:`offline_tiers` turns a config's embedded Valkey tiers into the servers recorded in its runtime directory
(starting nothing), so that :func:`open_offline_backends` opens the tiers as the engine's scheduler sees them.

Example::

    spec = offline_namespace("/models/llama", {"tiers": [{"type": "valkey"}]}, block_size=128)
    print(spec.namespace.hex(), spec.chunk_tokens)
    hashes, tail = spec.chain(token_ids)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from range_connector import compat
from range_connector.backends.base import Backend
from range_connector.backends.factory import open_scheduler_backends, open_tier_backends
from range_connector.config import RangeConfig
from range_connector.errors import BackendError, ConfigError
from range_connector.kv.heads import RankLayout
from range_connector.kv.namespace import ChunkHash, prefix_hash_chain, request_salt, tail_chunk_hash
from range_connector.kv.sharding import ShardPlan
from range_connector.spec import resolve_deployment

__all__ = ["OfflineSpec", "offline_namespace", "offline_tiers", "open_offline_backends", "open_offline_lookup_backends"]


@dataclass(frozen=True)
class OfflineSpec:
    """What an engine with this model and config would resolve, computed offline.

    Attributes:
        namespace: the 16-byte namespace fingerprint (:attr:`namespace_hex` to show it).
        fields: what went into it, by name (``model``, ``kv_spec``, ``num_layers``, ``packing``, ``block_size``,
            ``chunk_tokens``, ``num_shards``, ``shard_rule``, ``salt``, ``format_version``).
        config: the Range config resolved for this engine (``chunk_tokens`` set).
        plan: the shard plan.
        group: the KV-cache group the engine would register (its layer names are placeholders).
        ranks: the tensor-parallel ranks' head slices and ticket groups.
        block_size: the scheduler's block, tokens (the engine block size x the decode context-parallel size).
        tokenizer: the tokenizer vLLM would load (a path or a hub name).
        tensor_parallel_size: the engine's tensor-parallel size.
    """

    namespace: bytes
    fields: dict
    config: RangeConfig
    plan: ShardPlan
    group: compat.AttentionGroup
    ranks: RankLayout
    block_size: int
    tokenizer: str
    tensor_parallel_size: int

    @property
    def namespace_hex(self) -> str:
        """:attr:`namespace` as 32 hex digits."""
        return self.namespace.hex()

    @property
    def chunk_tokens(self) -> int:
        """Tokens per chunk (the resolved ``chunk_tokens``)."""
        assert self.config.chunk_tokens is not None
        return self.config.chunk_tokens

    @property
    def num_layers(self) -> int:
        """Attention layers of the model."""
        return len(self.group.layer_names)

    def chain(self, token_ids: Sequence[int] | np.ndarray, *, lora_name: str | None = None,
              cache_salt: str | None = None) -> tuple[list[ChunkHash], ChunkHash | None]:
        """A prompt's prefix hash chain as the scheduler computes it (:mod:`range_connector.kv.namespace`).

        Args:
            token_ids: ``[num_prompt_tokens]`` the prompt's token ids.
            lora_name: the request's adapter, if any.
            cache_salt: vLLM's per-request ``cache_salt``, if any.

        Returns:
            ``(hashes, tail)``: ``[num_prompt_tokens // chunk_tokens]`` chunk hashes, and the hash of the partial
            last chunk (``None`` when the prompt is whole chunks).
        """
        salt = request_salt(lora_name, cache_salt, ())
        hashes = prefix_hash_chain(self.namespace, salt, token_ids, self.chunk_tokens)
        return hashes, tail_chunk_hash(hashes, self.namespace, salt, token_ids, self.chunk_tokens)


def offline_namespace(model: str | Path, connector_config: Mapping[str, Any] | None, *, tensor_parallel_size: int = 1,
                      block_size: int | None = None, kv_cache_dtype: str = "auto", dtype: str = "auto",
                      **engine_args: Any) -> OfflineSpec:
    """The namespace (and the rest of :class:`OfflineSpec`) an engine would compute, without starting one.

    Args:
        model: the model as given to vLLM (a local directory, or a hub name that is in the local cache).
        connector_config: ``kv_connector_extra_config`` (``None``: ``{}``, the defaults).
        tensor_parallel_size: vLLM's ``--tensor-parallel-size``.
        block_size: vLLM's ``--block-size`` (tokens; ``None``: vLLM's default for the platform).
        kv_cache_dtype: vLLM's ``--kv-cache-dtype``.
        dtype: vLLM's ``--dtype``.
        **engine_args: other ``EngineArgs`` fields that change the KV layout (``revision``, ``tokenizer``,
            ``quantization``, ``decode_context_parallel_size``...).

    Returns:
        The offline spec; its ``namespace`` equals a real engine's for the same inputs.

    Raises:
        ConfigError: vLLM refuses the model or an argument (names ``model``), or the connector config is bad
            (names the key), as the engine would at start-up.
    """
    vllm_config = compat.offline_vllm_config(str(model), tensor_parallel_size=tensor_parallel_size,
                                             block_size=block_size, kv_cache_dtype=kv_cache_dtype, dtype=dtype,
                                             **engine_args)
    group = compat.offline_attention_group(vllm_config)
    _parsed, config, plan, cp, ranks, namespace, fields = resolve_deployment(
        vllm_config, group, dict(connector_config or {}), in_worker=False)
    return OfflineSpec(namespace, fields, config, plan, group, ranks, group.block_size * cp.dcp_size,
                       str(vllm_config.model_config.tokenizer), tensor_parallel_size)


def offline_tiers(config: RangeConfig) -> RangeConfig:
    """``config`` with each embedded Valkey tier pointed at the servers recorded in ``runtime_dir`` (their URLs,
    with the runtime dir's password, and the budget the engine would use), so that opening it starts nothing.

    Raises:
        ConfigError: an embedded tier has no servers recorded, or not ``num_shards`` of them (names ``runtime_dir``),
            or the record cannot be read.
    """
    from range_connector.backends.valkey.records import read_records
    from range_connector.backends.valkey.servers import embedded_urls

    tiers = list(config.tiers)
    for i, tier in enumerate(tiers):
        if not tier.embedded:
            continue
        runtime_dir = Path(config.resolved_runtime_dir)
        try:
            _, records = read_records(runtime_dir)
            urls = embedded_urls(runtime_dir)
        except BackendError as exc:
            raise ConfigError("runtime_dir", str(exc)) from exc
        if len(urls) != config.num_shards:
            hint = (f"set \"num_shards\": {len(urls)} in the config to use them" if urls else
                    f"start them with `range-connector valkey start --shards {config.num_shards} "
                    f"--runtime-dir {runtime_dir}` or by starting the engine")
            raise ConfigError("runtime_dir", f"{runtime_dir} records {len(urls)} embedded Valkey server(s), the "
                                             f"config has {config.num_shards} shard(s) (tiers[{i}]); {hint}")
        maxmemory_bytes = min((r.maxmemory_bytes for r in records if r.maxmemory_bytes), default=0)
        budget_bytes = tier.budget_bytes_for(maxmemory_bytes) if maxmemory_bytes else tier.budget_bytes
        tiers[i] = dataclasses.replace(tier, servers=tuple(urls), capacity_bytes=budget_bytes)
    return dataclasses.replace(config, tiers=tuple(tiers))


def open_offline_backends(config: RangeConfig, *, deployment: str | None = None) -> list[list[Backend] | None]:
    """Open every tier's shard backends for ``deployment`` (default: the config's), nearest tier first, embedded
    Valkey servers found in the runtime directory (:func:`offline_tiers`). The DRAM tier lives inside the engine:
    its place is ``None``. Close each backend when done.

    Returns:
        ``[num_tiers]`` lists of ``[num_shards]`` backends, or ``None`` for the DRAM tier.

    Raises:
        ConfigError: as :func:`offline_tiers`, or a server does not answer or refuses the credentials (names the
            tier's ``servers`` key).
    """
    resolved = offline_tiers(config if deployment is None else dataclasses.replace(config, deployment=deployment))
    return open_tier_backends(resolved, skip_memory=True)


def open_offline_lookup_backends(config: RangeConfig) -> list[Backend] | None:
    """The backends the engine's scheduler looks up with (:func:`~range_connector.backends.factory.
    open_scheduler_backends`), embedded servers found as :func:`offline_tiers` finds them.

    Raises:
        ConfigError: as :func:`open_offline_backends`.
    """
    return open_scheduler_backends(offline_tiers(config))
