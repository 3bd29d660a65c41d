"""Request traces for replay: the trace types, Mooncake JSONL and Azure CSV, and the best prefix-hit share.

A trace is a list of :class:`TraceRequest` (arrival time, prompt and output lengths in tokens, and one *hash id*
per block of ``block_tokens`` prompt tokens). Equal hash ids mean equal block content with equal prefixes before
it, so requests that share leading hash ids share a real token prefix once
:class:`~range_connector.bench.trace_prompts.PromptBuilder` turns every hash id into a fixed, seeded block of token
ids.

Formats:

* Mooncake (kvcache-ai/Mooncake, FAST'25 trace release): one JSON object per line, ``timestamp`` (ms from trace
  start), ``input_length``, ``output_length`` (tokens) and ``hash_ids`` (one per 512-token block).
* Azure LLM inference traces (Azure/AzurePublicDataset, Splitwise): CSV with ``TIMESTAMP`` (date and time),
  ``ContextTokens``, ``GeneratedTokens``. No prefix information: every request gets hash ids of its own.
* Synthetic: :func:`range_connector.bench.synthetic_trace.synthetic_trace` makes Mooncake-format conversations.

Slicing, sampling and scaling a trace: :mod:`range_connector.bench.trace_transforms`; prompts as token ids:
:mod:`range_connector.bench.trace_prompts`.

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
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from range_connector.errors import TraceError

__all__ = [
    "MOONCAKE_BLOCK_TOKENS",
    "Trace",
    "TraceRequest",
    "best_prefix_hit_share",
    "count_blocks",
    "read_azure",
    "read_mooncake",
    "read_trace",
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


def count_blocks(num_tokens: int, block_tokens: int) -> int:
    """Blocks of ``block_tokens`` that hold ``num_tokens`` tokens (the last one partly filled)."""
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
            expected = count_blocks(input_tokens, MOONCAKE_BLOCK_TOKENS)
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
            num_blocks = count_blocks(counts[0], block_tokens)
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
