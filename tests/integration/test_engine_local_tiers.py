"""The in-process DRAM tier and the file tier inside a real engine.

DRAM: bytes in the worker, index in the scheduler (learned from the worker's metadata), a hit after vLLM's own prefix
cache is reset. File: stripes and tickets on disk, read by a fresh engine process. DRAM in front of Valkey: one
prompt loaded part from each tier, then promoted into DRAM; the latency histograms and gauges on the engine's
Prometheus registry count in the right tiers, and a prompt-logprobs request (vLLM drops Range's answer) is no miss."""

from __future__ import annotations

import pytest

from range_connector.backends.valkey.servers import stop_servers
from range_connector.testing.tiny_models import build_model
from tests.integration.harness import prompt_ids, run_engine

pytestmark = [pytest.mark.engine, pytest.mark.timeout(600)]


def test_dram_tier_serves_a_hit_in_the_same_engine(tmp_path):
    model = build_model("gqa", "tiny")
    x = prompt_ids(model, 600)
    connector = {"backend": "memory", "min_load_deadline_s": 20.0}  # a loaded, shared machine: no cut loads
    res = run_engine(tmp_path, "dram", {"model": str(model), "connector": connector, "steps": [
        {"op": "generate", "prompts": [x]},
        {"op": "reset_prefix_cache"},
        {"op": "generate", "prompts": [x]}, {"op": "last_loads"},
    ]})
    assert res[0]["external_hits"] == 0
    assert res[2]["external_hits"] == 512
    assert len(res[3]["block_ids"]) == 4
    assert res[2]["token_ids"] == res[0]["token_ids"]


def test_file_tier_serves_a_fresh_engine(tmp_path):
    """Stripes and the ticket log on disk outlive the engine that wrote them: a fresh engine process loads them."""
    model = build_model("gqa", "tiny")
    x = prompt_ids(model, 600)
    connector = {"backend": "file", "file_dir": str(tmp_path / "kv"), "num_shards": 2, "chunk_tokens": 256,
                 "min_load_deadline_s": 20.0}
    first = run_engine(tmp_path, "file-writer", {"model": str(model), "connector": connector, "steps": [
        {"op": "generate", "prompts": [x]}]})
    on_disk = sum(p.stat().st_size for p in (tmp_path / "kv").rglob("*") if p.is_file() and "stripes" in p.parts)
    assert on_disk >= 512 * 2048  # 512 tokens x 2 KiB of KV per token, split over two shard directories
    second = run_engine(tmp_path, "file-reader", {"model": str(model), "connector": connector, "steps": [
        {"op": "generate", "prompts": [x]}, {"op": "last_loads"}]})
    assert first[0]["external_hits"] == 0
    assert second[0]["external_hits"] == 512
    assert len(second[1]["block_ids"]) == 4
    assert second[0]["token_ids"] == first[0]["token_ids"]


def _tier_tokens(metrics: list[dict], name: str = "vllm:range_tier_loaded_tokens") -> dict[str, float]:
    """``tier -> value`` of one by-tier counter, tiers that counted nothing left out."""
    return {m["labels"]["tier"]: m["value"] for m in metrics
            if m["name"] == name and m["labels"].get("tier") and m["value"]}


def _hist_counts(metrics: list[dict], name: str) -> dict[str, int]:
    """``tier -> observations`` of one histogram, tiers that observed nothing left out."""
    return {m["labels"]["tier"]: m["count"] for m in metrics
            if m["name"] == name and m["labels"].get("tier") and m.get("count")}


def _value(metrics: list[dict], name: str) -> float | None:
    """The value of an unlabelled counter or gauge (``None`` when it is not exported)."""
    return next((m["value"] for m in metrics if m["name"] == name), None)


def test_dram_in_front_of_valkey_loads_a_prompt_from_both_then_promotes_it(tmp_path):
    """DRAM holds two chunks' stripes (``capacity_bytes`` 1.1 MiB: 256 tokens x 2 KiB per chunk), Valkey (two
    embedded shards) everything. Chunk 0 of X is saved by A (= X's first chunk), chunk 1 by X; A is loaded again
    (chunk 0 becomes DRAM's most recently used) and a filler's save evicts X's chunk 1 from DRAM. X then loads chunk 0
    from DRAM and chunk 1 from Valkey, byte-identical to the blocks X computed; the second load from Valkey promotes
    chunk 1, and the next load takes all of X from DRAM. Greedy tokens equal X's first run every time."""
    model = build_model("gqa", "tiny")
    x = prompt_ids(model, 600)
    a, a2 = x[:256] + prompt_ids(model, 44, 20_000), x[:256] + prompt_ids(model, 44, 30_000)
    filler = prompt_ids(model, 300, 40_000)
    connector = {"tiers": [{"type": "memory", "capacity_bytes": 1_100_000},
                           {"type": "valkey", "embedded_maxmemory_bytes": 64 << 20}],
                 "num_shards": 2, "chunk_tokens": 256, "runtime_dir": str(tmp_path / "rt"),
                 "min_load_deadline_s": 20.0}
    try:
        res = _run_dram_valkey(tmp_path, model, connector, x, a, a2, filler)
    finally:
        stop_servers(tmp_path / "rt")
    assert all(r["ok"] for r in res if "ok" in r)  # every reset of vLLM's own prefix cache went through
    assert [res[i]["external_hits"] for i in (0, 2, 5, 7, 9, 13, 17)] == [0, 256, 256, 0, 512, 512, 512], \
        res[-1]["stats"]
    computed = set(res[3]["digests"].values())
    # blocks of 128 tokens; step 10 also lists the loads of steps 2 and 5 (X's chunk 0: two blocks each)
    for i, num_blocks in ((10, 2 + 2 + 4), (14, 4), (18, 4)):
        assert len(res[i]["block_ids"]) == num_blocks, f"step {i}"
        assert set(res[i]["digests"]) <= computed, f"step {i}: a loaded block X never computed"
    for i in (9, 13, 17):
        assert res[i]["token_ids"] == res[2]["token_ids"], f"step {i}"
    first, second, third = (_tier_tokens(res[i]["metrics"]) for i in (11, 15, 19))
    assert first.get("valkey") == 256 and first.get("memory") == 256 + 256 + 256, first
    assert second.get("valkey") == 512, second  # (the promotion's save happens after this load)
    # bytes by tier follow the tokens (2 KiB of KV per token), and the gate took every run it was offered
    assert _tier_tokens(res[11]["metrics"], "vllm:range_tier_loaded_bytes") == {
        t: n * 2048 for t, n in first.items() if n}, res[11]["metrics"]
    assert _tier_tokens(res[11]["metrics"], "vllm:range_tier_hit_tokens_taken") == {
        t: n for t, n in first.items() if n}
    assert _tier_tokens(res[19]["metrics"], "vllm:range_tier_hit_tokens_left_out") == {}
    # (vLLM's metric reader rounds counters down to integers: the seconds of these short loads read as 0 here)
    assert _tier_tokens(res[19]["metrics"], "vllm:range_tier_loads").get("valkey", 0) >= 2
    assert third.get("valkey") == 512 and third.get("memory") == 768 + 256 + 512, third
    promoted = [m["value"] for m in res[19]["metrics"] if m["name"] == "vllm:range_tier_promoted_chunks"
                and m["labels"].get("tier") == "memory"]
    assert promoted == [1], res[19]["metrics"]
    _check_histograms_and_gauges(res[19]["metrics"])
    # A prompt-logprobs request of X (stored whole in DRAM): vLLM drops Range's answer (vllm#57596), so Range counts
    # it as not read, not as hit tokens left out, and loads nothing.
    assert res[21]["external_hits"] == 0
    after = res[22]["metrics"]
    assert _value(after, "vllm:range_lookups_not_read") == 1, after
    assert _tier_tokens(after, "vllm:range_tier_hit_tokens_left_out") == {}
    assert _tier_tokens(after, "vllm:range_tier_loads") == _tier_tokens(res[19]["metrics"], "vllm:range_tier_loads")


def _check_histograms_and_gauges(metrics: list[dict]) -> None:
    """After loads from DRAM and from Valkey: the latency histograms count in the right tiers, and the gauges are
    there (the loads have ended: no lease is held)."""
    loads = _tier_tokens(metrics, "vllm:range_tier_loads")
    assert loads.get("memory", 0) >= 1 and loads.get("valkey", 0) >= 2, loads
    assert _hist_counts(metrics, "vllm:range_load_seconds") == loads  # once per job, by its farthest tier
    assert _hist_counts(metrics, "vllm:range_first_layer_seconds") == loads  # (one worker)
    lookups = _hist_counts(metrics, "vllm:range_lookup_seconds")
    assert lookups.get("memory", 0) >= 7 and lookups.get("valkey", 0) >= 1, lookups  # (Valkey: DRAM's misses only)
    saves = _hist_counts(metrics, "vllm:range_save_seconds")
    assert saves.get("memory", 0) >= 1 and saves.get("valkey", 0) >= 1, saves
    assert set(_hist_counts(metrics, "vllm:range_gate_load_ratio")) == set()  # (load_mode pipelined: no gate)
    [buckets] = [m["buckets"] for m in metrics if m["name"] == "vllm:range_load_seconds"
                 and m["labels"].get("tier") == "valkey"]
    assert len(buckets) == 21 and buckets["+Inf"] == loads["valkey"], buckets  # 10 us ... 30 s, +Inf
    assert _value(metrics, "vllm:range_banks") >= 1
    assert _value(metrics, "vllm:range_leased_stripes") == 0 and _value(metrics, "vllm:range_leasing_requests") == 0


def _run_dram_valkey(tmp_path, model, connector, x, a, a2, filler) -> list[dict]:
    gen = [{"op": "reset_prefix_cache"}, {"op": "generate", "prompts": [x]}, {"op": "last_loads"},
           {"op": "range_metrics"}]
    return run_engine(tmp_path, "dram-valkey", {"model": str(model), "connector": connector, "steps": [
        {"op": "generate", "prompts": [a]},  # 0: A saves chunk 0
        {"op": "reset_prefix_cache"}, {"op": "generate", "prompts": [x]},  # 2: X loads chunk 0, saves chunk 1
        {"op": "block_digests"},  # 3: X's blocks as computed
        {"op": "reset_prefix_cache"}, {"op": "generate", "prompts": [a2]},  # 5: touches chunk 0 in DRAM
        {"op": "reset_prefix_cache"}, {"op": "generate", "prompts": [filler]},  # 7: evicts X's chunk 1 from DRAM
        *gen,  # 9-11: chunk 0 from DRAM, chunk 1 from Valkey (its first far load)
        *gen,  # 13-15: the second far load of chunk 1: promoted
        *gen,  # 17-19: all from DRAM
        {"op": "worker_stats"},  # 20: (shown when an assertion fails)
        {"op": "generate", "prompts": [x], "max_tokens": 2, "prompt_logprobs": 1},  # 21: vLLM drops the answer
        {"op": "range_metrics"},  # 22
    ]})
