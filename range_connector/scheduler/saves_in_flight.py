"""Saves in flight: the chunks the scheduler asked the workers to write in the background (``save_mode``
``"async"``) whose writes have not all been reported ended.

With background saves, a request can arrive while the save of its prefix is still being written: its lookup would
miss chunks that are a few milliseconds from being stored, and it would compute and save them again. The scheduler
knows which chunks it asked to be saved (it plans every save) and learns from the workers' reports when each write
ended (``RangeWorkerMetadata.saved`` and ``unsaved``). So a request whose prompt has a chunk in flight past its local
hit is asked again at the next step (``get_num_new_matched_tokens`` returns ``None``; vLLM runs the other requests
meanwhile), until those writes ended, at most ``lookup_wait_s`` from its first wait. A wait that reaches that bound
is counted (``save_wait_timeouts``) and the request goes on with what is stored.

A chunk leaves the record when every saving rank reported it stored, or any one reported it not stored (the chunk is
then incomplete on the tier; waiting longer gains nothing), or ``lookup_wait_s`` after it was planned (a report that
never came: a worker that died, a reset). The clock is injected, so that tests step it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, MutableMapping, Sequence

from range_connector.kv.namespace import ChunkHash

#: chunks the record keeps at most (the oldest are forgotten first: a wait is only ever shortened)
MAX_CHUNKS_IN_FLIGHT = 1 << 16


class SavesInFlight:
    """Which chunks are being saved in the background, and which requests wait for them.

    Args:
        num_saving_ranks: workers that each write and report their own slice of every chunk (a chunk is stored
            once that many reported it).
        wait_s: the longest a request waits for saves in flight, in seconds, and the longest a planned chunk is
            kept without a report (``lookup_wait_s``).
        stats: the scheduler's counters (``save_waits``: steps a request was asked again for; ``save_wait_timeouts``:
            requests whose wait reached ``wait_s``).
        clock: monotonic seconds (injected by tests).

    Raises:
        ValueError: ``num_saving_ranks`` is less than 1, or ``wait_s`` is negative.
    """

    def __init__(self, num_saving_ranks: int, wait_s: float, stats: MutableMapping[str, int],
                 clock: Callable[[], float] = time.monotonic) -> None:
        if num_saving_ranks < 1:
            raise ValueError(f"num_saving_ranks must be at least 1, not {num_saving_ranks}")
        if wait_s < 0:
            raise ValueError(f"wait_s must not be negative, not {wait_s}")
        self.num_saving_ranks = num_saving_ranks
        self.wait_s = wait_s
        self.stats = stats
        self.clock = clock
        stats.setdefault("save_waits", 0)
        stats.setdefault("save_wait_timeouts", 0)
        #: chunk hash -> [ranks that reported it stored, monotonic time it was (last) planned], oldest first
        self._chunks: dict[ChunkHash, list] = {}
        #: req_id -> monotonic time of its first wait
        self._waiting_since: dict[str, float] = {}

    def __len__(self) -> int:
        """Chunks in flight (after dropping those planned more than ``wait_s`` ago)."""
        self._expire()
        return len(self._chunks)

    def planned(self, chunk_hashes: Iterable[ChunkHash]) -> None:
        """The scheduler asked the workers to save these chunks in this step."""
        now = self.clock()
        for h in chunk_hashes:
            self._chunks.pop(h, None)  # (planned again: its reports start over, at the end of the order)
            self._chunks[h] = [0, now]
        while len(self._chunks) > MAX_CHUNKS_IN_FLIGHT:
            del self._chunks[next(iter(self._chunks))]

    def learn(self, saved: Sequence[ChunkHash], unsaved: Sequence[ChunkHash]) -> None:
        """One step's worker reports: ``saved``, one entry per rank that stored a chunk on every shard; ``unsaved``,
        one per rank whose write of a chunk ended without storing it (skipped or failed)."""
        for h in unsaved:
            self._chunks.pop(h, None)
        for h in saved:
            entry = self._chunks.get(h)
            if entry is None:
                continue
            entry[0] += 1
            if entry[0] >= self.num_saving_ranks:
                del self._chunks[h]

    def should_wait(self, req_id: str, chunk_hashes: Sequence[ChunkHash], first_chunk_idx: int) -> bool:
        """Whether the request is to be asked again later: one of its chunks from ``first_chunk_idx`` on (the first
        chunk not covered by its local hit) is in flight, and it has waited less than ``wait_s``. Counts each wait
        and each wait that reached the bound."""
        self._expire()
        if not any(h in self._chunks for h in chunk_hashes[max(0, first_chunk_idx):]):
            self._waiting_since.pop(req_id, None)
            return False
        now = self.clock()
        since = self._waiting_since.setdefault(req_id, now)
        if now - since >= self.wait_s:
            self._waiting_since.pop(req_id, None)
            self.stats["save_wait_timeouts"] += 1
            return False
        self.stats["save_waits"] += 1
        return True

    def forget(self, req_id: str) -> None:
        """The request ended (or was admitted): drop its wait."""
        self._waiting_since.pop(req_id, None)

    def clear(self) -> None:
        """The connector's cache was reset: the writes in flight store nothing (their epoch is gone)."""
        self._chunks.clear()
        self._waiting_since.clear()

    def _expire(self) -> None:
        """Drop chunks planned ``wait_s`` ago or more (their report never came)."""
        cutoff = self.clock() - self.wait_s
        while self._chunks:
            h = next(iter(self._chunks))
            if self._chunks[h][1] > cutoff:
                break
            del self._chunks[h]
