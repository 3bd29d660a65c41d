"""A layer-pipelined load is paced by its own forward: the load's deadline bounds the waiting for the tier, not the
compute between two layers.

Found by ``bench/hit_ttft.py`` (December 2026): on the bench model a 4,096-token hit's forward takes 1.3 s, its load
was given the 0.25 s minimum deadline, and every other DRAM hit was cut after its first layers ("layers 4-31 not
delivered (the load deadline passed)") and recomputed in full (about 100 s), although every byte was in reach.

Nothing here is timed: the worker's modules read a virtual clock that moves only when the test says, and the forward
"computes" by moving it ten times the load's deadline before attention asks for each layer. The twin shows that a
tier that does not answer still costs at most the deadline of waiting.
"""

from __future__ import annotations

import pytest

from range_connector.worker import facade, lent_views, loads, shard_reads
from tests.unit.clocks import HOLD_MAX_S, virtual_monotonic
from tests.unit.scheduler_worker_harness import (
    BLOCK,
    LAYERS,
    PATH_CONFIG,
    Engine,
    FakeRequest,
    produce,
    prompt_tokens,
    same_block,
    shard_backends,
    wrap,
)

DEADLINE_S = 5.0  # the load's deadline (also the longest real wait for a tiny in-memory read: only a hang exceeds it)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("path", ["views", "layer-banks", "direct"])
def test_a_pipelined_load_is_not_cut_while_its_forward_computes_for_longer_than_the_deadline(
        path: str, monkeypatch) -> None:
    inner = shard_backends(1, 1)
    prompt = prompt_tokens(150, seed=61)
    a, a_blocks = produce(inner, prompt)
    clock = virtual_monotonic(monkeypatch, loads, lent_views, shard_reads, facade)
    b = Engine(wrap(inner, path), seed=62, load_mode="pipelined", min_load_deadline_s=DEADLINE_S,
               load_deadline_s=DEADLINE_S, **PATH_CONFIG[path])  # type: ignore[arg-type]
    assert b.admit(FakeRequest("B-0", prompt)) == 128
    meta = b.sched.build_connector_meta(b._scheduler_output())
    b.worker.start_load(meta)
    dst = list(b.running["B-0"].block_ids)
    for name in LAYERS:
        clock.advance(10 * DEADLINE_S)  # the forward's layers before this attention layer
        b.worker.wait_for_layer(name)
    b.worker.save(meta)
    assert b.worker.take_failed_block_ids() == set()
    assert b.worker.stats["load_deadline_misses"] == 0
    for i in range(128 // BLOCK):
        assert same_block(b.kv, dst[i], a.kv, a_blocks[i])
    [timeline] = b.worker.load_timelines
    assert timeline["mode"] == "pipelined"
    a.close()
    b.close()


@pytest.mark.timeout(60)
def test_a_tier_that_does_not_answer_still_costs_at_most_the_deadline_of_waiting(monkeypatch) -> None:
    inner = shard_backends(1, 1)
    prompt = prompt_tokens(150, seed=63)
    a, _ = produce(inner, prompt)
    flaky = wrap(inner, "layer-banks")
    clock = virtual_monotonic(monkeypatch, loads, lent_views, shard_reads, facade)
    b = Engine(flaky, seed=64, load_mode="pipelined", min_load_deadline_s=DEADLINE_S, load_deadline_s=DEADLINE_S,
               **PATH_CONFIG["layer-banks"])  # type: ignore[arg-type]
    assert b.admit(FakeRequest("B-0", prompt)) == 128
    meta = b.sched.build_connector_meta(b._scheduler_output())
    for f in flaky:
        f.hold_reads()  # the tier does not answer (until released below; a held read gives up after HOLD_MAX_S)
    b.worker.start_load(meta)
    clock.advance(10 * DEADLINE_S)  # the forward computes, then attention waits for layer 0: the clock stands
    # still, so the wait for the silent tier ends on the real time it is allowed, DEADLINE_S, well before HOLD_MAX_S
    b.worker.wait_for_layer(LAYERS[0])
    assert b.worker.stats["load_deadline_misses"] == 1
    for f in flaky:
        f.release_reads()
    for name in LAYERS[1:]:
        b.worker.wait_for_layer(name)
    b.worker.save(meta)
    assert len(b.worker.take_failed_block_ids()) == 128 // BLOCK  # reported: vLLM recomputes them
    assert HOLD_MAX_S > DEADLINE_S
    a.close()
    b.close()
