"""The in-process DRAM tier inside a real engine: bytes in the worker, index in the scheduler (learned from the
worker's metadata), a hit after vLLM's own prefix cache is reset."""

from __future__ import annotations

import pytest

from range_connector.tiny_models import build_model
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
