"""Disaggregated prefill through the connector's ``kv_transfer_params``: the producer stores the whole prompt and
announces it, the consumer loads all but the last token, waits within ``remote_wait_s`` for announced KV, and both
sides name settings that differ (a mismatched producer is never waited for).

The hand-off is durable: a producer announces only the chunks every saving rank reported stored, completed in the
step its request finishes in (vLLM calls ``request_finished`` before it hands over that step's worker report; the
last test checks that order in the installed vLLM), and a consumer computes at once when nothing was announced or
when its lookups count the tier as down. Waits in these tests are far longer than the tests (no wall-clock
thresholds): a consumer that waited would answer ``None``.

Driven through the engine-less harness (:mod:`tests.unit.scheduler_worker_harness`): a producing engine
(``can_load=False``) and a consuming one (``can_save=False``) on the same in-memory stripe stores.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import textwrap
import threading

import pytest

import range_connector.scheduler.handoff as handoff_module
from range_connector.errors import BackendError
from tests.unit.clocks import virtual_monotonic
from tests.unit.scheduler_worker_harness import (
    Engine,
    FakeRequest,
    FlakyBackend,
    chain,
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


# ------------------------------------------------------------------------------------------------ durable hand-off
def _announcement(res, req_id: str) -> dict:
    """The ``"range"`` part of what ``request_finished`` returned in that step, as vLLM serializes it after the step."""
    params = res.finished_params[req_id]
    assert params is not None and set(params) == {"range"}
    return params["range"]


def _prefill(p: Engine, req: FakeRequest, **step_kw):
    """A one-step prefill that stops in its step (``max_tokens = 1``): request_finished, then the step's report."""
    assert p.admit(req) == 0
    return p.step(finish_in_step=[req.request_id], **step_kw)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("refusal", ["error", "full"])
def test_producer_whose_tier_refuses_writes_announces_nothing_and_the_consumer_computes_at_once(refusal: str) -> None:
    # The producer's tier refuses every write (an error, or no room): it announces 0 tokens, and the consumer, with
    # a wait far longer than the test, answers (0, False) at its first call: no lookup, no wait, no asynchronous load
    # (so the request never enters WAITING_FOR_REMOTE_KVS).
    inner = shard_backends(1, 1, capacity_bytes=1 if refusal == "full" else 64 << 20)
    flaky = FlakyBackend(inner[0])
    if refusal == "error":
        flaky.fail_write = BackendError
    prompt = prompt_tokens(150, seed=90)
    p = Engine([flaky], can_load=False, can_save=True, seed=91)
    res = _prefill(p, _pd_request("P-0", prompt, {"do_remote_decode": True}))
    assert [c.chunk_idx for r in res.meta.saves for c in r.chunks] == [0, 1, 2, 3, 4]  # planned, never stored
    assert all(r.confirm for r in res.meta.saves)
    assert res.worker_meta is not None and res.worker_meta.save_results == [("P-0", c, False) for c in range(5)]
    info = _announcement(res, "P-0")
    assert info["num_tokens"] == 0 and info["chain_head"] is None
    assert p.sched.stats["handoff_unconfirmed_chunks"] == 5 and p.sched.handoff.num_followed == 0

    consumer_flaky = FlakyBackend(inner[0])
    c = Engine([consumer_flaky], can_load=True, can_save=False, seed=92, remote_wait_s=600.0)
    creq = _pd_request("C-0", prompt, res.finished_params["P-0"])
    assert c.sched.get_num_new_matched_tokens(creq, 0) == (0, False)
    assert consumer_flaky.calls["get_tickets"] == 0  # nothing announced: nothing looked up
    assert c.sched.stats["remote_waits"] == 0 and c.sched.stats["remote_nothing_announced"] == 1
    assert c.admit(creq) == 0
    c.step()
    p.close()
    c.close()


@pytest.mark.timeout(60)
def test_producer_announces_what_its_workers_stored_in_the_step_its_request_finishes() -> None:
    # request_finished comes before the step's worker report (vLLM's order): the answer it returned is completed in
    # place by update_connector_output of the same step, so it names the whole prompt once the workers stored it.
    inner = shard_backends(2, 2)
    prompt = prompt_tokens(150, seed=93)
    p = Engine(inner, num_shards=2, can_load=False, can_save=True, seed=94)
    req = _pd_request("P-0", prompt, {"do_remote_decode": True})
    res = _prefill(p, req)
    info = _announcement(res, "P-0")
    assert info == {"version": 1, "settings": p.sched.settings, "num_tokens": 150,
                    "chain_head": p.sched._chain(req)[1].hex()}
    assert p.sched.stats["handoff_unconfirmed_chunks"] == 0 and p.sched.handoff.num_followed == 0

    c = Engine(wrap(inner), num_shards=2, can_load=True, can_save=False, seed=95, remote_wait_s=600.0)
    assert c.admit(_pd_request("C-0", prompt, res.finished_params["P-0"])) == 149
    assert c.step(forward=False).invalid_block_ids == set()
    p.close()
    c.close()


@pytest.mark.timeout(60)
def test_producer_whose_later_chunks_fail_announces_only_the_stored_leading_chunks() -> None:
    # Chunked prefill: the first step stores chunks 0 and 1, then the tier fails: chunks 2, 3 and the partial last
    # one are not stored, so 64 tokens are announced (chain head: chunk 1) and the consumer loads them at once.
    inner = shard_backends(1, 1)
    flaky = FlakyBackend(inner[0])
    prompt = prompt_tokens(150, seed=96)
    p = Engine([flaky], can_load=False, can_save=True, seed=97)
    req = _pd_request("P-0", prompt, {"do_remote_decode": True})
    assert p.admit(req, 70) == 0
    first = p.step()
    assert first.worker_meta is not None and first.worker_meta.save_results == [("P-0", 0, True), ("P-0", 1, True)]
    flaky.fail_write = BackendError
    p.continue_("P-0")
    res = p.step(finish_in_step=["P-0"])
    assert [c.chunk_idx for r in res.meta.saves for c in r.chunks] == [2, 3, 4]
    info = _announcement(res, "P-0")
    assert info["num_tokens"] == 64 and info["chain_head"] == chain(prompt, 32)[1].hex()
    assert p.sched.stats["handoff_unconfirmed_chunks"] == 3

    c = Engine(wrap(inner), can_load=True, can_save=False, seed=98, remote_wait_s=600.0)
    creq = _pd_request("C-0", prompt, res.finished_params["P-0"])
    assert c.sched.get_num_new_matched_tokens(creq, 0) == (64, False)  # all that was announced: no wait
    assert c.sched.stats["remote_waits"] == 0
    p.close()
    c.close()


def _one_rank(meta):
    return [meta]


def _two_ranks(meta):
    return [meta, dataclasses.replace(meta, save_results=list(meta.save_results))]


def _second_rank_fails(chunk_idxs):
    def reports(meta):
        other = [(r, c, c not in chunk_idxs and ok) for r, c, ok in meta.save_results]
        return [meta, dataclasses.replace(meta, save_results=other)]
    return reports


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("ranks", "num_tokens", "num_unconfirmed"), [
    (_one_rank, 0, 5),  # the other saving rank never reported: nothing counts as stored
    (_two_ranks, 150, 0),
    (_second_rank_fails({0, 1, 2, 3, 4}), 0, 5),  # one rank's failure report makes a chunk unstored
    (_second_rank_fails({2}), 64, 1),  # ... and ends the announced prefix there (stored 3 and the tail follow it)
], ids=["one-rank-only", "both-ranks", "second-rank-failed", "second-rank-failed-chunk-2"])
def test_with_two_saving_ranks_a_chunk_is_announced_only_once_both_reported_it_stored(ranks, num_tokens: int,
                                                                                   num_unconfirmed: int) -> None:
    inner = shard_backends(1, 1)
    prompt = prompt_tokens(150, seed=99)
    p = Engine(inner, can_load=False, can_save=True, seed=100, num_saving_ranks=2)
    res = _prefill(p, _pd_request("P-0", prompt, {"do_remote_decode": True}), rank_reports=ranks)
    assert _announcement(res, "P-0")["num_tokens"] == num_tokens
    assert p.sched.stats["handoff_unconfirmed_chunks"] == num_unconfirmed
    p.close()


def test_num_saving_ranks_below_one_is_refused() -> None:
    with pytest.raises(ValueError, match="num_saving_ranks"):
        Engine(shard_backends(1, 1), can_load=False, can_save=True, num_saving_ranks=0)


class _GatedBackend(FlakyBackend):
    """Writes from the saver's background thread wait until :attr:`gate` opens (at most 30 s: a test that forgets it
    fails rather than hangs); writes made in the step pass."""

    def __init__(self, inner) -> None:
        super().__init__(inner, name="gated")
        self.gate = threading.Event()

    def write_stripe(self, write):
        if threading.current_thread().name.startswith("range-save"):
            self.gate.wait(30.0)
        return super().write_stripe(write)


@pytest.mark.timeout(60)
def test_an_engine_that_saves_in_the_background_writes_a_hand_offs_saves_in_the_step() -> None:
    # A kv_both engine with save_mode "async" (the default): an ordinary request's save goes to the background (the
    # step returns while the write waits at the gate), but a request that asked for a hand-off has its saves written
    # in its step, so that its announcement, serialized as the request ends, names the whole prompt.
    gated = _GatedBackend(shard_backends(1, 1)[0])
    eng = Engine([gated], seed=102, save_mode="async")
    res = _prefill(eng, FakeRequest("plain", prompt_tokens(150, seed=101)))
    assert eng.worker.saver.backlog_bytes > 0  # the step returned with its write still waiting at the closed gate
    assert res.worker_meta is None or not res.worker_meta.saved
    gated.gate.set()
    assert eng.worker.wait_for_saves(30.0) and eng.worker.saver.backlog_bytes == 0

    gated.gate.clear()  # (a background write would now wait: the hand-off's must not be one)
    res = _prefill(eng, _pd_request("handoff", prompt_tokens(150, seed=103), {"do_remote_decode": True}))
    assert eng.worker.saver.backlog_bytes == 0
    assert res.worker_meta is not None and len(res.worker_meta.save_results) == 4  # (kv_both: no partial tail)
    assert all(stored for _req, _chunk, stored in res.worker_meta.save_results)
    assert _announcement(res, "handoff")["num_tokens"] == 128
    assert eng.sched.handoff.num_followed == 0
    gated.gate.set()
    eng.close()


@pytest.mark.timeout(60)
def test_consumer_whose_lookups_count_the_tier_down_does_not_wait_for_announced_kv() -> None:
    # The consumer's tier fails a lookup: for the tier's retry_s, lookups are misses without asking, so waiting for
    # announced KV cannot help: the request is computed at once, whether the failure came before its first lookup,
    # with it, or while it was already waiting.
    inner = shard_backends(1, 1)
    flaky = FlakyBackend(inner[0])
    c = Engine([flaky], can_load=True, can_save=False, seed=104, remote_wait_s=600.0, backend_retry_s=600.0)
    settings = dict(c.sched.settings)

    def announced(req_id: str, seed: int) -> FakeRequest:
        return _pd_request(req_id, prompt_tokens(150, seed=seed), {"range": {"settings": settings, "num_tokens": 150}})

    waiting = announced("C-wait", 105)
    assert c.sched.get_num_new_matched_tokens(waiting, 0) == (None, False)  # the tier is up: the KV may come
    flaky.fail_get_tickets = BackendError
    assert c.sched.get_num_new_matched_tokens(waiting, 0) == (0, False)  # this lookup fails: stop waiting
    assert c.sched.lookup.is_down()
    assert c.sched.get_num_new_matched_tokens(announced("C-1", 106), 0) == (0, False)  # the tier is down already
    assert c.sched.stats["lookups_skipped"] == 1  # C-1 was not even looked up
    assert c.sched.stats["remote_waits"] == 1 and c.sched.stats["remote_waits_tier_down"] == 2
    assert c.sched.stats["remote_wait_timeouts"] == 0
    c.close()


@pytest.mark.timeout(30)
@pytest.mark.parametrize("num_tokens", ["150", -1, True, 1.5e300, None, 1 << 62, [150], {"n": 1}])
def test_malformed_announced_token_counts_are_ignored(num_tokens) -> None:
    # kv_transfer_params are client input: a token count that is not a bounded non-negative integer is no
    # announcement at all (no wait, no exception).
    c = Engine(shard_backends(1, 1), can_load=True, can_save=False, seed=107, remote_wait_s=600.0)
    req = _pd_request("C-0", prompt_tokens(150, seed=108),
                      {"range": {"settings": dict(c.sched.settings), "num_tokens": num_tokens}})
    assert c.sched.get_num_new_matched_tokens(req, 0) == (0, False)
    assert c.sched.stats["remote_waits"] == 0
    c.close()


# ------------------------------------------------------------------------------------------------ vLLM's order
def _method(cls, name: str) -> ast.FunctionDef:
    tree = ast.parse(textwrap.dedent(inspect.getsource(getattr(cls, name))))
    node = tree.body[0]
    assert isinstance(node, ast.FunctionDef) and node.name == name
    return node


def _calls(node: ast.AST, attr: str) -> list[ast.Call]:
    return [n for n in ast.walk(node) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
            and n.func.attr == attr]


@pytest.mark.timeout(30)
def test_vllm_finishes_a_request_before_it_hands_over_the_steps_connector_output() -> None:
    """The producer's announcement is completed in ``update_connector_output`` of the step whose
    ``request_finished`` returned it (``scheduler/handoff.py``). That relies on the installed vLLM's
    ``Scheduler.update_from_output``: it frees stopped requests (``_free_request`` -> ``request_finished``) in its
    per-request loop, puts the returned dict itself (not a copy) into the ``EngineCoreOutput``, and only after the
    loop calls ``_update_from_kv_xfer_finished`` -> ``connector.update_connector_output``. A vLLM that changes this
    must fail here, not silently shorten every announcement."""
    from vllm.v1.core.sched.scheduler import Scheduler

    update = _method(Scheduler, "update_from_output")
    loops = [n for n in update.body if isinstance(n, ast.For) and "num_scheduled_tokens" in ast.unparse(n.iter)]
    assert len(loops) == 1, "update_from_output: its per-request loop over num_scheduled_tokens is not found"
    [loop] = loops
    frees = _calls(loop, "_free_request")
    assert frees, "update_from_output no longer frees stopped requests inside its per-request loop"
    handovers = _calls(update, "_update_from_kv_xfer_finished")
    assert len(handovers) == 1 and handovers[0].lineno > loop.end_lineno, \
        "update_from_output hands over the connector output before (or inside) its per-request loop"
    outputs = [k.value for c in ast.walk(loop) if isinstance(c, ast.Call) and ast.unparse(c.func) == "EngineCoreOutput"
               for k in c.keywords if k.arg == "kv_transfer_params"]
    assert [ast.unparse(v) for v in outputs] == ["kv_transfer_params"], \
        "update_from_output no longer passes request_finished's dict itself into EngineCoreOutput"
    assignments = [n for n in ast.walk(loop) if isinstance(n, ast.Assign)
                   and any("kv_transfer_params" in ast.unparse(t) for t in n.targets)
                   and isinstance(n.value, ast.Call) and _calls(n.value, "_free_request") == [n.value]]
    assert assignments, "update_from_output no longer takes kv_transfer_params straight from _free_request"
    assert _calls(_method(Scheduler, "_update_from_kv_xfer_finished"), "update_connector_output")
    free = _method(Scheduler, "_free_request")
    assert _calls(free, "_connector_finished") and "kv_xfer_params" in ast.unparse(free.body[-1]), \
        "_free_request no longer returns _connector_finished's kv_transfer_params"
    finished = _method(Scheduler, "_connector_finished")
    assert _calls(finished, "request_finished")
    copies = [c for name in ("copy", "deepcopy", "dict") for c in ast.walk(free) if isinstance(c, ast.Call)
              and ast.unparse(c.func).endswith(name) and "kv_xfer_params" in ast.unparse(c)]
    assert not copies, "_free_request copies the connector's kv_transfer_params"
