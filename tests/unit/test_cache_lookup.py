"""``cache lookup``'s engine-less answer (:func:`range_connector.ops.cache_lookup.lookup_prompt`) against what the
scheduler half says for the same prompt: two file tiers (real files, two shards) saved by the engine-less harness,
the nearer tier missing part of the prompt, so that the hit comes from both."""

from __future__ import annotations

import pytest

from range_connector.backends.file.backend import FileBackend
from range_connector.backends.tiered import TieredBackend
from range_connector.compat import AttentionGroup
from range_connector.config.tree import TierConfig
from range_connector.kv.tickets import ticket_key
from range_connector.ops.cache_lookup import lookup_prompt
from range_connector.ops.offline_spec import OfflineSpec
from tests.unit.scheduler_worker_harness import BLOCK, LAYERS, NAMESPACE, Engine, FakeRequest, chain, prompt_tokens

pytestmark = pytest.mark.timeout(60)


def test_lookup_answers_what_the_scheduler_finds_tier_by_tier(tmp_path):
    dirs = [tmp_path / "near", tmp_path / "far"]
    shards = [[FileBackend(d / "default" / f"shard-{s}") for s in range(2)] for d in dirs]
    tiers = tuple(TierConfig("file", directory=str(d), index=i) for i, d in enumerate(dirs))
    eng = Engine([TieredBackend([near, far], far_writes="sync") for near, far in zip(*shards)],
                 lookup_backends=[TieredBackend([near, far]) for near, far in zip(*shards)], num_shards=2,
                 tiers=tiers, seed=3)
    prompt = prompt_tokens(150, seed=3)  # four chunks of 32 tokens, and a tail
    eng.admit(FakeRequest("P", prompt))
    eng.step()
    assert eng.worker.wait_for_saves(30)
    eng.step(forward=False)
    eng.finish("P")
    hashes = chain(prompt, 32)
    for s, near in enumerate(shards[0]):  # the near tier loses chunks 1-3: they come from the far one
        near.delete_tickets([ticket_key(h, s, 0) for h in hashes[1:]])
    spec = OfflineSpec(NAMESPACE, {}, eng.config, eng.sched.plan,
                       AttentionGroup(LAYERS, BLOCK, eng.layer_block_bytes, (), False), eng.ranks, BLOCK, "", 1)
    answer = lookup_prompt(spec, prompt)
    external, _ = eng.sched.get_num_new_matched_tokens(FakeRequest("Q", prompt), 0)
    assert answer.hit_tokens == external == 128
    assert (answer.num_stored_chunks, answer.tail_stored) == (4, False)
    assert [(t.served_tokens, t.stored_tokens) for t in answer.tiers] == [(32, 32), (96, 128)]
    assert answer.as_dict()["tiers"][1]["tier_type"] == "file"
