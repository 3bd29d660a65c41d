"""Per-request timestamps of the proxy's hand-off, for finding where a P/D request's time to first token goes.

For every generation request the proxy keeps one :class:`HandoffTrace`: when it received the request, sent the
prefill call and read its answer, sent the decode call, got decode's response headers and its first streamed bytes,
and finished. The last ``max_traces`` are served as JSON at ``GET /proxy/traces`` (oldest first), so that a client
that sent ``X-Request-Id`` can join them with what it saw itself (``range_connector.bench.handoff``).

Times are wall-clock seconds (``time.time()``), so that a client on the same host can subtract its own send time;
differences between two stamps of one trace are what is meant to be read. A stamp is ``None`` where the step did
not happen (a fleet request has no prefill call; a failed request stops where it failed). The request id is the
client's ``X-Request-Id`` cut to :data:`MAX_REQUEST_ID_CHARS` characters (it is untrusted input), or the proxy's own.
"""

from __future__ import annotations

import collections
import time
from dataclasses import asdict, dataclass
from typing import Any

__all__ = ["DEFAULT_MAX_TRACES", "MAX_REQUEST_ID_CHARS", "HandoffTrace", "TraceLog"]

#: traces kept by default (about 300 bytes each)
DEFAULT_MAX_TRACES = 4096
#: longest request id stored (a longer ``X-Request-Id`` is cut)
MAX_REQUEST_ID_CHARS = 128


@dataclass(slots=True)
class HandoffTrace:
    """One request's path through the proxy. Wall-clock seconds; ``None``: did not happen.

    Attributes:
        request_id: ``X-Request-Id`` (at most :data:`MAX_REQUEST_ID_CHARS` characters) or the proxy's own id.
        received_s: the request's body was about to be read.
        prefill_url / decode_url: the engines that answered.
        prefill_sent_s: the prefill call was sent.
        prefill_answered_s: the prefill engine's whole answer was read (it holds ``kv_transfer_params``).
        decode_sent_s: the decode call (a fleet engine's call) was sent.
        decode_headers_s: its response headers arrived.
        first_chunk_s: its first body bytes were passed on (streaming: the first event, normally the first token;
            otherwise the whole answer).
        done_s: the proxy finished the request (answer sent or error returned).
        status: the HTTP status returned to the client.
    """

    request_id: str
    received_s: float
    prefill_url: str | None = None
    decode_url: str | None = None
    prefill_sent_s: float | None = None
    prefill_answered_s: float | None = None
    decode_sent_s: float | None = None
    decode_headers_s: float | None = None
    first_chunk_s: float | None = None
    done_s: float | None = None
    status: int | None = None

    @staticmethod
    def now() -> float:
        """The clock of every stamp (wall-clock seconds)."""
        return time.time()

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class TraceLog:
    """The last ``max_traces`` :class:`HandoffTrace` of a proxy (a bounded deque: old ones fall out).

    Args:
        max_traces: traces kept; at least 1.

    Raises:
        ValueError: ``max_traces`` < 1.
    """

    def __init__(self, max_traces: int = DEFAULT_MAX_TRACES) -> None:
        if max_traces < 1:
            raise ValueError(f"max_traces: {max_traces} must be >= 1")
        self._traces: collections.deque[HandoffTrace] = collections.deque(maxlen=max_traces)

    def start(self, request_id: str) -> HandoffTrace:
        """A new trace, received now, kept in the log."""
        trace = HandoffTrace(str(request_id)[:MAX_REQUEST_ID_CHARS], HandoffTrace.now())
        self._traces.append(trace)
        return trace

    def to_list(self) -> list[dict[str, Any]]:
        """Every kept trace as a dict, oldest first."""
        return [trace.to_dict() for trace in self._traces]

    def __len__(self) -> int:
        return len(self._traces)
