"""The disaggregated hand-off (docs/disaggregated.md): what a prefill engine (``kv_producer``) announces when a request
ends, and how long a decode engine (``kv_consumer``) waits for the KV it was announced.

A producer answers ``kv_transfer_params = {"range": {"settings", "num_tokens", "chain_head", ...}}`` for the tokens
it stored (durable: written in the step that computed them, before vLLM answers). A consumer that receives them
waits at most ``remote_wait_s`` per request for that many tokens to be visible, then recomputes what is missing. The
settings both sides share (namespace and the settings behind it) are compared by name: a mismatch is logged and the
KV is not used, never silently mixed. Everything read from ``kv_transfer_params`` is client input: anything that is
not the expected shape is ignored.
"""

from __future__ import annotations

import logging
import time
from collections.abc import MutableMapping
from typing import TYPE_CHECKING, Any

from range_connector.scheduler.planning import RequestState

if TYPE_CHECKING:
    from range_connector.scheduler.engine_view import EngineRequest

logger = logging.getLogger("vllm." + __name__)


def settings_mismatch(theirs: dict[str, Any], ours: dict[str, Any]) -> str:
    """``"key: theirs != ours, ..."`` for every setting both sides name with different values ("" if none)."""
    return ", ".join(f"{k}: {theirs[k]!r} != {ours[k]!r}" for k in sorted(set(theirs) & set(ours))
                     if theirs[k] != ours[k])


class Handoff:
    """Both ends of the hand-off for one engine.

    Args:
        settings: what a consumer must share with a producer (``namespace`` and the settings behind it).
        remote_wait_s: how long a consumer waits for announced KV, per request.
        stats: the scheduler's counters (``remote_waits``, ``remote_wait_timeouts``, ``settings_mismatches``).
    """

    def __init__(self, settings: dict[str, Any], remote_wait_s: float, stats: MutableMapping[str, int]) -> None:
        self.settings = settings
        self.remote_wait_s = remote_wait_s
        self.stats = stats
        self._wait_until: dict[str, float] = {}  # req_id -> when to stop waiting for announced KV (0: not waiting)

    def forget(self, req_id: str) -> None:
        """The request ended."""
        self._wait_until.pop(req_id, None)

    def should_wait(self, request: EngineRequest, hit: int) -> bool:
        """Whether to wait for KV that a producer announced in ``kv_transfer_params`` and that is not all visible yet
        (``hit`` tokens are): at most ``remote_wait_s`` per request, then what is missing is recomputed. A producer
        whose settings differ from ours is logged by name and not waited for."""
        params = getattr(request, "kv_transfer_params", None)
        info = params.get("range") if isinstance(params, dict) else None
        if not isinstance(info, dict) or "num_tokens" not in info:
            return False
        theirs = info.get("settings") or {}
        mismatched = settings_mismatch(theirs, self.settings)
        if mismatched:
            if request.request_id not in self._wait_until:
                self._wait_until[request.request_id] = 0.0
                self.stats["settings_mismatches"] += 1
                logger.error("Range: request %s comes from a producer with other settings (%s); its KV is not used",
                             request.request_id, mismatched)
            return False
        expected = min(int(info["num_tokens"]), len(request.prompt_token_ids or []) - 1)
        if hit >= expected:
            self._wait_until.pop(request.request_id, None)
            return False
        now = time.monotonic()
        until = self._wait_until.setdefault(request.request_id, now + self.remote_wait_s)
        if until and now < until:
            self.stats["remote_waits"] += 1
            return True
        if until:
            self._wait_until[request.request_id] = 0.0
            self.stats["remote_wait_timeouts"] += 1
            logger.warning("Range: request %s: %d of the %d announced tokens arrived within %.1f s; recomputing the "
                           "rest", request.request_id, hit, expected, self.remote_wait_s)
        return False

    def announcement(self, request: EngineRequest, state: RequestState | None, *, can_save: bool,
                     chunk_tokens: int) -> dict[str, Any] | None:
        """``kv_transfer_params`` for a finished request that asked for them (``do_remote_decode`` from a
        disaggregated proxy, or ``range_describe``): ``{"range": {"version", "settings", "num_tokens",
        "chain_head"}}``, the tokens this producer stored for the prompt; ``None`` otherwise. ``range_expect``
        (the consumer's settings, sent by the proxy) is compared with ours and a mismatch is logged by name."""
        params = getattr(request, "kv_transfer_params", None)
        if not isinstance(params, dict) or not (params.get("do_remote_decode") or params.get("range_describe")):
            return None
        info: dict[str, Any] = {"version": 1, "settings": self.settings}
        expect = params.get("range_expect")
        if isinstance(expect, dict):
            mismatched = settings_mismatch(expect, self.settings)
            if mismatched:
                self.stats["settings_mismatches"] += 1
                logger.error("Range: request %s: the consumer's settings differ from this producer's (%s)",
                             request.request_id, mismatched)
        if can_save and state is not None:
            num_tokens = state.num_saved_chunks * chunk_tokens
            head = state.chunk_hashes[state.num_saved_chunks - 1] if state.num_saved_chunks else None
            if state.tail_saved:
                num_tokens, head = len(state.prompt_token_ids), state.tail_hash
            info.update(num_tokens=num_tokens, chain_head=head.hex() if head else None)
        return {"range": info}
