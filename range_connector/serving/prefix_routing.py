"""Cache-aware routing for the proxy: which engine already holds the longest prefix of a prompt.

The proxy cannot see an engine's KV cache, so it keeps its own record of what it sent where. A prompt is cut into
blocks and each block gets a *prefix hash* that covers it and everything before it (a chain, like vLLM's block
hashes), so that two prompts share the hashes of exactly their common leading blocks. For each engine a
:class:`PrefixRecord` remembers the prefix hashes of the prompts it was sent, least recently used first out, and
:meth:`PrefixRecord.matched_blocks` counts how many leading blocks of a new prompt an engine has seen.

What a block is depends on what the client sent (the proxy has no tokenizer):

* ``prompt`` as token ids (``[int, ...]``): :data:`TOKENS_PER_BLOCK` tokens a block;
* ``prompt`` as text, or chat ``messages``: :data:`BYTES_PER_BLOCK` bytes of its UTF-8 (messages: their canonical
  JSON) a block, about as many tokens as a token block at 4 bytes a token;
* a batch (a list of prompts): its first prompt.

Anything else (no prompt, a shape the proxy does not know) has no prefix hashes and is routed by load alone. The
``model`` field and any ``cache_salt`` are hashed into the first block: prompts of different models or tenants never
match. The record is an approximation of the engine's cache: an engine may have evicted what the record still
holds, or hold a prefix computed for a request another proxy sent; a wrong guess costs a recompute, never a wrong
token, since the engine decides for itself what it has.
"""

from __future__ import annotations

import collections
import json
from collections.abc import Mapping
from typing import Any

import xxhash

__all__ = ["BYTES_PER_BLOCK", "DEFAULT_RECORD_BLOCKS", "TOKENS_PER_BLOCK", "PrefixRecord", "prompt_prefix_hashes"]

TOKENS_PER_BLOCK = 16
"""Tokens a block of a token-id prompt (vLLM's default block size)."""
BYTES_PER_BLOCK = 64
"""UTF-8 bytes a block of a text prompt or of chat messages."""
DEFAULT_RECORD_BLOCKS = 1 << 18
"""Prefix hashes one engine's record keeps (about 4 M tokens of prompts; 8 bytes a hash plus the dict's own)."""
MAX_PROMPT_BLOCKS = 1 << 16
"""Blocks hashed of one prompt at most (a longer one is routed on its first blocks)."""


def _prompt_units(body: Mapping[str, Any]) -> tuple[list[bytes], bytes] | None:
    """The blocks of the prompt in ``body`` and the seed of its chain, or ``None`` when it has no known shape."""
    seed = json.dumps([body.get("model"), body.get("cache_salt")], default=str).encode()
    messages = body.get("messages")
    if messages is not None:
        try:
            raw = json.dumps(messages, sort_keys=True, ensure_ascii=False, default=str).encode()
        except (TypeError, ValueError):
            return None
        return _cut(raw, BYTES_PER_BLOCK), seed
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch: its first prompt
    if isinstance(prompt, str):
        return _cut(prompt.encode("utf-8", "surrogatepass"), BYTES_PER_BLOCK), seed
    if isinstance(prompt, list) and prompt and all(type(token) is int for token in prompt[:TOKENS_PER_BLOCK]):
        blocks = []
        for start in range(0, min(len(prompt), MAX_PROMPT_BLOCKS * TOKENS_PER_BLOCK), TOKENS_PER_BLOCK):
            block = prompt[start:start + TOKENS_PER_BLOCK]
            if not all(type(token) is int for token in block):
                break
            blocks.append(b",".join(str(token).encode() for token in block))
        return blocks, seed
    return None


def _cut(raw: bytes, size: int) -> list[bytes]:
    return [raw[start:start + size] for start in range(0, min(len(raw), MAX_PROMPT_BLOCKS * size), size)]


def prompt_prefix_hashes(body: Mapping[str, Any]) -> list[int]:
    """The prefix hashes of the prompt in a client's request body, first block first.

    Args:
        body: A ``/v1/completions`` or ``/v1/chat/completions`` request body (untrusted: any JSON object).

    Returns:
        One 64-bit xxh3 hash per whole or partial block (at most :data:`MAX_PROMPT_BLOCKS`); hash ``i`` covers
        blocks ``0..i``, seeded with the body's ``model`` and ``cache_salt``. Empty when the body has no prompt of
        a known shape. Never raises.
    """
    cut = _prompt_units(body)
    if cut is None:
        return []
    blocks, seed = cut
    hashes: list[int] = []
    previous = xxhash.xxh3_64_intdigest(seed)
    for block in blocks:
        previous = xxhash.xxh3_64_intdigest(previous.to_bytes(8, "little") + block)
        hashes.append(previous)
    return hashes


class PrefixRecord:
    """The prefix hashes one engine was sent, bounded, least recently used out first.

    Args:
        max_blocks: Prefix hashes kept (> 0).

    Raises:
        ValueError: ``max_blocks`` is not positive.
    """

    def __init__(self, max_blocks: int = DEFAULT_RECORD_BLOCKS) -> None:
        if max_blocks <= 0:
            raise ValueError(f"max_blocks must be positive, not {max_blocks}")
        self.max_blocks = max_blocks
        self._hashes: collections.OrderedDict[int, None] = collections.OrderedDict()

    def __len__(self) -> int:
        return len(self._hashes)

    def matched_blocks(self, hashes: list[int]) -> int:
        """How many leading blocks of a prompt (its :func:`prompt_prefix_hashes`) this engine was sent."""
        matched = 0
        for value in hashes:
            if value not in self._hashes:
                break
            matched += 1
        return matched

    def add(self, hashes: list[int]) -> None:
        """Remember a prompt sent to this engine (its blocks become the most recently used, its first block most)."""
        for value in reversed(hashes[:self.max_blocks]):  # leading blocks go out last: they are what matches
            self._hashes[value] = None
            self._hashes.move_to_end(value)
        while len(self._hashes) > self.max_blocks:
            self._hashes.popitem(last=False)
