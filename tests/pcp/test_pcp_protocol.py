"""PCP-rank-sharded storage end to end: P real rank processes (gloo on loopback), one real Valkey server per shard,
the real scheduler and worker halves, and the PCP exchange (issue 4 acceptance; cases C02 and C09).

One pool of four rank processes serves every test (starting a rank costs about 8 s of imports on this machine);
P = 2 scenarios use ranks 0 and 1 through their own process group. Each engine (a producer A that computes and
saves, a consumer B that loads) is a :class:`~tests.pcp.harness.PcpEngine`: a real ``RangeScheduler`` here and
real ``RangeWorker`` rank views plus ``PcpExchange`` in the ranks, hooks in vLLM's order (see
``tests/pcp/rank_process.py``). Every test is bounded in time.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable, Iterator

import pytest

from range_connector.backends.valkey.client import ValkeyBackend
from range_connector.kv.namespace import prefix_hash_chain
from range_connector.kv.sharding import ShardPlan, leading_run
from range_connector.kv.tickets import ticket_key
from tests.conftest import ValkeyServers
from tests.pcp.harness import PcpEngine, RankPool
from tests.unit.scheduler_worker_harness import BLOCK, LAYER_BLOCK_BYTES, LAYERS, NAMESPACE, FakeRequest, prompt_tokens

pytestmark = pytest.mark.timeout(180)

WORLD = 4
#: a step or a wait that takes this long hangs (the deadlines and collective timeouts here are 1-2 s): how long they
#: took is bounded only by this, what they decided (failed blocks, a broken group) is checked exactly
WIDE_S = 60.0
CHUNK = 64  # tokens: 4 blocks of 16, so a chunk splits evenly over 1, 2 or 4 shards


@pytest.fixture(scope="module")
def pool() -> Iterator[RankPool]:
    p = RankPool(WORLD)
    try:
        yield p
    finally:
        p.close()


@pytest.fixture(scope="module")
def servers(module_valkey_server_sets: Callable[[int], ValkeyServers]) -> ValkeyServers:
    """Four shard servers shared by the non-destructive tests (prompts differ per test, so keys never collide)."""
    return module_valkey_server_sets(4)


def used_bytes(urls: list[str]) -> list[int]:
    out = []
    for u in urls:
        b = ValkeyBackend(u)
        out.append(b.used_bytes())
        b.close()
    return out


def produce(pool: RankPool, pcp_size: int, urls: list[str], prompt: list[int], req_id: str, *,
            engine: PcpEngine | None = None, first_step_tokens: int | None = None,
            **kw) -> tuple[PcpEngine, list[int], bytes]:
    """Engine A (P ranks) computes ``prompt`` (in one step, or two from ``first_step_tokens``) and saves its full
    chunks (one stripe per shard and step); returns A, the request's block ids and their bytes (identical on every
    rank, checked)."""
    a = engine or PcpEngine(pool, f"A-{req_id}", pcp_size, urls, seed=1, **kw)
    req = FakeRequest(req_id, prompt)
    assert a.sched.admit(req, first_step_tokens) == 0
    meta, results = a.step()
    assert not meta.loads and all(not r["failed"] for r in results)
    if first_step_tokens is not None:
        a.sched.continue_(req_id)
        _, results = a.step()
        assert all(not r["failed"] for r in results)
    block_ids = list(a.sched.running[req_id].block_ids)
    replicas = a.blocks(block_ids)
    assert all(b == replicas[0] for b in replicas), "PCP replicas differ after the forward"
    a.sched.finish(req_id)
    return a, block_ids, replicas[0]


def lease_keys(url: str) -> list[bytes]:
    """Lease counters held on a shard's server (``rc3:<deployment>:l:<stripe>``, see backends/valkey/client.py)."""
    import valkey

    from range_connector.backends.base import deployment_key_prefix
    from range_connector.config.keys import DEFAULT_DEPLOYMENT

    client = valkey.Valkey.from_url(url, socket_timeout=5.0)
    try:
        return sorted(client.scan_iter(match=f"{deployment_key_prefix(DEFAULT_DEPLOYMENT)}l:*"))
    finally:
        client.close()


def block_bytes(image: bytes, block_ids: list[int], wanted: list[int]) -> bytes:
    """Bytes of ``wanted`` (a subset of ``block_ids``) cut from an image of ``block_ids`` (layer-major)."""
    per_block = len(image) // (len(block_ids) * len(LAYERS))
    n, pos = len(block_ids), {b: i for i, b in enumerate(block_ids)}
    return b"".join(image[(layer * n + pos[b]) * per_block:(layer * n + pos[b] + 1) * per_block]
                    for layer in range(len(LAYERS)) for b in wanted)


def consume(pool: RankPool, name: str, pcp_size: int, urls: list[str], prompt: list[int], req_id: str, **kw):
    """Engine B (P ranks) is sent ``prompt``: lookup, lease, one step (load, exchange, forward, save)."""
    b = PcpEngine(pool, name, pcp_size, urls, seed=2, **kw)
    ext = b.sched.admit(FakeRequest(req_id, prompt))
    meta, results = b.step()
    return b, ext, meta, results


# ---------------------------------------------------------------------------------------------------- acceptance
@pytest.mark.parametrize(("pcp_size", "num_shards", "kind"), [
    pytest.param(2, 2, "dense", id="P2-S2"), pytest.param(4, 4, "dense", id="P4-S4"),
    pytest.param(2, 4, "dense", id="P2-S4"), pytest.param(2, 2, "mla", id="P2-S2-mla")])
def test_every_rank_restores_byte_identical_kv_and_a_pcp1_reader_restores_the_same(
        pool: RankPool, servers: ValkeyServers, pcp_size: int, num_shards: int, kind: str,
        server_commandstats) -> None:
    urls = list(servers.urls[:num_shards])
    prompt = prompt_tokens(300, seed=1000 + 10 * pcp_size + num_shards + (kind == "mla"))
    before = used_bytes(urls)
    a, a_ids, image = produce(pool, pcp_size, urls, prompt, f"save-{pcp_size}-{num_shards}-{kind}", kind=kind)
    # Rank r wrote only its shards: every byte is stored once, each shard holds exactly its slice.
    num_chunks = len(prompt) // CHUNK
    stored = [after - b for after, b in zip(used_bytes(urls), before)]
    per_shard = num_chunks * (CHUNK // BLOCK // num_shards) * len(LAYERS) * LAYER_BLOCK_BYTES[kind]
    assert stored == [per_shard] * num_shards
    gets_before = [server_commandstats(u).get("get", 0) for u in urls]

    b, ext, meta, results = consume(pool, f"B-{pcp_size}-{num_shards}-{kind}", pcp_size, urls, prompt,
                                    "load", kind=kind)
    hit_blocks = ext // BLOCK
    assert ext == num_chunks * CHUNK
    b_ids = list(b.sched.running["load"].block_ids)
    assert all(r["failed"] == [] and r["consistent"] for r in results)
    # Each rank read its own shards once (one GET per layer of its stripe on its own server), and got the other
    # ranks' blocks through the exchange.
    gets = [server_commandstats(u).get("get", 0) - g for u, g in zip(urls, gets_before)]
    assert gets == [len(LAYERS)] * num_shards
    for rank, r in enumerate(results):
        own = {p for s in range(rank, num_shards, pcp_size) for p in ShardPlan(CHUNK // BLOCK, num_shards)
               .shard_blocks(s)}
        expected_own = [bid for i, bid in enumerate(b_ids[:hit_blocks]) if i % (CHUNK // BLOCK) in own]
        assert sorted(r["loaded_blocks"]) == sorted(expected_own)
        assert r["exchanged_blocks"] == (hit_blocks - len(expected_own)) * len(LAYERS)  # summed over layers
    want = block_bytes(image, a_ids, a_ids[:hit_blocks])
    for got in b.blocks(b_ids[:hit_blocks]):
        assert got == want
    # A decode-style reader with PCP = 1 reads all S shards itself and restores the same bytes.
    c, ext_c, _, results_c = consume(pool, f"C-{pcp_size}-{num_shards}-{kind}", 1, urls, prompt, "read-all",
                                     kind=kind)
    assert ext_c == ext and results_c[0]["failed"] == [] and results_c[0]["exchanged_blocks"] == 0
    c_ids = list(c.sched.running["read-all"].block_ids)
    assert c.blocks(c_ids[:hit_blocks]) == [want]
    for e in (a, b, c):
        e.close()


def test_a_step_without_loads_after_a_load_step_exchanges_nothing(pool: RankPool, servers: ValkeyServers) -> None:
    """vLLM starts a step's loads after the forward when none is synchronous (mixin L82-90): that forward must not
    replay the previous step's exchange into blocks (which the scheduler may have handed to another request)."""
    urls = list(servers.urls[:2])
    prompt = prompt_tokens(4 * CHUNK + 5, seed=2500)
    a, _, _ = produce(pool, 2, urls, prompt, "stale-save")
    b, ext, _, results = consume(pool, "B-stale", 2, urls, prompt, "stale-load")
    assert ext == 4 * CHUNK and all(r["exchanged_blocks"] > 0 for r in results)

    fresh = prompt_tokens(2 * CHUNK + 3, seed=2501)  # stored nowhere: the step loads nothing
    assert b.sched.admit(FakeRequest("stale-fresh", fresh)) == 0
    meta, results = b.step()

    assert not meta.loads
    assert [(r["exchanged_blocks"], r["failed"]) for r in results] == [(0, []), (0, [])]
    replicas = b.blocks(list(b.sched.running["stale-fresh"].block_ids))
    assert replicas[0] == replicas[1]
    a.close()
    b.close()


@pytest.mark.parametrize(("pcp_size", "evicted_shard"), [(2, 1), (4, 1), (4, 3)])
def test_evicting_one_chunk_slice_on_a_nonzero_shard_shortens_the_hit_on_every_rank(
        pool: RankPool, servers: ValkeyServers, pcp_size: int, evicted_shard: int) -> None:
    urls = list(servers.urls[:pcp_size])
    prompt = prompt_tokens(6 * CHUNK + 10, seed=2000 + pcp_size * 10 + evicted_shard)
    a, a_ids, image = produce(pool, pcp_size, urls, prompt, f"evict-{pcp_size}-{evicted_shard}")
    evicted_chunk = 3
    chain = prefix_hash_chain(NAMESPACE, b"", prompt, CHUNK)
    backend = ValkeyBackend(urls[evicted_shard])
    backend.delete_tickets([ticket_key(chain[evicted_chunk], evicted_shard)])
    backend.close()

    b, ext, meta, results = consume(pool, f"B-evict-{pcp_size}-{evicted_shard}", pcp_size, urls, prompt, "r")
    assert ext == evicted_chunk * CHUNK  # never a false hit: chunk 3 is not on every shard
    assert [c.chunk_idx for r in meta.loads for c in r.chunks] == list(range(evicted_chunk))
    hit_blocks = ext // BLOCK
    b_ids = list(b.sched.running["r"].block_ids)
    assert all(r["failed"] == [] for r in results)
    assert sorted(bid for r in results for bid in r["loaded_blocks"]) == sorted(b_ids[:hit_blocks])
    want = block_bytes(image, a_ids, a_ids[:hit_blocks])
    assert b.blocks(b_ids[:hit_blocks]) == [want] * pcp_size
    a.close()
    b.close()


def test_plans_that_differ_between_ranks_fail_every_load_alike(pool: RankPool, servers: ValkeyServers) -> None:
    urls = list(servers.urls[:2])
    prompt = prompt_tokens(3 * CHUNK + 1, seed=3000)
    a, _, _ = produce(pool, 2, urls, prompt, "mismatch")
    b = PcpEngine(pool, "B-mismatch", 2, urls, seed=2)
    ext = b.sched.admit(FakeRequest("m", prompt))
    meta, scheduled = b.sched.build()
    assert ext == 3 * CHUNK and meta.loads
    # Rank 1 receives a plan whose last chunk goes to other blocks (metadata corrupted in transit).
    bad = type(meta)(loads=[type(meta.loads[0])(meta.loads[0].req_id, meta.loads[0].chunks[:-1],
                                                meta.loads[0].num_tokens)], saves=meta.saves)
    pool.send([0, 1], "step", per_rank=[{"meta": meta}, {"meta": bad}], engine="B-mismatch", scheduled=scheduled,
              forward_seed=7)
    results = pool.collect([0, 1], timeout_s=30)
    b.sched.complete([r["worker_meta"] for r in results])
    all_blocks = sorted(x for c in meta.loads[0].chunks for x in c.block_ids)
    assert [r["consistent"] for r in results] == [False, False]
    assert results[0]["failed"] == all_blocks  # rank 1's share differs, but the plan check fails both
    assert not any(r["broken"] for r in results)  # the group stays usable: a mismatch is not a timeout
    a.close()
    b.close()


def test_a_rank_with_nothing_locally_issues_every_collective_and_every_rank_agrees_on_the_minimum(
        pool: RankPool, valkey_server_sets: Callable[[int], ValkeyServers]) -> None:
    """sglang#30760 deadlocked when a rank with nothing to do skipped a collective: here rank 2's shard loses all
    it held after the lookup promised it, so rank 2 finds nothing to load while ranks 0, 1 and 3 load theirs; every
    rank still agrees (no collective times out, no group breaks) on the minimum: the whole load is recomputed."""
    import valkey

    urls = list(valkey_server_sets(4).urls)
    prompt = prompt_tokens(3 * CHUNK + 5, seed=5100)
    a, _, _ = produce(pool, 4, urls, prompt, "empty-rank")
    b = PcpEngine(pool, "B-empty-rank", 4, urls, seed=2)
    assert b.sched.admit(FakeRequest("e", prompt)) == 3 * CHUNK
    meta, scheduled = b.sched.build()
    admin = valkey.Valkey.from_url(urls[2], socket_timeout=5.0)
    admin.flushall()
    admin.close()
    pool.send(list(range(WORLD)), "step", engine="B-empty-rank", meta=meta, scheduled=scheduled, forward_seed=7)
    results = pool.collect(list(range(WORLD)), timeout_s=WIDE_S)
    b.sched.complete([r["worker_meta"] for r in results])
    all_blocks = sorted(x for r in meta.loads for c in r.chunks for x in c.block_ids)
    assert [bool(r["local_failed"]) for r in results] == [False, False, True, False]
    assert all(r["failed"] == all_blocks for r in results)
    assert all(r["consistent"] and not r["broken"] for r in results)
    a.close()
    b.close()


# ---------------------------------------------------------------------------------------------------- failures
def test_killing_one_shard_server_during_a_load_fails_the_same_blocks_on_every_rank_in_time(
        pool: RankPool, valkey_server_sets: Callable[[int], ValkeyServers]) -> None:
    servers = valkey_server_sets(2)
    urls = list(servers.urls)
    load_deadline_s, collective_timeout_s = 2.0, 2.0
    kw = dict(backend_timeout_s=1.0, load_deadline_s=load_deadline_s, collective_timeout_s=collective_timeout_s)
    prompt = prompt_tokens(4 * CHUNK + 3, seed=4000)
    a, _, _ = produce(pool, 2, urls, prompt, "kill", **kw)
    b = PcpEngine(pool, "B-kill", 2, urls, seed=2, **kw)
    ext = b.sched.admit(FakeRequest("k", prompt))
    assert ext == 4 * CHUNK
    # Freeze shard 1's server, start the step, and kill the server while rank 1 waits on it mid-load.
    pool_start = time.monotonic()
    os.kill(servers.pids[1], signal.SIGSTOP)
    killer = threading.Timer(0.3, lambda: os.kill(servers.pids[1], signal.SIGKILL))
    killer.start()
    meta = b.start_step()
    results = b.finish_step(timeout_s=WIDE_S)
    elapsed_s = time.monotonic() - pool_start
    killer.join()
    all_blocks = sorted(x for r in meta.loads for c in r.chunks for x in c.block_ids)
    assert elapsed_s < WIDE_S, f"the step took {elapsed_s:.1f} s"
    assert results[0]["failed"] == results[1]["failed"] == all_blocks
    assert results[0]["local_failed"] == []  # rank 0 loaded its shard: it fails only because rank 1 did
    assert results[1]["local_failed"] and all(r["consistent"] and not r["broken"] for r in results)
    # Nobody is left in a collective: the next step (shard 1 is gone: a miss) runs at once on both ranks.
    b.sched.finish("k")
    assert b.sched.admit(FakeRequest("k2", prompt_tokens(2 * CHUNK, seed=4001))) == 0
    _, results = b.step(timeout_s=WIDE_S)
    # (a rank left in a collective would make this step's collectives time out: the group would be broken)
    assert all(r["failed"] == [] and not r["broken"] for r in results)
    assert b.sched.sched.num_leases == 0  # the promised stripes were released (shard 1's release is best effort)
    a.close()
    b.close()


def test_a_stopped_rank_costs_the_others_one_timeout_then_the_group_recovers(
        pool: RankPool, servers: ValkeyServers) -> None:
    urls = list(servers.urls[:2])
    kw = dict(load_deadline_s=1.0, collective_timeout_s=1.0)
    prompt = prompt_tokens(2 * CHUNK + 5, seed=5000)
    a, a_ids, image = produce(pool, 2, urls, prompt, "stop", **kw)
    b = PcpEngine(pool, "B-stop", 2, urls, seed=2, **kw)
    assert b.sched.admit(FakeRequest("s", prompt)) == 2 * CHUNK
    pool.signal(1, signal.SIGSTOP)  # rank 1 stops before it reaches the step's collectives
    try:
        meta = b.start_step()
        t0 = time.monotonic()
        [r0] = pool.collect([0], timeout_s=30)
        waited_s = time.monotonic() - t0
    finally:
        pool.signal(1, signal.SIGCONT)
    [r1] = pool.collect([1], timeout_s=30)
    b.sched.complete([r0["worker_meta"], r1["worker_meta"]])
    all_blocks = sorted(x for r in meta.loads for c in r.chunks for x in c.block_ids)
    assert waited_s < WIDE_S  # one timeout, not a hang (how long a timeout takes is not this test's to time)
    assert r0["failed"] == r1["failed"] == all_blocks and r0["broken"] and r1["broken"]
    # A fresh group (every rank of the world takes part) and the same load succeeds, byte-exact on both ranks.
    pool.call_all("regroup", timeout_s=30)
    b.sched.finish("s")
    ext = b.sched.admit(FakeRequest("s2", prompt))
    _, results = b.step()
    assert ext == 2 * CHUNK and all(r["failed"] == [] and not r["broken"] for r in results)
    b_ids = list(b.sched.running["s2"].block_ids)
    assert b.blocks(b_ids[:ext // BLOCK]) == [block_bytes(image, a_ids, a_ids[:ext // BLOCK])] * 2
    a.close()
    b.close()


# ---------------------------------------------------------------------------------------------------- cases
def test_case_C02_ranks_with_small_evicting_tiers_hit_the_minimum_and_keep_what_was_promised(
        pool: RankPool, valkey_server_sets: Callable[[int], ValkeyServers]) -> None:
    """C02: two ranks whose shards have small Range budgets of different sizes; after other prompts the ranks hold
    different amounts of an old prompt; it is sent again: the hit is the minimum over ranks, and the promised
    stripes stay (leased) through another engine's saves until they are loaded, on both ranks."""
    servers = valkey_server_sets(2)
    urls = list(servers.urls)
    unit = (CHUNK // BLOCK // 2) * len(LAYERS) * LAYER_BLOCK_BYTES["dense"]  # one chunk's slice on one shard
    capacities = [6 * unit, 10 * unit]
    a = PcpEngine(pool, "A-C02", 2, urls, seed=1, capacities=capacities)
    # X is computed in two steps: stripes X1 (chunks 0-1) and X2 (chunks 2-3) on each shard.
    x = prompt_tokens(4 * CHUNK + 1, seed=6000)
    _, x_ids, x_image = produce(pool, 2, urls, x, "x", engine=a, first_step_tokens=2 * CHUNK)
    # A request sharing X's first two chunks loads them: X1 becomes the most recently used stripe on both shards.
    r = PcpEngine(pool, "R-C02", 2, urls, seed=4)
    assert r.sched.admit(FakeRequest("x-head", x[:2 * CHUNK + 5])) == 2 * CHUNK
    _, results = r.step()
    assert all(res["failed"] == [] for res in results)
    # Y (4 chunks) needs room: shard 0 (6 units) evicts X2, shard 1 (10 units) keeps everything.
    produce(pool, 2, urls, prompt_tokens(4 * CHUNK + 1, seed=6001), "y", engine=a)
    chain = prefix_hash_chain(NAMESPACE, b"", x, CHUNK)
    held = []
    for s, u in enumerate(urls):
        backend = ValkeyBackend(u)
        held.append(leading_run(backend.get_tickets([ticket_key(h, s) for h in chain])))
        backend.close()
    assert held == [2, 4]  # the ranks hold different amounts of X

    b = PcpEngine(pool, "B-C02", 2, urls, seed=2)
    ext = b.sched.admit(FakeRequest("x-again", x))
    assert ext == min(held) * CHUNK  # the minimum over ranks
    assert [len(lease_keys(u)) for u in urls] == [1, 1]  # X1 is leased on every shard, shard 1's longer run too
    # Before B's load runs, another engine saves Z (5 chunks): on shard 0 only X1 could make room, and it is
    # leased, so that save is skipped; shard 1 evicts unleased stripes.
    other = PcpEngine(pool, "O-C02", 2, urls, seed=3, capacities=capacities)
    other.sched.admit(FakeRequest("z", prompt_tokens(5 * CHUNK + 1, seed=6002)))
    _, results = other.step()
    assert results[0]["stats"].get("saves_skipped_capacity", 0) == 1
    assert results[1]["stats"].get("saved_stripes", 0) == 1
    _, results = b.step()
    assert all(res["failed"] == [] for res in results)
    b_ids = list(b.sched.running["x-again"].block_ids)
    assert b.blocks(b_ids[:ext // BLOCK]) == [block_bytes(x_image, x_ids, x_ids[:ext // BLOCK])] * 2
    assert b.sched.sched.num_leases == 0 and [lease_keys(u) for u in urls] == [[], []]  # released on both shards
    for e in (a, r, b, other):
        e.close()


def test_case_C09_pcp2_block16_prompt_of_600_tokens_counts_keys_and_blocks_alike(
        pool: RankPool, servers: ValkeyServers) -> None:
    """C09: PCP 2, block 16, a prompt of about 600 tokens: the request succeeds and overlapping prompts hit, with
    the hit counted in tokens, a whole number of blocks and of chunks."""
    urls = list(servers.urls[:2])
    prompt = prompt_tokens(600, seed=7000)
    a, a_ids, image = produce(pool, 2, urls, prompt, "c09")
    assert a.sched.sched.stats["promised_tokens"] == 0
    overlapping = prompt[:520] + prompt_tokens(90, seed=7001)  # shares 8 whole chunks (512 tokens)
    b, ext, meta, results = consume(pool, "B-c09", 2, urls, overlapping, "c09-b")
    assert ext == 512 and ext % BLOCK == 0 and ext % CHUNK == 0
    assert sum(len(c.block_ids) for r in meta.loads for c in r.chunks) == ext // BLOCK
    assert all(r["failed"] == [] for r in results)
    assert sorted(x for r in results for x in r["loaded_blocks"]) == sorted(b.sched.running["c09-b"].block_ids[:32])
    b_ids = list(b.sched.running["c09-b"].block_ids)
    assert b.blocks(b_ids[:32]) == [block_bytes(image, a_ids, a_ids[:32])] * 2
    # B saved its own new full chunk (tokens 512..575 of its prompt): a later prompt overlapping B's hits 9 chunks.
    b.sched.finish("c09-b")
    later = overlapping[:590] + prompt_tokens(40, seed=7002)
    c, ext_c, _, results_c = consume(pool, "C-c09", 2, urls, later, "c09-c")
    assert ext_c == 9 * CHUNK and all(r["failed"] == [] for r in results_c)
    for e in (a, b, c):
        e.close()
