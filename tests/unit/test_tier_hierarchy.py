"""A tier hierarchy (DRAM in front of a shared tier): the lookup across tiers, loads routed to the tier that holds
each chunk, write-through saves, promotion into DRAM, and the per-tier token counts.

Driven through the engine-less harness (:mod:`tests.unit.scheduler_worker_harness`) with the real DRAM tier, real
files (the file tier) and, for one test, real Valkey servers (one per shard).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from range_connector.backends.file.backend import FileBackend
from range_connector.backends.memory import MemoryBackend
from range_connector.backends.tiered import TieredBackend, stripe_tier, tag_stripe
from range_connector.config.tree import TierConfig
from range_connector.errors import BackendError
from range_connector.kv.tickets import Ticket, ticket_key
from range_connector.scheduler.tiers import _tag, entry_tier
from tests.unit.clocks import instant_probes, probe_timings_once_back
from tests.unit.scheduler_worker_harness import (
    CHUNK_BYTES_DENSE_32,
    Engine,
    FlakyBackend,
    FakeRequest,
    MiB,
    chain,
    prompt_tokens,
    same_block,
    snapshot,
)

def _engine(far: list, *, seed: int, promote_after_hits: int = 2, dram_bytes: int = 64 * MiB,
            far_type: str = "file", **config) -> tuple[Engine, MemoryBackend]:
    dram = MemoryBackend(dram_bytes, name="dram")
    worker = [TieredBackend([dram, b]) for b in far]
    sched = [TieredBackend([None, b]) for b in far]
    tiers = (TierConfig("memory", index=0), TierConfig(far_type, index=1))
    eng = Engine(worker, lookup_backends=sched, num_shards=len(far), seed=seed, tiers=tiers,
                 promote_after_hits=promote_after_hits, **config)
    return eng, dram


def _files(tmp_path: Path, n: int = 2) -> list[FileBackend]:
    return [FileBackend(tmp_path / f"shard-{s}", None, timeout_s=5.0) for s in range(n)]


def _tiers_of(eng: Engine, prompt: list[int]) -> list[int]:
    return [entry_tier(e) for e in eng.sched.stored_prefix(chain(prompt, 32))]


def _produce(eng: Engine, req_id: str, prompt: list[int]) -> list[int]:
    eng.admit(FakeRequest(req_id, prompt))
    eng.step()
    for worker in eng.workers:  # (every rank's far copies too: each writes its own heads)
        assert worker.wait_for_saves(30)
    eng.step(forward=False)  # the saves' report reaches the scheduler
    blocks = list(eng.running[req_id].block_ids)
    eng.finish(req_id)
    return blocks


class Produced:
    """A DRAM + files engine after one prompt was saved through both tiers (:func:`_produced`)."""

    def __init__(self, files: list, eng: Engine, dram: MemoryBackend, prompt: list[int], src: list[int]) -> None:
        self.files, self.eng, self.dram, self.prompt, self.src = files, eng, dram, prompt, src
        self.saved = snapshot(eng.kv)  # (the prompt's blocks are free now: a later request may reuse them)


def _produced(tmp_path: Path, seed: int, *, wrap=lambda files: files, **config) -> Produced:
    """Files per shard (``wrap``: around them), an engine of DRAM in front of them, and a 150-token prompt saved."""
    files = _files(tmp_path)
    eng, dram = _engine(wrap(files), seed=seed, **config)
    prompt = prompt_tokens(150, seed=seed)
    return Produced(files, eng, dram, prompt, _produce(eng, "P-0", prompt))


def _forget_in_dram(eng: Engine, dram: MemoryBackend, prompt: list[int], chunk_idxs: range) -> None:
    """Chunks gone from DRAM (as if evicted), still on the far tier."""
    hashes = [chain(prompt, 32)[c] for c in chunk_idxs]
    dram.delete_tickets([ticket_key(h, s) for h in hashes for s in range(eng.config.num_shards)])
    eng.sched.lookup.learn([], hashes)


@pytest.mark.timeout(60)
def test_a_hit_is_loaded_part_from_dram_part_from_files_byte_exact_and_counted_by_tier(tmp_path: Path) -> None:
    run = _produced(tmp_path, 41, promote_after_hits=0)
    files, eng, dram, prompt = run.files, run.eng, run.dram, run.prompt
    src = run.src
    saved = run.saved
    assert _tiers_of(eng, prompt) == [0, 0, 0, 0]  # write-through: in both; the nearest wins
    asked = [f.counters.commands for f in files]
    eng.sched.stored_prefix(chain(prompt, 32))
    assert [f.counters.commands for f in files] == asked  # DRAM covered it all: the files were not asked

    _forget_in_dram(eng, dram, prompt, range(2, 4))
    assert _tiers_of(eng, prompt) == [0, 0, 1, 1]
    read_before = [b.counters.bytes_read for b in (dram, *files)]
    assert eng.admit(FakeRequest("L-0", prompt)) == 128
    dst = eng.running["L-0"].block_ids
    res = eng.step(forward=False)
    assert not res.invalid_block_ids
    for i in range(8):
        assert same_block(res.after_load, dst[i], saved, src[i]), f"block {i}"
    # each tier served its own run (both hold every stripe: write-through), as the tiers count their bytes
    read = [b.counters.bytes_read - n for b, n in zip((dram, *files), read_before)]
    assert read == [2 * CHUNK_BYTES_DENSE_32, CHUNK_BYTES_DENSE_32, CHUNK_BYTES_DENSE_32], read
    counts = eng.sched.tally.counts
    assert counts["loaded_tokens"] == 128
    assert counts["loaded_tokens@memory"] == 64 and counts["loaded_tokens@file"] == 64
    worker = eng.worker.stats
    assert worker["loaded_bytes@memory"] == worker["loaded_bytes@file"] == 2 * CHUNK_BYTES_DENSE_32
    assert eng.sched.stats["hit_tokens_taken@memory"] == eng.sched.stats["hit_tokens_taken@file"] == 64
    assert eng.sched.stats.get("hit_tokens_left_out@file", 0) == 0
    assert eng.sched.stats["loads@file"] == 1 and eng.sched.stats["load_seconds@file"] > 0  # (the farthest tier)
    eng.finish("L-0")
    eng.close()


@pytest.mark.timeout(60)
def test_a_gap_on_one_shard_of_the_far_tier_shortens_the_hit_there(tmp_path: Path) -> None:
    run = _produced(tmp_path, 42, promote_after_hits=0)
    files, eng, dram, prompt = run.files, run.eng, run.dram, run.prompt
    _forget_in_dram(eng, dram, prompt, range(1, 4))
    files[1].delete_tickets([ticket_key(chain(prompt, 32)[2], 1)])  # chunk 2 gone from shard 1 of the files
    assert _tiers_of(eng, prompt) == [0, 1]
    assert eng.admit(FakeRequest("L-0", prompt)) == 64
    eng.close()


@pytest.mark.timeout(60)
def test_a_chunk_only_in_dram_past_a_far_run_is_not_offered_out_of_order(tmp_path: Path) -> None:
    """Runs go outward: DRAM 0-1, files 2; chunk 3 is in DRAM only, after the files' run ended: not part of the hit
    (the far tier does not hold it), and nothing is offered past a chunk no tier holds."""
    run = _produced(tmp_path, 43, promote_after_hits=0)
    files, eng, dram, prompt = run.files, run.eng, run.dram, run.prompt
    hashes = chain(prompt, 32)
    _forget_in_dram(eng, dram, prompt, range(2, 3))
    for f in files:
        f.delete_tickets([ticket_key(hashes[3], s) for s in range(2)])
    assert _tiers_of(eng, prompt) == [0, 0, 1]
    eng.close()


@pytest.mark.timeout(60)
def test_a_chunk_loaded_from_the_far_tier_twice_is_promoted_into_dram(tmp_path: Path) -> None:
    run = _produced(tmp_path, 44, promote_after_hits=2)
    files, eng, dram, prompt = run.files, run.eng, run.dram, run.prompt
    src = run.src
    saved = run.saved
    _forget_in_dram(eng, dram, prompt, range(2, 4))
    written = [f.counters.bytes_written for f in files]
    for n, req_id in enumerate(("L-0", "L-1")):
        assert eng.admit(FakeRequest(req_id, prompt)) == 128
        eng.step()
        assert eng.worker.wait_for_saves(30)
        eng.step(forward=False)
        eng.finish(req_id)
        promoted = eng.sched.stats["promoted_chunks@memory"]
        assert promoted == (0 if n == 0 else 2), f"after load {n + 1}"
    assert _tiers_of(eng, prompt) == [0, 0, 0, 0]  # the index learnt the promotion's DRAM stripe
    assert [f.counters.bytes_written for f in files] == written  # a promotion writes DRAM only
    dst_load = eng.admit(FakeRequest("L-2", prompt))
    assert dst_load == 128
    dst = eng.running["L-2"].block_ids
    res = eng.step(forward=False)
    for i in range(8):
        assert same_block(res.after_load, dst[i], saved, src[i]), f"block {i}"
    assert eng.sched.tally.counts["loaded_tokens@memory"] == 128 + 2 * 64
    eng.close()


@pytest.mark.timeout(60)
def test_dram_in_front_of_valkey_shards(valkey_servers) -> None:
    """The same split with real Valkey servers as the far tier (one per shard)."""
    from range_connector.backends.valkey.client import ValkeyBackend

    far = [ValkeyBackend(url, deployment="tier-hierarchy") for url in valkey_servers.urls[:2]]
    for b in far:
        b.clear()
        b.refresh_epoch()  # (a clear bumps the reset epoch; saves stamped with the old one store nothing)
    eng, dram = _engine(far, seed=45, promote_after_hits=0, far_type="valkey")
    prompt = prompt_tokens(150, seed=45)
    src = _produce(eng, "P-0", prompt)
    saved = snapshot(eng.kv)
    _forget_in_dram(eng, dram, prompt, range(1, 4))
    assert _tiers_of(eng, prompt) == [0, 1, 1, 1]
    assert eng.admit(FakeRequest("L-0", prompt)) == 128
    dst = eng.running["L-0"].block_ids
    res = eng.step(forward=False)
    assert not res.invalid_block_ids
    assert all(same_block(res.after_load, dst[i], saved, src[i]) for i in range(8))
    assert eng.sched.tally.counts["loaded_tokens@valkey"] == 96
    eng.close()


def test_tags_route_and_a_stored_id_that_looks_tagged_is_a_miss() -> None:
    assert stripe_tier(tag_stripe(2, "ab12")) == (2, "ab12") and stripe_tier("ab12") == (0, "ab12")
    assert tag_stripe(0, "ab12") == "ab12" and tag_stripe(1, "ab12").isalnum()
    ticket = Ticket("T1" + "ab" * 15, 0, 1, 1, 1, 1, 16, (0,), (), 0, 1)
    assert _tag((ticket,), 0) is None and _tag((ticket,), 1) is None  # storage is untrusted: a miss
    fine = Ticket("ab" * 16, 0, 1, 1, 1, 1, 16, (0,), (), 0, 1)
    assert _tag(((fine, fine),), 1)[0][0].stripe_id == "T1" + "ab" * 16  # pieces are tagged too


def _slow(gate, tier: str, num_shards: int, seconds_per_mib: float) -> None:
    """Teach the gate one tier's speed as the workers' load timings would (``observe_load`` per shard)."""
    for _ in range(8):
        for s in range(num_shards):
            gate.observe_load(s, MiB, seconds_per_mib, tier=tier)


@pytest.mark.timeout(60)
def test_the_gate_weighs_each_tier_run_and_leaves_out_a_far_tier_slower_than_recompute(tmp_path: Path,
                                                                                      monkeypatch) -> None:
    """load_mode auto: with both tiers fast the whole hit is taken; once the file tier is learnt slower than
    recompute, the next request takes the DRAM run and recomputes the rest, and the left-out tier is probed (one of
    its chunks read in the background), which teaches the gate its speed again."""
    run = _produced(tmp_path, 46, promote_after_hits=0, load_mode="auto")
    eng, dram, prompt = run.eng, run.dram, run.prompt
    _forget_in_dram(eng, dram, prompt, range(2, 4))
    gate = eng.sched.gate
    assert gate is not None
    _slow(gate, "memory", 1, 1e-4)
    _slow(gate, "file", 2, 1e-4)
    assert eng.sched.get_num_new_matched_tokens(FakeRequest("fast", prompt), 0)[0] == 128
    _slow(gate, "file", 2, 5.0)  # a far tier that slowed down (5 s per MiB: slower than recompute here)
    assert eng.admit(FakeRequest("slow", prompt)) == 64  # the DRAM run only
    assert eng.sched.stats["hit_tokens_taken@memory"] == 64 and eng.sched.stats["hit_tokens_left_out@file"] == 64
    assert eng.sched.stats.get("hit_tokens_left_out@memory", 0) == 0
    [probe] = eng.sched.admission.probes
    assert {stripe_tier(t.stripe_id)[0] for t in probe} == {1}  # a chunk of the left-out run, on the file tier
    instant_probes(monkeypatch)  # (the probe timed on a virtual clock: 0.1 ms, a fast tier again)
    samples = gate.tiers.num_samples("file", 0)
    slow_file_s = gate.predict_s(64, 128, [("file", 128)])[0]
    assert probe_timings_once_back(eng, eng.step(forward=False))  # sent with the next step, timed, reported
    assert gate.tiers.num_samples("file", 0) > samples  # learnt as the file tier's, not the gate's default
    assert gate.predict_s(64, 128, [("file", 128)])[0] < slow_file_s  # a fast probe: the run is predicted faster
    _slow(gate, "memory", 1, 5.0)  # the DRAM run, which every candidate starts with, slower too: refused
    assert eng.sched.get_num_new_matched_tokens(FakeRequest("none", prompt), 0)[0] == 0
    eng.close()


@pytest.mark.timeout(60)
def test_a_far_tier_that_dies_mid_load_shortens_the_hit_to_what_dram_delivered(tmp_path: Path) -> None:
    """The far tier answers the lookup, then fails every read: the chunks from DRAM land byte-exact, the far run's
    blocks are reported failed (vLLM recomputes them), the far tier's stripes were leased for the load and the
    leases are released, and nothing is left promised."""
    run = _produced(tmp_path, 47, promote_after_hits=0, wrap=lambda files: [FlakyBackend(f, f"flaky-{s}") for s, f in enumerate(files)])
    files, eng, dram, prompt = run.files, run.eng, run.dram, run.prompt
    flaky = [b.tiers[1] for b in eng.worker.backends]
    src = run.src
    saved = run.saved
    _forget_in_dram(eng, dram, prompt, range(2, 4))
    assert _tiers_of(eng, prompt) == [0, 0, 1, 1]
    assert eng.admit(FakeRequest("L-0", prompt)) == 128
    assert [f.num_leases() for f in files] == [1, 1]  # the far run's stripe on each shard, leased until loaded
    for f in flaky:
        f.fail_read = BackendError  # the tier dies after its lookup answered
    dst = eng.running["L-0"].block_ids
    res = eng.step(forward=False)
    assert res.invalid_block_ids == set(dst[4:8])  # chunks 2, 3: two blocks each
    for i in range(4):
        assert same_block(res.after_load, dst[i], saved, src[i]), f"block {i}"
    assert [f.num_leases() for f in files] == [0, 0]
    counts = eng.sched.tally.counts
    assert counts["loaded_tokens@memory"] == 64 and counts.get("loaded_tokens@file", 0) == 0
    assert counts["failed_tokens"] == 64
    eng.close()


@pytest.mark.timeout(60)
def test_write_back_saves_to_dram_only_and_demotes_what_dram_evicts(tmp_path: Path) -> None:
    """write_policy write-back, through the factory (open_worker_backends wires DRAM's evictions to each shard's
    next tier): a save leaves the file tier empty; when DRAM evicts the prompt's stripes, they are written to the
    files of their shard, and the prompt then loads from there, byte-exact."""
    from range_connector.backends.factory import open_scheduler_backends, open_worker_backends
    from range_connector.config import RangeConfig

    stripe_bytes = 4 * CHUNK_BYTES_DENSE_32 // 2  # one shard's slice of four chunks
    extra = {"tiers": [{"type": "memory", "capacity_bytes": 2 * stripe_bytes},
                       {"type": "file", "directory": str(tmp_path / "files")}],
             "num_shards": 2, "write_policy": "write-back"}
    config = RangeConfig.from_extra_config(extra).resolve(16)
    worker = open_worker_backends(config, write_back=True)
    dram = worker[0].tiers[0]
    files = [b.tiers[1] for b in worker]
    eng = Engine(worker, lookup_backends=open_scheduler_backends(config), num_shards=2, seed=48,
                 tiers=config.tiers, promote_after_hits=0)
    first, second = prompt_tokens(150, seed=48), prompt_tokens(150, seed=49)
    src = _produce(eng, "P-0", first)
    saved = snapshot(eng.kv)
    assert [f.used_bytes() for f in files] == [0, 0]  # write-back: DRAM only
    _produce(eng, "P-1", second)  # DRAM holds two stripes: the first prompt's two are evicted, and demoted
    assert eng.worker.wait_for_saves(30)
    eng.step(forward=False)  # the evictions reach the scheduler's DRAM index
    assert [f.used_bytes() for f in files] == [stripe_bytes, stripe_bytes]
    assert eng.worker.stats["demoted_chunks@memory"] == 4
    assert _tiers_of(eng, first) == [1, 1, 1, 1]
    assert eng.admit(FakeRequest("L-0", first)) == 128
    dst = eng.running["L-0"].block_ids
    res = eng.step(forward=False)
    assert not res.invalid_block_ids
    assert all(same_block(res.after_load, dst[i], saved, src[i]) for i in range(8))
    eng.close()
    assert isinstance(dram, MemoryBackend)


def test_write_back_needs_dram_in_front_of_another_tier() -> None:
    from range_connector.config import RangeConfig
    from range_connector.errors import ConfigError

    for tiers in ([{"type": "valkey"}, {"type": "file"}], [{"type": "memory"}]):
        with pytest.raises(ConfigError) as exc_info:
            RangeConfig.from_extra_config({"tiers": tiers, "write_policy": "write-back"})
        assert exc_info.value.key == "write_policy"


@pytest.mark.timeout(60)
def test_at_tp_2_each_rank_has_its_own_dram_and_a_hit_splits_over_both_tiers_on_every_rank(tmp_path: Path) -> None:
    """Tensor parallelism 2: each rank saves its own heads into its own DRAM and through to the shared files; the
    scheduler's DRAM index holds both ranks' tickets. With chunks 2-3 gone from DRAM, every rank loads chunks 0-1
    from its DRAM and 2-3 from the files, byte-exact (compared on each rank's own KV cache)."""
    files = _files(tmp_path)
    drams = [MemoryBackend(64 * MiB, name=f"dram-{r}") for r in range(2)]
    ranks = [[TieredBackend([dram, f]) for f in files] for dram in drams]
    eng = Engine(ranks[0], lookup_backends=[TieredBackend([None, f]) for f in files], num_shards=2, seed=50,
                 tiers=(TierConfig("memory", index=0), TierConfig("file", index=1)), promote_after_hits=0,
                 tp_size=2, rank_backends=ranks)
    prompt = prompt_tokens(150, seed=50)
    a_ids = _produce(eng, "P-0", prompt)
    saved = [snapshot(kv) for kv in eng.kvs]  # (P-0's blocks are free now: a later request may reuse them)
    hashes = chain(prompt, 32)[2:4]
    for dram in drams:
        dram.delete_tickets([ticket_key(h, s, head) for h in hashes for s in range(2) for head in range(8)])
    eng.sched.lookup.learn([], hashes)
    assert _tiers_of(eng, prompt) == [0, 0, 1, 1]
    assert eng.admit(FakeRequest("L-0", prompt)) == 128
    b_ids = eng.running["L-0"].block_ids
    res = eng.step(forward=False)
    assert not res.invalid_block_ids
    assert [(r, i) for r in range(2) for i in range(8) if not same_block(eng.kvs[r], b_ids[i], saved[r], a_ids[i])
            ] == []
    assert eng.sched.tally.counts["loaded_tokens@memory"] == 64 and eng.sched.tally.counts["loaded_tokens@file"] == 64
    eng.close()


@pytest.mark.timeout(60)
def test_with_a_fixed_load_mode_a_far_run_predicted_late_is_cut_and_dram_still_serves(tmp_path: Path) -> None:
    """load_mode pipelined (no gate decision): a far run whose load is predicted past its deadline is not
    started; the hit keeps the DRAM run (one tier too slow must not cost the other tier's hit)."""
    run = _produced(tmp_path, 51, promote_after_hits=0, load_mode="pipelined")
    eng, dram, prompt = run.eng, run.dram, run.prompt
    _forget_in_dram(eng, dram, prompt, range(2, 4))
    gate = eng.sched.gate
    assert gate is not None
    assert eng.sched.get_num_new_matched_tokens(FakeRequest("fast", prompt), 0)[0] == 128
    _slow(gate, "file", 2, 50.0)  # a load of the file run now predicted far past any deadline
    assert eng.sched.get_num_new_matched_tokens(FakeRequest("slow", prompt), 0)[0] == 64
    assert eng.sched.stats["loads_not_started_late"] == 1
    [probe] = eng.sched.admission.probes  # the left-out run is probed, not the DRAM chunk before it
    assert {stripe_tier(t.stripe_id)[0] for t in probe} == {1}
    eng.close()


@pytest.mark.timeout(60)
def test_with_a_fixed_load_mode_a_slow_dram_estimate_never_cuts_the_dram_run(tmp_path: Path) -> None:
    """The DRAM tier alone never refuses a load as late; in front of another tier it does not either (a DRAM load
    that once ran past its deadline must not halve the DRAM hits that follow)."""
    run = _produced(tmp_path, 52, promote_after_hits=0, load_mode="pipelined")
    eng, prompt = run.eng, run.prompt
    _slow(eng.sched.gate, "memory", 1, 50.0)
    assert eng.sched.get_num_new_matched_tokens(FakeRequest("dram", prompt), 0)[0] == 128
    assert eng.sched.stats["loads_not_started_late"] == 0
    eng.close()


def test_a_far_copy_bigger_than_the_backlog_is_written_through_and_one_past_a_waiting_one_is_skipped_and_counted(
        ) -> None:
    # A stripe larger than save_backlog_bytes finds the far-write backlog empty and is written through (before,
    # such a stripe was never copied to a far tier, and nothing showed it); a second one while the first still waits
    # on a frozen far tier is skipped, counted by tier (the worker exports it as
    # vllm:range_tier_far_copies_skipped_total) and stays in the nearest tier only.
    from range_connector.backends.base import StripeWrite
    from range_connector.backends.latency import LatencyBackend, LatencyControl, TierLatency
    from tests.unit.clocks import StillClock, wait_until

    clock = StillClock()
    control = LatencyControl(TierLatency(frozen=True), clock=clock)
    dram, far_inner = MemoryBackend(64 * MiB, name="dram"), MemoryBackend(64 * MiB, name="far")
    tiered = TieredBackend([dram, LatencyBackend(far_inner, control, timeout_s=5.0, sleep=lambda s: None)],
                           max_backlog_bytes=1024)
    values = [bytes(4096)] * 2  # 8 KiB: eight times the bound
    readings = clock.readings
    assert tiered.write_stripe(StripeWrite("aa01", values, [(b"k:aa01", b"t")]))
    wait_until(lambda: clock.readings >= readings + 3, "the first far copy reached the frozen far tier")
    assert tiered.write_stripe(StripeWrite("bb02", values, [(b"k:bb02", b"t")]))  # the near tier stores it
    assert tiered.take_far_copies_skipped() == {1: 1} and tiered.far_writes_skipped == 1
    assert tiered.take_far_copies_skipped() == {}  # (taken once)
    control.update(frozen=False)
    assert tiered.wait_far_writes(30.0)
    assert far_inner.used_bytes() == 8192 and dram.used_bytes() == 16384  # the far tier holds the first only
    tiered.close()
