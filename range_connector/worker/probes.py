"""Background probes of a refused tier (worker side): re-measure its speed without making a request pay for it.

While the cost gate refuses a tier (``load_mode`` ``"auto"``), the only way to notice that it recovered is to read
from it. A probe reads one stored chunk (every layer and plane of its byte range, one batched ranged read per shard,
the shards at the same time) into a scratch buffer that nothing else sees, on a thread of its own; the request that
triggered it is recomputed as if refused. The time from submission to the last byte goes back to the scheduler
(:attr:`~range_connector.kv.metadata.RangeWorkerMetadata.probe_timings`), which learns the tier's line from it
(:meth:`~range_connector.cost.estimators.TierEstimator.observe` with ``probe``). The gate bounds the rate
(``probe_interval_s``, ``probe_every_refusals``; one probe in flight at a time).

A probe that finds its bytes gone, or meets a backend error other than a timeout, measures nothing and is dropped; a
timeout (the tier's own ``timeout_s``) reports the time it took as a lower bound.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Executor

from range_connector.backends.base import Backend, RangeRead
from range_connector.errors import BackendError, BackendTimeoutError
from range_connector.kv.tickets import Ticket


def chunk_reads(t: Ticket, dest: memoryview) -> list[RangeRead]:
    """The ranged reads of one chunk's blocks in every layer and plane of its stripe, into ``dest``.

    Args:
        t: the chunk's ticket on one shard.
        dest: writable, ``num_layers * num_planes * num_blocks * row_bytes`` bytes.

    Raises:
        ValueError: ``dest`` has another size.
    """
    length = t.num_blocks * t.row_bytes
    if dest.nbytes != t.num_layers * t.num_planes * length:
        raise ValueError(f"probe buffer of {dest.nbytes} bytes for a chunk of {t.num_layers * t.num_planes * length}")
    reads, pos = [], 0
    for layer_idx in range(t.num_layers):
        for p in range(t.num_planes):
            reads.append(RangeRead(t.stripe_id, layer_idx, (p * t.stripe_blocks + t.block_offset) * t.row_bytes,
                                   length, t.layer_bytes, dest[pos:pos + length]))
            pos += length
    return reads


def probe_chunk(backends: list[Backend], tickets: tuple[Ticket, ...], readers: Executor, *,
                clock: Callable[[], float] = time.monotonic) -> tuple[int, float, bool] | None:
    """Read one chunk from every shard at once; ``(bytes per shard, seconds, complete)`` or ``None``.

    Args:
        backends: ``[num_shards]`` backends (the worker's).
        tickets: ``[num_shards]`` tickets of the chunk.
        readers: runs one shard's read each (the worker's per-shard pool).
        clock: seconds, on which the probe is timed (tests pass a virtual one: what the gate then decides must not
            depend on how busy the test machine is).

    Returns:
        ``complete`` False: a shard timed out after ``seconds`` (a lower bound on the tier's time). ``None``: the
        bytes were gone or a shard failed otherwise (nothing measured).
    """
    def one(s: int) -> bool | None:
        t = tickets[s]
        dest = memoryview(bytearray(t.num_layers * t.num_planes * t.num_blocks * t.row_bytes))
        try:
            return all(backends[s].read_ranges(chunk_reads(t, dest)))
        except BackendTimeoutError:
            return False
        except (BackendError, ValueError):
            return None

    start = clock()
    if len(tickets) == 1:
        results = [one(0)]
    else:
        results = [f.result() for f in [readers.submit(one, s) for s in range(len(tickets))]]
    seconds = clock() - start
    if any(r is None for r in results):
        return None
    t = tickets[0]
    return t.num_layers * t.num_planes * t.num_blocks * t.row_bytes, seconds, all(results)
