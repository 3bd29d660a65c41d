"""Real vLLM engines (CPU) at ``--tensor-parallel-size 2`` on the tiny GQA model (2 KV heads, one per rank), and
engines of different TP sizes sharing one store.

The bug users saw (issue 15): a fresh TP 2 engine reloading a saved prompt got a 512-token hit and different
greedy tokens, because every rank loaded rank 0's heads. Seven engines, each a fresh process (TP 2 with one core per
rank, ``VLLM_CPU_OMP_THREADS_BIND="0|1"``), against embedded Valkey in a temporary runtime directory:

1. ``reference`` (TP 2): no connector; each rank's KV blocks (per head), and greedy tokens of prompt X computed
   whole, then again with vLLM's own prefix cache holding 512 and then 256 of its tokens; then prompt Z.
2. ``producer`` (TP 2, ``kv_both``): saves X and Z (each rank its own head); Z is sent as the disaggregated proxy
   sends a prefill request (``do_remote_decode``) and its announcement kept for step 4. (``kv_both`` rather than
   ``kv_producer``, which also stores a prompt's partial last chunk: X's hits below are counted in whole chunks.)
3. ``tp1`` (TP 1, 2 heads on one rank, ``kv_both``): loads X from the TP 2 producer's slices (reassembled head by
   head), then computes and saves prompt Y.
4. ``decode-tp1`` (TP 1, ``kv_consumer``): answers the proxy's describe probe, then receives Z with the TP 2
   producer's announcement, as the proxy's second call sends it: P/D from TP 2 to TP 1.
5. ``prefill-tp1`` (TP 1, ``kv_producer``): computes prompt W for the proxy (with the TP 1 consumer's settings as
   the proxy's ``range_expect``), and a request whose expected settings name another block size.
6. ``consumer`` (TP 2, ``kv_consumer``): loads X; then one rank's slice of the second chunk is deleted (a shorter
   hit for both ranks); then one byte of a block rank 1 loads is flipped (checksums off) to show that the per-head
   byte comparison catches a wrong block; then loads Y, stored at TP 1 by a ``kv_both`` engine; then receives W with
   the TP 1 producer's announcement (P/D from TP 1 to TP 2), and a request whose announcement names another KV dtype.
7. ``dram`` (TP 2): the in-process DRAM tier, each rank storing into its own memory: X again after vLLM's own
   prefix cache is reset is loaded by both ranks.

Blocks are compared by BLAKE3 digests of each KV head of each block (all layers), read from the engines' own KV
caches, never by the connector's checksums: against the reference run, or, for KV stored at another TP size,
against the producer's own cache (the last bits of KV differ between TP 1 and TP 2 on this CPU build). Greedy tokens
are compared with the reference run whose own prefix cache held the same tokens: at TP 2, computing the rest of a
prompt on top of cached KV gives other greedy tokens than computing it whole on this random-weight model, with
vLLM's own prefix cache as much as with Range (the KV bytes are identical either way).
"""

from __future__ import annotations

import random

import pytest

from range_connector.backends.valkey.servers import stop_servers
from range_connector.serving.engines import mismatched_settings
from range_connector.testing.embedded import embedded_urls
from range_connector.testing.tiny_models import build_model
from tests.integration.harness import prompt_ids, run_engine

pytestmark = [pytest.mark.engine, pytest.mark.timeout(1800)]

CHUNK = 256
BLOCK = 128
TP2 = {"engine_args": {"tensor_parallel_size": 2}}
TP2_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("engine-tp2")
    model = build_model("gqa", "tiny")
    runtime_dir = tmp / "runtime"
    x = prompt_ids(model, 600)
    y = prompt_ids(model, 400, offset_chars=30_000)
    z = prompt_ids(model, 513, offset_chars=45_000)  # P/D prompts: 2 full chunks and one token
    w = prompt_ids(model, 513, offset_chars=75_000)
    remote = {"do_remote_decode": True}
    connector = {"runtime_dir": str(runtime_dir), "chunk_tokens": CHUNK, "min_load_deadline_s": 20.0}
    heads = {"op": "head_digests", "tp_size": 2}
    loaded_heads = {"op": "head_digests", "last_loads": True}
    try:
        ref = run_engine(tmp, "reference", {**TP2, "model": str(model), "connector": None, "steps": [
            {"op": "generate", "prompts": [x]}, {"op": "generate", "prompts": [y]}, heads,  # 0, 1, 2
            {"op": "generate", "prompts": [x]},                                           # 3: 512 cached
            {"op": "reset_prefix_cache"}, {"op": "generate", "prompts": [x[:300]]},       # 4, 5
            {"op": "generate", "prompts": [x]},                                           # 6: 256 cached
            {"op": "reset_prefix_cache"}, {"op": "generate", "prompts": [y[:300]]},       # 7, 8
            {"op": "generate", "prompts": [y]},                                           # 9: 256 of Y cached
            {"op": "reset_prefix_cache"}, {"op": "generate", "prompts": [z]}, heads,      # 10, 11, 12
        ]}, env=TP2_ENV)
        prod = run_engine(tmp, "producer", {**TP2, "model": str(model), "connector": connector, "steps": [
            {"op": "generate", "prompts": [x]},                                           # 0
            {"op": "generate", "prompts": [z], "kv_transfer_params": remote, "max_tokens": 1},  # 1
        ]}, env={**TP2_ENV, "PYTHONHASHSEED": str(random.randint(1, 10**6))})
        (url,) = embedded_urls(runtime_dir)  # (with the password: the harness opens clients)
        tp1 = run_engine(tmp, "tp1", {"model": str(model), "connector": connector, "steps": [
            {"op": "generate", "prompts": [x]}, {**loaded_heads, "tp_size": 1},           # 0, 1
            {"op": "generate", "prompts": [y]}, {"op": "head_digests", "tp_size": 1},     # 2, 3
        ]})
        decode_tp1 = run_engine(tmp, "decode-tp1", {"model": str(model), "connector": connector,
                                                    "role": "kv_consumer", "steps": [
            {"op": "generate", "prompts": [[0]], "max_tokens": 1,
             "kv_transfer_params": {"range_describe": True}},                             # 0: the proxy's probe
            {"op": "generate", "prompts": [z], "kv_transfer_params": prod[1]["kv_transfer_params"]},  # 1
            {**loaded_heads, "tp_size": 1},                                               # 2
        ]})
        decode_tp1_settings = decode_tp1[0]["kv_transfer_params"][0]["range"]["settings"]
        prefill_tp1 = run_engine(tmp, "prefill-tp1", {"model": str(model), "connector": connector,
                                                      "role": "kv_producer", "steps": [
            {"op": "generate", "prompts": [w], "max_tokens": 1,
             "kv_transfer_params": {**remote, "range_expect": decode_tp1_settings}},      # 0
            {"op": "head_digests", "tp_size": 1},                                         # 1
            {"op": "generate", "prompts": [y[:40]], "max_tokens": 1, "kv_transfer_params": {
                **remote, "range_expect": {**decode_tp1_settings, "block_size": 32}}},    # 2
        ]})
        w_announced = prefill_tp1[0]["kv_transfer_params"][0]
        other_dtype = {"range": {**w_announced["range"], "settings": {
            **w_announced["range"]["settings"], "kv_spec.dtype": "torch.float8_e4m3fn"}}}
        cons = run_engine(tmp, "consumer", {**TP2, "model": str(model), "role": "kv_consumer",
                                            "connector": {**connector, "verify_checksums": False}, "steps": [
            {"op": "generate", "prompts": [x]}, {"op": "last_loads_ranks"},               # 0, 1
            {"op": "delete_loaded_ticket", "url": url, "rank": 1, "index": 1},            # 2
            {"op": "reset_prefix_cache"},                                                 # 3
            {"op": "generate", "prompts": [x]}, loaded_heads,                             # 4, 5
            {"op": "corrupt", "url": url, "rank": 1, "byte_offset": 0},                   # 6
            {"op": "reset_prefix_cache"},                                                 # 7
            {"op": "generate", "prompts": [x]}, loaded_heads,                             # 8, 9
            {"op": "generate", "prompts": [y]}, loaded_heads,                             # 10, 11
            {"op": "generate", "prompts": [w], "kv_transfer_params": [w_announced]}, loaded_heads,  # 12, 13
            {"op": "generate", "prompts": [x[:300]], "kv_transfer_params": [other_dtype]},   # 14
        ]}, env={**TP2_ENV, "PYTHONHASHSEED": str(random.randint(1, 10**6))})
        dram = run_engine(tmp, "dram", {**TP2, "model": str(model), "connector": {
            "tiers": [{"type": "memory", "capacity_bytes": 256 << 20}], "chunk_tokens": CHUNK,
            "min_load_deadline_s": 20.0}, "steps": [
            {"op": "generate", "prompts": [x]},                                           # 0
            {"op": "reset_prefix_cache"},                                                 # 1
            {"op": "generate", "prompts": [x]}, loaded_heads,                             # 2, 3
        ]}, env=TP2_ENV)
    finally:
        stop_servers(runtime_dir)
    logs = {name: (tmp / f"{name}.log").read_text(errors="replace") for name in ("producer", "decode-tp1",
                                                                                   "prefill-tp1", "consumer")}
    return {"x": x, "y": y, "z": z, "w": w, "ref": ref, "prod": prod, "tp1": tp1, "cons": cons, "dram": dram,
            "decode_tp1": decode_tp1, "prefill_tp1": prefill_tp1, "logs": logs}


def ref_heads(runs, step: int = 2) -> dict[str, set[str]]:
    """Per model KV head, the digests of every block of the reference run's cache (X and Y; Z with ``step`` 12)."""
    return {head: set(d) for head, d in runs["ref"][step]["heads"].items()}


def assert_loaded_exactly(loaded: dict[str, list[str]], refs: dict[str, set[str]], num_blocks: int) -> None:
    """Both heads of ``num_blocks`` loaded blocks, each byte-identical to the reference's blocks of that head."""
    assert sorted(loaded) == ["0", "1"]
    for head, digests in loaded.items():
        assert len(digests) == num_blocks, f"head {head}: {len(digests)} blocks loaded"
        assert set(digests) <= refs[head], f"head {head}: loaded blocks no run without the connector computed"


def test_the_two_heads_hold_different_bytes(runs):
    refs = ref_heads(runs)
    assert refs["0"] and refs["1"] and not refs["0"] & refs["1"]


def test_the_producer_is_cold_and_equal_to_the_reference(runs):
    assert runs["prod"][0]["external_hits"] == 0
    assert runs["prod"][0]["token_ids"] == runs["ref"][0]["token_ids"]


def test_a_fresh_tp2_engine_loads_each_ranks_own_heads_and_generates_the_same_tokens(runs):
    cons, ref = runs["cons"], runs["ref"]
    assert cons[0]["external_hits"] == 512
    refs = ref_heads(runs)
    for rank, digests in enumerate(cons[1]["digests"]):
        assert len(digests) == 512 // BLOCK, f"rank {rank} loaded {len(digests)} blocks"
        assert set(digests) <= refs[str(rank)], f"rank {rank} loaded blocks no run without the connector computed"
    assert cons[0]["token_ids"] == ref[3]["token_ids"]  # the reference with 512 tokens in its own prefix cache


def test_one_ranks_slice_evicted_gives_a_shorter_hit_and_the_same_tokens(runs):
    cons, ref = runs["cons"], runs["ref"]
    assert cons[2]["deleted"] == 1 and cons[2]["key"].endswith(":h1")
    assert cons[4]["external_hits"] == CHUNK  # chunk 0 only, for both ranks
    assert_loaded_exactly(cons[5]["heads"], ref_heads(runs), CHUNK // BLOCK)
    assert cons[4]["token_ids"] == ref[6]["token_ids"]  # the reference with 256 tokens in its own prefix cache
    assert cons[8]["external_hits"] == CHUNK  # a kv_consumer does not save the recomputed chunk again


def test_a_tp1_engine_assembles_the_tp2_producers_slices(runs):
    tp1 = runs["tp1"]
    assert tp1[0]["external_hits"] == 512
    assert_loaded_exactly(tp1[1]["heads"], ref_heads(runs), 512 // BLOCK)


def test_a_tp2_engine_loads_what_a_tp1_engine_stored(runs):
    """The blocks are the TP 1 producer's, exactly. (KV a TP 1 engine computes differs in its last bits from what a
    TP 2 engine computes on this CPU build, so the oracle here is the producer's own cache, and greedy tokens are
    not compared.)"""
    cons, tp1 = runs["cons"], runs["tp1"]
    assert cons[10]["external_hits"] == CHUNK  # Y: 400 tokens, one full chunk stored by the TP 1 engine
    producer = {head: set(d) for head, d in tp1[3]["heads"].items()}
    assert_loaded_exactly(cons[11]["heads"], producer, CHUNK // BLOCK)


def test_the_per_head_byte_comparison_catches_one_corrupted_block(runs):
    """The comparisons above can fail: one flipped byte in rank 1's stored value (checksums off) changes exactly
    one block of head 1, and none of head 0's."""
    cons = runs["cons"]
    refs = ref_heads(runs)
    loaded = cons[9]["heads"]
    assert cons[8]["external_hits"] == CHUNK  # (chunk 1's slice of head 1 is still gone)
    assert len(loaded["0"]) == len(loaded["1"]) == CHUNK // BLOCK
    assert set(loaded["0"]) <= refs["0"]
    assert len([d for d in loaded["1"] if d not in refs["1"]]) == 1


def test_the_dram_tier_at_tp2_reloads_both_ranks(runs):
    dram, ref = runs["dram"], runs["ref"]
    assert dram[0]["token_ids"] == ref[0]["token_ids"] and dram[0]["external_hits"] == 0
    assert dram[2]["external_hits"] == 512
    assert_loaded_exactly(dram[3]["heads"], ref_heads(runs), 512 // BLOCK)
    assert dram[2]["token_ids"] == ref[3]["token_ids"]


# ------------------------------------------------------------------------------------------------------------------
# Disaggregated prefill between engines of different TP sizes (the proxy's two calls, played by the test)


def test_pd_from_a_tp2_producer_to_a_tp1_consumer(runs):
    """The TP 2 producer announces Z's two full chunks (both ranks confirmed their slices; a ``kv_both`` engine does
    not store the one-token partial chunk); the TP 1 consumer, whose settings the proxy finds equal (TP is not a
    setting), loads all of it, both heads byte-identical to a TP 2 run without the connector, without waiting."""
    announced = runs["prod"][1]["kv_transfer_params"][0]["range"]
    assert announced["num_tokens"] == 2 * CHUNK
    decode = runs["decode_tp1"]
    assert mismatched_settings(announced["settings"], decode[0]["kv_transfer_params"][0]["range"]["settings"]) == {}
    assert decode[1]["external_hits"] == 512  # every token but the last, in whole blocks
    assert_loaded_exactly(decode[2]["heads"], ref_heads(runs, 12), 512 // BLOCK)
    assert "announced tokens arrived within" not in runs["logs"]["decode-tp1"]
    assert "other settings" not in runs["logs"]["decode-tp1"]


def test_pd_from_a_tp1_producer_to_a_tp2_consumer(runs):
    """The reverse: W computed at TP 1 and announced; the TP 2 consumer's ranks each load their head of it, byte for
    byte the TP 1 producer's own cache (KV computed at TP 1 and TP 2 differ in the last bits on this CPU build)."""
    announced = runs["prefill_tp1"][0]["kv_transfer_params"][0]["range"]
    assert announced["num_tokens"] == len(runs["w"])
    cons = runs["cons"]
    assert cons[12]["external_hits"] == 512
    producer = {head: set(d) for head, d in runs["prefill_tp1"][1]["heads"].items()}
    assert_loaded_exactly(cons[13]["heads"], producer, 512 // BLOCK)
    assert "announced tokens arrived within" not in runs["logs"]["consumer"]


def test_settings_that_cannot_be_shared_are_named_in_both_engines_logs(runs):
    """A block size or KV dtype the other side does not share is named: by the producer when the proxy's
    ``range_expect`` differs, by the consumer when an announcement's settings differ (the proxy itself answers 409
    before it would send such a request: tests/unit/test_proxy.py)."""
    assert "the consumer's settings differ from this producer's (block_size" in runs["logs"]["prefill-tp1"]
    assert "comes from a producer with other settings (kv_spec.dtype" in runs["logs"]["consumer"]
    # the request that carried the consumer's true settings was not flagged
    assert runs["logs"]["prefill-tp1"].count("the consumer's settings differ") == 1
