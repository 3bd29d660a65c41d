"""The namespace computed without an engine (:mod:`range_connector.ops.offline_spec`): what changes it and what does
not, as the engine's. Its equality with a real engine's is checked in ``tests/integration/test_cache_admin_engine.py``."""

from __future__ import annotations

import pytest

from range_connector.errors import ConfigError
from range_connector.ops.offline_spec import offline_namespace
from range_connector.testing.tiny_models import build_model

pytestmark = pytest.mark.timeout(180)

CONFIG = {"tiers": [{"type": "file", "directory": "/nonexistent-unused"}], "num_shards": 2, "chunk_tokens": 256}


def test_the_namespace_follows_the_kv_layout_but_not_the_tensor_parallel_size():
    model = build_model("gqa", "tiny")
    base = offline_namespace(model, CONFIG, block_size=128)
    assert len(base.namespace) == 16 and base.namespace_hex == base.namespace.hex()
    assert (base.chunk_tokens, base.block_size, base.num_layers) == (256, 128, 4)
    kv_spec = base.fields["kv_spec"]
    # 2 KV heads x 64 x (K + V) x 2 bytes (bf16) x 128 tokens: one block of one layer of one head
    assert (kv_spec["num_kv_heads"], kv_spec["head_size"], kv_spec["head_page_size_bytes"]) == ("2", "64", "32768")
    assert base.fields["packing"].startswith("cpu-")
    tp2 = offline_namespace(model, CONFIG, block_size=128, tensor_parallel_size=2)
    assert tp2.namespace == base.namespace  # (tickets name their heads: engines of other TP sizes share a store)
    assert [g.count for g in tp2.ranks.groups] == [1, 1]
    assert offline_namespace(model, CONFIG, block_size=64).namespace != base.namespace
    assert offline_namespace(model, {**CONFIG, "namespace_salt": "x"}, block_size=128).namespace != base.namespace
    hashes, tail = base.chain(list(range(600)))
    assert len(hashes) == 2 and tail is not None
    assert base.chain(list(range(600)), cache_salt="tenant")[0][0] != hashes[0]


def test_a_bad_model_or_config_is_named(tmp_path):
    with pytest.raises(ConfigError, match="^model: "):
        offline_namespace(tmp_path / "no-such-model", {}, block_size=128)
    with pytest.raises(ConfigError, match=r"^chunk_tokens: "):
        offline_namespace(build_model("gqa", "tiny"), {**CONFIG, "chunk_tokens": 100}, block_size=128)
