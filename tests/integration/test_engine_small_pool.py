"""Case C13 on a real vLLM CPU engine: a small KV pool, two long cached prefixes, then two requests extending them,
sent together, that need more blocks together than are free. Asynchronous loads hold their blocks while they wait
in ``WAITING_FOR_REMOTE_KVS``; the engine must still make progress (no permanent stall), and the outputs must be
those of a run without the connector.
"""

from __future__ import annotations

import pytest

from range_connector.backends.valkey.servers import stop_servers
from range_connector.testing.tiny_models import build_model
from tests.integration.harness import prompt_ids, run_engine

pytestmark = [pytest.mark.engine, pytest.mark.timeout(900)]

BLOCK = 32  # the smallest block vLLM-CPU's attention takes for this model
NUM_BLOCKS = 48  # 1,536 token slots in all


def test_case_C13_loads_needing_more_blocks_than_free_do_not_stall_the_engine(tmp_path) -> None:
    model = build_model("gqa", "tiny")
    text = prompt_ids(model, 1400)
    p1, p2 = text[:600], text[700:1300]
    e1, e2 = p1 + prompt_ids(model, 300, offset_chars=40_000), p2 + prompt_ids(model, 300, offset_chars=50_000)
    engine_args = {"num_gpu_blocks_override": NUM_BLOCKS}
    connector = {"runtime_dir": str(tmp_path / "runtime"), "chunk_tokens": 128, "load_mode": "async"}
    try:
        # The reference runs the producer's sequence first, so that the prefixes it reuses from vLLM's own prefix cache
        # were computed the way the stored ones were (a prefix computed inside a longer prompt can differ in the last
        # bf16 bits, and on this random-weight model that flips greedy tokens: docs/benchmarks.md, "Why reused KV changes outputs").
        ref = run_engine(tmp_path, "reference", {"model": str(model), "connector": None, "block_size": BLOCK,
                                                   "max_model_len": 1024, "engine_args": engine_args, "steps": [
            {"op": "generate", "prompts": [p1]}, {"op": "generate", "prompts": [p2]},
            {"op": "generate", "prompts": [e1, e2], "max_tokens": 32}]})
        run_engine(tmp_path, "producer", {"model": str(model), "connector": connector, "block_size": BLOCK, "max_model_len": 1024,
                                          "engine_args": engine_args, "steps": [
            {"op": "generate", "prompts": [p1]}, {"op": "generate", "prompts": [p2]}]})
        # Together the two extensions need 2 x 30 = 60 blocks of the 48 (932 tokens each): the loads (16 blocks
        # each) and the computation cannot all fit at once.
        got = run_engine(tmp_path, "consumer", {"model": str(model), "connector": connector, "block_size": BLOCK, "max_model_len": 1024,
                                                "engine_args": engine_args, "steps": [
            {"op": "generate", "prompts": [e1, e2], "max_tokens": 32}, {"op": "worker_stats"}]})
    finally:
        stop_servers(tmp_path / "runtime")
    assert got[0]["external_hits"] > 0, "the stored prefixes were loaded"
    assert got[0]["token_ids"] == ref[2]["token_ids"]
    assert got[1]["stats"]["loaded_blocks"] > 0
