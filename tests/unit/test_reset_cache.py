"""``reset_cache`` on the scheduler side (vLLM's ``reset_prefix_cache(reset_connector=True)``, the API server's
``/reset_prefix_cache?reset_external=true``): the next lookup misses, on this engine and on a fresh one, the tier's
bytes for the deployment go, another deployment's entries stay, and a shard that cannot be cleared makes it return
``False``. Real schedulers and workers (``scheduler_worker_harness``), a real Valkey server, the DRAM tier."""

from __future__ import annotations

import os
import signal

import pytest

from range_connector.backends.valkey.client import ValkeyBackend
from tests.unit.scheduler_worker_harness import Engine, FakeRequest, produce, prompt_tokens, shard_backends

PROMPT_TOKENS = 100  # three full chunks of 32 tokens


def _hit(engine: Engine, req_id: str, prompt: list[int]) -> int:
    return engine.sched.get_num_new_matched_tokens(FakeRequest(req_id, prompt), 0)[0]


@pytest.mark.timeout(60)
def test_reset_makes_the_next_lookup_miss_on_valkey_and_keeps_other_deployments(dedicated_valkey) -> None:
    url = dedicated_valkey.urls[0]
    ours, theirs = ValkeyBackend(url, deployment="ours"), ValkeyBackend(url, deployment="theirs")
    prompt = prompt_tokens(PROMPT_TOKENS, seed=3)
    try:
        a, _ = produce([ours], prompt, deployment="ours")
        other, _ = produce([theirs], prompt, deployment="theirs")
        assert _hit(Engine([ours], deployment="ours"), "B-0", prompt) == 96
        assert ours.used_bytes() > 0
        assert a.sched.reset_cache() is True
        assert _hit(a, "A-1", prompt) == 0  # this engine, from the moment reset returned
        assert _hit(Engine([ours], deployment="ours"), "C-0", prompt) == 0  # and a fresh one
        assert ours.used_bytes() == 0
        assert _hit(Engine([theirs], deployment="theirs"), "D-0", prompt) == 96  # the other deployment's entries
        assert a.sched.counters()["resets"] == 1
        other.close()
        a.close()
    finally:
        ours.close()
        theirs.close()


@pytest.mark.timeout(60)
def test_reset_returns_false_when_a_shard_does_not_answer(dedicated_valkey) -> None:
    url = dedicated_valkey.urls[0]
    backend = ValkeyBackend(url, timeout_s=0.5)
    prompt = prompt_tokens(PROMPT_TOKENS, seed=4)
    try:
        a, _ = produce([backend], prompt)
        os.kill(dedicated_valkey.pids[0], signal.SIGSTOP)  # frozen: every call times out
        try:
            assert a.sched.reset_cache() is False
        finally:
            os.kill(dedicated_valkey.pids[0], signal.SIGCONT)
        assert a.sched.reset_cache() is True  # answered again: cleared
        assert _hit(a, "A-1", prompt) == 0
        a.close()
    finally:
        backend.close()


@pytest.mark.timeout(60)
def test_reset_of_the_dram_tier_clears_the_index_at_once_and_the_workers_next_step() -> None:
    backends = shard_backends(1, 1)
    prompt = prompt_tokens(PROMPT_TOKENS, seed=5)
    a, _ = produce(backends, prompt, lookup_backends=None)
    assert _hit(a, "A-1", prompt) == 96  # the scheduler's index of what the worker holds
    assert backends[0].used_bytes() > 0
    assert a.sched.reset_cache() is True
    assert _hit(a, "A-2", prompt) == 0  # the index is empty from the moment reset returned
    assert backends[0].used_bytes() > 0  # the worker's bytes go with the next step's metadata
    step = a.step()
    assert step.meta.reset_generation == 1
    assert backends[0].used_bytes() == 0 and a.worker.stats["resets"] == 1
    a.close()


@pytest.mark.timeout(60)
def test_saves_gathered_before_a_reset_are_not_written_after_it() -> None:
    backends = shard_backends(1, 1)
    a = Engine(backends, lookup_backends=None, save_mode="async")
    a.worker.saver._thread.submit(lambda: None).result()  # (the saver thread is up)
    gate = __import__("threading").Event()
    a.worker.saver._thread.submit(gate.wait, 30)  # hold the saver: the next save waits in its queue
    prompt = prompt_tokens(PROMPT_TOKENS, seed=6)
    assert a.admit(FakeRequest("A-0", prompt), None) == 0
    a.step()  # gathers the chunks; their write waits behind the gate
    assert a.sched.reset_cache() is True
    a.finish("A-0")
    a.step()  # the workers learn of the reset before the queued write runs
    gate.set()
    assert a.worker.saver.wait(30)
    a.step()
    assert backends[0].used_bytes() == 0
    assert a.worker.stats["saves_skipped_reset"] >= 1
    assert _hit(a, "A-1", prompt) == 0
    a.close()


@pytest.mark.timeout(60)
def test_a_save_gathered_before_a_reset_and_written_before_the_workers_hear_of_it_stores_nothing(
        dedicated_valkey) -> None:
    # The window between the scheduler's clear and the step that tells the workers: the saver's write runs in it.
    # The save carries the tier's epoch from when it was gathered, so the tier refuses it.
    url = dedicated_valkey.urls[0]
    ours = ValkeyBackend(url, deployment="ours")
    try:
        a = Engine([ours], deployment="ours", save_mode="async")
        a.worker.saver._thread.submit(lambda: None).result()  # (the saver thread is up)
        gate = __import__("threading").Event()
        a.worker.saver._thread.submit(gate.wait, 30)  # hold the saver: the next save waits in its queue
        prompt = prompt_tokens(PROMPT_TOKENS, seed=7)
        assert a.admit(FakeRequest("A-0", prompt), None) == 0
        a.step()  # gathers the chunks (epoch 0); their write waits behind the gate
        assert a.sched.reset_cache() is True  # epoch 1
        gate.set()  # the write runs before any step tells the workers of the reset
        assert a.worker.saver.wait(30)
        assert ours.used_bytes() == 0
        assert _hit(Engine([ours], deployment="ours"), "B-0", prompt) == 0
        a.finish("A-0")
        a.step()  # now they hear of it: later saves carry the new epoch and land
        assert ours.epoch_hint == 1
        assert a.admit(FakeRequest("A-2", prompt), None) == 0
        a.step()
        assert a.worker.saver.wait(30)
        assert _hit(Engine([ours], deployment="ours"), "C-0", prompt) == 96
        a.close()
    finally:
        ours.close()
