"""The min-across-shards lookup end to end against real Valkey servers (one per shard), under random eviction.

Each example writes a prompt's chunks through the real worker's rank views (rank ``r`` writes shard ``r``: real
stripes and tickets through ``range_connector.backends.valkey.client``), evicts random chunks on random shards with the
backend's own delete, and compares the lookup ``RangeScheduler.stored_prefix`` (what ``scheduler.py`` uses) with a
brute-force oracle and with :func:`range_connector.kv.sharding.common_stored_prefix` over the tickets read back.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from range_connector.backends.valkey.client import ValkeyBackend
from range_connector.config import RangeConfig, TierConfig
from range_connector.kv.metadata import ChunkTransfer, RangeConnectorMetadata, RequestTransfer
from range_connector.kv.sharding import RankSlice, ShardPlan, common_stored_prefix
from range_connector.kv.tickets import Ticket, ticket_key
from range_connector.scheduler.facade import RangeScheduler
from range_connector.worker.facade import RangeWorker
from range_connector.worker.pcp_router import rank_view_config
from tests.conftest import ValkeyServers
from tests.unit.scheduler_worker_harness import (
    BLOCK,
    LAYER_BLOCK_BYTES,
    LAYERS,
    NAMESPACE,
    NUM_BLOCKS,
    chain,
    make_kv,
    prompt_tokens,
)

pytestmark = pytest.mark.timeout(180)

MAX_SHARDS = 4
CHUNK = 4 * BLOCK


@pytest.fixture(scope="module")
def shard_urls(module_valkey_server_sets: Callable[[int], ValkeyServers]) -> list[str]:
    return list(module_valkey_server_sets(MAX_SHARDS).urls)


def connect(urls: list[str]) -> list[ValkeyBackend]:
    return [ValkeyBackend(u, timeout_s=5.0) for u in urls]


@settings(max_examples=30, deadline=None)
@given(num_shards=st.sampled_from([1, 2, 4]), num_chunks=st.integers(1, 8), seed=st.integers(0, 2**31), data=st.data())
def test_lookup_on_real_servers_is_the_longest_prefix_on_every_shard(
        shard_urls: list[str], num_shards: int, num_chunks: int, seed: int, data) -> None:
    urls = shard_urls[:num_shards]
    config = RangeConfig(tiers=(TierConfig("valkey"),), num_shards=num_shards, chunk_tokens=CHUNK).resolve(BLOCK)
    plan = ShardPlan(CHUNK // BLOCK, num_shards, pcp_size=num_shards)
    prompt = prompt_tokens(num_chunks * CHUNK + 1, seed=seed)  # a fresh prompt: keys never seen before
    hashes = chain(prompt, CHUNK)
    saves = RangeConnectorMetadata(saves=[RequestTransfer("w", tuple(
        ChunkTransfer(i, h, tuple(range(4)), tuple(range(4 * i, 4 * i + 4))) for i, h in enumerate(hashes)),
        num_chunks * CHUNK)])
    kv = make_kv("dense", seed=seed % 1000)
    for rank in range(num_shards):  # every rank writes its own shard, through its own connection
        view = RankSlice(plan, rank)
        worker = RangeWorker(rank_view_config(view, config, BLOCK), BLOCK, LAYERS, NUM_BLOCKS,
                             view.backends(connect([urls[s] for s in view.shard_idxs])), shard_idxs=view.shard_idxs)
        worker.register_kv_caches(kv)
        worker.save(view.metadata(saves))
        worker.close()
        assert worker.stats["saved_chunks"] == num_chunks
    evicted = data.draw(st.sets(st.tuples(st.integers(0, num_shards - 1), st.integers(0, num_chunks - 1))))
    backends = connect(urls)
    for s, i in sorted(evicted):  # the backend's own delete
        backends[s].delete_tickets([ticket_key(hashes[i], s)])
    per_shard = [[Ticket.decode(raw, num_layers=len(LAYERS), layer_block_bytes=LAYER_BLOCK_BYTES["dense"],
                                num_blocks=plan.blocks_per_shard)
                  for raw in b.get_tickets([ticket_key(h, s) for h in hashes])] for s, b in enumerate(backends)]

    sched = RangeScheduler(config, NAMESPACE, BLOCK, backends, can_load=True, can_save=True,
                           num_layers=len(LAYERS), layer_block_bytes=LAYER_BLOCK_BYTES["dense"])
    try:
        found = sched.stored_prefix(hashes)
    finally:
        sched.close()  # and the backends
    oracle = max(n for n in range(num_chunks + 1)
                 if all((s, i) not in evicted for s in range(num_shards) for i in range(n)))
    assert len(found) == oracle == len(common_stored_prefix(per_shard))
    assert found == common_stored_prefix(per_shard)
