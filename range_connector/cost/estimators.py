"""Online estimates of ``R``, ``B`` and ``T0``, for the gate (:mod:`range_connector.cost.gate`).

* :class:`RateEstimator`: ``R`` from the engine's own steps (scheduled prefill tokens, step seconds, context). It
  keeps the *shape* of the calibrated :class:`~range_connector.cost.model.PrefillRate` and learns one speed factor,
  an exponentially weighted geometric mean of observed / predicted step time.
* :class:`TierEstimator`: ``B`` and ``T0`` per backend and shard from completed loads (bytes, seconds): an
  exponentially weighted least-squares line ``seconds = T0 + bytes/B``, seeded with two pseudo-loads on the
  calibrated line. A load far outside the line (by more than ``jump_ratio`` either way) first rescales the whole
  line to pass through it, so a tier that suddenly slows is refused at the next request and one that recovers is
  taken again after its next probe; :meth:`TierEstimator.should_probe` rate-limits the probes of a refused tier.

Bounds (sane values, so one bad sample cannot make the model absurd): ``R`` in ``[10, 1e9]`` tokens/s, one step
sample moves the speed factor by at most 4x; ``B`` in ``[1e5, 1e13]`` bytes/s, ``T0`` in ``[0, 30]`` s.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from range_connector.cost.model import PrefillRate, TierEstimate, combine_shards

__all__ = ["MAX_BANDWIDTH_BYTES_PER_S", "MAX_T0_S", "MAX_TOKENS_PER_S", "MIN_BANDWIDTH_BYTES_PER_S",
           "MIN_TOKENS_PER_S", "RateEstimator", "TierEstimator"]

MIN_TOKENS_PER_S, MAX_TOKENS_PER_S = 10.0, 1e9
MIN_BANDWIDTH_BYTES_PER_S, MAX_BANDWIDTH_BYTES_PER_S = 1e5, 1e13
MAX_T0_S = 30.0


class RateEstimator:
    """Online prefill rate: the seed curve times a learned speed factor.

    A step that prefilled ``n`` tokens after ``ctx`` tokens of context in ``step_s`` seconds says the engine runs
    ``(step_s - step_overhead_s) / seed.time_s(ctx, ctx + n)`` times slower than the seed; the factor is the
    exponentially weighted geometric mean of these ratios (weight ``alpha`` for the newest), each clamped to 4x of
    the current factor, and the rate is kept within ``[10, 1e9]`` tokens/s at context 0. Steps with fewer than
    ``min_tokens`` prefill tokens (decode-dominated) only update the typical step length.

    Args:
        seed: the calibrated curve.
        step_overhead_s: fixed seconds of a step that are not prefill (from calibration).
        alpha: weight of the newest sample, in (0, 1].
        min_tokens: smallest prefill that informs the rate.
        seed_step_s: typical step length before any sample.

    Raises:
        ValueError: ``alpha`` outside (0, 1] or a negative argument.
    """

    def __init__(self, seed: PrefillRate, *, step_overhead_s: float = 0.0, alpha: float = 0.2,
                 min_tokens: int = 32, seed_step_s: float = 0.05) -> None:
        if not 0 < alpha <= 1:
            raise ValueError(f"alpha: {alpha!r} is not in (0, 1]")
        if step_overhead_s < 0 or min_tokens < 0 or not seed_step_s >= 0:
            raise ValueError("step_overhead_s, min_tokens, seed_step_s: must be >= 0")
        self.seed = seed
        self.step_overhead_s = step_overhead_s
        self.alpha = alpha
        self.min_tokens = min_tokens
        self._log_factor = 0.0
        self._step_s = seed_step_s
        self.num_samples = 0
        fastest = 1.0 / (seed.linear_s_per_token * MAX_TOKENS_PER_S)
        slowest = 1.0 / (seed.linear_s_per_token * MIN_TOKENS_PER_S)
        self._log_bounds = (math.log(fastest), math.log(slowest))

    def observe(self, num_prefill_tokens: int, step_s: float, context_tokens: int = 0) -> None:
        """Learn from one engine step (bad samples, NaN or negative, are ignored)."""
        if not (step_s >= 0 and math.isfinite(step_s)) or num_prefill_tokens < 0 or context_tokens < 0:
            return
        self._step_s += self.alpha * (step_s - self._step_s)
        if num_prefill_tokens < max(1, self.min_tokens):
            return
        predicted = self.seed.time_s(context_tokens, context_tokens + num_prefill_tokens)
        work_s = step_s - self.step_overhead_s
        if work_s <= 0 or predicted <= 0:
            return
        sample = min(max(math.log(work_s / predicted), self._log_factor - math.log(4)), self._log_factor + math.log(4))
        value = self._log_factor + self.alpha * (sample - self._log_factor)
        self._log_factor = min(max(value, self._log_bounds[0]), self._log_bounds[1])
        self.num_samples += 1

    @property
    def rate(self) -> PrefillRate:
        """The current curve (seed times the learned factor)."""
        return self.seed.scaled(math.exp(self._log_factor))

    @property
    def step_s(self) -> float:
        """Exponentially weighted step length, seconds."""
        return self._step_s


@dataclass(slots=True)
class _LineFit:
    """Exponentially weighted moments of ``(bytes, seconds)`` samples and the line fitted to them."""

    w: float
    sx: float
    sy: float
    sxx: float
    sxy: float
    t0_s: float
    s_per_byte: float
    num_samples: int = 0
    num_jumps: int = 0

    @classmethod
    def seeded(cls, seed: TierEstimate, weight: float) -> _LineFit:
        # Two pseudo-loads on the seed line: an empty one and one whose transfer equals T0 (1 MiB .. 1 GiB).
        spb = 1.0 / min(max(seed.bandwidth_bytes_per_s, MIN_BANDWIDTH_BYTES_PER_S), MAX_BANDWIDTH_BYTES_PER_S)
        t0 = min(seed.t0_s, MAX_T0_S)
        x = min(max(t0 / spb, 1 << 20), 1 << 30)
        y = t0 + x * spb
        return cls(2 * weight, weight * x, weight * (t0 + y), weight * x * x, weight * x * y, t0, spb)

    def predict_s(self, num_bytes: float) -> float:
        return self.t0_s + num_bytes * self.s_per_byte

    def add(self, x: float, y: float, alpha: float, jump_ratio: float) -> None:
        predicted = self.predict_s(x)
        ratio = y / predicted if predicted > 0 else 1.0
        if ratio > jump_ratio or ratio * jump_ratio < 1:
            # Fast path: rescale the history so the line passes through this sample, then learn as usual.
            self.sy *= ratio
            self.sxy *= ratio
            self.t0_s *= ratio
            self.num_jumps += 1
        keep = 1.0 - alpha
        self.w, self.sx, self.sy = keep * self.w + 1, keep * self.sx + x, keep * self.sy + y
        self.sxx, self.sxy = keep * self.sxx + x * x, keep * self.sxy + x * y
        self.num_samples += 1
        self._refit()

    def _refit(self) -> None:
        mx, my = self.sx / self.w, self.sy / self.w
        var = self.sxx / self.w - mx * mx
        if var > 1e-4 * mx * mx:  # sizes spread enough to separate T0 from 1/B
            spb = (self.sxy / self.w - mx * my) / var
            t0 = my - spb * mx
        else:  # all loads about one size: keep T0, learn B
            t0 = min(self.t0_s, my)
            spb = (my - t0) / mx if mx > 0 else self.s_per_byte
        if t0 < 0:
            t0, spb = 0.0, self.sxy / self.sxx
        lo, hi = 1.0 / MAX_BANDWIDTH_BYTES_PER_S, 1.0 / MIN_BANDWIDTH_BYTES_PER_S
        if spb < lo:
            spb = lo
            t0 = max(0.0, my - spb * mx)
        self.s_per_byte = min(spb, hi)
        self.t0_s = min(t0, MAX_T0_S)


class TierEstimator:
    """Online ``B`` and ``T0`` per (backend, shard), seeded from calibration.

    Args:
        seeds: ``{backend: [num_shards] TierEstimate}`` from the calibration file (may be empty).
        default_seed: seed for a (backend, shard) the file does not name.
        alpha: weight of the newest load in (0, 1] (the seed's pseudo-loads decay like real ones).
        jump_ratio: observed / predicted seconds beyond which a load rescales the line at once (> 1).
        seed_weight: weight of each of the two seed pseudo-loads.
        probe_interval_s: least seconds between two probes of one backend.
        probe_every_refusals: least refused offers of one backend between two probes (1: time alone limits them).
        probe_jump_ratio: observed / predicted seconds of a probe beyond which it rescales the line at once (> 1).

    Raises:
        ValueError: ``alpha`` outside (0, 1], ``jump_ratio`` <= 1, or a negative weight or interval.
    """

    def __init__(self, seeds: Mapping[str, Sequence[TierEstimate]], default_seed: TierEstimate, *,
                 alpha: float = 0.3, jump_ratio: float = 2.0, seed_weight: float = 1.0,
                 probe_interval_s: float = 1.0, probe_every_refusals: int = 1, probe_jump_ratio: float = 1.25) -> None:
        if not 0 < alpha <= 1 or not jump_ratio > 1 or not seed_weight > 0 or not probe_interval_s >= 0 \
                or not probe_every_refusals >= 1 or not probe_jump_ratio > 1:
            raise ValueError("alpha in (0, 1], jump_ratio > 1, probe_jump_ratio > 1, seed_weight > 0, "
                             "probe_interval_s >= 0 and probe_every_refusals >= 1 required")
        self.probe_jump_ratio = probe_jump_ratio
        self.seeds = {k: tuple(v) for k, v in seeds.items()}
        self.default_seed = default_seed
        self.alpha, self.jump_ratio, self.seed_weight = alpha, jump_ratio, seed_weight
        self.probe_interval_s = probe_interval_s
        self.probe_every_refusals = probe_every_refusals
        self._refusals: dict[str, int] = {}  # refused offers since the last probe, per backend
        self._fits: dict[tuple[str, int], _LineFit] = {}
        self._last_probe_s: dict[str, float] = {}

    def _fit(self, backend: str, shard_idx: int) -> _LineFit:
        key = (backend, shard_idx)
        if key not in self._fits:
            seeds = self.seeds.get(backend, ())
            seed = seeds[shard_idx] if shard_idx < len(seeds) else seeds[-1] if seeds else self.default_seed
            self._fits[key] = _LineFit.seeded(seed, self.seed_weight)
        return self._fits[key]

    def observe(self, backend: str, shard_idx: int, num_bytes: int, seconds: float, *,
                lower_bound: bool = False, probe: bool = False) -> None:
        """Learn from one completed load of ``num_bytes`` from one shard in ``seconds`` (bad samples ignored).

        ``lower_bound``: the load did not complete (it ran out of its deadline after ``seconds``): the true time is
        longer, so the sample is learnt only when it is slower than the current prediction (a censored sample).
        ``probe``: a probe of a refused tier, the only fresh sample while it is refused (the history describes the
        tier before it was refused): it rescales the line already when it is ``probe_jump_ratio`` off."""
        if num_bytes > 0 and seconds >= 0 and math.isfinite(seconds) and shard_idx >= 0:
            fit = self._fit(backend, shard_idx)
            if lower_bound and seconds <= fit.predict_s(float(num_bytes)):
                return
            jump = min(self.jump_ratio, self.probe_jump_ratio) if probe else self.jump_ratio
            fit.add(float(num_bytes), float(seconds), self.alpha, jump)

    def estimate(self, backend: str, shard_idx: int) -> TierEstimate:
        """Current ``B`` and ``T0`` of one shard."""
        fit = self._fit(backend, shard_idx)
        return TierEstimate(1.0 / fit.s_per_byte, fit.t0_s)

    def combined(self, backend: str, num_shards: int) -> TierEstimate:
        """The backend as a reader of all ``num_shards`` shards sees it (:func:`combine_shards`)."""
        return combine_shards([self.estimate(backend, s) for s in range(num_shards)])

    def num_samples(self, backend: str, shard_idx: int) -> int:
        """Loads learned from for one shard."""
        return self._fit(backend, shard_idx).num_samples

    def probe_due(self, backend: str, now_s: float) -> bool:
        """Whether :meth:`should_probe` would allow a probe at ``now_s`` for one more refused offer (no side effect)."""
        last = self._last_probe_s.get(backend)
        return last is None or (now_s - last >= self.probe_interval_s
                                and self._refusals.get(backend, 0) + 1 >= self.probe_every_refusals)

    def note_refusal(self, backend: str) -> None:
        """Count a refused offer toward the next probe without asking for one (see :meth:`should_probe`)."""
        self._refusals[backend] = self._refusals.get(backend, 0) + 1

    def should_probe(self, backend: str, now_s: float) -> bool:
        """Whether a refused ``backend`` may be probed at ``now_s`` (monotonic seconds); records the probe if so.

        At most one probe per ``probe_interval_s`` per backend, so probing a slow tier costs a bounded share of time,
        and (after the first) at most one per ``probe_every_refusals`` refused offers, so that requests further
        apart than the interval are not all probes.
        """
        refusals = self._refusals[backend] = self._refusals.get(backend, 0) + 1
        last = self._last_probe_s.get(backend)
        if last is not None and (now_s - last < self.probe_interval_s or refusals < self.probe_every_refusals):
            return False
        self._last_probe_s[backend] = now_s
        self._refusals[backend] = 0
        return True
