"""The engine patch on a real vLLM CPU engine (tiny MLA model), with the test switch that makes MLA attention take
its direct-call branch (patches/README.md).

Two engines, the same steps (a prompt, vLLM's prefix cache reset, the prompt again served from the DRAM tier):

* the installed vLLM (unpatched): every MLA layer takes the direct-call branch and the connector's per-layer hooks
  are never called, although the connector loads and saves: the gap the patch closes;
* a private copy of vLLM with the patch applied (fixture ``vllm_copy``; the installed vLLM is never written): every
  MLA layer's ``wait_for_layer_load`` and ``save_kv_layer`` run in every forward step, and the greedy tokens are
  those of the unpatched run.

Without the patch the connector falls back to completing every load before the forward (the unpatched run above);
with that fallback switched off (test-only ``RANGE_CONNECTOR_TEST_NO_MLA_FALLBACK``), its layer-pipelined loads are
read by attention before they land, which the worker detects (``layers_read_before_load``) and reports as load
errors so vLLM recomputes. Loaded blocks are compared by BLAKE3 with the blocks the run's own cold pass computed.
"""

from __future__ import annotations

import os

import pytest

from range_connector import cli
from range_connector.ops.checks import cpu_mla_block_size
from range_connector.plugin import FORCE_MLA_DIRECT_CALL_ENV
from range_connector.spec import NO_MLA_FALLBACK_ENV
from range_connector.testing.tiny_models import build_model
from tests.integration.harness import prompt_ids, run_engine

pytestmark = [pytest.mark.engine, pytest.mark.timeout(900)]

# vLLM-CPU forces 16 for MLA on its reference backend; its AMX backend (x86 with AMX) refuses 16 and defaults to 128
MLA_BLOCK_SIZE = cpu_mla_block_size()


def test_patched_direct_call_branch_reaches_the_layer_hooks(vllm_copy, tmp_path) -> None:
    model = build_model("mla", "tiny")
    x = prompt_ids(model, 600)
    spec = {"model": str(model), "block_size": MLA_BLOCK_SIZE,
            "connector": {"backend": "memory", "chunk_tokens": 256}, "steps": [
                {"op": "count_layer_hooks"}, {"op": "mla_probe"},                                  # 0, 1
                {"op": "generate", "prompts": [x]}, {"op": "reset_prefix_cache"},                  # 2, 3
                {"op": "generate", "prompts": [x]}, {"op": "layer_hook_counts"},                   # 4, 5
                {"op": "last_loads"}, {"op": "worker_stats"}, {"op": "block_digests"},             # 6, 7, 8
            ]}
    switch = {FORCE_MLA_DIRECT_CALL_ENV: "1", "PYTHONDONTWRITEBYTECODE": "1"}
    unpatched = run_engine(tmp_path, "unpatched", spec, env=switch)
    no_fallback = run_engine(tmp_path, "no-fallback", spec, env={**switch, NO_MLA_FALLBACK_ENV: "1"})
    assert cli.main(["patch", "apply", "--vllm-dir", str(vllm_copy.vllm_dir)]) == 0
    pythonpath = os.pathsep.join([str(vllm_copy.root), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    patched = run_engine(tmp_path, "patched", spec, env={**switch, "PYTHONPATH": pythonpath})

    for run in (unpatched, patched):
        probe = run[1]
        assert probe["direct_call_branch_taken"] is True
        assert probe["layers"] and all(layer == {"type": "MLAAttention", "use_direct_call": True}
                                       for layer in probe["layers"].values()), probe["layers"]
        assert run[4]["external_hits"] == 512  # the connector did load: two 256-token chunks of 600 tokens
    layer_names = sorted(unpatched[1]["layers"])

    assert unpatched[1]["patch_applied"] is False
    assert unpatched[5]["counts"] == {"wait_for_layer_load": {}, "save_kv_layer": {}}

    assert patched[1]["patch_applied"] is True
    counts = patched[5]["counts"]
    for hook in ("wait_for_layer_load", "save_kv_layer"):
        assert sorted(counts[hook]) == layer_names, (hook, counts[hook])
        per_layer = set(counts[hook].values())
        assert len(per_layer) == 1 and per_layer.pop() >= 2, (hook, counts[hook])  # every layer, every step
    assert patched[2]["token_ids"] == unpatched[2]["token_ids"]
    assert patched[4]["token_ids"] == unpatched[4]["token_ids"]


    # Unpatched: the fallback delivered every load before the forward, so nothing was read early.
    assert unpatched[7]["stats"].get("layers_read_before_load", 0) == 0
    assert unpatched[7]["stats"].get("failed_blocks", 0) == 0
    # Patched: loads are layer-pipelined, and every layer was waited for.
    assert patched[7]["stats"].get("layers_read_before_load", 0) == 0
    assert patched[7]["stats"].get("failed_blocks", 0) == 0
    for run in (unpatched, patched):
        loaded = run[6]["digests"]
        assert len(loaded) == 512 // MLA_BLOCK_SIZE
        assert set(loaded) <= set(run[8]["digests"].values())  # the blocks the cold pass computed
    # Without the patch and without the fallback: attention read layers before they landed; the worker saw it and
    # reported the whole load, so vLLM recomputed those blocks.
    stats = no_fallback[7]["stats"]
    assert stats["layers_read_before_load"] >= len(layer_names)
    assert stats["failed_blocks"] >= 512 // MLA_BLOCK_SIZE
