"""Disaggregated prefill through the connector's ``kv_transfer_params``: the producer stores the whole prompt and
announces it, the consumer loads all but the last token, waits within ``remote_wait_s`` for announced KV, and both
sides name settings that differ (a mismatched producer is never waited for).

Driven through the engine-less harness (:mod:`tests.unit.scheduler_worker_harness`): a producing engine
(``can_load=False``) and a consuming one (``can_save=False``) on the same in-memory stripe stores.
"""

from __future__ import annotations

import pytest

import range_connector.scheduler.handoff as handoff_module
from tests.unit.clocks import virtual_monotonic
from tests.unit.scheduler_worker_harness import (
    Engine,
    FakeRequest,
    prompt_tokens,
    same_block,
    shard_backends,
    wrap,
)


# ------------------------------------------------------------------------------------------------ disaggregated prefill
def _pd_request(req_id: str, prompt: list[int], params: dict | None) -> FakeRequest:
    req = FakeRequest(req_id, prompt)
    req.kv_transfer_params = params  # type: ignore[attr-defined]
    return req


@pytest.mark.timeout(60)
@pytest.mark.parametrize("num_shards", [1, 2])
def test_producer_stores_the_whole_prompt_and_the_consumer_loads_all_but_the_last_token(num_shards: int) -> None:
    inner = shard_backends(num_shards, num_shards)
    prompt = prompt_tokens(150, seed=70)  # 4 full 32-token chunks and a 22-token tail
    p = Engine(inner, num_shards=num_shards, can_load=False, can_save=True, seed=71)
    req = _pd_request("P-0", prompt, {"do_remote_decode": True})
    assert p.admit(req) == 0
    res = p.step()
    assert [c.chunk_idx for r in res.meta.saves for c in r.chunks] == [0, 1, 2, 3, 4]  # the tail as chunk 4
    p_blocks = list(p.running["P-0"].block_ids)
    assert p.sched.request_finished(req, p_blocks) == (False, {"range": {
        "version": 1, "settings": p.sched.settings, "num_tokens": 150,
        "chain_head": p.sched._chain(req)[1].hex()}})
    params = p.sched.request_finished(req, p_blocks)[1]  # (state already forgotten: no token count any more)
    assert "num_tokens" not in params["range"]
    announced = {"range": {"version": 1, "settings": p.sched.settings, "num_tokens": 150}}

    c = Engine(wrap(inner), num_shards=num_shards, can_load=True, can_save=False, seed=72)  # type: ignore[arg-type]
    creq = _pd_request("C-0", prompt, announced)
    assert c.admit(creq) == 149  # all but the last token (vLLM computes that one)
    res = c.step(forward=False)
    assert res.invalid_block_ids == set()
    dst = c.running["C-0"].block_ids
    assert len(res.loaded_block_log) == 10  # ceil(149 / 16): the last block only partly holds prompt tokens
    for i in range(10):
        assert same_block(res.after_load, dst[i], p.kv, p_blocks[i]), f"block {i}"
    # A longer prompt that extends this one does not match the tail: its chunk 4 holds other tokens.
    longer = _pd_request("C-1", prompt + prompt_tokens(30, seed=73), None)
    assert c.sched.get_num_new_matched_tokens(longer, 0) == (128, False)
    p.close()
    c.close()


@pytest.mark.timeout(30)
def test_consumer_waits_within_remote_wait_s_for_announced_kv_then_recomputes(monkeypatch) -> None:
    # (on a virtual clock: the wait is remote_wait_s exactly, however busy the machine)
    clock = virtual_monotonic(monkeypatch, handoff_module)
    inner = shard_backends(1, 1)
    prompt = prompt_tokens(150, seed=74)
    c = Engine(inner, can_load=True, can_save=False, seed=75, remote_wait_s=0.3)
    settings = dict(c.sched.settings)
    req = _pd_request("C-0", prompt, {"range": {"settings": settings, "num_tokens": 150}})
    assert c.sched.get_num_new_matched_tokens(req, 0) == (None, False)  # not there yet: asked again next step
    for _ in range(5):  # asked again at every step until remote_wait_s has passed
        clock.advance(0.29 / 5)
        assert c.sched.get_num_new_matched_tokens(req, 0) == (None, False)
    clock.advance(0.02)  # 0.31 s after the first ask
    assert c.sched.get_num_new_matched_tokens(req, 0) == (0, False)  # then nothing is promised: recomputed
    assert c.sched.get_num_new_matched_tokens(req, 0) == (0, False)  # (and not waited for again)
    assert c.sched.stats["remote_wait_timeouts"] == 1
    c.close()


@pytest.mark.timeout(30)
def test_mismatched_producer_settings_are_named_and_never_waited_for(caplog) -> None:
    inner = shard_backends(1, 1)
    c = Engine(inner, can_load=True, can_save=False, seed=76, remote_wait_s=5.0)
    theirs = {**c.sched.settings, "block_size": 32, "chunk_tokens": 64}
    req = _pd_request("C-0", prompt_tokens(150, seed=77), {"range": {"settings": theirs, "num_tokens": 150}})
    assert c.sched.get_num_new_matched_tokens(req, 0) == (0, False)
    assert c.sched.stats["settings_mismatches"] == 1
    assert "block_size: 32 != 16" in caplog.text and "chunk_tokens: 64 != 32" in caplog.text
    c.close()


@pytest.mark.timeout(30)
def test_producer_names_a_consumer_whose_settings_differ(caplog) -> None:
    inner = shard_backends(1, 1)
    p = Engine(inner, can_load=False, can_save=True, seed=82)
    theirs = {**p.sched.settings, "num_shards": 2}
    req = _pd_request("P-0", prompt_tokens(150, seed=83), {"do_remote_decode": True, "range_expect": theirs})
    p.admit(req)
    p.step()
    assert p.sched.request_finished(req, list(p.running["P-0"].block_ids))[1]["range"]["num_tokens"] == 150
    assert p.sched.stats["settings_mismatches"] == 1 and "num_shards: 2 != 1" in caplog.text
    p.close()
