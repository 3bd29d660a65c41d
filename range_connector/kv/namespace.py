"""Namespace fingerprint and prefix hash chain.

The namespace is everything that changes the bytes of KV for the whole deployment (model and revision, KV dtype,
layout including the CPU instruction-set packing, block size, chunk size, shard count and slicing rule, format
version, a user salt). Per-request inputs that change KV without changing token ids (LoRA adapter, cache salt, media
identities) enter the first link of the request's chain.

Chain: ``h_0 = H(namespace || request_salt)``, ``h_i = H(h_{i-1} || token ids of chunk i as little-endian int32)``,
with ``H`` = BLAKE3 truncated to 16 bytes. It is a cryptographic hash, stable across processes and restarts (never
Python's ``hash()``): a collision here would serve wrong KV (docs/architecture.md, principle 6).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, NewType

import msgpack
import numpy as np
from blake3 import blake3

#: Bump when the byte format of stored values changes: old entries then miss instead of being misread.
FORMAT_VERSION = 2
#: The rule that maps blocks of a chunk to shards (see sharding.py).
SHARD_RULE = "block-round-robin-v1"
HASH_BYTES = 16

ChunkHash = NewType("ChunkHash", bytes)


def namespace_fingerprint(fields: Mapping[str, Any]) -> bytes:
    """Hash a deployment description into the namespace fingerprint.

    Args:
        fields: JSON-like mapping (str keys; str/int/float/bool/list/dict values). Key order does not matter.

    Returns:
        16 bytes.
    """
    packed = msgpack.packb(_canonical(fields), use_bin_type=True)
    return blake3(b"range-connector/namespace\x00" + packed).digest(length=HASH_BYTES)


def _canonical(value: Any) -> Any:
    if isinstance(value, Mapping):
        return [[str(k), _canonical(value[k])] for k in sorted(value, key=str)]
    if isinstance(value, (list, tuple)):
        return [_canonical(v) for v in value]
    if isinstance(value, (str, int, float, bool, bytes)) or value is None:
        return value
    return str(value)


def request_salt(lora_name: str | None, cache_salt: str | None, media_ids: Sequence[str]) -> bytes:
    """Per-request inputs that change KV but not token ids, as bytes for the chain's first link.

    Args:
        lora_name: the adapter's name, or ``None``.
        cache_salt: vLLM's per-request ``cache_salt``, or ``None``.
        media_ids: identities of images or other media in the prompt (vLLM's ``mm_features[i].identifier``), in
            prompt order.
    """
    if not lora_name and not cache_salt and not media_ids:
        return b""
    return msgpack.packb([lora_name or "", cache_salt or "", list(media_ids)], use_bin_type=True)


def prefix_hash_chain(
    namespace: bytes, salt: bytes, token_ids: Sequence[int] | np.ndarray, chunk_tokens: int
) -> list[ChunkHash]:
    """Hash every full chunk of a token sequence.

    Args:
        namespace: the namespace fingerprint.
        salt: :func:`request_salt` of the request.
        token_ids: ``[num_tokens]`` token ids.
        chunk_tokens: tokens per chunk.

    Returns:
        ``num_tokens // chunk_tokens`` hashes; hash ``i`` identifies tokens ``[0, (i + 1) * chunk_tokens)``.
    """
    tokens = np.asarray(token_ids, dtype="<i4")
    num_chunks = len(tokens) // chunk_tokens
    prev = blake3(namespace + b"\x00" + salt).digest(length=HASH_BYTES)
    out: list[ChunkHash] = []
    for i in range(num_chunks):
        h = blake3(prev)
        h.update(tokens[i * chunk_tokens : (i + 1) * chunk_tokens].tobytes())
        prev = h.digest(length=HASH_BYTES)
        out.append(ChunkHash(prev))
    return out


def tail_chunk_hash(chain: Sequence[ChunkHash], namespace: bytes, salt: bytes, token_ids: Sequence[int] | np.ndarray,
                    chunk_tokens: int) -> ChunkHash | None:
    """Hash of a prompt's partial last chunk (the tokens after its last full chunk), or ``None`` if there are none.

    A tail identifies exactly ``tokens[: len(tokens)]`` of this prompt: its hash is domain-separated from full-chunk
    links and covers the tail's length, so a longer prompt never matches it (its chunk at that index holds more
    tokens). Disaggregated prefill stores tails so that a decode engine loads all of a prompt but the last token.

    Args:
        chain: :func:`prefix_hash_chain` of the same tokens.
        namespace: the namespace fingerprint.
        salt: :func:`request_salt` of the request.
        token_ids: ``[num_tokens]`` token ids.
        chunk_tokens: tokens per chunk.
    """
    tokens = np.asarray(token_ids, dtype="<i4")
    start = len(tokens) // chunk_tokens * chunk_tokens
    if start == len(tokens):
        return None
    prev = chain[-1] if chain else blake3(namespace + b"\x00" + salt).digest(length=HASH_BYTES)
    h = blake3(b"range-connector/tail\x00" + prev + int(len(tokens) - start).to_bytes(4, "little"))
    h.update(tokens[start:].tobytes())
    return ChunkHash(h.digest(length=HASH_BYTES))
