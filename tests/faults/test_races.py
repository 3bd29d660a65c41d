"""Races on a shared Valkey server: two engines saving the same prompt at the same moment while a third reads it
(Mooncake#1374: a key visible before its value was complete), and a read that outlives its lease while a third
writer fills the server's byte budget (Mooncake#850). A read gets one writer's bytes for every chunk it loads, or
reports the chunk failed; never a torn or foreign value. Also case C25: the media identity is part of the key.
"""

from __future__ import annotations

import threading

import pytest
from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange

from tests.faults.conftest import Baseline, assert_oracle, scan_keys, wait_until
from tests.unit.scheduler_worker_harness import (
    CHUNK_BYTES_DENSE_32,
    Engine,
    FakeRequest,
    produce,
    prompt_tokens,
)

PROMPT = prompt_tokens(150, seed=5)


@pytest.mark.timeout(90)
def test_two_writers_of_one_prompt_at_once_never_tear_a_read(valkey_server_sets, backends_for) -> None:
    [url] = valkey_server_sets(1).urls
    base = Baseline([url])
    base.record()
    # (a reader that saves nothing: its steps run no forward; and no checksum check to hide a torn value)
    reader = Engine(backends_for([url]), seed=99, verify_checksums=False, can_save=False)  # type: ignore[arg-type]
    rounds, loaded = 4, 0
    for n in range(rounds):
        prompt = prompt_tokens(150, seed=1000 + n)
        # both writers look up (a miss for both) before either saves: they then save at the same moment
        engines = [Engine(backends_for([url]), seed=10 * n + i) for i in range(2)]  # type: ignore[arg-type]
        for i, e in enumerate(engines):
            assert e.admit(FakeRequest(f"W{i}-{n}", prompt)) == 0
        writers: list = [(e, list(e.running[f"W{i}-{n}"].block_ids)) for i, e in enumerate(engines)]
        barrier = threading.Barrier(3)

        def write(i: int, barrier: threading.Barrier = barrier, engines: list = engines) -> None:
            barrier.wait(10.0)
            engines[i].step()

        threads = [threading.Thread(target=write, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        barrier.wait(10.0)
        # read while the two saves race: whatever the lookup finds must be some writer's complete chunk
        reads = []
        for k in range(3):
            req_id = f"R-{n}-{k}"
            ext = reader.admit(FakeRequest(req_id, prompt))
            reads.append((req_id, ext, reader.step(forward=False)))
        for t in threads:
            t.join(20.0)
            assert not t.is_alive()
        for req_id, ext, res in reads:
            loaded += assert_oracle([(w, blocks) for w, blocks in writers], reader, req_id, ext, [res])
            reader.finish(req_id)
        ext = reader.admit(FakeRequest(f"R-{n}-last", prompt))
        assert ext == 128  # both saves ended: the prompt is stored (by whichever wrote its tickets last)
        res = reader.step(forward=False)
        assert res.invalid_block_ids == set()
        loaded += assert_oracle([(w, blocks) for w, blocks in writers], reader, f"R-{n}-last", ext, [res])
        reader.finish(f"R-{n}-last")
        for w, _ in writers:
            assert w.worker.stats["saved_chunks"] == 4  # (both saves went through: they raced)
            w.close()
    assert loaded >= 8 * rounds
    reader.step(forward=False)
    base.check_live([reader])
    reader.close()
    backends_for.close_all()
    base.check_closed()


@pytest.mark.timeout(60)
def test_read_that_outlives_its_lease_fails_instead_of_reading_evicted_bytes(valkey_server_sets,
                                                                             backends_for) -> None:
    [url] = valkey_server_sets(1).urls
    base = Baseline([url])
    base.record()
    budget = 5 * CHUNK_BYTES_DENSE_32  # room for one prompt's four chunks, not two prompts'
    a, a_blocks = produce(backends_for([url], capacity_bytes=budget), PROMPT)
    b = Engine(backends_for([url], capacity_bytes=budget), seed=4, lease_ttl_s=0.2)  # type: ignore[arg-type]
    ext = b.admit(FakeRequest("B-0", PROMPT))
    assert ext == 128 and scan_keys(url, "l")
    # the read is slow: its lease runs out first (the server expires it), and a third writer's save evicts the
    # stripes the lease no longer protects
    assert wait_until(lambda: not scan_keys(url, "l"))
    c, _ = produce(backends_for([url], capacity_bytes=budget), prompt_tokens(150, seed=6), seed=7, req_id="C-0")
    assert c.worker.stats["saved_chunks"] >= 1

    res = b.step(forward=False)

    blocks = b.running["B-0"].block_ids
    assert set(blocks[:4]) <= res.invalid_block_ids  # the oldest stripe (chunks 0-1) was evicted
    assert assert_oracle([(a, a_blocks)], b, "B-0", ext, [res]) <= 4
    b.finish("B-0")
    b.step(forward=False)
    base.check_live([a, b, c])
    for e in (a, b, c):
        e.close()
    backends_for.close_all()
    base.check_closed()


def _image(identifier: str) -> MultiModalFeatureSpec:
    return MultiModalFeatureSpec(data=None, modality="image", identifier=identifier,
                                 mm_position=PlaceholderRange(offset=4, length=16))


@pytest.mark.timeout(60)
def test_case_C25_same_text_with_another_image_is_a_miss_and_the_same_image_a_hit(valkey_server_sets,
                                                                                 backends_for) -> None:
    [url] = valkey_server_sets(1).urls
    a = Engine(backends_for([url]), seed=1)  # type: ignore[arg-type]
    with_a = FakeRequest("A-0", PROMPT, mm_features=[_image("sha256:image-a")])
    assert a.admit(with_a) == 0
    a.step()
    a_blocks = list(a.running["A-0"].block_ids)
    a.finish("A-0")

    b = Engine(backends_for([url]), seed=2)  # type: ignore[arg-type]
    assert b.sched._chain(with_a)[0] != b.sched._chain(FakeRequest("x", PROMPT, mm_features=[_image("sha256:b")]))[0]
    assert b.admit(FakeRequest("B-0", PROMPT, mm_features=[_image("sha256:image-b")])) == 0  # other image: miss
    assert b.admit(FakeRequest("B-1", PROMPT)) == 0  # no image: miss
    ext = b.admit(FakeRequest("B-2", PROMPT, mm_features=[_image("sha256:image-a")]))  # the same image: a hit
    assert ext == 128
    res = b.step(forward=False)
    assert res.invalid_block_ids == set()
    assert assert_oracle([(a, a_blocks)], b, "B-2", ext, [res]) == 8
    a.close()
    b.close()
