"""The cost model: load a hit only when it beats recomputing it (docs/cost-model.md).

Formulas, after *When the KV Cache Is Slower Than the GPU* (arXiv 2610.21500), with ``h`` tokens to load, ``s`` KV
bytes per token, ``B`` the tier's delivered bytes/s and ``T0`` the fixed seconds every hit pays:

* load: ``T0 + h·s/B`` (:func:`load_time_s`);
* recompute: ``h/R`` for a constant prefill rate ``R`` tokens/s. Ours (not in the paper): attention makes a token's
  prefill cost grow with its position, so tokens ``[a, b)`` of a prompt cost
  ``c1·(b - a) + c2·(b² - a²)/2`` seconds (``c1``: per-token linear work, projections and MLP; ``c2``: attention
  per token per token of context). ``R(ctx) = 1/(c1 + c2·ctx)`` is the marginal rate at context ``ctx``
  (:class:`PrefillRate`, fitted by :func:`range_connector.cost.calibration_file.fit_prefill_rate`);
* break-even bandwidth ``B* = s·R`` (a hit can pay only above it) and the shortest prompt that can win,
  ``T0·R`` at infinite bandwidth (:func:`break_even_bandwidth_bytes_per_s`, :func:`min_winning_prompt_tokens`);
* layer-pipelined (ours): the load of layer ``l`` overlaps the compute of layers ``< l`` and of the uncached suffix.
  With ``L`` layers, transfer ``X = h·s/B`` and suffix compute ``Y``, a two-stage pipeline of ``L`` equal stages
  finishes at ``T0 + max(X, Y) + min(X, Y)/L`` (:func:`pipelined_time_s`), to compare with computing the whole
  prompt.

The per-request decision built on these (take, shorten or refuse; asynchronous or layer-pipelined) is
:mod:`range_connector.cost.decision`. Everything here is a pure function of its arguments; the online estimates live
in :mod:`range_connector.cost.estimators`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

__all__ = ["PrefillRate", "TierEstimate", "break_even_bandwidth_bytes_per_s", "combine_shards",
           "layout_bytes_per_token", "load_time_s", "min_winning_prompt_tokens", "pipelined_time_s",
           "recompute_time_s"]


def _number(name: str, value: float, *, positive: bool = False, allow_inf: bool = False) -> float:
    """``value`` as a float, or ValueError naming ``name`` (negative, NaN, or infinite when not allowed)."""
    ok = not isinstance(value, bool) and isinstance(value, (int, float, np.integer, np.floating))
    v = float(value) if ok else math.nan
    if math.isnan(v) or v < 0 or (positive and v == 0) or (math.isinf(v) and not allow_inf):
        sign = "positive" if positive else "non-negative"
        raise ValueError(f"{name}: {value!r} is not a {sign}{'' if allow_inf else ' finite'} number")
    return v


def _tokens(name: str, value: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
        raise ValueError(f"{name}: {value!r} is not a non-negative integer number of tokens")
    return int(value)


@dataclass(frozen=True, slots=True)
class PrefillRate:
    """Prefill time of a prompt's tokens, attention-aware.

    Tokens ``[a, b)`` cost ``linear_s_per_token·(b - a) + attention_s_per_token2·(b² - a²)/2`` seconds: every token
    pays a fixed amount of linear work and attention over its ``position`` predecessors. With
    ``attention_s_per_token2 = 0`` this is the paper's constant rate ``R = 1/linear_s_per_token``.

    Attributes:
        linear_s_per_token: ``c1``, seconds per token (> 0).
        attention_s_per_token2: ``c2``, seconds per token per token of context (>= 0).

    Raises:
        ValueError: a coefficient is negative, NaN or infinite (or ``c1`` is 0).
    """

    linear_s_per_token: float
    attention_s_per_token2: float = 0.0

    def __post_init__(self) -> None:
        _number("linear_s_per_token", self.linear_s_per_token, positive=True)
        _number("attention_s_per_token2", self.attention_s_per_token2)

    @classmethod
    def constant(cls, tokens_per_s: float) -> PrefillRate:
        """The paper's model: ``R`` tokens/s whatever the context. Raises ValueError unless ``R`` > 0, finite."""
        return cls(1.0 / _number("tokens_per_s", tokens_per_s, positive=True))

    def time_s(self, start_tokens: int, end_tokens: int) -> float:
        """Seconds to prefill prompt positions ``[start_tokens, end_tokens)`` (0 when empty)."""
        a, b = _tokens("start_tokens", start_tokens), _tokens("end_tokens", end_tokens)
        if b <= a:
            return 0.0
        return self.linear_s_per_token * (b - a) + self.attention_s_per_token2 * (b * b - a * a) / 2.0

    def tokens_per_s(self, context_tokens: int = 0) -> float:
        """Marginal prefill rate ``R(ctx) = 1/(c1 + c2·ctx)`` tokens/s at position ``context_tokens``."""
        ctx = _tokens("context_tokens", context_tokens)
        return 1.0 / (self.linear_s_per_token + self.attention_s_per_token2 * ctx)

    def scaled(self, factor: float) -> PrefillRate:
        """The same curve ``factor`` times slower (both coefficients multiplied)."""
        f = _number("factor", factor, positive=True)
        return PrefillRate(self.linear_s_per_token * f, self.attention_s_per_token2 * f)


@dataclass(frozen=True, slots=True)
class TierEstimate:
    """A tier's delivered speed: a load of ``n`` bytes takes ``t0_s + n / bandwidth_bytes_per_s`` seconds.

    Attributes:
        bandwidth_bytes_per_s: ``B``, bytes/s (``0``: unusable; ``inf``: free transfer).
        t0_s: ``T0``, fixed seconds per hit.
    """

    bandwidth_bytes_per_s: float
    t0_s: float

    def __post_init__(self) -> None:
        _number("bandwidth_bytes_per_s", self.bandwidth_bytes_per_s, allow_inf=True)
        _number("t0_s", self.t0_s)

    def transfer_s(self, num_bytes: float) -> float:
        """Seconds to move ``num_bytes`` at ``B`` (without ``T0``); ``inf`` when ``B`` is 0 and bytes > 0."""
        if num_bytes <= 0:
            return 0.0
        return math.inf if self.bandwidth_bytes_per_s == 0 else num_bytes / self.bandwidth_bytes_per_s


def layout_bytes_per_token(layer_block_bytes: int, num_layers: int, block_size: int) -> float:
    """``s``: KV bytes of one token, every layer, every shard together.

    Args:
        layer_block_bytes: bytes of one block of one layer (all planes), from the registered layout.
        num_layers: attention layers.
        block_size: engine block size, tokens.

    Raises:
        ValueError: an argument is not positive.
    """
    for name, v in (("layer_block_bytes", layer_block_bytes), ("num_layers", num_layers), ("block_size", block_size)):
        if _tokens(name, v) == 0:
            raise ValueError(f"{name}: must be > 0")
    return layer_block_bytes * num_layers / block_size


def combine_shards(shards: Sequence[TierEstimate]) -> TierEstimate:
    """The tier as one reader sees it when a hit is read from every shard in parallel.

    Each of ``S`` shards holds ``1/S`` of a hit's bytes and the load ends when the last shard lands, so
    ``max_i(T0_i + n/(S·B_i))`` is bounded above by ``max_i T0_i + n/(S·min_i B_i)``: this returns
    ``TierEstimate(S·min_i B_i, max_i T0_i)`` (conservative).

    Raises:
        ValueError: no shards.
    """
    if not shards:
        raise ValueError("shards: at least one shard estimate is needed")
    return TierEstimate(len(shards) * min(s.bandwidth_bytes_per_s for s in shards), max(s.t0_s for s in shards))


def load_time_s(hit_tokens: int, bytes_per_token: float, bandwidth_bytes_per_s: float, t0_s: float) -> float:
    """Seconds to load a hit: ``T0 + h·s/B`` (arXiv 2610.21500; docs/cost-model.md).

    Args:
        hit_tokens: ``h``, tokens loaded; 0 means no load at all (0 s, no ``T0``).
        bytes_per_token: ``s``, bytes.
        bandwidth_bytes_per_s: ``B``, delivered bytes/s; 0 gives ``inf``, ``inf`` gives ``T0``.
        t0_s: ``T0``, seconds.

    Raises:
        ValueError: an argument is negative or NaN (``s`` and ``T0`` must be finite).
    """
    h = _tokens("hit_tokens", hit_tokens)
    s = _number("bytes_per_token", bytes_per_token)
    tier = TierEstimate(bandwidth_bytes_per_s, t0_s)
    return 0.0 if h == 0 else tier.t0_s + tier.transfer_s(h * s)


def _as_rate(rate: float | PrefillRate) -> PrefillRate:
    return rate if isinstance(rate, PrefillRate) else PrefillRate.constant(rate)


def recompute_time_s(hit_tokens: int, context_tokens: int, rate: float | PrefillRate) -> float:
    """Seconds to prefill the ``hit_tokens`` tokens after ``context_tokens`` already in the KV cache.

    ``h/R`` for a constant ``R`` (arXiv 2610.21500); with a :class:`PrefillRate`, positions
    ``[context_tokens, context_tokens + hit_tokens)`` at their own context length.

    Args:
        hit_tokens: tokens to prefill.
        context_tokens: tokens before them (their attention context).
        rate: ``R`` in tokens/s (> 0, finite) or a :class:`PrefillRate`.

    Raises:
        ValueError: a negative, NaN or infinite input, or ``R`` <= 0.
    """
    ctx = _tokens("context_tokens", context_tokens)
    return _as_rate(rate).time_s(ctx, ctx + _tokens("hit_tokens", hit_tokens))


def pipelined_time_s(t0_s: float, transfer_s: float, compute_s: float, num_layers: int) -> float:
    """Seconds until the last layer is computed when loads overlap compute layer by layer (ours).

    Layer ``l``'s transfer takes ``X/L``, its compute ``Y/L``; compute of layer ``l`` waits for its transfer and for
    layer ``l - 1``. The makespan of this two-stage flow shop of ``L`` equal jobs is
    ``x + y + (L - 1)·max(x, y) = max(X, Y) + min(X, Y)/L``, after the fixed ``T0``.

    Args:
        t0_s: ``T0``, seconds before the first layer's bytes flow.
        transfer_s: ``X``, seconds to move every layer's bytes (``inf`` allowed).
        compute_s: ``Y``, seconds of compute that needs the loaded KV (the uncached suffix, all layers).
        num_layers: ``L`` >= 1.

    Raises:
        ValueError: a negative or NaN time, or ``num_layers`` < 1.
    """
    t0 = _number("t0_s", t0_s)
    x, y = _number("transfer_s", transfer_s, allow_inf=True), _number("compute_s", compute_s)
    if _tokens("num_layers", num_layers) < 1:
        raise ValueError("num_layers: must be >= 1")
    return t0 + max(x, y) + min(x, y) / num_layers


def break_even_bandwidth_bytes_per_s(bytes_per_token: float, rate: float | PrefillRate,
                                     context_tokens: int = 0) -> float:
    """``B* = s·R``: below it, loading a token is slower than recomputing it, whatever ``T0`` (arXiv 2610.21500).

    Args:
        bytes_per_token: ``s``, bytes.
        rate: ``R`` tokens/s or a :class:`PrefillRate` (then ``R`` at ``context_tokens``).
        context_tokens: position at which ``R`` is taken.

    Raises:
        ValueError: negative, NaN or infinite inputs.
    """
    return _number("bytes_per_token", bytes_per_token) * _as_rate(rate).tokens_per_s(context_tokens)


def min_winning_prompt_tokens(t0_s: float, rate: float | PrefillRate, bytes_per_token: float = 0.0,
                              bandwidth_bytes_per_s: float = math.inf) -> int | None:
    """Shortest hit ``h`` (from position 0) whose recompute takes longer than its load.

    Solves ``c1·h + c2·h²/2 > T0 + h·s/B``. Constant ``R`` (``c2 = 0``): ``h > T0/(1/R - s/B)``, i.e. ``T0·R`` at
    infinite bandwidth (arXiv 2610.21500: ~17k tokens). Otherwise the positive root of ``(c2/2)h² + (c1 - s/B)h -
    T0``.

    Args:
        t0_s: ``T0``, seconds.
        rate: ``R`` tokens/s or a :class:`PrefillRate`.
        bytes_per_token: ``s``, bytes (0: transfer is free).
        bandwidth_bytes_per_s: ``B`` (default infinite).

    Returns:
        The smallest winning integer ``h`` (>= 1), or ``None`` when no length wins (``B <= B*`` with a constant
        rate, or ``B = 0``).

    Raises:
        ValueError: negative or NaN inputs.
    """
    t0 = _number("t0_s", t0_s)
    r = _as_rate(rate)
    per_token = TierEstimate(bandwidth_bytes_per_s, 0.0).transfer_s(_number("bytes_per_token", bytes_per_token))
    if math.isinf(per_token):
        return None
    a, b = r.attention_s_per_token2 / 2.0, r.linear_s_per_token - per_token
    if a == 0.0:
        return None if b <= 0 else math.floor(t0 / b) + 1
    root = (-b + math.sqrt(b * b + 4.0 * a * t0)) / (2.0 * a)
    return max(1, math.floor(root) + 1)
