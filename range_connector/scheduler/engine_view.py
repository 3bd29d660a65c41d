"""What the scheduler half reads of vLLM's scheduler objects, as protocols (no vLLM import).

The scheduler half runs inside vLLM's engine core and is handed vLLM's ``Request`` and ``SchedulerOutput``; it
reads only the attributes below (vLLM 0.32: ``vllm/v1/request.py``, ``vllm/v1/core/sched/output.py``). Typing
against these protocols keeps :mod:`range_connector.scheduler` importable, and testable, without vLLM.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol


class EngineRequest(Protocol):
    """vLLM's ``Request`` as the lookup and the hand-off read it.

    Attributes:
        request_id: vLLM's request id.
        prompt_token_ids: ``[num_prompt_tokens]`` token ids (``None`` for prompt-embedding requests: no lookup).
        kv_transfer_params: what a disaggregated-prefill proxy attached (untrusted client input), or ``None``.
    """

    request_id: str
    prompt_token_ids: Sequence[int] | None
    kv_transfer_params: dict[str, Any] | None


class StepSchedule(Protocol):
    """vLLM's ``SchedulerOutput`` of one step, as the step planner reads it.

    Attributes:
        scheduled_new_reqs: requests scheduled for the first time (``req_id``, ``block_ids``, ``num_computed_tokens``).
        scheduled_cached_reqs: running or resumed requests (``req_ids``, ``new_block_ids``, ``num_computed_tokens``,
            ``resumed_req_ids``).
        num_scheduled_tokens: ``req_id -> tokens`` computed in this step.
        total_num_scheduled_tokens: their sum.
        finished_req_ids: requests that finished since the last step.
    """

    scheduled_new_reqs: Sequence[Any]
    scheduled_cached_reqs: Any
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    finished_req_ids: set[str]
