"""How the connector is configured for context parallelism: ``spec.deployment_plan`` (shard count, load mode,
plan, slicing rule) and the compatibility probe of vLLM's PCP/DCP sizes and ranks (``compat.context_parallel``).
The worker-side routing itself (:class:`~range_connector.worker.pcp_router.PcpWorkerRouter`) runs in the multi-process
harness (``tests/pcp``)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from vllm.config import ParallelConfig

from range_connector import compat
from range_connector.compat import ContextParallel
from range_connector.config import RangeConfig
from range_connector.errors import ConfigError
from range_connector.kv.namespace import SHARD_RULE
from range_connector.kv.sharding import ShardPlan
from range_connector.spec import deployment_plan

pytestmark = pytest.mark.timeout(60)

BLOCK = 16


@pytest.mark.parametrize("load_mode", ["pipelined", "async", "auto"])
def test_one_writer_leaves_the_config_as_it_was(load_mode: str) -> None:
    config = RangeConfig.from_extra_config({"backend": "valkey", "num_shards": 2, "load_mode": load_mode})

    resolved, plan = deployment_plan(config, ContextParallel(), BLOCK, num_shards_set=True)

    assert resolved == config.resolve(BLOCK)
    assert plan == ShardPlan(resolved.chunk_tokens // BLOCK, 2)
    assert plan.rule == SHARD_RULE


@pytest.mark.parametrize("pcp_size", [2, 4])
def test_num_shards_defaults_to_the_pcp_size_and_loads_are_synchronous(pcp_size: int) -> None:
    config = RangeConfig.from_extra_config({"backend": "valkey", "load_mode": "auto"})

    resolved, plan = deployment_plan(config, ContextParallel(pcp_size=pcp_size), BLOCK, num_shards_set=False)

    assert resolved.num_shards == plan.num_shards == pcp_size
    assert resolved.load_mode == "sync"  # the ranks agree in start_load_kv, before the forward
    assert (plan.pcp_size, plan.num_writers, plan.needs_exchange) == (pcp_size, pcp_size, True)
    assert resolved.chunk_tokens % (BLOCK * pcp_size) == 0
    assert plan.blocks_per_chunk == resolved.chunk_tokens // BLOCK


def test_more_shards_than_ranks_are_kept() -> None:
    config = RangeConfig.from_extra_config({"backend": "valkey", "num_shards": 4})

    resolved, plan = deployment_plan(config, ContextParallel(pcp_size=2), BLOCK, num_shards_set=True)

    assert (resolved.num_shards, plan.shards_per_writer) == (4, 2)


def test_a_shard_count_that_is_not_a_multiple_of_the_pcp_size_is_refused() -> None:
    config = RangeConfig.from_extra_config({"backend": "valkey", "valkey_urls": [
        "valkey://127.0.0.1:7001", "valkey://127.0.0.1:7002", "valkey://127.0.0.1:7003"]})

    with pytest.raises(ConfigError, match="num_shards"):
        deployment_plan(config, ContextParallel(pcp_size=2), BLOCK, num_shards_set=True)


def test_the_dram_tier_cannot_serve_several_ranks() -> None:
    config = RangeConfig.from_extra_config({"backend": "memory"})

    with pytest.raises(ConfigError, match="backend"):
        deployment_plan(config, ContextParallel(pcp_size=2), BLOCK, num_shards_set=False)


def test_dcp_splits_blocks_and_names_its_interleave_in_the_rule() -> None:
    config = RangeConfig.from_extra_config({"backend": "valkey"})

    resolved, plan = deployment_plan(config, ContextParallel(dcp_size=2, cp_interleave_tokens=8), BLOCK,
                                     num_shards_set=False)

    # the scheduler's block is block_size * D tokens (vLLM's single_type_kv_cache_manager.py L108)
    assert resolved.chunk_tokens % (BLOCK * 2) == 0
    assert plan.blocks_per_chunk == resolved.chunk_tokens // (BLOCK * 2)
    assert plan.splits_blocks and not plan.needs_exchange
    assert plan.rule == f"dcp2-interleave8-{SHARD_RULE}"
    plan.check_tiling(BLOCK)


def test_context_parallel_reads_vllms_parallel_config() -> None:
    vllm_config = SimpleNamespace(parallel_config=ParallelConfig(
        prefill_context_parallel_size=2, decode_context_parallel_size=1, cp_kv_cache_interleave_size=4))

    cp = compat.context_parallel(vllm_config)  # type: ignore[arg-type]

    assert cp == ContextParallel(pcp_size=2, dcp_size=1, cp_interleave_tokens=4, pcp_rank=0, dcp_rank=0)


def test_a_worker_without_vllms_pcp_group_is_a_config_error() -> None:
    vllm_config = SimpleNamespace(parallel_config=ParallelConfig(prefill_context_parallel_size=2))

    with pytest.raises(ConfigError, match="parallel_config"):
        compat.context_parallel(vllm_config, in_worker=True)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="parallel_config"):
        compat.cp_process_group(dcp=False)
