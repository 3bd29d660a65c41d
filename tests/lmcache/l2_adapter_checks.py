"""The Range L2 adapter's conformance checks, run INSIDE LMCache's environment (``.venv-lmcache/bin/python``).

Started by ``tests/lmcache/test_l2_adapter.py`` with the URLs of real Valkey servers (one per shard) and a scratch
directory; runs every check in :data:`CHECKS` against real LMCache objects (``L1MemoryManager`` buffers, LMCache's
``Bitmap`` and event notifiers) and prints one JSON object ``{check name: "ok" | "FAIL: <why>"}`` on its last line.
Each check uses a deployment of its own, so the checks share the servers without seeing each other's entries.

Usage: python tests/lmcache/l2_adapter_checks.py --urls valkey://h:p,valkey://h:p --scratch DIR [--docs FILE]
"""

from __future__ import annotations

import argparse
import json
import re
import select
import shlex
import sys
import threading
import traceback
import uuid
from pathlib import Path

import torch
from lmcache.v1.distributed.api import MemoryLayoutDesc
from lmcache.v1.platform.event_notifier import consume_fd

from range_connector.lmcache.adapter import RangeL2Adapter, key_object_id
from tests.lmcache.l2_driver import (
    OBJECT_BYTES,
    TASK_DEADLINE_S,
    Env,
    holds,
    keys_of,
    lease_keys,
    load,
    lookup,
    round_trips,
    store,
)


# ------------------------------------------------------------------------------------------------------ the checks
def check_store_lookup_load_unlock(env: Env) -> None:
    """A task of 16 objects over 2 shards: stored, found and leased, loaded bit for bit, unlocked (no lease left)."""
    a, dep = env.adapter()
    try:
        keys = keys_of("rt", 16)
        objs = env.objects(keys)
        res = store(a, keys, objs)
        assert res.is_successful() and res.bytes_transferred() == 16 * OBJECT_BYTES, f"store result {int(res)}"
        assert {a.objects.shard_of(a_oid) for a_oid in map(key_object_id, keys)} == {0, 1}, "the keys must span both shards"
        assert lookup(a, keys) == [1] * 16
        assert lease_keys(env, dep) == 2, f"one leased stripe per shard, found {lease_keys(env, dep)}"
        dest = env.objects(keys, fill=False)
        assert load(a, keys, dest) == [1] * 16
        assert all(holds(o, k) for o, k in zip(dest, keys)), "loaded bytes differ from the stored ones"
        a.submit_unlock(keys)
        a.close()
        assert lease_keys(env, dep) == 0, "unlock left leases behind"
        env.free(objs + dest)
    finally:
        a.close()


def check_round_trips_follow_shards_not_objects(env: Env) -> None:
    """Store, lookup-and-lock and load cost the same round trips per shard for 8 and for 256 objects (32x)."""
    costs = []
    for n in (8, 256):
        a, _ = env.adapter()
        try:
            keys = keys_of(f"rt{n}", n)
            objs, dest = env.objects(keys), env.objects(keys, fill=False)
            per_op = []
            for op in (lambda: store(a, keys, objs), lambda: lookup(a, keys), lambda: load(a, keys, dest)):
                before = round_trips(a)
                op()
                per_op.append([x - y for x, y in zip(round_trips(a), before)])
            costs.append(per_op)
            assert all(holds(o, k) for o, k in zip(dest, keys))
            a.submit_unlock(keys)
            env.free(objs + dest)
        finally:
            a.close()
    assert costs[0] == costs[1], f"round trips per shard [store, lookup, load]: 8 objects {costs[0]}, 256 {costs[1]}"
    assert costs[0][0] == [1, 1], f"a store task is one round trip per shard, got {costs[0][0]}"


def check_event_fds(env: Env) -> None:
    """Three distinct fds; each becomes readable when its task completes; each result is returned once."""
    a, _ = env.adapter()
    try:
        fds = {a.get_store_event_fd(), a.get_lookup_and_lock_event_fd(), a.get_load_event_fd()}
        assert len(fds) == 3, f"event fds not distinct: {fds}"
        keys = keys_of("fd", 4)
        objs = env.objects(keys)
        for fd, submit, query in (
            (a.get_store_event_fd(), lambda: a.submit_store_task(keys, objs),
             lambda t: a.pop_completed_store_tasks().get(t)),
            (a.get_lookup_and_lock_event_fd(), lambda: a.submit_lookup_and_lock_task(keys, {}),
             a.query_lookup_and_lock_result),
            (a.get_load_event_fd(), lambda: a.submit_load_task(keys, objs), a.query_load_result),
        ):
            tid = submit()
            ready, _, _ = select.select([fd], [], [], TASK_DEADLINE_S)
            assert ready == [fd], f"fd {fd} not signalled"
            consume_fd(fd)
            assert query(tid) is not None, "the fd was signalled before the result was there"
            assert query(tid) is None, "a result was returned twice"
        a.submit_unlock(keys)
        env.free(objs)
    finally:
        a.close()


def check_partial_failure_bitmaps(env: Env) -> None:
    """A missing, a corrupted (on purpose, on the server) and a wrongly sized object are 0 bits; the rest load."""
    a, dep = env.adapter()
    try:
        keys = keys_of("pf", 6)
        never = keys_of("never-stored", 1)[0]
        objs = env.objects(keys)
        assert store(a, keys, objs).is_successful()
        oids = [key_object_id(k) for k in keys]
        tickets, _ = a.objects.lookup(oids, lease=False)
        # key 2: flip one byte of its bytes inside its stripe's value on its shard
        t2, admin2 = tickets[2], env.admin[a.objects.shard_of(oids[2])]
        value_key = f"rc3:{dep}:s:{t2.stripe_id}:0"
        pos = t2.block_offset + 100
        byte = admin2.getrange(value_key, pos, pos)
        admin2.setrange(value_key, pos, bytes([byte[0] ^ 0xFF]))
        stored = admin2.getrange(value_key, t2.block_offset, t2.block_offset + t2.num_blocks - 1)
        assert stored != bytes(objs[2].tensor.view(torch.uint8).flatten().numpy()), "the corruption did not land"
        # key 4: its ticket gone from its shard (as after an eviction)
        env.admin[a.objects.shard_of(oids[4])].delete(f"rc3:{dep}:".encode() + a.objects.key_of(oids[4]))
        # mutation: with the checksum comparison made to pass, the corrupt bytes come back under a 1 bit; so the 0
        # bit below is the checksum's doing
        import range_connector.lmcache.objects as objects_mod

        real_xxhash = objects_mod.xxhash
        objects_mod.xxhash = type("Blind", (), {"xxh3_64_intdigest": staticmethod(lambda _: t2.checksums[0])})
        try:
            blind = env.objects([keys[2]], fill=False)
            assert load(a, [keys[2]], blind) == [1] and not holds(blind[0], keys[2]), "the mutation did not bite"
        finally:
            objects_mod.xxhash = real_xxhash
        asked = keys + [never]
        assert lookup(a, asked) == [1, 1, 1, 1, 0, 1, 0]
        other = MemoryLayoutDesc(shapes=[torch.Size([2, 2, 8, 64])], dtypes=[torch.bfloat16])
        dest = env.objects(asked[:5], fill=False) + env.objects([keys[5]], fill=False, layout=other) + \
            env.objects([never], fill=False)
        assert load(a, asked, dest) == [1, 1, 0, 1, 0, 0, 0], "corrupt, missing and wrongly sized must be 0 bits"
        assert all(holds(dest[i], keys[i]) for i in (0, 1, 3))
        a.submit_unlock(asked)
        assert lookup(a, [keys[2]]) == [0], "a corrupt object's ticket must be deleted"
        a.submit_unlock([keys[2]])
        env.free(objs + dest + blind)
    finally:
        a.close()


def check_lock_counts_and_leases(env: Env) -> None:
    """Two locks of one key need two unlocks; the lease goes with the last; unlocking an unlocked key is harmless."""
    a, dep = env.adapter(servers=env.urls[:1])
    try:
        keys = keys_of("lk", 3)
        objs = env.objects(keys)
        assert store(a, keys, objs).is_successful()
        assert lookup(a, keys) == [1, 1, 1] and lookup(a, keys[:1]) == [1]
        assert lease_keys(env, dep) == 1
        a.submit_unlock(keys)
        assert a.report_status()["num_locks_held"] == 1
        a.submit_unlock(keys[:1] + keys_of("not-locked", 2))
        assert a.report_status()["num_locks_held"] == 0
        a.close()
        assert lease_keys(env, dep) == 0
        env.free(objs)
    finally:
        a.close()


def check_budget_evicts_unleased_stripes(env: Env) -> None:
    """Range's budget: with room for 3 stripes, 5 store tasks evict the oldest unleased ones, never the locked one;
    usage reports Range's bytes and budget, and LMCache is told not to evict on its own."""
    task_bytes = 4 * OBJECT_BYTES
    a, _ = env.adapter(servers=env.urls[:1], capacity_bytes=3 * task_bytes)
    try:
        tasks = [keys_of(f"ev{t}", 4) for t in range(5)]
        objs = [env.objects(k) for k in tasks]
        assert store(a, tasks[0], objs[0]).is_successful()
        assert lookup(a, tasks[0]) == [1] * 4
        for t in range(1, 5):
            assert store(a, tasks[t], objs[t]).is_successful(), f"store {t}"
        found = [lookup(a, k) for k in tasks]
        assert found == [[1] * 4, [0] * 4, [0] * 4, [1] * 4, [1] * 4], f"found after eviction: {found}"
        dest = env.objects(tasks[0], fill=False)
        assert load(a, tasks[0], dest) == [1] * 4 and all(holds(o, k) for o, k in zip(dest, tasks[0]))
        usage = a.get_usage()
        assert (usage.total_bytes_used, usage.total_capacity_bytes) == (3 * task_bytes, 3 * task_bytes), usage
        assert not a.supports_global_eviction
        for k in tasks:
            a.submit_unlock(k)
        a.submit_unlock(tasks[0])
        env.free([o for group in objs for o in group] + dest)
    finally:
        a.close()


def check_usage_by_cache_salt(env: Env) -> None:
    """``get_usage``: Range's stored bytes, and what was stored per ``cache_salt``."""
    a, _ = env.adapter()
    try:
        plain, salted = keys_of("us", 3), keys_of("us", 2, salt="user1")
        objs = env.objects(plain + salted)
        assert store(a, plain + salted, objs).is_successful()
        usage = a.get_usage()
        assert usage.total_bytes_used == 5 * OBJECT_BYTES and usage.total_capacity_bytes == 0, usage
        assert dict(usage.bytes_by_cache_salt) == {"": 3 * OBJECT_BYTES, "user1": 2 * OBJECT_BYTES}
        assert lookup(a, keys_of("us", 2, salt="user2")) == [0, 0], "another salt must not hit"
        env.free(objs)
    finally:
        a.close()


def check_two_threads_at_once(env: Env) -> None:
    """LMCache's two controller threads: concurrent store / lookup-and-lock / load / unlock cycles, some keys shared
    by both; every load is exact, and no lock or lease is left."""
    a, dep = env.adapter()
    errors: list[str] = []
    shared = keys_of("shared", 4)

    def controller(name: str) -> None:
        try:
            for it in range(8):
                keys = keys_of(f"{name}{it}", 6) + shared
                objs = env.objects(keys)
                assert store(a, keys, objs).is_successful()
                assert lookup(a, keys) == [1] * len(keys)
                dest = env.objects(keys, fill=False)
                assert load(a, keys, dest) == [1] * len(keys)
                assert all(holds(o, k) for o, k in zip(dest, keys)), "wrong bytes"
                a.submit_unlock(keys)
                env.free(objs + dest)
        except Exception:
            errors.append(f"{name}: {traceback.format_exc(limit=3)}")

    try:
        threads = [threading.Thread(target=controller, args=(n,)) for n in ("store-ctl", "prefetch-ctl")]
        for t in threads:
            t.start()
        for t in threads:
            t.join(TASK_DEADLINE_S * 4)
        assert not any(t.is_alive() for t in threads), "a controller thread hung"
        assert not errors, errors
        assert a.report_status()["num_locks_held"] == 0
        a._pool.shutdown(wait=True)  # (the releases queued by the last unlocks have run)
        assert lease_keys(env, dep) == 0, "leases left behind"
    finally:
        a.close()


def check_file_tier(env: Env) -> None:
    """The file tier (one directory per shard): round trip, a missing key is a 0 bit, leases released."""
    a, _ = env.adapter(servers=[], type="file", directory=str(env.scratch / "files"), num_shards=2)
    try:
        keys = keys_of("ft", 8)
        objs = env.objects(keys)
        assert store(a, keys, objs).is_successful()
        asked = keys + keys_of("ft-missing", 1)
        assert lookup(a, asked) == [1] * 8 + [0]
        dest = env.objects(asked, fill=False)
        assert load(a, asked, dest) == [1] * 8 + [0]
        assert all(holds(o, k) for o, k in zip(dest, keys))
        a.submit_unlock(asked)
        env.free(objs + dest)
    finally:
        a.close()


def check_lmcache_loads_the_plugin_from_the_docs(env: Env) -> None:
    """docs/lmcache.md's ``--l2-adapter`` JSON, servers replaced by the test's, goes through LMCache's own parser
    and factory (what the MP server does) and yields a working Range adapter."""
    from lmcache.v1.distributed.l2_adapters import create_l2_adapter
    from lmcache.v1.distributed.l2_adapters.config import add_l2_adapters_args, parse_args_to_l2_adapters_config

    text = env.docs.read_text() if env.docs else ""
    m = re.search(r"--l2-adapter\s+('[^']+')", text)
    assert m, "docs/lmcache.md has no --l2-adapter '<json>' argument"
    spec = json.loads(shlex.split(m.group(1))[0])
    spec["adapter_params"]["servers"] = env.urls
    spec["adapter_params"]["deployment"] = "lmc" + uuid.uuid4().hex[:12]
    parser = argparse.ArgumentParser()
    add_l2_adapters_args(parser)
    [cfg] = parse_args_to_l2_adapters_config(parser.parse_args(["--l2-adapter", json.dumps(spec)])).adapters
    a = create_l2_adapter(cfg)
    try:
        assert isinstance(a, RangeL2Adapter), type(a)
        keys = keys_of("docs", 4)
        objs, dest = env.objects(keys), env.objects(keys, fill=False)
        assert store(a, keys, objs).is_successful() and lookup(a, keys) == [1] * 4
        assert load(a, keys, dest) == [1] * 4 and all(holds(o, k) for o, k in zip(dest, keys))
        a.submit_unlock(keys)
        env.free(objs + dest)
    finally:
        a.close()


def check_no_vllm(env: Env) -> None:
    """The adapter and everything it imported run without vLLM."""
    assert not [m for m in sys.modules if m == "vllm" or m.startswith("vllm.")], "vllm was imported"


def check_a_task_that_raises_fails_its_keys_and_is_counted(env: Env) -> None:
    """A load task whose storage call raises answers every key with a failed bit, and report_status counts it."""
    a, _dep = env.adapter(servers=env.urls[:1])
    try:
        keys = keys_of("raise", 2)
        objs = env.objects(keys)
        assert store(a, keys, objs).is_successful()
        assert lookup(a, keys) == [1, 1]

        def broken_load(*args, **kwargs):
            raise RuntimeError("injected")

        a.objects.load = broken_load
        dest = env.objects(keys, fill=False)
        assert load(a, keys, dest) == [0, 0], "a raising load must fail every key"
        assert a.report_status()["task_failures"] == {"load": 1}
        a.submit_unlock(keys)
        env.free(objs + dest)
    finally:
        a.close()


CHECKS = {name[len("check_"):]: fn for name, fn in sorted(globals().items()) if name.startswith("check_")}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--urls", required=True)
    p.add_argument("--scratch", required=True, type=Path)
    p.add_argument("--docs", type=Path)
    p.add_argument("--only", default="")
    args = p.parse_args()
    env = Env(args.urls.split(","), args.scratch, args.docs)
    results = {}
    try:
        for name, fn in CHECKS.items():
            if args.only and name not in args.only.split(","):
                continue
            try:
                fn(env)
                results[name] = "ok"
            except Exception as exc:
                results[name] = f"FAIL: {type(exc).__name__}: {exc}\n{traceback.format_exc(limit=4)}"
    finally:
        env.close()
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
