"""The cost model's decision: whether, how much and how to load one request's hit (docs/cost-model.md).

:func:`decide` turns the formulas of :mod:`range_connector.cost.model` into a per-request :class:`Decision`: take the
hit, take a shorter one (whole chunks), or refuse (:class:`Action`); asynchronous loading when the load is long
compared with an engine step, layer-pipelined otherwise (:class:`LoadMode`). A pure function of its arguments, like
the formulas; :class:`range_connector.cost.gate.CostGate` calls it with the online estimates.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

from range_connector.cost.model import (
    PrefillRate,
    TierEstimate,
    _as_rate,
    _number,
    _tokens,
    load_time_s,
    pipelined_time_s,
)

__all__ = ["Action", "Decision", "LoadMode", "decide"]


_TIE = 1e-9  # relative: a predicted saving this small is rounding, and recomputing is the safe side of a tie


class Action(enum.Enum):
    """What the gate does with a hit."""

    TAKE = "take"  # load everything offered
    SHORTEN = "shorten"  # load a shorter, whole-chunk prefix
    REFUSE = "refuse"  # load nothing (recompute)


class LoadMode(enum.Enum):
    """How a taken hit is loaded (docs/architecture.md, "The path of one request")."""

    PIPELINED = "pipelined"  # ``(n, False)``: computed in the same step, layer ``l`` waits for layer ``l`` only
    ASYNC = "async"  # ``(n, True)``: waits in WAITING_FOR_REMOTE_KVS while other requests run


@dataclass(frozen=True, slots=True)
class Decision:
    """The gate's answer for one request.

    Attributes:
        action: take, shorten or refuse.
        mode: load mode for the hit (meaningful when something is loaded).
        hit_tokens: prompt positions ``[0, hit_tokens)`` in the KV cache after the load (``num_computed_tokens``
            when refused).
        num_new_tokens: tokens to load, ``hit_tokens - num_computed_tokens`` (what ``get_num_new_matched_tokens``
            returns).
        offered_tokens: tokens the tier offered beyond ``num_computed_tokens``.
        load_s: predicted seconds of the load, ``T0 + h·s/B`` (of the offered hit when refused).
        recompute_s: predicted seconds to prefill the same tokens instead.
        with_load_s: predicted prefill seconds of the request's remaining prompt with the load, in ``mode``.
        without_load_s: predicted prefill seconds of the remaining prompt without it.
        is_probe: a short hit taken only to re-measure a refused tier.
        reason: one line for logs.
    """

    action: Action
    mode: LoadMode
    hit_tokens: int
    num_new_tokens: int
    offered_tokens: int
    load_s: float
    recompute_s: float
    with_load_s: float
    without_load_s: float
    is_probe: bool
    reason: str

    @property
    def is_async(self) -> bool:
        """The second value of ``get_num_new_matched_tokens``."""
        return self.mode is LoadMode.ASYNC and self.num_new_tokens > 0

    @property
    def saving_s(self) -> float:
        """Predicted seconds saved, ``without_load_s - with_load_s`` (negative or ``-inf`` for a loss)."""
        return self.without_load_s - self.with_load_s


def decide(prompt_tokens: int, num_computed_tokens: int, hit_tokens: int, *, bytes_per_token: float,
           tier: TierEstimate, rate: float | PrefillRate, num_layers: int, block_size: int, chunk_tokens: int,
           step_s: float, async_step_ratio: float = 1.0, min_saving_s: float = 0.0,
           probe: bool = False) -> Decision:
    """Decide whether, how much and how to load a request's hit.

    The offered load covers positions ``[c, H)`` (``c = num_computed_tokens``, ``H = hit_tokens``). Mode: ASYNC
    when the full load ``T0 + (H - c)·s/B`` exceeds ``async_step_ratio·step_s``, else PIPELINED. Each candidate
    ``h'`` (``H`` and every multiple of ``chunk_tokens`` in ``(c, H)``) costs, with ``X = (h' - c)·s/B`` and
    ``Y = C([h', prompt))`` the suffix compute:

    * ASYNC: ``T0 + X + Y`` (the request waits for its load, then computes its suffix);
    * PIPELINED: ``T0 + max(X, Y) + min(X, Y)/num_layers`` (:func:`pipelined_time_s`);

    against ``C([c, prompt))`` without a load. The cheapest candidate is taken if it saves more than
    ``min_saving_s`` (and more than rounding: a tie is refused); ``h' < H`` is a SHORTEN (this pays in pipelined mode
    when the tier is slower than compute: load a prefix while the rest is computed). ``Y`` is concave in ``h'`` and
    ``X`` linear, so either cost is concave on each side of the point where ``X`` overtakes ``Y``: only both ends and
    the two candidates around that point are evaluated (found by bisection). With ``probe`` a refusal becomes the
    shortest candidate, flagged ``is_probe``, so the tier is re-measured.

    Args:
        prompt_tokens: prompt length, tokens.
        num_computed_tokens: tokens already in the engine's KV cache (local prefix cache).
        hit_tokens: ``H``, the tier's stored prefix from position 0, a multiple of ``block_size``, at most
            ``prompt_tokens - 1``.
        bytes_per_token: ``s`` (:func:`layout_bytes_per_token`).
        tier: ``B`` and ``T0`` (:func:`combine_shards` for several shards).
        rate: ``R`` tokens/s or a :class:`PrefillRate`.
        num_layers: attention layers (pipelining granularity).
        block_size: engine block size, tokens.
        chunk_tokens: reuse granularity, a multiple of ``block_size``.
        step_s: typical engine step, seconds.
        async_step_ratio: load-to-step ratio above which the load is asynchronous (``inf``: always pipelined).
        min_saving_s: a hit must save more than this (hysteresis against noisy estimates).
        probe: allow a probe when refusing.

    Returns:
        A frozen :class:`Decision`.

    Raises:
        ValueError: negative, NaN or inconsistent inputs (``hit_tokens`` not block-aligned or not below
            ``prompt_tokens``, ``chunk_tokens`` not a multiple of ``block_size``), naming the argument.
    """
    n, c, big_h = (_tokens("prompt_tokens", prompt_tokens), _tokens("num_computed_tokens", num_computed_tokens),
                   _tokens("hit_tokens", hit_tokens))
    s = _number("bytes_per_token", bytes_per_token)
    r = _as_rate(rate)
    for name, value in (("block_size", block_size), ("chunk_tokens", chunk_tokens), ("num_layers", num_layers)):
        if _tokens(name, value) < 1:
            raise ValueError(f"{name}: must be >= 1")
    if chunk_tokens % block_size:
        raise ValueError(f"chunk_tokens: {chunk_tokens} is not a multiple of block_size {block_size}")
    if big_h % block_size or (big_h > 0 and big_h >= n):
        raise ValueError(f"hit_tokens: {big_h} is not a multiple of block_size {block_size} below prompt_tokens {n}")
    step = _number("step_s", step_s)
    ratio = _number("async_step_ratio", async_step_ratio, allow_inf=True)
    margin = _number("min_saving_s", min_saving_s)
    without = r.time_s(c, n)
    offered = max(0, big_h - c)

    def load_of(h: int) -> float:
        return load_time_s(h - c, s, tier.bandwidth_bytes_per_s, tier.t0_s)

    full_load = load_of(big_h) if offered else 0.0
    mode = LoadMode.ASYNC if full_load > ratio * step else LoadMode.PIPELINED

    def with_load(h: int) -> float:
        x, y = tier.transfer_s((h - c) * s), r.time_s(h, n)
        if mode is LoadMode.ASYNC:
            return tier.t0_s + x + y
        return pipelined_time_s(tier.t0_s, x, y, num_layers)

    def result(action: Action, h: int, reason: str, is_probe: bool = False) -> Decision:
        # A refusal reports the predictions of the offered hit: logs and metrics show what was declined.
        shown, loads = (big_h, False) if action is Action.REFUSE else (h, True)
        return Decision(action, mode, h if loads else c, h - c if loads else 0, offered,
                        load_of(shown) if shown > c else 0.0, r.time_s(c, max(shown, c)),
                        with_load(shown) if shown > c else without, without, is_probe, reason)

    if offered == 0:
        return result(Action.REFUSE, c, "nothing to load beyond the local prefix")
    # Candidates: whole chunks first + i·chunk_tokens below H (i < num_short), then H itself (i = num_short).
    first = (c // chunk_tokens + 1) * chunk_tokens
    num_short = max(0, -(-(big_h - first) // chunk_tokens))

    def candidate(i: int) -> int:
        return first + i * chunk_tokens if i < num_short else big_h

    # First candidate whose transfer is at least its suffix compute (X rises with h', Y falls): bisection.
    lo, hi = 0, num_short
    while lo < hi:
        mid = (lo + hi) // 2
        if tier.transfer_s((candidate(mid) - c) * s) >= r.time_s(candidate(mid), n):
            hi = mid
        else:
            lo = mid + 1
    # The cost is concave on each side of that point, so its minimum is at one of these four.
    picks = {candidate(i) for i in (0, max(0, lo - 1), lo, num_short)}
    best = min(sorted(picks), key=lambda h: (with_load(h), -h))
    best_cost = with_load(best)
    if best_cost + margin < without * (1 - _TIE):
        action = Action.TAKE if best == big_h else Action.SHORTEN
        what = "all" if action is Action.TAKE else f"{best - c} of {offered}"
        return result(action, best, f"{mode.value}: loading {what} tokens saves {without - best_cost:.4g} s")
    if probe:
        shortest = candidate(0)
        return result(Action.TAKE if shortest == big_h else Action.SHORTEN, shortest,
                      f"probe: {shortest - c} tokens to re-measure a refused tier", is_probe=True)
    if math.isinf(best_cost):
        return result(Action.REFUSE, c, "tier delivers no bandwidth")
    return result(Action.REFUSE, c, f"{mode.value}: {without:.4g} s without a load, {best_cost:.4g} s with the best "
                                    f"one ({best - c} of {offered} tokens)")
