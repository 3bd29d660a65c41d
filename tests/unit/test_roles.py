"""Roles: a producer (``can_load=False``) never loads, a consumer (``can_save=False``) never saves.

Driven through the engine-less harness (:mod:`tests.unit.scheduler_worker_harness`).
"""

from __future__ import annotations

import pytest

from tests.unit.scheduler_worker_harness import (
    Engine,
    FakeRequest,
    live_leases,
    produce,
    prompt_tokens,
    shard_backends,
)


# ---------------------------------------------------------------------------------------------------- roles
@pytest.mark.timeout(30)
def test_producer_never_loads() -> None:
    backends = shard_backends(1, 1)
    prompt = prompt_tokens(150, seed=24)
    a, _ = produce(backends, prompt)
    p = Engine(backends, can_load=False, can_save=True, seed=3)
    assert p.sched.get_num_new_matched_tokens(FakeRequest("P-0", prompt), 0) == (0, False)
    assert p.admit(FakeRequest("P-1", prompt)) == 0
    assert p.sched.num_leases == 0
    res = p.step()
    assert res.meta.loads == []
    assert backends[0].counters.bytes_read == 0
    assert live_leases(backends) == 0
    a.close()
    p.close()


@pytest.mark.timeout(30)
def test_consumer_never_saves() -> None:
    backends = shard_backends(2, 2)
    c = Engine(backends, num_shards=2, can_load=True, can_save=False, seed=3)
    c.admit(FakeRequest("C-0", prompt_tokens(150, seed=25)), 70)
    steps = [c.step()]
    c.continue_("C-0")
    steps.append(c.step())
    c.continue_("C-0", 1)  # a decode step
    steps.append(c.step())
    assert all(s.meta.saves == [] for s in steps)
    assert all(m.counters.bytes_written == 0 and m.used_bytes() == 0 for m in backends)
    c.finish("C-0")
    c.step()
    assert c.sched._requests == {}
    c.close()
