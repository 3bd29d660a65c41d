"""Faults in stored data on a real Valkey server: stripe values truncated or with flipped bytes, tickets that point
outside their stripe or carry absurd geometry, and stripes removed behind the tickets' back (the server's own
eviction). Each is a miss or a failed load (vLLM recomputes), never wrong bytes, an exception or an allocation sized
from a poisoned ticket; afterwards leases, banks, threads and connections are back to their baseline.
"""

from __future__ import annotations

import contextlib
import dataclasses

import msgpack
import pytest

from range_connector.kv.tickets import TICKET_VERSION, Ticket, ticket_key
from range_connector.worker import loads
from tests.faults.conftest import (
    Baseline,
    admin,
    assert_oracle,
    key_prefix,
    scan_keys,
    stripe_value_key,
)
from tests.unit.scheduler_worker_harness import (
    NUM_BLOCKS,
    Engine,
    FakeRequest,
    FlakyBackend,
    chain,
    produce,
    prompt_tokens,
    stored_ticket,
)

PROMPT = prompt_tokens(150, seed=31)  # 4 full chunks: stripes of chunks 0-1 and 2-3 (two saving steps)
HASHES = chain(PROMPT, 32)


def _engines(url: str, backends_for, path: str, **kw) -> tuple[Engine, list[int], Engine]:
    """Writer A saves PROMPT; reader B (its own connections; bank or direct path) is built, nothing admitted."""
    a, a_blocks = produce(backends_for([url]), PROMPT)
    inner = backends_for([url])
    reader_backends = [FlakyBackend(b, scatter=path == "direct") for b in inner]
    b = Engine(reader_backends, seed=8, verify_checksums=True, **kw)  # type: ignore[arg-type]
    return a, a_blocks, b


def _finish(base: Baseline, a: Engine, b: Engine, backends_for) -> None:
    for r in list(b.running):
        b.finish(r)
    b.step(forward=False)  # (the finished requests reach the worker; their leases are already released)
    base.check_live([a, b])
    a.close()
    b.close()
    backends_for.close_all()
    base.check_closed()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("path", ["direct", "bank"])
@pytest.mark.parametrize("damage", ["truncated", "flipped-byte"])
def test_damaged_stripe_value_fails_its_chunks_and_the_rest_loads(servers, backends_for, damage: str,
                                                                  path: str) -> None:
    [url] = servers(1)
    base = Baseline([url])
    base.record()
    a, a_blocks, b = _engines(url, backends_for, path)
    t = stored_ticket(a.worker.backends[0], HASHES[2], 0)
    assert t is not None
    key = stripe_value_key(t.stripe_id, 1)
    with contextlib.closing(admin(url)) as c:
        value = c.get(key)
        assert value is not None and len(value) == t.layer_bytes
        if damage == "truncated":
            c.set(key, value[: len(value) // 2])
        else:
            offset = t.plane_range(0)[0] + 5
            c.setrange(key, offset, bytes([value[offset] ^ 0x40]))

    ext = b.admit(FakeRequest("B-0", PROMPT))
    assert ext == 128
    res = b.step(forward=False)

    # chunks 2-3 (the damaged stripe) are reported; 0-1 are delivered byte for byte
    blocks = b.running["B-0"].block_ids
    assert res.invalid_block_ids == set(blocks[4:8])
    assert assert_oracle([(a, a_blocks)], b, "B-0", ext, [res]) == 4
    assert HASHES[2] in res.worker_meta.dropped  # type: ignore[union-attr]
    # the bad chunk is not offered again: the next lookup stops before it
    assert b.sched.get_num_new_matched_tokens(FakeRequest("B-1", PROMPT), 0) == (64, False)
    _finish(base, a, b, backends_for)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("path", ["direct", "bank"])
def test_ticket_pointing_outside_its_stripe_fails_its_chunk(servers, backends_for, path: str) -> None:
    [url] = servers(1)
    base = Baseline([url])
    base.record()
    a, a_blocks, b = _engines(url, backends_for, path)
    t = stored_ticket(a.worker.backends[0], HASHES[2], 0)
    assert t is not None
    # a stripe that claims to be 4x as long as it is, and the chunk in its last quarter: past the stored value
    lying = dataclasses.replace(t, stripe_blocks=4 * t.stripe_blocks, block_offset=3 * t.stripe_blocks,
                                stripe_checksums=())
    with contextlib.closing(admin(url)) as c:
        c.set(key_prefix().encode() + ticket_key(HASHES[2], 0), lying.encode())

    ext = b.admit(FakeRequest("B-0", PROMPT))
    assert ext == 128  # it fits the layout: only the read can tell
    res = b.step(forward=False)

    blocks = b.running["B-0"].block_ids
    assert set(blocks[4:6]) <= res.invalid_block_ids  # chunk 2 (and so 3) recomputed
    assert assert_oracle([(a, a_blocks)], b, "B-0", ext, [res]) == 4
    _finish(base, a, b, backends_for)


def _absurd(t: Ticket) -> dict[str, bytes]:
    """Raw ticket bytes that must be a miss at lookup."""
    fields = [TICKET_VERSION, t.stripe_id, t.block_offset, t.num_blocks, t.stripe_blocks, t.num_layers, t.num_planes,
              t.row_bytes, list(t.checksums), t.head_start, t.num_heads, list(t.stripe_checksums)]

    def with_(idx: int, value) -> bytes:
        f = list(fields)
        f[idx] = value
        return msgpack.packb(f)

    return {
        "stripe-of-2^40-blocks": with_(4, 1 << 40)[:0] + msgpack.packb(
            [*fields[:2], (1 << 40) - 2, fields[3], 1 << 40, *fields[5:]]),
        "billions-of-blocks": with_(3, 10**9),
        "row-of-2^50-bytes": with_(7, 1 << 50),
        "negative-offset": with_(2, -1),
        "negative-stripe": with_(4, -4),
        "offset-as-string": with_(2, "0"),
        "blocks-as-float": with_(3, 2.0),
        "blocks-as-bool": with_(3, True),
        "nested-lists": with_(4, [[[[4]]]]),
        "uint64-max-heads": with_(10, (1 << 64) - 1),
        "2^16-heads-from-head-1": with_(9, 1)[:0] + msgpack.packb([*fields[:9], 1, 1 << 16, fields[11]]),
        "checksums-as-map": with_(8, {"a": 1}),
        "not-a-list": msgpack.packb({"stripe": t.stripe_id}),
        "wrong-version": with_(0, TICKET_VERSION + 1),
        "truncated-msgpack": t.encode()[:-3],
        "4-GiB-length-prefix": b"\xc6\xff\xff\xff\xff" + b"x" * 16,
        "not-msgpack": b"\xff" * 40,
    }


ABSURD = list(_absurd(Ticket("a" * 32, 2, 2, 4, 4, 1, 2048, (1, 2, 3, 4), (5, 6, 7, 8))))


@pytest.mark.timeout(60)
def test_tickets_with_absurd_geometry_are_misses(servers, backends_for) -> None:
    # (one server and one writer for every case: each case damages chunk 1's ticket and puts it back after)
    [url] = servers(1)
    base = Baseline([url])
    base.record()
    a, a_blocks, b = _engines(url, backends_for, "direct")
    t = stored_ticket(a.worker.backends[0], HASHES[1], 0)
    assert t is not None
    good = t.encode()
    assert sorted(_absurd(t)) == sorted(ABSURD)
    with contextlib.closing(admin(url)) as c:
        for n, (case, raw) in enumerate(_absurd(t).items()):
            c.set(key_prefix().encode() + ticket_key(HASHES[1], 0), raw)
            # a lookup reads it and stops before it: only chunk 0 is a hit, and loads byte for byte
            ext = b.admit(FakeRequest(f"B-{n}", PROMPT))
            assert ext == 32, case
            res = b.step(forward=False)
            assert res.invalid_block_ids == set(), case
            assert assert_oracle([(a, a_blocks)], b, f"B-{n}", ext, [res]) == 2, case
            b.finish(f"B-{n}")
            c.set(key_prefix().encode() + ticket_key(HASHES[1], 0), good)
    assert b.sched.get_num_new_matched_tokens(FakeRequest("B-good", PROMPT), 0) == (128, False)  # (the check bites)
    _finish(base, a, b, backends_for)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("path", ["direct", "bank"])
def test_tickets_spread_over_a_huge_stripe_allocate_nothing_and_fail_the_load(servers, backends_for, monkeypatch,
                                                                              path: str) -> None:
    # Chunks 0 and 1 in one stripe of 2^16 + 2 blocks, at its two ends: each ticket is within the tier's value
    # limit (128 MiB a layer), but a load that read both would stage the whole stripe (2^16 rows per layer).
    [url] = servers(1)
    base = Baseline([url])
    base.record()
    a, a_blocks, b = _engines(url, backends_for, path)
    t0, t1 = (stored_ticket(a.worker.backends[0], h, 0) for h in HASHES[:2])
    assert t0 is not None and t1 is not None and t0.stripe_id == t1.stripe_id
    huge = (1 << 16) + 2
    with contextlib.closing(admin(url)) as c:
        p = key_prefix().encode()
        c.set(p + ticket_key(HASHES[0], 0), dataclasses.replace(t0, stripe_blocks=huge, stripe_checksums=()).encode())
        c.set(p + ticket_key(HASHES[1], 0), dataclasses.replace(t1, stripe_blocks=huge, block_offset=huge - 2,
                                                                stripe_checksums=()).encode())
    staged: list[int] = []
    real_plan = loads.plan_segments

    def spy(wanted):
        segments = real_plan(wanted)
        staged.append(sum(s.num_blocks for s in segments))
        return segments

    monkeypatch.setattr(loads, "plan_segments", spy)

    ext = b.admit(FakeRequest("B-0", PROMPT))
    res = b.step(forward=False)

    blocks = b.running["B-0"].block_ids
    assert ext == 128 and set(blocks[:8]) == res.invalid_block_ids  # refused at the worker: all recomputed
    assert max(staged) <= loads.MAX_STAGED_POOLS * NUM_BLOCKS  # nothing sized from the lying stripe
    assert b.worker.banks.allocations == 0 or all(buf.numel() <= b.config.bank_bytes
                                                  for buf, _fence in b.worker.banks._free)
    assert assert_oracle([(a, a_blocks)], b, "B-0", ext, [res]) == 0
    _finish(base, a, b, backends_for)


@pytest.mark.timeout(60)
def test_stripes_removed_under_live_tickets_fail_the_load_and_the_tickets_go(servers, backends_for) -> None:
    # What the server's own eviction (allkeys-lru) does: stripe values vanish while their tickets stay; here the
    # values are deleted after the reader's lookup and lease, before its load.
    urls = servers(2)
    base = Baseline(urls)
    base.record()
    a, a_blocks = produce(backends_for(urls), PROMPT, num_shards=2)
    b = Engine(backends_for(urls), num_shards=2, seed=8, verify_checksums=True)  # type: ignore[arg-type]
    ext = b.admit(FakeRequest("B-0", PROMPT))
    assert ext == 128 and scan_keys(urls[1], "l")  # leased
    t = stored_ticket(a.worker.backends[1], HASHES[2], 1, blocks_per_shard=1)
    assert t is not None
    with contextlib.closing(admin(urls[1])) as c:
        c.delete(*[stripe_value_key(t.stripe_id, layer) for layer in range(t.num_layers)])

    res = b.step(forward=False)

    blocks = b.running["B-0"].block_ids
    assert res.invalid_block_ids == set(blocks[4:8])
    assert assert_oracle([(a, a_blocks)], b, "B-0", ext, [res]) == 4
    assert b.sched.get_num_new_matched_tokens(FakeRequest("B-1", PROMPT), 0) == (64, False)  # tickets dropped
    _finish(base, a, b, backends_for)
