"""Prompts rebuilt as token ids from a trace's hash ids, drawn from a tokenizer's normal vocabulary.

:class:`PromptBuilder` maps every hash id to a fixed block of token ids that depends only on ``(seed, block
tokens, hash id)``, so requests of a :class:`~range_connector.bench.traces.Trace` that share leading hash ids share
a real token prefix, the same in every process and run. :func:`normal_vocab_token_ids` gives the ids to draw from
(a tokenizer's vocabulary without its special tokens; ``transformers`` is imported only for a model directory).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from range_connector.bench.traces import Trace, TraceRequest
from range_connector.errors import TraceError

__all__ = ["PromptBuilder", "normal_vocab_token_ids"]


def normal_vocab_token_ids(tokenizer_or_model_dir: Any) -> list[int]:
    """Token ids of the tokenizer's normal vocabulary: every id in its vocabulary except special tokens.

    Args:
        tokenizer_or_model_dir: A Hugging Face tokenizer, or a model directory (or name) to load one from.

    Returns:
        Sorted token ids.
    """
    tokenizer = tokenizer_or_model_dir
    if isinstance(tokenizer, (str, os.PathLike)):
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(tokenizer))
    special = set(tokenizer.all_special_ids)
    return sorted(set(tokenizer.get_vocab().values()) - special)


class PromptBuilder:
    """Rebuild prompts as token ids: hash id ``h`` is always the same block of ids drawn from ``vocab_token_ids``.

    Block ``h`` of ``B`` tokens is drawn uniformly (with replacement) by ``numpy.random.default_rng([seed, B, h])``,
    so it depends only on ``(seed, B, h)``: the same across processes and runs. A prompt is its blocks in order,
    the last cut to ``input_tokens``; prompts with equal leading hash ids share a token prefix.

    Args:
        vocab_token_ids: Ids to draw from (:func:`normal_vocab_token_ids`).
        seed: Seed of the whole mapping (another seed gives prompts sharing nothing with these).

    Raises:
        TraceError: ``vocab_token_ids`` empty.
    """

    def __init__(self, vocab_token_ids: Sequence[int], seed: int = 0) -> None:
        if len(vocab_token_ids) == 0:
            raise TraceError("vocab_token_ids: empty")
        self._vocab = np.asarray(vocab_token_ids, dtype=np.int64)
        self.seed = seed
        self._blocks: dict[tuple[int, int], np.ndarray] = {}

    def block(self, hash_id: int, block_tokens: int) -> np.ndarray:
        """Token ids of block ``hash_id``: ``[block_tokens]`` int64."""
        key = (hash_id, block_tokens)
        ids = self._blocks.get(key)
        if ids is None:
            rng = np.random.default_rng([self.seed, block_tokens, hash_id])
            ids = self._vocab[rng.integers(0, len(self._vocab), size=block_tokens)]
            self._blocks[key] = ids
        return ids

    def prompt(self, request: TraceRequest, block_tokens: int) -> list[int]:
        """Prompt of ``request`` as ``[input_tokens]`` token ids.

        Raises:
            TraceError: The hash ids cover fewer than ``input_tokens`` tokens.
        """
        if len(request.hash_ids) * block_tokens < request.input_tokens:
            raise TraceError(f"hash_ids: {len(request.hash_ids)} blocks of {block_tokens} tokens cannot hold "
                             f"input_length {request.input_tokens}")
        blocks = [self.block(h, block_tokens) for h in request.hash_ids]
        return np.concatenate(blocks)[:request.input_tokens].tolist() if blocks else []

    def prompts(self, trace: Trace) -> list[list[int]]:
        """Prompts of every request of ``trace``, in order."""
        return [self.prompt(r, trace.block_tokens) for r in trace.requests]
