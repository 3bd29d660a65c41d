"""End to end: a vLLM CPU engine with LMCache's MP connector, LMCache's MP server with the Range L2 adapter on two
real Valkey servers (one per shard), and a prompt served from Range's tier after the MP server restarted empty.

1. MP server A (Range adapter, a fresh deployment on the session's two Valkey shards) and a cold engine: prompts
   P, Q and R are computed and saved; the test waits after each until the adapter has written its full chunks
   (their tickets appear on the shards) and records which objects are whose.
2. Server A stops; server B starts with an empty L1 and the same adapter configuration. Between the two, one of
   Q's objects is *forged* (a byte of its bytes flipped and its ticket's checksum recomputed: wrong bytes that pass
   every check the adapter has) and one of R's is *corrupted* (a byte flipped, the checksum left as stored).
3. A fresh engine asks for P, Q and R again. vLLM's external prefix-cache counters, the engine's KV-cache blocks
   (digests, ``tests/integration/engine_harness.py``) and each shard's ``INFO`` counters are read from outside.

What must hold: P is served from the tier (vLLM counts its full chunks as external hits; the shards served at
least its objects' bytes with reads) and its served blocks are byte-identical to the cold run's, as is its
greedy output. R's corrupted object is refused by the adapter's checksum: R is served less than its full chunks,
and what it is served is byte-identical. Q shows that the byte comparison is what would catch a wrong byte: its
forged object is served, and its blocks differ from the cold run's (if they did not, the comparison would prove
nothing). The block ids of each prompt come from the cold run (the blocks that became non-zero with it); both
engines allocate the same ids for the same sequence of prompts.

Needs ``.venv-lmcache`` (``bash bench/setup_lmcache_env.sh``): skipped with the reason without it. Two engine
starts and two MP server starts: about a minute and a half on two cores.
"""

from __future__ import annotations

import dataclasses
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest
import valkey
import xxhash

from range_connector.backends.base import deployment_key_prefix
from range_connector.kv.tickets import Ticket
from range_connector.testing.lmcache_server import LMCacheServer, range_l2_adapter
from range_connector.testing.tiny_models import build_model
from tests.integration.harness import prompt_ids, run_engine
from tests.lmcache.lmcache_env import REPO, lmcache_unavailable_reason

pytestmark = [pytest.mark.engine, pytest.mark.timeout(600)]

CHUNK_TOKENS = 256  # LMCache's chunk
BLOCK_TOKENS = 128  # the engine's block
PROMPT_TOKENS = 600  # two full chunks and a partial one (LMCache stores full chunks only)
FULL_CHUNKS = PROMPT_TOKENS // CHUNK_TOKENS
#: the engine harness's process layout and its workaround for LMCache's numba (llvmlite) in the worker's process
#: (``engine_harness._llvmlite_workaround``): one process starts in about 20 s, vLLM's layout in about 65 s
ENGINE_LAYOUT = {"processes": "one", "llvmlite_workaround": True}
#: longest wait for the adapter to have written a prompt's objects, seconds (a deadline against a hang)
STORE_DEADLINE_S = 120.0


def _client(url: str) -> valkey.Valkey:
    return valkey.Valkey.from_url(url, socket_timeout=10.0)


def object_tickets(urls: list[str], deployment: str) -> dict[tuple[int, bytes], Ticket]:
    """Every object ticket of ``deployment``: ``{(shard, key): ticket}``."""
    prefix = deployment_key_prefix(deployment).encode()
    found: dict[tuple[int, bytes], Ticket] = {}
    for shard, url in enumerate(urls):
        client = _client(url)
        try:
            for key in client.scan_iter(match=prefix + b"t:*", count=1000):
                ticket = Ticket.decode_object(client.get(key))
                if ticket is not None:
                    found[(shard, key)] = ticket
        finally:
            client.close()
    return found


def wait_for_new_objects(urls: list[str], deployment: str, known: set, count: int) -> set:
    """Wait until ``count`` object tickets beyond ``known`` exist; return them.

    Raises:
        AssertionError: not within :data:`STORE_DEADLINE_S`, or more than ``count`` appeared.
    """
    deadline = time.monotonic() + STORE_DEADLINE_S
    while True:
        new = set(object_tickets(urls, deployment)) - known
        if len(new) >= count or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert len(new) == count, f"expected {count} new objects on the shards, found {len(new)}"
    return new


def tamper(urls: list[str], deployment: str, key: tuple[int, bytes], *, forge: bool) -> None:
    """Flip one byte in the middle of one object's bytes in its stripe; ``forge``: also store the checksum of the
    changed bytes in its ticket, so that only a byte comparison can tell."""
    shard, tkey = key
    prefix = deployment_key_prefix(deployment).encode()
    client = _client(urls[shard])
    try:
        ticket = Ticket.decode_object(client.get(tkey))
        assert ticket is not None, tkey
        skey = prefix + b"s:%s:0" % ticket.stripe_id.encode()
        value = bytearray(client.get(skey))
        start, length = ticket.block_offset, ticket.num_blocks  # (an object's ticket: byte offset and length)
        value[start + length // 2] ^= 0x5A
        client.set(skey, bytes(value))
        if forge:
            checksum = xxhash.xxh3_64_intdigest(bytes(value[start:start + length]))
            client.set(tkey, dataclasses.replace(ticket, checksums=(checksum,)).encode())
    finally:
        client.close()


def shard_reads(urls: list[str]) -> list[dict[str, int]]:
    """Per shard: read commands served (``GET``, ``GETRANGE``, ``MGET`` calls) and bytes sent to clients."""
    out = []
    for url in urls:
        client = _client(url)
        try:
            stats = client.info("commandstats")
            sent = int(client.info("stats")["total_net_output_bytes"])
        finally:
            client.close()
        calls = {name.removeprefix("cmdstat_"): int(s["calls"]) for name, s in stats.items()}
        out.append({"reads": sum(calls.get(c, 0) for c in ("get", "getrange")), "mget": calls.get("mget", 0),
                    "sent_bytes": sent})
    return out


def new_block_ids(before: dict, after: dict) -> list[int]:
    """Blocks that became non-zero, or changed, from one digest map to the next, sorted."""
    return sorted(int(b) for b, d in after.items() if before.get(b) != d)


def generate_steps(prompts: list[list[int]], marks: Path | None) -> list[dict]:
    steps: list[dict] = []
    for i, prompt in enumerate(prompts):
        steps += [{"op": "generate", "prompts": [prompt], "max_tokens": 8}, {"op": "block_digests"}]
        if marks is not None:
            steps += [{"op": "mark", "path": str(marks / f"{i}.done")},
                      {"op": "wait_for", "path": str(marks / f"{i}.stored"), "timeout_s": STORE_DEADLINE_S + 30}]
    return steps


@pytest.mark.timeout(600)
def test_prompt_served_from_range_tier_after_mp_server_restart(valkey_servers, tmp_path: Path) -> None:
    reason = lmcache_unavailable_reason()
    if reason:
        pytest.skip(reason)
    import importlib.util

    # (the engine runs under this interpreter: Range's .venv, not LMCache's)
    if importlib.util.find_spec("vllm") is None:
        pytest.skip(f"vLLM is not installed in {sys.executable}: run this test from Range's .venv (the MP server "
                    "runs in .venv-lmcache)")
    urls = list(valkey_servers.urls)
    deployment = "e2e" + uuid.uuid4().hex[:12]
    venv = REPO / ".venv-lmcache"
    adapter = range_l2_adapter(urls, deployment=deployment)
    model = build_model("gqa", "tiny")
    prompts = [prompt_ids(model, PROMPT_TOKENS, offset_chars=20_000 * i) for i in range(3)]  # P, Q, R
    marks = tmp_path / "marks"
    marks.mkdir()

    # 1. Cold: computed and saved; the objects of each prompt recorded as they appear.
    objects_of: list[set] = []
    with LMCacheServer(venv, tmp_path / "mp-a.log", l1_size_gb=0.25, l2_adapters=[adapter]) as server:
        spec = {"model": str(model), "connector": None, "kv_transfer_config": server.kv_transfer_config(),
                **ENGINE_LAYOUT, "steps": generate_steps(prompts, marks)}
        env = {"PYTHONPATH": server.engine_pythonpath()}
        results: dict = {}
        engine = threading.Thread(target=lambda: results.update(
            cold=_run(tmp_path, "cold", spec, env)), daemon=True)
        engine.start()
        known: set = set()
        try:
            for i in range(len(prompts)):
                while not (marks / f"{i}.done").exists():
                    assert engine.is_alive(), f"the cold engine stopped early: {results.get('cold')}"
                    time.sleep(0.2)
                objects_of.append(wait_for_new_objects(urls, deployment, known, FULL_CHUNKS))
                known |= objects_of[-1]
                (marks / f"{i}.stored").touch()
        finally:  # (on a failure here the engine must not wait for marks that never come)
            for i in range(len(prompts)):
                (marks / f"{i}.stored").touch()
            engine.join(timeout=300)
        cold = results["cold"]
    # No KV segment of a stopped engine is left in /dev/shm (LMCache unlinks it from a finalizer that a killed
    # engine never runs; the server's stop removes what is left), so that repeated runs do not fill the memory.
    assert not [p for p in Path("/dev/shm").glob("lmcache_kv_*") if not Path(f"/proc/{p.name.split('_')[2]}").exists()]
    assert not isinstance(cold, BaseException), cold
    assert all(cold[4 * i]["external_hits"] == 0 for i in range(len(prompts)))  # (a fresh deployment)

    # 2. One of Q's objects forged, one of R's corrupted; server B starts with an empty L1.
    tamper(urls, deployment, sorted(objects_of[1])[0], forge=True)
    tamper(urls, deployment, sorted(objects_of[2])[0], forge=False)
    p_bytes = sum(t.num_blocks for k, t in object_tickets(urls, deployment).items() if k in objects_of[0])
    before = shard_reads(urls)
    with LMCacheServer(venv, tmp_path / "mp-b.log", l1_size_gb=0.25, l2_adapters=[adapter]) as server:
        spec = {"model": str(model), "connector": None, "kv_transfer_config": server.kv_transfer_config(),
                **ENGINE_LAYOUT, "steps": generate_steps(prompts, None)}
        warm = _run(tmp_path, "warm", spec, {"PYTHONPATH": server.engine_pythonpath()})
    after = shard_reads(urls)
    assert not isinstance(warm, BaseException), warm

    cold_digests = [{}] + [cold[4 * i + 1]["digests"] for i in range(len(prompts))]
    warm_digests = [{}] + [warm[2 * i + 1]["digests"] for i in range(len(prompts))]
    blocks = [new_block_ids(cold_digests[i], cold_digests[i + 1]) for i in range(len(prompts))]
    full_hit_tokens = FULL_CHUNKS * CHUNK_TOKENS

    def served(i: int) -> tuple[int, list[int]]:
        hit = warm[2 * i]["external_hits"]
        ids = blocks[i][:hit // BLOCK_TOKENS]
        return hit, [b for b in ids if warm_digests[i + 1][str(b)] != cold_digests[i + 1][str(b)]]

    # P: all of its full chunks from Range's tier, byte-identical, same greedy output.
    hit, differing = served(0)
    assert hit == full_hit_tokens, f"P: vLLM counted {hit} external hit tokens, not {full_hit_tokens}"
    assert len(blocks[0]) >= hit // BLOCK_TOKENS
    assert differing == [], f"P: served blocks {differing} differ from the cold run's"
    assert warm[0]["token_ids"] == cold[0]["token_ids"]
    # ... and the bytes came from the shards (counted there): reads, and at least P's objects' bytes sent.
    assert sum(a["reads"] - b["reads"] for a, b in zip(after, before)) >= 1, (before, after)
    assert sum(a["sent_bytes"] - b["sent_bytes"] for a, b in zip(after, before)) >= p_bytes, (before, after, p_bytes)

    # R: the corrupted object is refused (a shorter hit), and what is served is byte-identical.
    hit, differing = served(2)
    assert hit < full_hit_tokens and hit % CHUNK_TOKENS == 0, f"R: {hit} external hit tokens"
    assert differing == [], f"R: served blocks {differing} differ from the cold run's"

    # Q: the forged object passes the adapter; the byte comparison above is what catches it.
    hit, differing = served(1)
    assert hit == full_hit_tokens, f"Q: {hit} external hit tokens"
    assert differing, "Q: a forged object was served and no block differs: the byte comparison is blind"


def _run(tmp_path: Path, name: str, spec: dict, env: dict) -> list[dict] | BaseException:
    try:
        return run_engine(tmp_path, name, spec, env=env)
    except BaseException as exc:  # (reported by the test thread)
        return exc
