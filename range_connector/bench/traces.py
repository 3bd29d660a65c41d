"""Request traces for replay: Mooncake JSONL, Azure CSV, a synthetic generator, and prompts rebuilt as token ids.

A trace is a list of :class:`TraceRequest` (arrival time, prompt and output lengths in tokens, and one *hash id*
per block of ``block_tokens`` prompt tokens). Equal hash ids mean equal block content with equal prefixes before
it, so requests that share leading hash ids share a real token prefix once :class:`PromptBuilder` turns every hash
id into a fixed, seeded block of token ids.

Formats:

* Mooncake (kvcache-ai/Mooncake, FAST'25 trace release): one JSON object per line, ``timestamp`` (ms from trace
  start), ``input_length``, ``output_length`` (tokens) and ``hash_ids`` (one per 512-token block).
* Azure LLM inference traces (Azure/AzurePublicDataset, Splitwise): CSV with ``TIMESTAMP`` (date and time),
  ``ContextTokens``, ``GeneratedTokens``. No prefix information: every request gets hash ids of its own.
* Synthetic: :func:`range_connector.bench.synthetic_trace.synthetic_trace` makes Mooncake-format conversations.

Transforms (each recorded in :attr:`Trace.transforms`, so a report says what was replayed): :func:`slice_trace`
or :func:`sample_conversations`,
:func:`scale_time`, :func:`scale_tokens` (the hash block shrinks with the token counts, so the sharing structure is
kept), :func:`cap_lengths`; :func:`prepare_trace` applies them in that order.

Example::

    trace = prepare_trace(read_trace("mooncake_conversation_trace.jsonl"), start=0, count=100,
                          time_scale=0.1, token_scale=1 / 32, max_model_len=4096)
    builder = PromptBuilder(normal_vocab_token_ids(model_dir), seed=0)
    prompts = [builder.prompt(r) for r in trace.requests]
"""

from __future__ import annotations

import csv
import json
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, replace
from datetime import datetime
from pathlib import Path
from typing import Any

import numpy as np

from range_connector.errors import TraceError

__all__ = [
    "MOONCAKE_BLOCK_TOKENS",
    "PromptBuilder",
    "Trace",
    "TraceRequest",
    "best_prefix_hit_share",
    "cap_lengths",
    "normal_vocab_token_ids",
    "prepare_trace",
    "read_azure",
    "read_mooncake",
    "read_trace",
    "sample_conversations",
    "scale_time",
    "scale_tokens",
    "slice_trace",
    "write_mooncake",
]

#: Tokens per hash id in the Mooncake traces.
MOONCAKE_BLOCK_TOKENS = 512
_AZURE_FIELDS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One request of a trace.

    Attributes:
        arrival_s: Arrival time in seconds from the start of the trace (after any time scaling).
        input_tokens: Prompt length in tokens (>= 1).
        output_tokens: Tokens to generate (``max_tokens``; >= 1).
        hash_ids: ``[ceil(input_tokens / block_tokens)]`` ids, one per prompt block; the last block is cut to
            ``input_tokens``.
    """

    arrival_s: float
    input_tokens: int
    output_tokens: int
    hash_ids: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Trace:
    """A trace and how it was made.

    Attributes:
        requests: In arrival order.
        block_tokens: Tokens per hash id (512 in Mooncake traces; smaller after :func:`scale_tokens`).
        source: File path, or a description of the generator and its arguments.
        format: ``"mooncake"``, ``"azure"`` or ``"synthetic"``.
        transforms: Human-readable description of each transform applied, in order.
    """

    requests: tuple[TraceRequest, ...]
    block_tokens: int
    source: str
    format: str
    transforms: tuple[str, ...] = ()

    def describe(self) -> dict[str, Any]:
        """Summary for reports: counts, totals in tokens, duration in seconds, transforms and the best hit share."""
        reqs = self.requests
        return {
            "source": self.source,
            "format": self.format,
            "block_tokens": self.block_tokens,
            "transforms": list(self.transforms),
            "num_requests": len(reqs),
            "duration_s": (reqs[-1].arrival_s - reqs[0].arrival_s) if reqs else 0.0,
            "input_tokens": sum(r.input_tokens for r in reqs),
            "output_tokens": sum(r.output_tokens for r in reqs),
            "max_input_tokens": max((r.input_tokens for r in reqs), default=0),
            "best_prefix_hit_share": best_prefix_hit_share(self),
        }

    def describe_lines(self) -> list[str]:
        """:meth:`describe` as log lines: one summary line, then one line per transform applied."""
        info = self.describe()
        head = (f"trace: {info['source']} ({info['format']}): {info['num_requests']} requests over "
                f"{info['duration_s']:.1f} s, {info['input_tokens']} prompt and {info['output_tokens']} output tokens, "
                f"longest prompt {info['max_input_tokens']}, at best {info['best_prefix_hit_share']:.1%} from a "
                f"prefix cache")
        return [head] + [f"  transform: {note}" for note in info["transforms"]]


def _num_blocks(num_tokens: int, block_tokens: int) -> int:
    return -(-num_tokens // block_tokens)


def _int_field(value: Any, field: str, where: str, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise TraceError(f"{where}: {field}: {value!r} is not an integer >= {minimum}")
    return value


# ------------------------------------------------------------------------------------------------------ reading
def read_mooncake(path: str | os.PathLike[str]) -> Trace:
    """Read a Mooncake-format JSONL trace.

    Args:
        path: File with one JSON object per line: ``timestamp`` (ms, >= 0, non-decreasing), ``input_length``
            (tokens, >= 1), ``output_length`` (tokens, >= 1), ``hash_ids`` (``[ceil(input_length / 512)]``
            non-negative integers). Blank lines are skipped; other keys are ignored.

    Returns:
        The trace, ``block_tokens`` 512, arrival times in seconds.

    Raises:
        TraceError: A line is not a JSON object or a field is missing or bad (names the file, line and field).
        OSError: The file cannot be read.
    """
    name = Path(path).name
    requests: list[TraceRequest] = []
    previous_ms = 0.0
    with open(path, encoding="utf-8") as trace_file:
        for line_no, line in enumerate(trace_file, start=1):
            if not line.strip():
                continue
            where = f"{name}:{line_no}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise TraceError(f"{where}: not valid JSON ({exc.msg} at column {exc.colno})") from None
            if not isinstance(row, dict):
                raise TraceError(f"{where}: not a JSON object")
            for key in ("timestamp", "input_length", "output_length", "hash_ids"):
                if key not in row:
                    raise TraceError(f"{where}: {key}: missing")
            ts = row["timestamp"]
            if isinstance(ts, bool) or not isinstance(ts, (int, float)) or not math.isfinite(ts) or ts < 0:
                raise TraceError(f"{where}: timestamp: {ts!r} is not a number of milliseconds >= 0")
            if ts < previous_ms:
                raise TraceError(f"{where}: timestamp: {ts} is earlier than the previous line's {previous_ms:g}")
            previous_ms = float(ts)
            input_tokens = _int_field(row["input_length"], "input_length", where, 1)
            output_tokens = _int_field(row["output_length"], "output_length", where, 1)
            ids = row["hash_ids"]
            if not isinstance(ids, list) or any(isinstance(h, bool) or not isinstance(h, int) or h < 0 for h in ids):
                raise TraceError(f"{where}: hash_ids: not a list of non-negative integers")
            expected = _num_blocks(input_tokens, MOONCAKE_BLOCK_TOKENS)
            if len(ids) != expected:
                raise TraceError(f"{where}: hash_ids: {len(ids)} ids, but input_length {input_tokens} needs "
                                 f"{expected} blocks of {MOONCAKE_BLOCK_TOKENS} tokens")
            requests.append(TraceRequest(ts / 1000.0, input_tokens, output_tokens, tuple(ids)))
    if not requests:
        raise TraceError(f"{name}: no requests")
    return Trace(tuple(requests), MOONCAKE_BLOCK_TOKENS, str(path), "mooncake")


def read_azure(path: str | os.PathLike[str], block_tokens: int = MOONCAKE_BLOCK_TOKENS) -> Trace:
    """Read an Azure LLM inference trace (CSV with header ``TIMESTAMP,ContextTokens,GeneratedTokens``).

    The trace carries no prefix information: each request gets hash ids no other request has (no sharing).

    Args:
        path: CSV file; ``TIMESTAMP`` is an ISO date and time (``2023-11-16 18:15:46.6805900``; digits past
            microseconds are dropped), rows in time order; token counts are integers >= 1.
        block_tokens: Tokens per hash id given to the rebuilt prompts.

    Returns:
        The trace, arrival times in seconds from the first row.

    Raises:
        TraceError: A column is missing or a field is bad (names the file, line and field).
        OSError: The file cannot be read.
    """
    name = Path(path).name
    requests: list[TraceRequest] = []
    next_id = 0
    first: datetime | None = None
    previous_s = 0.0
    with open(path, encoding="utf-8", newline="") as trace_file:
        reader = csv.DictReader(trace_file, skipinitialspace=True)
        missing = [f for f in _AZURE_FIELDS if f not in (reader.fieldnames or [])]
        if missing:
            raise TraceError(f"{name}:1: {missing[0]}: column missing (header {reader.fieldnames})")
        for row in reader:
            where = f"{name}:{reader.line_num}"
            raw_ts = (row["TIMESTAMP"] or "").strip()
            try:
                stamp = datetime.fromisoformat(_trim_fraction(raw_ts))
            except ValueError:
                raise TraceError(f"{where}: TIMESTAMP: {raw_ts!r} is not a date and time") from None
            first = stamp if first is None else first
            arrival_s = (stamp - first).total_seconds()
            if arrival_s < previous_s:
                raise TraceError(f"{where}: TIMESTAMP: {raw_ts} is earlier than the previous row")
            previous_s = arrival_s
            counts = []
            for key in _AZURE_FIELDS[1:]:
                text = (row[key] or "").strip()
                try:
                    counts.append(_int_field(int(text), key, where, 1))
                except ValueError:
                    raise TraceError(f"{where}: {key}: {text!r} is not an integer >= 1") from None
            num_blocks = _num_blocks(counts[0], block_tokens)
            requests.append(TraceRequest(arrival_s, counts[0], counts[1], tuple(range(next_id, next_id + num_blocks))))
            next_id += num_blocks
    if not requests:
        raise TraceError(f"{name}: no requests")
    return Trace(tuple(requests), block_tokens, str(path), "azure")


def _trim_fraction(stamp: str) -> str:
    """Keep at most 6 fractional digits (``datetime`` resolution)."""
    head, dot, frac = stamp.partition(".")
    return f"{head}.{frac[:6]}" if dot else head


def read_trace(path: str | os.PathLike[str]) -> Trace:
    """Read a trace by file suffix: ``.jsonl``/``.json`` as Mooncake, ``.csv`` as Azure.

    Raises:
        TraceError: Unknown suffix, or what :func:`read_mooncake` / :func:`read_azure` raise.
    """
    suffix = Path(path).suffix.lower()
    if suffix in (".jsonl", ".json"):
        return read_mooncake(path)
    if suffix == ".csv":
        return read_azure(path)
    raise TraceError(f"{path}: unknown trace format {suffix!r} (expected .jsonl for Mooncake or .csv for Azure)")


def write_mooncake(trace: Trace, path: str | os.PathLike[str]) -> None:
    """Write ``trace`` as Mooncake JSONL (``timestamp`` in whole ms, ``hash_ids`` of ``trace.block_tokens``)."""
    with open(path, "w", encoding="utf-8") as out:
        for r in trace.requests:
            out.write(json.dumps({"timestamp": round(r.arrival_s * 1000.0), "input_length": r.input_tokens,
                                  "output_length": r.output_tokens, "hash_ids": list(r.hash_ids)}) + "\n")


# --------------------------------------------------------------------------------------------------- transforms
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
                        hash_ids=r.hash_ids[:_num_blocks(num_input, trace.block_tokens)])
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


def best_prefix_hit_share(trace: Trace) -> float:
    """Share of prompt tokens an unlimited prefix cache could serve: each request's leading run of hash ids already
    seen in earlier requests, in tokens (capped at its length), over all prompt tokens. 0.0 for an empty trace."""
    seen: set[int] = set()
    hit = total = 0
    for r in trace.requests:
        run = 0
        for h in r.hash_ids:
            if h not in seen:
                break
            run += 1
        hit += min(run * trace.block_tokens, r.input_tokens)
        total += r.input_tokens
        seen.update(r.hash_ids)
    return hit / total if total else 0.0


# ---------------------------------------------------------------------------------------------------- prompts
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
