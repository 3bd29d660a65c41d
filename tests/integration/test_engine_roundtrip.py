"""Real vLLM engines (CPU) on the tiny GQA and MLA models: save in one engine process, load in a fresh one.

Per model, one scenario runs four engines one after another (each a fresh process, so vLLM's own prefix cache
cannot serve a later run) against embedded Valkey in a temporary runtime directory:

1. ``reference``: no connector; the KV blocks and greedy tokens every comparison is made against.
2. ``producer``: the connector saves the prompts.
3. ``consumer``: a fresh engine loads them (layer-pipelined, one layer per transfer bank), with checksum
   verification off so that a block corrupted on purpose reaches the KV cache and the byte comparison (engine cache
   vs. reference) must catch it.
4. ``verifier``: checksum verification on; the corrupted value is detected, the blocks are recomputed, the output
   is unchanged, and the phantom entry is not offered again.
5. ``async``: asynchronous loads (the requests wait in ``WAITING_FOR_REMOTE_KVS``); same hits, same bytes, same
   output.

Blocks are compared by BLAKE3 digests of the engine's own KV-cache bytes (all layers of a block), never by the
connector's checksums.
"""

from __future__ import annotations

import random

import pytest
import torch

from range_connector.backends.valkey.servers import stop_servers
from range_connector.ops.checks import cpu_has_amx_mla, cpu_mla_block_size
from range_connector.testing.embedded import embedded_urls
from range_connector.testing.tiny_models import build_model
from tests.integration.harness import prompt_ids, run_engine

pytestmark = [pytest.mark.engine, pytest.mark.timeout(1800)]

CHUNK = 256
# Engine block size: 128 for GQA. For MLA, vLLM-CPU's reference backend forces 16 (and turns its own prefix caching
# off); its AMX backend (x86 with AMX tiles) refuses 16, defaults to 128 and keeps prefix caching on.
BLOCK_SIZES = {"gqa": 128, "mla": cpu_mla_block_size()}


def expected_hit(num_prompt_tokens: int, stored_tokens: int, block: int) -> int:
    return min(stored_tokens, num_prompt_tokens - 1) // block * block


#: vLLM's CPU attention runs an FP8 KV cache only with AVX-512 or AMX (vllm/v1/attention/backends/cpu_attn.py)
FP8_KV_SUPPORTED = torch.cpu._is_avx512_supported() or torch.cpu._is_amx_tile_supported()

def assert_same_greedy(kind: str, got: list[list[int]], want: list[list[int]]) -> None:
    """Greedy tokens of a run that loaded a prefix against a run that computed it: identical for GQA.

    MLA is exempt (the byte comparisons still hold): vLLM-CPU computes a prompt whose prefix is already in the cache
    through a different attention path (the context latent is up-projected and merged by log-sum-exp instead of one
    SDPA over the whole prompt), and with random weights that flips greedy tokens, sometimes the first one, even
    though every loaded block is byte-identical to the reference. vLLM-CPU turns its own prefix caching off for
    MLA, so there is no in-engine reference for the cached-context path.
    """
    if kind == "gqa":
        assert got == want


@pytest.fixture(scope="module", params=["gqa", "mla"])
def scenario(request, tmp_path_factory):
    kind = request.param
    tmp = tmp_path_factory.mktemp(f"engine-{kind}")
    model = build_model(kind, "tiny")
    runtime_dir = tmp / "runtime"
    x = prompt_ids(model, 600)
    a = x[:400]
    b = x[:300] + prompt_ids(model, 200, offset_chars=60_000)
    batch = [prompt_ids(model, 300 + 70 * i, offset_chars=9_000 * (i + 1)) for i in range(5)] + [x[:256] + b[300:]]
    # Deadlines no shorter than 20 s: these runs count every loaded block, which a busy 2-core machine must not turn
    # into recomputed ones (each load's deadline otherwise follows the cost model's estimate, down to 0.25 s).
    connector = {"runtime_dir": str(runtime_dir), "chunk_tokens": CHUNK, "min_load_deadline_s": 20.0}
    try:
        # The reference runs the producer's sequence first (same batches, same prefix-cache state).
        ref = run_engine(tmp, "reference", {"model": str(model), "connector": None, "steps": [
            {"op": "generate", "prompts": [x]}, {"op": "block_digests"},                   # 0, 1
            {"op": "generate", "prompts": batch}, {"op": "block_digests"},                 # 2, 3
            {"op": "generate", "prompts": [b]}, {"op": "generate", "prompts": [a]},        # 4, 5
        ]})
        prod = run_engine(tmp, "producer", {"model": str(model), "connector": connector, "steps": [
            {"op": "generate", "prompts": [x]}, {"op": "generate", "prompts": batch},
            {"op": "block_digests"},
        ]}, env={"PYTHONHASHSEED": str(random.randint(1, 10**6))})
        (url,) = embedded_urls(runtime_dir)  # (with the password: the harness opens clients)
        cons = run_engine(tmp, "consumer", {"model": str(model), "connector": {
            **connector, "verify_checksums": False, "load_mode": "pipelined", "bank_bytes": 1, "num_banks": 2},
                                            "steps": [
            {"op": "generate", "prompts": [x]}, {"op": "last_loads"},                      # 0, 1
            {"op": "reset_prefix_cache"},                                                  # 2
            {"op": "generate", "prompts": batch}, {"op": "last_loads"},                    # 3, 4
            {"op": "reset_prefix_cache"},                                                  # 5
            {"op": "generate", "prompts": [a]}, {"op": "last_loads"},                      # 6, 7
            {"op": "generate", "prompts": [x]}, {"op": "last_loads"},                      # 8, 9
            {"op": "reset_prefix_cache"},                                                  # 10
            {"op": "generate", "prompts": [b]}, {"op": "last_loads"},                      # 11, 12
            {"op": "reset_prefix_cache"},                                                  # 13
            {"op": "generate", "prompts": [x]}, {"op": "last_loads"},                      # 14, 15
            {"op": "corrupt", "url": url, "byte_offset": 0},                               # 16
            {"op": "reset_prefix_cache"},                                                  # 17
            {"op": "generate", "prompts": [x]}, {"op": "last_loads"},                      # 18, 19
            {"op": "load_timelines"},                                                      # 20
        ]}, env={"PYTHONHASHSEED": str(random.randint(1, 10**6))})
        ver = run_engine(tmp, "verifier", {"model": str(model), "connector": connector, "steps": [
            {"op": "generate", "prompts": [x]}, {"op": "last_loads"},
            {"op": "reset_prefix_cache"},
            {"op": "generate", "prompts": [x]}, {"op": "last_loads"},
        ]})
        asy = run_engine(tmp, "async", {"model": str(model), "connector": {**connector, "load_mode": "async"},
                                        "steps": [
            {"op": "generate", "prompts": [x]}, {"op": "last_loads"},                      # 0, 1
            {"op": "reset_prefix_cache"},                                                  # 2
            {"op": "generate", "prompts": batch}, {"op": "last_loads"},                    # 3, 4
            {"op": "load_timelines"},                                                      # 5
        ]})
        # C26: same model and store, FP8 KV instead of bf16 (CPU supports it with AVX-512/AMX): a different namespace.
        fp8 = None
        if kind == "gqa" and FP8_KV_SUPPORTED:
            fp8 = run_engine(tmp, "fp8", {"model": str(model), "connector": connector,
                                          "engine_args": {"kv_cache_dtype": "fp8"},
                                          "steps": [{"op": "generate", "prompts": [x]}]})
    finally:
        stop_servers(runtime_dir)
    return {"kind": kind, "block": BLOCK_SIZES[kind], "x": x, "a": a, "b": b, "batch": batch, "ref": ref, "prod": prod, "cons": cons,
            "ver": ver, "fp8": fp8, "async": asy}


def _ref_digests(s) -> set[str]:
    return set(s["ref"][1]["digests"].values()) | set(s["ref"][3]["digests"].values())


def test_producer_run_is_cold_and_equal_to_reference(scenario):
    prod, ref = scenario["prod"], scenario["ref"]
    assert prod[0]["external_hits"] == 0
    assert prod[0]["token_ids"] == ref[0]["token_ids"]
    # The batch's first five prompts share nothing with anything saved, so they are computed cold in both runs.
    assert prod[1]["token_ids"][:5] == ref[2]["token_ids"][:5]
    # The last one starts with x[:256], which the producer saved one step earlier: it may load it (when the save
    # has landed by its lookup), and under MLA that takes the cached-context path (see assert_same_greedy).
    assert_same_greedy(scenario["kind"], prod[1]["token_ids"][5:], ref[2]["token_ids"][5:])


def test_fresh_engine_gets_the_promised_hit(scenario):
    cons, x = scenario["cons"], scenario["x"]
    block = scenario["block"]
    hit = expected_hit(len(x), len(x) // CHUNK * CHUNK, block)
    assert hit == 512
    assert cons[0]["external_hits"] == hit
    assert len(cons[1]["block_ids"]) == hit // block


def test_loaded_blocks_are_byte_identical_to_a_run_without_the_connector(scenario):
    cons, ref = scenario["cons"], scenario["ref"]
    ref_x = set(ref[1]["digests"].values())
    loaded = cons[1]["digests"]
    assert len(set(loaded)) == len(loaded) == 512 // scenario["block"]
    assert set(loaded) <= ref_x
    assert_same_greedy(scenario["kind"], cons[0]["token_ids"], ref[0]["token_ids"])


def test_corrupted_block_is_caught_by_the_byte_comparison(scenario):
    """The check above can fail: one flipped byte in one stored value (checksums off) changes one loaded block."""
    cons, ref = scenario["cons"], scenario["ref"]
    ref_x = set(ref[1]["digests"].values())
    clean = cons[15]["digests"]
    corrupted = cons[19]["digests"]
    assert set(clean) <= ref_x
    assert len(corrupted) == len(clean)
    mismatched = [d for d in corrupted if d not in ref_x]
    assert len(mismatched) == 1, "the comparison must flag exactly the corrupted block"


def test_checksum_catches_corruption_and_the_engine_recomputes(scenario):
    ver, ref = scenario["ver"], scenario["ref"]
    # The corrupted value fails verification: its blocks are recomputed and the output is unchanged.
    assert_same_greedy(scenario["kind"], ver[0]["token_ids"], ref[0]["token_ids"])
    assert len(ver[1]["block_ids"]) < 512 // scenario["block"]
    assert set(ver[1]["digests"]) <= set(ref[1]["digests"].values())


def test_case_C27_phantom_hit_is_not_offered_again(scenario):
    """The corrupt entry is deleted when its load fails; the blocks vLLM recomputes are saved again, so the next
    request gets the full hit with correct bytes (the phantom is never served)."""
    ver, ref = scenario["ver"], scenario["ref"]
    ref_x = set(ref[1]["digests"].values())
    assert ver[3]["external_hits"] == 512
    assert len(ver[4]["block_ids"]) * scenario["block"] == 512
    assert set(ver[4]["digests"]) <= ref_x, "every block now loaded equals the reference: the bad value is gone"
    assert_same_greedy(scenario["kind"], ver[3]["token_ids"], ref[0]["token_ids"])


def test_case_C01_engines_with_different_hash_seeds_share_the_store(scenario):
    # producer and consumer ran with different random PYTHONHASHSEED values.
    assert scenario["cons"][0]["external_hits"] == 512


def test_case_C04_uneven_prompt_full_hit_leaves_tokens_to_compute(scenario):
    cons, ref, x = scenario["cons"], scenario["ref"], scenario["x"]
    assert len(x) % scenario["block"] != 0
    assert 0 < cons[0]["external_hits"] < len(x)
    assert_same_greedy(scenario["kind"], cons[0]["token_ids"], ref[0]["token_ids"])


def test_case_C05_engine_prefix_cache_plus_store_tail(scenario):
    """A = X[:400] loads its one full chunk (blocks 0-1) and computes block 2, so vLLM's prefix cache holds 3 blocks
    of X; the store holds 4 (2 chunks). X then loads only block 3 (the second half of chunk 1), never A's blocks."""
    if scenario["kind"] == "mla" and not cpu_has_amx_mla():
        pytest.skip("vLLM-CPU's reference MLA backend (no AMX here) turns its own prefix caching off: no local prefix "
                    "hit to combine with")
    cons, ref = scenario["cons"], scenario["ref"]
    a_blocks = set(cons[7]["block_ids"])
    assert cons[6]["external_hits"] == CHUNK
    assert len(a_blocks) == 2 and cons[6]["token_ids"] == ref[5]["token_ids"]
    assert cons[8]["external_hits"] == scenario["block"]
    assert len(cons[9]["block_ids"]) == 1 and not (set(cons[9]["block_ids"]) & a_blocks)
    assert set(cons[9]["digests"]) <= set(ref[1]["digests"].values())
    assert cons[8]["token_ids"] == ref[0]["token_ids"]


def test_case_C07_prompts_diverging_inside_a_block_reuse_only_whole_matching_blocks(scenario):
    cons, ref = scenario["cons"], scenario["ref"]
    assert cons[11]["external_hits"] == CHUNK  # B diverges at token 300: only chunk 0 (blocks 0 and 1) matches
    assert len(cons[12]["block_ids"]) == CHUNK // scenario["block"]
    assert set(cons[12]["digests"]) <= set(ref[1]["digests"].values())
    assert_same_greedy(scenario["kind"], cons[11]["token_ids"], ref[4]["token_ids"])


def test_case_C08_concurrent_loads_are_byte_exact(scenario):
    cons, ref, batch = scenario["cons"], scenario["ref"], scenario["batch"]
    block = scenario["block"]
    expected = sum(expected_hit(len(p), len(p) // CHUNK * CHUNK, block) for p in batch)
    assert cons[3]["external_hits"] == expected
    assert_same_greedy(scenario["kind"], cons[3]["token_ids"], ref[2]["token_ids"])
    assert len(cons[4]["digests"]) * block == expected
    assert set(cons[4]["digests"]) <= _ref_digests(scenario)


def test_case_C26_fp8_kv_engine_misses_bf16_entries(scenario):
    if scenario["kind"] != "gqa":
        pytest.skip("the FP8-KV run is made once, with the GQA model")
    if scenario["fp8"] is None:
        pytest.skip("vLLM's CPU attention needs AVX-512 or AMX for an FP8 KV cache; this CPU has neither")
    assert scenario["cons"][0]["external_hits"] == 512  # the bf16 entries are there ...
    assert scenario["fp8"][0]["external_hits"] == 0  # ... and an FP8-KV engine does not see them


def test_pipelined_layer_zero_is_handed_to_attention_before_the_last_layer_lands(scenario):
    """From the worker's recorded timestamps (real Valkey, no wrapper): with one layer per bank and two banks, the
    first layer's wait returned before the last layer's bytes had landed."""
    timelines = [t for t in scenario["cons"][20]["timelines"] if t["mode"] == "pipelined" and not t["failed"]]
    assert timelines
    for t in timelines:
        assert t["num_groups"] == len(t["layer_ready_s"]) >= 3
        assert all(w is not None for w in t["layer_waited_s"]), "attention waited for every layer"
        assert t["layer_delivered_s"][0] < t["layer_ready_s"][-1]


def test_async_loads_are_byte_identical_and_the_output_unchanged(scenario):
    asy, ref, batch = scenario["async"], scenario["ref"], scenario["batch"]
    block = scenario["block"]
    assert asy[0]["external_hits"] == 512
    assert set(asy[1]["digests"]) <= set(ref[1]["digests"].values())
    assert len(asy[1]["digests"]) * block == 512
    assert_same_greedy(scenario["kind"], asy[0]["token_ids"], ref[0]["token_ids"])
    expected = sum(expected_hit(len(p), len(p) // CHUNK * CHUNK, block) for p in batch)
    assert asy[3]["external_hits"] == expected
    assert set(asy[4]["digests"]) <= _ref_digests(scenario)
    assert_same_greedy(scenario["kind"], asy[3]["token_ids"], ref[2]["token_ids"])
    assert {t["mode"] for t in asy[5]["timelines"]} == {"async"}
