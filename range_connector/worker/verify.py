"""Checksum checks of a load job's layer groups that were read into a bank or straight into the KV cache.

A segment that holds a whole stripe is verified once per layer against the stripe's per-layer checksum; a chunk of
a verified segment needs no check of its own, and a chunk of a failed one is checked alone, so that only the bad
chunks fail (and are dropped where they are stored). Checks run before a layer group is handed to attention.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
import xxhash

logger = logging.getLogger("vllm.range_connector.worker.loads")


def verify_group(job: Any, group: range, sums_of: Callable[[range, int, int], list[int]]) -> None:
    """Segments that hold a whole stripe are verified once per layer; a chunk of a verified segment needs no
    check of its own, a chunk of a failed one is checked alone (to fail only the bad chunks).

    Args:
        job: the :class:`~range_connector.worker.loads.LoadJob` whose group it is (its segments, plan and failures).
        group: the layer indices of the group.
        sums_of: ``sums_of(group, first_row, num_rows)`` -> ``[len(group)]`` xxh3 of those rows of every plane.
    """
    whole_ok: dict[tuple[int, str], bool] = {}
    for seg in job.segments:
        t = seg.ticket
        if t.stripe_checksums and seg.first_block == 0 and seg.num_blocks == t.stripe_blocks:
            sums = sums_of(group, seg.bank_row, seg.num_blocks)
            whole_ok[(seg.shard_idx, t.stripe_id)] = sums == [t.stripe_checksums[i] for i in group]
    if len(whole_ok) == len(job.segments) and all(whole_ok.values()):
        return  # every segment is a whole stripe that verified: so is every chunk in it
    for req, chunk, parts, _src, _dst in job._plan:
        if not job._alive(req, chunk):
            continue
        for s, t, seg in parts:
            if whole_ok.get((s, t.stripe_id)):
                continue
            rel = seg.bank_row + t.block_offset - seg.first_block
            if sums_of(group, rel, t.num_blocks) != [t.checksums[i] for i in group]:
                logger.warning("Range load: checksum mismatch in stripe %s layers %d-%d blocks [%d, %d)",
                               t.stripe_id, group.start, group.stop - 1, t.block_offset,
                               t.block_offset + t.num_blocks)
                job.w.stats.add("load_integrity_errors")
                job.w.drop(chunk.chunk_hash, s)
                job._fail(req.req_id, chunk.chunk_idx)
                break

def bank_sums(buf: torch.Tensor, group: range, first_row: int, num_rows: int, num_planes: int, region_bytes: int,
          row_bytes: int) -> list[int]:
    """xxh3 of rows ``[first_row, first_row + num_rows)`` of every plane, per layer of the group."""
    mv = memoryview(buf.numpy()).cast("B")
    out = []
    for layer_idx in group:
        h = xxhash.xxh3_64()
        for p in range(num_planes):
            start = ((layer_idx - group.start) * num_planes + p) * region_bytes + first_row * row_bytes
            h.update(mv[start:start + num_rows * row_bytes])
        out.append(h.intdigest())
    return out
