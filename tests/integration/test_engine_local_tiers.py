"""The in-process DRAM tier and the file tier inside a real engine.

DRAM: bytes in the worker, index in the scheduler (learned from the worker's metadata), a hit after vLLM's own prefix
cache is reset. File: stripes and tickets on disk, read by a fresh engine process."""

from __future__ import annotations

import pytest

from range_connector.testing.tiny_models import build_model
from tests.integration.harness import prompt_ids, run_engine

pytestmark = [pytest.mark.engine, pytest.mark.timeout(600)]


def test_dram_tier_serves_a_hit_in_the_same_engine(tmp_path):
    model = build_model("gqa", "tiny")
    x = prompt_ids(model, 600)
    res = run_engine(tmp_path, "dram", {"model": str(model), "connector": {"backend": "memory"}, "steps": [
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
    connector = {"backend": "file", "file_dir": str(tmp_path / "kv"), "num_shards": 2, "chunk_tokens": 256}
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
