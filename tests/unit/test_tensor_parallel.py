"""Tensor parallelism > 1 is exact: every rank loads the KV of its own heads (issue 15, item 1).

The engine-less harness runs one scheduler half and one worker half per rank, each rank with KV tensors of its own
head slice (:mod:`range_connector.kv.heads`), and merges the ranks' outputs as vLLM's ``KVOutputAggregator`` does.
The oracle: every block a rank loads is byte-identical, in that rank's cache, to the block the producing engine's
same rank saved. The real engine at ``--tensor-parallel-size 2`` is tested in
``tests/integration/test_engine_tensor_parallel.py``.
"""

from __future__ import annotations

import msgpack
import pytest

from range_connector.backends.memory import MemoryBackend
from range_connector.errors import BackendError, ConfigError
from range_connector.kv.heads import HeadSlice, group_view, rank_layout
from range_connector.kv.tickets import Ticket, ticket_key
from tests.unit.scheduler_worker_harness import (
    BLOCK,
    NUM_KV_HEADS,
    Engine,
    FakeRequest,
    FlakyBackend,
    chain,
    live_leases,
    produce,
    prompt_tokens,
    same_block,
    same_head_block,
    shard_backends,
    wrap,
)

CHUNK = 32
PROMPT = 100  # three full chunks (96 tokens) and a partial one


def mismatched_blocks(a: Engine, a_ids: list[int], b: Engine, b_ids: list[int], num_blocks: int) -> list[tuple]:
    """``(rank, block index)`` of every one of the first ``num_blocks`` blocks whose bytes differ between engine
    ``a``'s and engine ``b``'s cache of the same rank (empty: every rank's blocks are identical)."""
    return [(r, i) for r in range(len(a.kvs)) for i in range(num_blocks)
            if not same_block(a.kvs[r], a_ids[i], b.kvs[r], b_ids[i])]


def reload(backends, prompt, *, req_id: str = "B-0", **engine_kw) -> tuple[Engine, int, list[int]]:
    """A fresh engine admits ``prompt``; returns it, the tokens it loaded, and the request's block ids."""
    b = Engine(backends, seed=2, **engine_kw)
    ext = b.admit(FakeRequest(req_id, prompt))
    res = b.step()
    assert not res.invalid_block_ids
    return b, ext, list(b.running[req_id].block_ids)


@pytest.mark.parametrize("path", ["bank", "direct", "views"])
@pytest.mark.parametrize("num_shards", [1, 2])
def test_tp2_fresh_engine_loads_each_rank_its_own_heads(path: str, num_shards: int) -> None:
    backends = wrap(shard_backends(num_shards, num_shards), path)
    prompt = prompt_tokens(PROMPT, seed=5)
    a, a_ids = produce(backends, prompt, num_shards=num_shards, tp_size=2)
    b, ext, b_ids = reload(backends, prompt, num_shards=num_shards, tp_size=2)
    assert ext == 96
    assert mismatched_blocks(a, a_ids, b, b_ids, ext // BLOCK) == []
    # each rank wrote its own stripes: the two ranks' tickets name different stripes holding different heads
    h = chain(prompt, CHUNK)[0]
    t0, t1 = (Ticket.decode(backends[0].get_tickets([ticket_key(h, 0, head)])[0], num_layers=4,
                            layer_block_bytes=b.layer_block_bytes, num_blocks=2 // num_shards,
                            heads=(head, 1)) for head in (0, 1))
    assert t0 is not None and t1 is not None and t0.stripe_id != t1.stripe_id
    assert b.sched.num_leases == 0 and live_leases(backends) == 0
    a.close()
    b.close()


def test_the_oracle_catches_a_rank_that_loads_another_ranks_heads() -> None:
    """The bug users saw: every rank read rank 0's tickets. Swapped in (rank 1 handed rank 0's tickets, and the
    head check of its tickets taken away, as the old code had none), the oracle reports rank 1's blocks."""
    backends = shard_backends(1, 1)
    prompt = prompt_tokens(PROMPT, seed=6)
    a, a_ids = produce(backends, prompt, tp_size=2)
    b = Engine(backends, seed=2, tp_size=2)
    b.rank_view = lambda meta, r: group_view(meta, 0, 2, 1)
    object.__setattr__(b.workers[1].load_context, "heads", (0, 1))
    ext = b.admit(FakeRequest("B-0", prompt))
    b.step()
    bad = mismatched_blocks(a, a_ids, b, list(b.running["B-0"].block_ids), ext // BLOCK)
    assert ext == 96 and bad and {r for r, _ in bad} == {1}
    a.close()
    b.close()


def test_a_rank_refuses_tickets_of_other_heads() -> None:
    """Without the scheduler's per-rank cut, rank 1's worker still never writes rank 0's heads: the tickets do not
    fit its heads, its blocks are reported failed and vLLM recomputes them."""
    backends = shard_backends(1, 1)
    prompt = prompt_tokens(PROMPT, seed=7)
    a, _ = produce(backends, prompt, tp_size=2)
    b = Engine(backends, seed=2, tp_size=2)
    b.rank_view = lambda meta, r: group_view(meta, 0, 2, 1)
    ext = b.admit(FakeRequest("B-0", prompt))
    before = {name: t.clone() for name, t in b.kvs[1].items()}
    res = b.step(forward=False)
    ids = b.running["B-0"].block_ids
    assert ext == 96 and res.invalid_block_ids == set(ids[:ext // BLOCK])
    assert all(b.kvs[1][n].equal(before[n]) for n in before)  # nothing was written into rank 1's cache
    a.close()
    b.close()


@pytest.mark.parametrize("evicted_chunk", [0, 1, 2])
def test_one_ranks_slice_evicted_shortens_the_hit_of_every_rank(evicted_chunk: int) -> None:
    backends = shard_backends(2, 2)
    prompt = prompt_tokens(PROMPT, seed=8)
    a, a_ids = produce(backends, prompt, num_shards=2, tp_size=2)
    h = chain(prompt, CHUNK)[evicted_chunk]
    backends[1].delete_tickets([ticket_key(h, 1, 1)])  # rank 1's slice of the chunk, on shard 1 only
    b, ext, b_ids = reload(backends, prompt, num_shards=2, tp_size=2)
    assert ext == evicted_chunk * CHUNK
    assert mismatched_blocks(a, a_ids, b, b_ids, ext // BLOCK) == []
    a.close()
    b.close()


@pytest.mark.parametrize("kind,tp_size", [("dense", 4), ("mla", 2)])
def test_replicated_heads_are_stored_once_and_loaded_by_every_rank(kind: str, tp_size: int) -> None:
    """TP > KV heads (GQA: vLLM replicates a head over TP / H ranks) and MLA (every rank holds the latent row):
    the first rank of each head slice writes, every rank loads."""
    mem = MemoryBackend(64 << 20)
    backends = [FlakyBackend(mem)]
    prompt = prompt_tokens(PROMPT, seed=9)
    a, a_ids = produce(backends, prompt, kind=kind, tp_size=tp_size)
    assert [w.is_writer for w in a.workers] == ([True, False, True, False] if kind == "dense" else [True, False])
    writes = backends[0].calls["write_stripe"]
    assert writes == 2 * (2 if kind == "dense" else 1)  # two save steps, one stripe per writing rank
    b, ext, b_ids = reload(backends, prompt, kind=kind, tp_size=tp_size)
    assert ext == 96
    assert mismatched_blocks(a, a_ids, b, b_ids, ext // BLOCK) == []
    a.close()
    b.close()


def dram_tier(tp_size: int) -> list[list]:
    """The in-process DRAM tier of each rank (each worker process holds its own)."""
    return [[FlakyBackend(MemoryBackend(64 << 20, name=f"dram-r{r}"), views=True)] for r in range(tp_size)]


def test_dram_tier_at_tp2_reloads_each_rank_from_its_own_memory() -> None:
    ranks = dram_tier(2)
    eng = Engine(ranks[0], lookup_backends=None, tp_size=2, rank_backends=ranks)
    prompt = prompt_tokens(PROMPT, seed=10)
    eng.admit(FakeRequest("A-0", prompt))
    eng.step()
    a_ids = list(eng.running["A-0"].block_ids)
    assert len(eng.sched.lookup.index) == 3
    # the index holds both ranks' tickets, each naming a stripe in that rank's own memory
    t0, t1 = eng.sched.lookup.index[chain(prompt, CHUNK)[0]]
    assert t0.stripe_id in ranks[0][0].inner._stripes and t1.stripe_id in ranks[1][0].inner._stripes
    # the same prompt again, into other blocks (A-0 still holds its own)
    ext = eng.admit(FakeRequest("A-1", prompt))
    res = eng.step()
    b_ids = list(eng.running["A-1"].block_ids)
    assert ext == 96 and not res.invalid_block_ids
    assert [(r, i) for r in range(2) for i in range(ext // BLOCK)
            if not same_block(eng.kvs[r], a_ids[i], eng.kvs[r], b_ids[i])] == []
    assert all(rank[0].calls["view_stripes"] == 1 for rank in ranks)
    eng.close()


def test_dram_tier_learns_a_chunk_only_once_every_rank_saved_it() -> None:
    ranks = dram_tier(2)
    ranks[1][0].fail_write = BackendError  # rank 1's DRAM tier refuses writes
    eng = Engine(ranks[0], lookup_backends=None, tp_size=2, rank_backends=ranks)
    prompt = prompt_tokens(PROMPT, seed=11)
    eng.admit(FakeRequest("A-0", prompt))
    res = eng.step()
    assert res.worker_meta is not None and {g for _h, g, _t in res.worker_meta.saved} == {0}
    assert eng.sched.lookup.index == {}
    assert eng.sched.get_num_new_matched_tokens(FakeRequest("A-1", prompt), 0) == (0, False)
    eng.close()


def test_dram_tier_eviction_on_one_rank_forgets_the_chunk_for_every_rank() -> None:
    ranks = dram_tier(2)
    eng = Engine(ranks[0], lookup_backends=None, tp_size=2, rank_backends=ranks)
    prompt = prompt_tokens(PROMPT, seed=12)
    eng.admit(FakeRequest("A-0", prompt))
    eng.step()
    hashes = chain(prompt, CHUNK)
    worker = eng.workers[1]
    worker.drop(hashes[1], 0)  # rank 1 found its chunk 1 bad (or its DRAM tier evicted it)
    eng.sched.update_connector_output(worker.build_worker_meta())
    assert list(eng.sched.lookup.index) == [hashes[0], hashes[2]]
    assert eng.sched.get_num_new_matched_tokens(FakeRequest("A-1", prompt), 0) == (32, False)
    eng.close()


def test_rank_layout_follows_vllms_split() -> None:
    assert rank_layout(2, 2, local_heads=1, process_local=False).groups == (HeadSlice(0, 1), HeadSlice(1, 1))
    tp4 = rank_layout(2, 4, local_heads=1, process_local=False)
    assert tp4.rank_slices == (HeadSlice(0, 1), HeadSlice(0, 1), HeadSlice(1, 1), HeadSlice(1, 1))
    assert tp4.rank_group == (0, 0, 1, 1) and tp4.writers == (True, False, True, False)
    tp2of8 = rank_layout(8, 2, local_heads=4, process_local=False)
    assert tp2of8.rank_slices == (HeadSlice(0, 4), HeadSlice(4, 4))
    local = rank_layout(2, 4, local_heads=1, process_local=True)
    assert local.num_groups == 4 and local.writers == (True,) * 4 and local.rank_group == (0, 1, 2, 3)
    mla = rank_layout(1, 2, local_heads=1, process_local=False)
    assert mla.groups == (HeadSlice(0, 1),) and mla.writers == (True, False)
    assert NUM_KV_HEADS == 2


def test_rank_layout_refuses_a_cache_that_is_not_vllms_split() -> None:
    with pytest.raises(ConfigError, match="tensor_parallel_size"):
        rank_layout(8, 2, local_heads=8, process_local=False)
    with pytest.raises(ConfigError, match="tensor_parallel_size"):
        rank_layout(6, 4, local_heads=1, process_local=False)


def test_a_ticket_for_other_heads_or_an_old_format_is_a_miss() -> None:
    t = Ticket("ab12", 0, 2, 2, 4, 1, 64, (1, 2, 3, 4), (), head_start=1, num_heads=1)
    raw = t.encode()
    kw = {"num_layers": 4, "layer_block_bytes": 64, "num_blocks": 2}
    assert Ticket.decode(raw, heads=(1, 1), **kw) == t
    assert Ticket.decode(raw, heads=(0, 1), **kw) is None
    assert Ticket.decode(raw, heads=(0, 2), **kw) is None
    old = msgpack.packb([1, "ab12", 0, 2, 2, 4, 1, 64, [1, 2, 3, 4]])  # a version-1 ticket (no heads)
    assert Ticket.decode(old, **kw) is None


# ------------------------------------------------------------------------------------- mixed layouts (P/D)
def head_mismatches(a: Engine, a_ids: list[int], b: Engine, b_ids: list[int], num_blocks: int) -> list[tuple]:
    """``(model head, block index)`` of every head of the first ``num_blocks`` blocks whose bytes differ between
    engine ``a`` and engine ``b``, whatever rank of each holds that head."""
    out = []
    for head in range(NUM_KV_HEADS):
        ra = next(r for r, s in enumerate(a.ranks.rank_slices) if head in s.heads)
        rb = next(r for r, s in enumerate(b.ranks.rank_slices) if head in s.heads)
        ha, hb = head - a.ranks.rank_slices[ra].start, head - b.ranks.rank_slices[rb].start
        out += [(head, i) for i in range(num_blocks)
                if not same_head_block(a.kvs[ra], a_ids[i], ha, b.kvs[rb], b_ids[i], hb)]
    return out


@pytest.mark.parametrize("kind", ["dense", "split-kv"])
@pytest.mark.parametrize("producer_tp,consumer_tp", [(2, 1), (1, 2)])
def test_a_consumer_of_another_tp_size_assembles_its_heads_from_the_producers_slices(
        kind: str, producer_tp: int, consumer_tp: int) -> None:
    backends = wrap(shard_backends(2, 2), "bank")
    prompt = prompt_tokens(PROMPT, seed=13)
    a, a_ids = produce(backends, prompt, num_shards=2, kind=kind, tp_size=producer_tp, model_heads=True)
    b = Engine(backends, seed=2, num_shards=2, kind=kind, tp_size=consumer_tp, model_heads=True)
    ext = b.admit(FakeRequest("B-0", prompt))
    res = b.step()
    b_ids = list(b.running["B-0"].block_ids)
    assert ext == 96 and not res.invalid_block_ids
    assert head_mismatches(a, a_ids, b, b_ids, ext // BLOCK) == []
    assert sum(w.stats["reassembled_chunks"] for w in b.workers) == 3 * consumer_tp
    assert b.sched.num_leases == 0 and live_leases(backends) == 0
    a.close()
    b.close()


def test_the_head_oracle_catches_a_corrupted_piece_and_the_checksum_fails_it() -> None:
    mem = [MemoryBackend(64 << 20, name=f"m{s}") for s in range(2)]
    backends = wrap(mem, "bank")
    prompt = prompt_tokens(PROMPT, seed=14)
    a, a_ids = produce(backends, prompt, num_shards=2, tp_size=2, model_heads=True)
    h = chain(prompt, CHUNK)[0]
    t = Ticket.decode(mem[0].get_tickets([ticket_key(h, 0, 1)])[0], num_layers=4, layer_block_bytes=a.layer_block_bytes,
                      num_blocks=1, heads=(1, 1))
    assert t is not None
    backends[0].corrupt_reads.add((t.stripe_id, 0, t.block_offset * t.row_bytes))  # head 1, block 0, layer 0
    unchecked = Engine(backends, seed=2, num_shards=2, model_heads=True, verify_checksums=False)
    ext = unchecked.admit(FakeRequest("B-0", prompt))
    unchecked.step()
    assert ext == 96
    assert head_mismatches(a, a_ids, unchecked, list(unchecked.running["B-0"].block_ids), 6) == [(1, 0)]
    checked = Engine(backends, seed=3, num_shards=2, model_heads=True)
    checked.admit(FakeRequest("C-0", prompt))
    res = checked.step()
    ids = checked.running["C-0"].block_ids
    assert res.invalid_block_ids == set(ids[:6])  # chunk 0 failed, so the request's load fails from there
    assert checked.workers[0].stats["load_integrity_errors"] == 1
    for e in (a, unchecked, checked):
        e.close()


def test_the_namespace_and_the_shared_settings_do_not_depend_on_the_tp_size() -> None:
    """A TP 1 and a TP 2 engine of one model share a namespace (the heads a value holds are in its ticket), and
    the settings a producer and a consumer compare name nested fields one by one."""
    from range_connector.compat import AttentionGroup
    from range_connector.spec import head_spec, producer_settings

    def group(local_heads: int) -> AttentionGroup:
        fields = (("spec", "FullAttentionSpec"), ("block_size", "128"), ("num_kv_heads", str(local_heads)),
                  ("head_size", "64"), ("dtype", "torch.bfloat16"), ("page_size_bytes", str(local_heads * 32768)))
        return AttentionGroup(("l0",), 128, local_heads * 32768, fields, False)

    tp1 = head_spec(group(2), rank_layout(2, 1, local_heads=2, process_local=False))
    tp2 = head_spec(group(1), rank_layout(2, 2, local_heads=1, process_local=False))
    assert tp1 == tp2 and tp1["num_kv_heads"] == "2" and tp1["head_page_size_bytes"] == "32768"
    settings = producer_settings({"kv_spec": tp1, "block_size": 128, "format_version": 2})
    assert settings["kv_spec.dtype"] == "torch.bfloat16" and settings["block_size"] == 128
    assert "kv_spec" not in settings


def _spec_inputs(*, tp: int = 1, pp: int = 1, dcp: int = 1, local_heads: int = 1, tier: str = "valkey"):
    """A stand-in for vLLM's config (only what ``RangeSpec.from_vllm`` reads before it opens a backend) and a real
    KV-cache config of one full-attention group."""
    from types import SimpleNamespace

    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    spec = FullAttentionSpec(block_size=128, num_kv_heads=local_heads, head_size=64, dtype=torch.bfloat16)
    kv_cache_config = KVCacheConfig(num_blocks=8, kv_cache_tensors=[],
                                    kv_cache_groups=[KVCacheGroupSpec(["model.layers.0.attn"], spec)])
    servers = [f"valkey://127.0.0.1:{port}" for port in range(1, 1 + dcp)]  # (one shard per DCP rank)
    extra = {"tiers": [{"type": tier, "servers": servers}] if tier == "valkey" else [{"type": tier}]}
    vllm_config = SimpleNamespace(
        kv_transfer_config=SimpleNamespace(kv_connector_extra_config=extra, kv_role="kv_both"),
        parallel_config=SimpleNamespace(tensor_parallel_size=tp, pipeline_parallel_size=pp,
                                        prefill_context_parallel_size=1, decode_context_parallel_size=dcp,
                                        cp_kv_cache_interleave_size=1),
        model_config=SimpleNamespace(get_total_num_kv_heads=lambda: 2, model="m", dtype="bfloat16"),
        cache_config=SimpleNamespace(cache_dtype="auto"))
    return vllm_config, kv_cache_config


def test_pipeline_parallelism_is_refused_at_start_up_by_name() -> None:
    from range_connector.spec import RangeSpec

    with pytest.raises(ConfigError, match="pipeline_parallel_size"):
        RangeSpec.from_vllm(*_spec_inputs(tp=2, pp=2), in_worker=False)


def test_decode_context_parallelism_with_heads_split_over_ranks_is_refused_by_name() -> None:
    from range_connector.spec import RangeSpec

    with pytest.raises(ConfigError, match="decode_context_parallel_size"):
        RangeSpec.from_vllm(*_spec_inputs(tp=2, dcp=2), in_worker=False)


def test_a_kv_cache_that_is_not_vllms_head_split_is_refused_by_name() -> None:
    from range_connector.spec import RangeSpec

    with pytest.raises(ConfigError, match="tensor_parallel_size"):
        RangeSpec.from_vllm(*_spec_inputs(tp=2, local_heads=2), in_worker=False)
