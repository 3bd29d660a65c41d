"""Trace transforms for replay: slice, sample whole conversations, scale time and tokens, cap lengths.

Each transform returns a new :class:`~range_connector.bench.traces.Trace` and records itself in
:attr:`~range_connector.bench.traces.Trace.transforms`, so a report says what was replayed: :func:`slice_trace` or
:func:`sample_conversations`, :func:`scale_time`, :func:`scale_tokens` (the hash block shrinks with the token
counts, so the sharing structure is kept), :func:`cap_lengths`; :func:`prepare_trace` applies them in that order.
A bad argument raises :class:`~range_connector.errors.TraceError` naming it.
"""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np

from range_connector.bench.traces import Trace, count_blocks
from range_connector.errors import TraceError

__all__ = ["cap_lengths", "prepare_trace", "sample_conversations", "scale_time", "scale_tokens", "slice_trace"]


def slice_trace(trace: Trace, start: int = 0, count: int | None = None) -> Trace:
    """Keep requests ``[start, start + count)`` and shift arrivals so that the first is at 0 s.

    Raises:
        TraceError: ``start`` or ``count`` negative, or the slice is empty.
    """
    if start < 0 or (count is not None and count < 1):
        raise TraceError(f"slice: start {start} must be >= 0 and count {count} >= 1")
    reqs = trace.requests[start:None if count is None else start + count]
    if not reqs:
        raise TraceError(f"slice: start {start} is past the trace's {len(trace.requests)} requests")
    t0 = reqs[0].arrival_s
    reqs = tuple(replace(r, arrival_s=r.arrival_s - t0) for r in reqs)
    note = f"slice: requests {start}..{start + len(reqs) - 1} of {len(trace.requests)}, arrivals shifted by -{t0:g} s"
    return replace(trace, requests=reqs, transforms=(*trace.transforms, note))


def sample_conversations(trace: Trace, count: int, *, seed: int = 0, key_blocks: int = 2) -> Trace:
    """Keep about ``count`` requests made of whole multi-turn conversations, in their original timing.

    A contiguous slice of a real trace holds few turns of one conversation (in the Mooncake conversation trace the
    median gap between turns is about 2 minutes, while 100 requests arrive in about 30 s), so its prompts share
    almost nothing. This takes conversations instead: requests are grouped by their first ``key_blocks`` hash ids
    (equal ids mean an equal prefix), groups with at least two requests are drawn in a seeded random order and
    kept whole until ``count`` requests are reached (the last group is cut), then arrivals are shifted so that the
    first is at 0 s. Combine with :func:`scale_time` to compress the hour they span.

    Raises:
        TraceError: ``count`` < 1, ``key_blocks`` < 1, or the trace has no request sharing a prefix.
    """
    if count < 1 or key_blocks < 1:
        raise TraceError(f"sample_conversations: count {count} and key_blocks {key_blocks} must be >= 1")
    groups: dict[tuple[int, ...], list[int]] = {}
    for i, r in enumerate(trace.requests):
        groups.setdefault(r.hash_ids[:key_blocks], []).append(i)
    multi = [idx for idx in groups.values() if len(idx) >= 2]
    if not multi:
        raise TraceError(f"sample_conversations: no two requests of {trace.source} share {key_blocks} hash blocks")
    order = np.random.default_rng(seed).permutation(len(multi))
    kept: list[int] = []
    num_groups = 0
    for g in order:
        kept.extend(multi[g][:count - len(kept)])
        num_groups += 1
        if len(kept) >= count:
            break
    reqs = [trace.requests[i] for i in sorted(kept)]
    t0 = reqs[0].arrival_s
    reqs = [replace(r, arrival_s=r.arrival_s - t0) for r in reqs]
    note = (f"conversations: {len(reqs)} requests of {num_groups} conversations (requests sharing their first "
            f"{key_blocks} hash blocks; seed {seed}) out of {len(trace.requests)}, arrivals shifted by -{t0:g} s")
    return replace(trace, requests=tuple(reqs), transforms=(*trace.transforms, note))


def scale_time(trace: Trace, factor: float) -> Trace:
    """Multiply every arrival time by ``factor`` (0.1: ten times faster than recorded).

    Raises:
        TraceError: ``factor`` not finite and > 0.
    """
    if not (math.isfinite(factor) and factor > 0):
        raise TraceError(f"time_scale: {factor!r} must be a finite number > 0")
    reqs = tuple(replace(r, arrival_s=r.arrival_s * factor) for r in trace.requests)
    return replace(trace, requests=reqs, transforms=(*trace.transforms, f"time x {factor:g}"))


def scale_tokens(trace: Trace, factor: float, *, scale_output: bool = True) -> Trace:
    """Multiply prompt (and output) lengths by ``factor``; the hash block shrinks with them.

    The new block is ``round(block_tokens * factor)`` tokens and the factor actually applied is that over the
    old block (1/32 of 512 is exactly 16). Each prompt keeps its hash ids: its length is scaled, then kept within
    its blocks, ``[(n - 1) * block + 1, n * block]`` for ``n`` ids, so sharing stays as in the original.
    Output lengths are scaled by the same factor (at least 1) unless ``scale_output`` is false.

    Raises:
        TraceError: ``factor`` is not > 0 or makes the block smaller than one token.
    """
    new_block = round(trace.block_tokens * factor) if math.isfinite(factor) and factor > 0 else 0
    if new_block < 1:
        raise TraceError(f"token_scale: {factor!r} leaves less than one token of a {trace.block_tokens}-token block")
    applied = new_block / trace.block_tokens
    reqs = []
    for r in trace.requests:
        n = len(r.hash_ids)
        num_input = min(max(round(r.input_tokens * applied), (n - 1) * new_block + 1), n * new_block)
        num_output = max(1, round(r.output_tokens * applied)) if scale_output else r.output_tokens
        reqs.append(replace(r, input_tokens=num_input, output_tokens=num_output))
    note = (f"tokens x {applied:g} (hash block {trace.block_tokens} -> {new_block} tokens; "
            f"output lengths {'scaled too' if scale_output else 'unchanged'})")
    return replace(trace, requests=tuple(reqs), block_tokens=new_block, transforms=(*trace.transforms, note))


def cap_lengths(trace: Trace, max_model_len: int) -> Trace:
    """Make every request fit ``max_model_len`` tokens (prompt + output), as vLLM requires.

    Output is cut to at most ``max_model_len // 2`` tokens, then the prompt to ``max_model_len - output`` (its
    hash ids with it): the prefix, and so the sharing, is kept.

    Raises:
        TraceError: ``max_model_len`` < 2.
    """
    if max_model_len < 2:
        raise TraceError(f"max_model_len: {max_model_len} must be >= 2")
    reqs, num_capped = [], 0
    for r in trace.requests:
        num_output = min(r.output_tokens, max_model_len // 2)
        num_input = min(r.input_tokens, max_model_len - num_output)
        if (num_input, num_output) != (r.input_tokens, r.output_tokens):
            num_capped += 1
            r = replace(r, input_tokens=num_input, output_tokens=num_output,
                        hash_ids=r.hash_ids[:count_blocks(num_input, trace.block_tokens)])
        reqs.append(r)
    note = f"capped to max_model_len {max_model_len}: {num_capped} of {len(reqs)} requests shortened"
    return replace(trace, requests=tuple(reqs), transforms=(*trace.transforms, note))


def prepare_trace(trace: Trace, *, start: int = 0, count: int | None = None, time_scale: float = 1.0,
                  token_scale: float = 1.0, scale_output: bool = True, max_model_len: int | None = None,
                  conversations: bool = False, seed: int = 0) -> Trace:
    """Apply :func:`slice_trace` (or, with ``conversations``, :func:`sample_conversations` of ``count`` requests
    drawn with ``seed``; ``start`` is then unused), :func:`scale_time`, :func:`scale_tokens` and
    :func:`cap_lengths` in that order (a transform whose argument is neutral is skipped, except the first, which
    always rebases time to 0).

    Raises:
        TraceError: A bad argument (named in the message).
    """
    if conversations:
        trace = sample_conversations(trace, count or len(trace.requests), seed=seed)
    else:
        trace = slice_trace(trace, start, count)
    if time_scale != 1.0:
        trace = scale_time(trace, time_scale)
    if token_scale != 1.0:
        trace = scale_tokens(trace, token_scale, scale_output=scale_output)
    if max_model_len is not None:
        trace = cap_lengths(trace, max_model_len)
    return trace
