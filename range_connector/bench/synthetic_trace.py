"""A deterministic synthetic trace in the Mooncake format: multi-turn conversations over a few shared system
prompts, with Poisson arrivals (for the demo and for tests; real traces are read by
:mod:`range_connector.bench.traces`).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from range_connector.bench.traces import MOONCAKE_BLOCK_TOKENS, Trace, TraceRequest
from range_connector.errors import TraceError

__all__ = ["synthetic_trace"]


def _num_blocks(num_tokens: int, block_tokens: int) -> int:
    return -(-num_tokens // block_tokens)

def synthetic_trace(num_requests: int = 100, *, seed: int = 0, request_rate_per_s: float = 1.0,
                    num_system_prompts: int = 3, system_prompt_blocks: tuple[int, int] = (2, 8),
                    first_user_tokens: tuple[int, int] = (512, 8192), next_user_tokens: tuple[int, int] = (64, 2048),
                    output_tokens: tuple[int, int] = (16, 512), new_conversation_share: float = 0.4,
                    max_turns: int = 6, block_tokens: int = MOONCAKE_BLOCK_TOKENS) -> Trace:
    """A deterministic Mooncake-format trace of multi-turn conversations sharing a few system prompts.

    Arrivals are a Poisson process of ``request_rate_per_s``. Each arrival either opens a conversation (with
    probability ``new_conversation_share``, or when none is open): one of ``num_system_prompts`` system prompts
    (whole blocks; prompt ``k`` chosen with weight ``1 / (k + 1)``) followed by a new user message; or continues an
    open conversation, chosen uniformly: the previous prompt, the previous answer and a new user message, so it
    shares every full block of the previous prompt (the previous last, partial block changes, as in Mooncake).
    A conversation closes after a turn count drawn from ``[1, max_turns]``. Lengths in tokens are drawn
    log-uniformly from the given ``(low, high)`` ranges (inclusive).

    Returns:
        The trace, ``format`` ``"synthetic"``, ``source`` naming the arguments.

    Raises:
        TraceError: A count or rate is not positive, or a range is empty.
    """
    for key, value in (("num_requests", num_requests), ("num_system_prompts", num_system_prompts),
                       ("max_turns", max_turns), ("block_tokens", block_tokens)):
        if value < 1:
            raise TraceError(f"{key}: {value} must be >= 1")
    if not request_rate_per_s > 0:
        raise TraceError(f"request_rate_per_s: {request_rate_per_s} must be > 0")
    for key, (low, high) in (("system_prompt_blocks", system_prompt_blocks), ("first_user_tokens", first_user_tokens),
                             ("next_user_tokens", next_user_tokens), ("output_tokens", output_tokens)):
        if not 1 <= low <= high:
            raise TraceError(f"{key}: ({low}, {high}) is not a range 1 <= low <= high")
    rng = np.random.default_rng(seed)
    next_id = 0

    def fresh(n: int) -> list[int]:
        nonlocal next_id
        next_id += n
        return list(range(next_id - n, next_id))

    def log_uniform(bounds: tuple[int, int]) -> int:
        return int(round(math.exp(rng.uniform(math.log(bounds[0]), math.log(bounds[1] + 0.5)))))

    systems = [fresh(int(rng.integers(system_prompt_blocks[0], system_prompt_blocks[1] + 1)))
               for _ in range(num_system_prompts)]
    weights = np.array([1.0 / (k + 1) for k in range(num_system_prompts)])
    weights /= weights.sum()
    open_convs: list[dict[str, Any]] = []  # {"ids", "input", "output", "turns_left"}
    requests: list[TraceRequest] = []
    arrival_s = 0.0
    for _ in range(num_requests):
        if not open_convs or rng.random() < new_conversation_share:
            system = systems[int(rng.choice(num_system_prompts, p=weights))]
            num_input = len(system) * block_tokens + log_uniform(first_user_tokens)
            ids = system + fresh(_num_blocks(num_input, block_tokens) - len(system))
            conv = {"turns_left": int(rng.integers(1, max_turns + 1))}
            open_convs.append(conv)
        else:
            conv = open_convs[int(rng.integers(len(open_convs)))]
            kept = conv["ids"][:conv["input"] // block_tokens]
            num_input = conv["input"] + conv["output"] + log_uniform(next_user_tokens)
            ids = kept + fresh(_num_blocks(num_input, block_tokens) - len(kept))
        num_output = log_uniform(output_tokens)
        conv.update(ids=ids, input=num_input, output=num_output)
        conv["turns_left"] -= 1
        if conv["turns_left"] == 0:
            open_convs.remove(conv)
        requests.append(TraceRequest(arrival_s, num_input, num_output, tuple(ids)))
        arrival_s += float(rng.exponential(1.0 / request_rate_per_s))
    source = (f"synthetic(num_requests={num_requests}, seed={seed}, request_rate_per_s={request_rate_per_s:g}, "
              f"num_system_prompts={num_system_prompts}, new_conversation_share={new_conversation_share:g}, "
              f"max_turns={max_turns})")
    return Trace(tuple(requests), block_tokens, source, "synthetic")

