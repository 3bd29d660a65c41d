"""A tier that fails a save or a lookup: the call is a skipped save or a miss, and the shard is left alone for
``backend_retry_s`` before it is asked again. A file tier whose file system is full is no failure: the save is
skipped and counted (``saves_skipped_no_space``), and the next one is written as soon as there is space.

Driven through the engine-less harness (:mod:`tests.unit.scheduler_worker_harness`), with failures injected by
``FlakyBackend`` (a full file system: a real small tmpfs, ``tests/conftest.py``). The back-off windows are read on a
virtual clock (:func:`virtual_monotonic`): a busy machine can neither end one early nor make a test sleep it out.
"""

from __future__ import annotations

from pathlib import Path

import pytest

import range_connector.scheduler.lookup as lookup_module
import range_connector.worker.saves as saves_module
from range_connector.backends.file.backend import FileBackend
from range_connector.errors import BackendError, BackendTimeoutError
from tests.filesystems import fill_up
from tests.unit.clocks import virtual_monotonic
from tests.unit.scheduler_worker_harness import (
    Engine,
    FakeRequest,
    FlakyBackend,
    chain,
    produce,
    prompt_tokens,
    saved_chunk_idxs,
    saved_hashes,
    shard_backends,
)


# ---------------------------------------------------------------------------------------------------- save failure
@pytest.mark.timeout(30)
@pytest.mark.parametrize(("num_shards", "failing_shard"), [(1, 0), (2, 1)])
def test_save_error_skips_the_shard_for_backend_retry_s_then_resumes(num_shards: int, failing_shard: int,
                                                                     monkeypatch) -> None:
    retry_s = 0.2
    clock = virtual_monotonic(monkeypatch, saves_module)
    inner = shard_backends(num_shards, num_shards)
    flaky = [FlakyBackend(m, name=f"flaky-s{s}") for s, m in enumerate(inner)]
    eng = Engine(flaky, num_shards=num_shards, backend_retry_s=retry_s, seed=1)  # type: ignore[arg-type]
    flaky[failing_shard].fail_write = BackendError

    eng.admit(FakeRequest("r0", prompt_tokens(70, seed=20)))
    s0 = eng.step()  # the write fails: no exception
    assert saved_chunk_idxs(s0.meta) == [0, 1]
    assert eng.worker.stats["save_errors"] == 1
    assert s0.worker_meta is None  # nothing reported as saved
    writes = flaky[failing_shard].calls["write_stripe"]
    assert writes == 1

    flaky[failing_shard].fail_write = None  # the tier is back, but the shard is still counted down
    eng.admit(FakeRequest("r1", prompt_tokens(70, seed=21)))
    eng.step()
    assert flaky[failing_shard].calls["write_stripe"] == writes  # skipped without asking
    assert eng.worker.stats["saves_skipped"] == 1
    assert eng.worker.stats["saved_chunks"] == 0
    if num_shards == 2:  # the healthy shard keeps being written, one stripe per step
        assert flaky[0].calls["write_stripe"] == 2

    clock.advance(retry_s * 0.9)  # still down: skipped without asking
    eng.admit(FakeRequest("r1b", prompt_tokens(70, seed=24)))
    eng.step()
    assert flaky[failing_shard].calls["write_stripe"] == writes and eng.worker.stats["saves_skipped"] == 2
    clock.advance(retry_s * 0.2)  # retry_s after the failure: asked again
    p2 = prompt_tokens(70, seed=22)
    eng.admit(FakeRequest("r2", p2))
    s2 = eng.step()
    assert flaky[failing_shard].calls["write_stripe"] == writes + 1
    assert eng.worker.stats["saved_chunks"] == 2
    assert saved_hashes(s2.worker_meta) == chain(p2, 32)[:2]
    # The first two prompts' saves were lost (a future miss), the third's is stored on every shard.
    reader = Engine(inner, num_shards=num_shards, seed=9)
    assert reader.sched.get_num_new_matched_tokens(FakeRequest("x0", prompt_tokens(70, seed=20)), 0) == (0, False)
    assert reader.sched.get_num_new_matched_tokens(FakeRequest("x2", p2), 0) == (64, False)
    eng.close()
    reader.close()


# ---------------------------------------------------------------------------------------------------- lookup failure
@pytest.mark.timeout(30)
@pytest.mark.parametrize("exc", [BackendError, BackendTimeoutError])
@pytest.mark.parametrize(("num_shards", "failing_shard"), [(1, 0), (2, 1)])
def test_lookup_error_is_a_miss_and_the_tier_is_not_asked_again_for_backend_retry_s(
    num_shards: int, failing_shard: int, exc: type[BackendError], monkeypatch
) -> None:
    retry_s = 0.2
    inner = shard_backends(num_shards, num_shards)
    prompt = prompt_tokens(150, seed=23)
    a, _ = produce(inner, prompt, num_shards=num_shards)
    flaky = [FlakyBackend(m, name=f"flaky-s{s}") for s, m in enumerate(inner)]
    b = Engine(flaky, num_shards=num_shards, backend_retry_s=retry_s, seed=2)  # type: ignore[arg-type]
    flaky[failing_shard].fail_get_tickets = exc
    clock = virtual_monotonic(monkeypatch, lookup_module)

    assert b.sched.get_num_new_matched_tokens(FakeRequest("B-0", prompt), 0) == (0, False)
    assert b.sched.stats["lookup_errors"] == 1
    calls = sum(f.calls["get_tickets"] for f in flaky)
    flaky[failing_shard].fail_get_tickets = None
    for i in range(5):
        assert b.sched.get_num_new_matched_tokens(FakeRequest(f"B-{i + 1}", prompt), 0) == (0, False)
        clock.advance(retry_s * 0.9 / 5)  # (all of them within retry_s of the failure)
    assert sum(f.calls["get_tickets"] for f in flaky) == calls
    assert b.sched.stats["lookups_skipped"] == 5

    clock.advance(retry_s * 0.2)  # retry_s after the failure
    assert b.sched.get_num_new_matched_tokens(FakeRequest("B-9", prompt), 0) == (128, False)
    assert sum(f.calls["get_tickets"] for f in flaky) == calls + num_shards  # one ticket read per shard
    a.close()
    b.close()


# ---------------------------------------------------------------------------------------------------- full tier
@pytest.mark.timeout(30)
def test_a_save_to_a_full_file_tier_is_counted_as_no_space_and_the_next_is_written_once_there_is_space(
        small_tmpfs: Path) -> None:
    tier = FileBackend(small_tmpfs / "shard-0", timeout_s=10.0)
    eng = Engine([tier], seed=3)
    filler = fill_up(small_tmpfs / "filler")
    eng.admit(FakeRequest("r0", prompt_tokens(70, seed=30)))
    eng.step()  # ENOSPC: skipped, not an error, and the shard is not counted down
    assert eng.worker.stats["saves_skipped_no_space"] == 1 and tier.counters.saves_skipped_no_space == 1
    assert eng.worker.stats["save_errors"] == eng.worker.stats["saves_skipped_capacity"] == 0
    assert eng.worker.stats["saved_chunks"] == 0 and tier.used_bytes() == 0
    filler.unlink()
    p1 = prompt_tokens(70, seed=31)
    eng.admit(FakeRequest("r1", p1))
    s1 = eng.step()  # at once: no back-off after a full disk
    assert eng.worker.stats["saved_chunks"] == 2 and saved_hashes(s1.worker_meta) == chain(p1, 32)[:2]
    assert eng.worker.stats["saves_skipped"] == 0 and eng.worker.stats["saves_skipped_no_space"] == 1
    reader = Engine([FileBackend(small_tmpfs / "shard-0")], seed=4)
    assert reader.sched.get_num_new_matched_tokens(FakeRequest("x1", p1), 0) == (64, False)
    eng.close()
    reader.close()
