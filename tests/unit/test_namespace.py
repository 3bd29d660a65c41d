"""Namespace fingerprint and prefix hash chain: stable across processes, separated by everything that changes KV
bytes, and prefix-closed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from range_connector.kv.namespace import (
    FORMAT_VERSION,
    HASH_BYTES,
    SHARD_RULE,
    namespace_fingerprint,
    prefix_hash_chain,
    request_salt,
)

pytestmark = pytest.mark.timeout(30)

CHUNK_TOKENS = 16

#: Shaped like ``connector.build_namespace``'s fields.
BASE_FIELDS: dict = {
    "format_version": FORMAT_VERSION,
    "model": {"model": "tiny-llama", "revision": "abc123", "dtype": "bfloat16"},
    "kv_spec": {"kv_cache_dtype": "bfloat16", "num_kv_heads": 2, "head_size": 64, "kind": "FullAttentionSpec"},
    "num_layers": 4,
    "packing": "cpu-avx512",
    "block_size": 16,
    "chunk_tokens": CHUNK_TOKENS,
    "num_shards": 1,
    "shard_rule": SHARD_RULE,
    "salt": "",
}

TOKENS = [(i * 7919 + 13) % 32_000 for i in range(CHUNK_TOKENS * 6 + 5)]

#: One field changed at a time; every one changes KV bytes (or their placement), so chains must be disjoint.
NAMESPACE_VARIANTS = {
    "kv_dtype": {"kv_spec": {**BASE_FIELDS["kv_spec"], "kv_cache_dtype": "fp8_e4m3"}},
    "model_dtype": {"model": {**BASE_FIELDS["model"], "dtype": "float16"}},
    "model_revision": {"model": {**BASE_FIELDS["model"], "revision": "def456"}},
    "num_kv_heads": {"kv_spec": {**BASE_FIELDS["kv_spec"], "num_kv_heads": 4}},
    "head_size": {"kv_spec": {**BASE_FIELDS["kv_spec"], "head_size": 128}},
    "num_layers": {"num_layers": 5},
    "packing": {"packing": "cpu-avx2"},
    "block_size": {"block_size": 32},
    "chunk_tokens": {"chunk_tokens": 2 * CHUNK_TOKENS},
    "num_shards": {"num_shards": 2},
    "shard_rule": {"shard_rule": "block-round-robin-v2"},
    "format_version": {"format_version": FORMAT_VERSION + 1},
    "salt": {"salt": "adapter-x"},
}

_CHILD = """
import json, sys
from range_connector.kv.namespace import namespace_fingerprint, prefix_hash_chain, request_salt
fields, tokens, chunk_tokens = json.loads(sys.stdin.read())
ns = namespace_fingerprint(fields)
salt = request_salt("lora-a", "cache-salt", ["img-1", "img-2"])
print(json.dumps([ns.hex(), [h.hex() for h in prefix_hash_chain(ns, b"", tokens, chunk_tokens)],
                  [h.hex() for h in prefix_hash_chain(ns, salt, tokens, chunk_tokens)]]))
"""


def _chain(fields: dict = BASE_FIELDS, tokens=TOKENS, salt: bytes = b"", chunk_tokens: int = CHUNK_TOKENS):
    return prefix_hash_chain(namespace_fingerprint(fields), salt, tokens, chunk_tokens)


def _hex_in_process(fields: dict, tokens: list[int], chunk_tokens: int) -> list:
    ns = namespace_fingerprint(fields)
    salt = request_salt("lora-a", "cache-salt", ["img-1", "img-2"])
    return [
        ns.hex(),
        [h.hex() for h in prefix_hash_chain(ns, b"", tokens, chunk_tokens)],
        [h.hex() for h in prefix_hash_chain(ns, salt, tokens, chunk_tokens)],
    ]


# ---------------------------------------------------------------------- determinism
def test_chain_is_deterministic_and_input_type_independent() -> None:
    first = _chain()

    assert _chain() == first
    assert _chain(tokens=np.array(TOKENS, dtype=np.int64)) == first
    assert _chain(tokens=tuple(TOKENS)) == first
    assert _chain(fields=dict(reversed(list(BASE_FIELDS.items())))) == first  # key order does not matter
    assert all(isinstance(h, bytes) and len(h) == HASH_BYTES for h in first)


@pytest.mark.timeout(60)
def test_case_C01_hashes_are_stable_across_processes_and_hash_seeds() -> None:
    # C01: two engines started without fixing PYTHONHASHSEED must compute the same keys.
    fields = {**BASE_FIELDS, "extra": {"b": [1, 2.5, True, None], "a": {"nested": "x"}}}
    payload = json.dumps([fields, TOKENS, CHUNK_TOKENS])
    expected = _hex_in_process(fields, TOKENS, CHUNK_TOKENS)

    outputs = []
    for seed in ("1", "2"):
        result = subprocess.run(
            [sys.executable, "-c", textwrap.dedent(_CHILD)],
            input=payload,
            env={**os.environ, "PYTHONHASHSEED": seed},
            capture_output=True,
            text=True,
            timeout=50,
            check=False,
        )
        assert result.returncode == 0, result.stderr
        outputs.append(json.loads(result.stdout))

    assert outputs[0] == outputs[1] == expected
    assert len(expected[1]) == len(TOKENS) // CHUNK_TOKENS


# ---------------------------------------------------------------------- namespace separation
@pytest.mark.parametrize("variant", sorted(NAMESPACE_VARIANTS))
def test_case_C26_namespaces_differing_in_one_field_give_disjoint_chains(variant: str) -> None:
    fields = {**BASE_FIELDS, **NAMESPACE_VARIANTS[variant]}
    assert fields != BASE_FIELDS

    base, other = _chain(), _chain(fields=fields)

    assert namespace_fingerprint(fields) != namespace_fingerprint(BASE_FIELDS)
    assert len(base) == len(other) == len(TOKENS) // CHUNK_TOKENS
    assert set(base).isdisjoint(other)


def test_all_namespace_variants_are_pairwise_distinct() -> None:
    fingerprints = [namespace_fingerprint({**BASE_FIELDS, **v}) for v in NAMESPACE_VARIANTS.values()]
    fingerprints.append(namespace_fingerprint(BASE_FIELDS))

    assert len(set(fingerprints)) == len(fingerprints)


def test_value_types_are_part_of_the_fingerprint() -> None:
    # 16 and "16" (or 1 and True) are different descriptions; they must not collide.
    assert namespace_fingerprint({"block_size": 16}) != namespace_fingerprint({"block_size": "16"})
    assert namespace_fingerprint({"flag": 1}) != namespace_fingerprint({"flag": True})
    assert namespace_fingerprint({"a": [1, 2]}) != namespace_fingerprint({"a": [2, 1]})


# ---------------------------------------------------------------------- request salt
SALTS = {
    "lora": request_salt("lora-a", None, []),
    "lora_b": request_salt("lora-b", None, []),
    "cache_salt": request_salt(None, "lora-a", []),
    "media": request_salt(None, None, ["img-1"]),
    "media_other": request_salt(None, None, ["img-2"]),
    "media_two": request_salt(None, None, ["img-1", "img-2"]),
    "media_swapped": request_salt(None, None, ["img-2", "img-1"]),
    "media_joined": request_salt(None, None, ["img-1img-2"]),
    "all": request_salt("lora-a", "s", ["img-1"]),
}


def test_no_salt_equals_empty_salt() -> None:
    assert request_salt(None, None, []) == b""
    assert request_salt("", "", ()) == b""
    assert _chain(salt=request_salt(None, None, [])) == _chain(salt=b"")


@pytest.mark.parametrize("name", sorted(SALTS))
def test_request_salt_separates_chains(name: str) -> None:
    salt = SALTS[name]
    assert salt != b""

    assert set(_chain(salt=salt)).isdisjoint(_chain(salt=b""))


def test_request_salts_are_pairwise_distinct() -> None:
    assert len(set(SALTS.values())) == len(SALTS)
    chains = [_chain(salt=s) for s in SALTS.values()]
    firsts = [c[0] for c in chains]
    assert len(set(firsts)) == len(firsts)


def test_case_C25_same_text_different_images_get_different_keys() -> None:
    a = _chain(salt=request_salt(None, None, ["sha256:aaaa"]))
    b = _chain(salt=request_salt(None, None, ["sha256:bbbb"]))

    assert set(a).isdisjoint(b)


# ---------------------------------------------------------------------- shape and prefix property
@pytest.mark.parametrize("num_tokens", [0, 1, CHUNK_TOKENS - 1, CHUNK_TOKENS, CHUNK_TOKENS + 1, 5 * CHUNK_TOKENS])
def test_number_of_hashes_is_full_chunks(num_tokens: int) -> None:
    assert len(_chain(tokens=TOKENS[:num_tokens])) == num_tokens // CHUNK_TOKENS


def test_changing_one_token_changes_its_chunk_and_every_later_hash() -> None:
    base = _chain()
    changed_tokens = list(TOKENS)
    changed_tokens[2 * CHUNK_TOKENS + 3] += 1

    changed = _chain(tokens=changed_tokens)

    assert changed[:2] == base[:2]
    assert all(a != b for a, b in zip(changed[2:], base[2:]))


@settings(max_examples=150, deadline=None)
@given(
    tokens=st.lists(st.integers(min_value=0, max_value=2**31 - 1), max_size=300),
    chunk_tokens=st.integers(min_value=1, max_value=64),
    cut=st.integers(min_value=0, max_value=300),
    salt=st.binary(max_size=8),
)
def test_chain_of_a_prefix_is_a_prefix_of_the_chain(
    tokens: list[int], chunk_tokens: int, cut: int, salt: bytes
) -> None:
    ns = namespace_fingerprint(BASE_FIELDS)
    full = prefix_hash_chain(ns, salt, tokens, chunk_tokens)
    prefix = prefix_hash_chain(ns, salt, tokens[:cut], chunk_tokens)

    assert len(full) == len(tokens) // chunk_tokens
    assert len(prefix) == min(cut, len(tokens)) // chunk_tokens
    assert prefix == full[: len(prefix)]
    assert len(set(full)) == len(full)  # a chain never repeats a hash
