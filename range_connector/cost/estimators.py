"""Online estimates of ``R``, ``B`` and ``T0``, and the gate that uses them.

* :class:`RateEstimator`: ``R`` from the engine's own steps (scheduled prefill tokens, step seconds, context). It
  keeps the *shape* of the calibrated :class:`~range_connector.cost.model.PrefillRate` and learns one speed factor,
  an exponentially weighted geometric mean of observed / predicted step time.
* :class:`TierEstimator`: ``B`` and ``T0`` per backend and shard from completed loads (bytes, seconds): an
  exponentially weighted least-squares line ``seconds = T0 + bytes/B``, seeded with two pseudo-loads on the
  calibrated line. A load far outside the line (by more than ``jump_ratio`` either way) first rescales the whole
  line to pass through it, so a tier that suddenly slows is refused at the next request and one that recovers is
  taken again after its next probe; :meth:`TierEstimator.should_probe` rate-limits the probes of a refused tier.
* :class:`DecisionStats`: counters of decisions and predicted vs realised load seconds.
* :class:`CostGate`: the three together, one call per lookup for the scheduler, seeded from a
  :class:`~range_connector.cost.calibration_file.Calibration`.

Bounds (sane values, so one bad sample cannot make the model absurd): ``R`` in ``[10, 1e9]`` tokens/s, one step
sample moves the speed factor by at most 4x; ``B`` in ``[1e5, 1e13]`` bytes/s, ``T0`` in ``[0, 30]`` s.
"""

from __future__ import annotations

import collections
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from range_connector.cost.model import (
    Action,
    Decision,
    PrefillRate,
    TierEstimate,
    combine_shards,
    decide,
    load_time_s,
    recompute_time_s,
)

if TYPE_CHECKING:
    from range_connector.cost.calibration_file import Calibration

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


_ACTION_COUNTER = {Action.TAKE: "taken", Action.SHORTEN: "shortened", Action.REFUSE: "refused"}


@dataclass
class DecisionStats:
    """Counters of the gate's decisions, and predicted vs realised load seconds.

    :meth:`snapshot` names: ``decisions_taken``, ``decisions_shortened``, ``decisions_refused``,
    ``decisions_probes``, ``loads_async``, ``loads_pipelined``, ``predicted_load_s`` and ``realised_load_s`` (sums
    over the loads whose realised time was reported), ``realised_loads``. ``recent`` keeps the last 256
    ``(predicted_s, realised_s)`` pairs.
    """

    counts: dict[str, float] = field(default_factory=lambda: collections.defaultdict(float))
    recent: collections.deque[tuple[float, float]] = field(default_factory=lambda: collections.deque(maxlen=256))

    def record(self, decision: Decision) -> None:
        """Count one decision (decisions with nothing offered are not counted)."""
        if decision.offered_tokens == 0:
            return
        name = "probes" if decision.is_probe else _ACTION_COUNTER[decision.action]
        self.counts[f"decisions_{name}"] += 1
        if decision.action is not Action.REFUSE:
            self.counts[f"loads_{decision.mode.value}"] += 1

    def record_load(self, predicted_s: float, realised_s: float) -> None:
        """Record one finished load: the decision's ``load_s`` and the measured seconds."""
        if math.isfinite(predicted_s) and math.isfinite(realised_s):
            self.counts["predicted_load_s"] += predicted_s
            self.counts["realised_load_s"] += realised_s
            self.counts["realised_loads"] += 1
            self.recent.append((predicted_s, realised_s))

    def snapshot(self) -> dict[str, float]:
        """The counters as a plain dict (for the connector's stats)."""
        return dict(self.counts)


# ------------------------------------------------------------------------------------------------ the gate
@dataclass(frozen=True, slots=True)
class GateConfig:
    """Parameters of :class:`CostGate`.

    Without a calibration file the seeds are optimistic (fast tier, slow prefill), so hits are taken, as without a
    gate, until measured loads and steps say otherwise.

    Attributes:
        async_step_ratio: a load longer than this many typical steps is asynchronous.
        min_saving_s: a hit must save more than this many seconds.
        probe_interval_s: least seconds between two probes of a refused tier.
        probe_every_refusals: least refused offers between two probes. A probe costs about one chunk's transfer
            minus its compute, a sizeable share of a request when the tier is slow; when requests come further apart
            than ``probe_interval_s`` (seconds-long prefills on a CPU engine), the interval alone would make every
            refused request a probe (seen in bench/threshold.py); 4 keeps that share <= 1/4 and still re-measures a
            recovered tier within ~4 requests.
        seed_tokens_per_s: ``R`` before calibration or samples.
        seed_bandwidth_bytes_per_s: ``B`` per shard before calibration or samples.
        seed_t0_s: ``T0`` before calibration or samples.
        seed_step_s: typical step length before samples.
        rate_alpha: weight of the newest step in the rate estimate.
        tier_alpha: weight of the newest load in the tier estimate.
        jump_ratio: a load this many times off the prediction rescales the tier's line at once.
        probe_jump_ratio: the same for a probe of a refused tier (its only fresh sample: trusted sooner).
    """

    async_step_ratio: float = 1.0
    min_saving_s: float = 0.0
    probe_interval_s: float = 1.0
    probe_every_refusals: int = 4
    seed_tokens_per_s: float = 2000.0
    seed_bandwidth_bytes_per_s: float = 1e10
    seed_t0_s: float = 0.001
    seed_step_s: float = 0.05
    rate_alpha: float = 0.2
    tier_alpha: float = 0.3
    jump_ratio: float = 2.0
    probe_jump_ratio: float = 1.25


class CostGate:
    """The admission gate of one scheduler: estimators, decisions and their counters.

    Args:
        backend: the tier's type (``RangeConfig.tier.type``).
        num_shards: shards read in parallel by every load.
        bytes_per_token: ``s``, all layers and shards (:func:`~range_connector.cost.model.layout_bytes_per_token`).
        num_layers: attention layers.
        block_size: engine block size, tokens.
        chunk_tokens: reuse granularity, tokens.
        calibration: seeds (``None``: :class:`GateConfig`'s).
        config: parameters.
    """

    def __init__(self, backend: str, num_shards: int, bytes_per_token: float, num_layers: int, block_size: int,
                 chunk_tokens: int, calibration: Calibration | None = None, config: GateConfig | None = None) -> None:
        self.config = config = config or GateConfig()
        # The DRAM tier keeps every shard in one process's memory: a load reads them all from one place.
        self.backend, self.num_shards = backend, 1 if backend == "memory" else num_shards
        self.bytes_per_token, self.num_layers = bytes_per_token, num_layers
        self.block_size, self.chunk_tokens = block_size, chunk_tokens
        prefill = calibration.prefill if calibration is not None else None
        self.rates = RateEstimator(prefill or PrefillRate.constant(config.seed_tokens_per_s),
                                   alpha=config.rate_alpha, seed_step_s=config.seed_step_s)
        self.tiers = TierEstimator(calibration.tiers if calibration is not None else {},
                                   TierEstimate(config.seed_bandwidth_bytes_per_s, config.seed_t0_s),
                                   alpha=config.tier_alpha, jump_ratio=config.jump_ratio,
                                   probe_interval_s=config.probe_interval_s,
                                   probe_every_refusals=config.probe_every_refusals,
                                   probe_jump_ratio=config.probe_jump_ratio)
        self.stats = DecisionStats()

    def decide(self, prompt_tokens: int, num_computed_tokens: int, hit_tokens: int,
               now_s: float | None = None) -> Decision:
        """Decide one lookup (side-effect free except for the probe clock; see :func:`~.cost_model.decide`).

        Args:
            prompt_tokens: prompt length.
            num_computed_tokens: tokens vLLM already has.
            hit_tokens: the stored prefix, block-rounded, at most ``prompt_tokens - 1``.
            now_s: ``time.monotonic()`` by default (tests pass simulated time).

        Raises:
            ValueError: inconsistent inputs.
        """
        args = self._decide_args()
        d = decide(prompt_tokens, num_computed_tokens, hit_tokens, **args)
        if d.action is Action.REFUSE and d.offered_tokens > 0:
            if self.tiers.should_probe(self.backend, time.monotonic() if now_s is None else now_s):
                d = decide(prompt_tokens, num_computed_tokens, hit_tokens, probe=True, **args)
        return d

    def refuses_any_hit(self, prompt_tokens: int, num_computed_tokens: int,
                        now_s: float | None = None) -> Decision | None:
        """The refusal of the largest hit this prompt could have (all of it but its last token), when even that
        would not pay and no probe is due, else ``None``: a request the tier cannot help, whatever is stored.

        With it the scheduler skips the request's lookup and save (a tier slower than recompute then costs the
        engine nothing but its probes). Counts as one refused offer toward the next probe.

        Raises:
            ValueError: inconsistent inputs.
        """
        best = (max(0, prompt_tokens - 1) // self.block_size) * self.block_size
        if best <= num_computed_tokens:
            return None
        d = decide(prompt_tokens, num_computed_tokens, best, **self._decide_args())
        if d.action is not Action.REFUSE:
            return None
        if self.tiers.probe_due(self.backend, time.monotonic() if now_s is None else now_s):
            return None  # looked up as usual, so that decide() can make this request the probe
        self.tiers.note_refusal(self.backend)
        return d

    def predict_s(self, num_computed_tokens: int, hit_tokens: int) -> tuple[float, float]:
        """Predicted seconds to load prompt positions ``[num_computed_tokens, hit_tokens)`` and to recompute them
        instead (``T0 + h·s/B`` and ``Y``: :func:`~.cost_model.load_time_s`, :func:`~.cost_model.recompute_time_s`),
        for a load whose mode the configuration chose.

        Raises:
            ValueError: ``hit_tokens < num_computed_tokens`` or a negative count.
        """
        tier = self.tiers.combined(self.backend, self.num_shards)
        return (load_time_s(hit_tokens - num_computed_tokens, self.bytes_per_token, tier.bandwidth_bytes_per_s,
                            tier.t0_s),
                recompute_time_s(hit_tokens - num_computed_tokens, num_computed_tokens, self.rates.rate))

    def _decide_args(self) -> dict:
        return dict(bytes_per_token=self.bytes_per_token, tier=self.tiers.combined(self.backend, self.num_shards),
                    rate=self.rates.rate, num_layers=self.num_layers, block_size=self.block_size,
                    chunk_tokens=self.chunk_tokens, step_s=self.rates.step_s,
                    async_step_ratio=self.config.async_step_ratio, min_saving_s=self.config.min_saving_s)

    @staticmethod
    def deadline_s(load_s: float, recompute_s: float, min_s: float, max_s: float) -> float:
        """A load's deadline, seconds: twice its expected time ``load_s``, at most what recomputing its tokens would
        cost (``recompute_s``: past that, waiting can only lose), within ``[min_s, max_s]`` (``min_s`` keeps timer
        noise and a first, seed-based estimate from failing healthy loads; ``max_s`` is the configured
        ``load_deadline_s``). DESIGN.md §4 "Load": a slow tier holds a request no longer than this.
        """
        return min(max_s, max(min_s, min(2.0 * load_s, recompute_s)))

    def commit(self, decision: Decision) -> None:
        """Count a decision vLLM acted on (call once per request, not once per lookup)."""
        self.stats.record(decision)

    def shard_bytes(self, decision: Decision) -> int:
        """Bytes each shard delivers for ``decision``'s load."""
        return round(decision.num_new_tokens * self.bytes_per_token / self.num_shards)

    def observe_load(self, shard_idx: int, num_bytes: int, seconds: float, *, lower_bound: bool = False,
                     probe: bool = False) -> None:
        """Learn from one shard's finished load (worker-measured, submission to last byte; ``lower_bound``: it ran
        out of its deadline after ``seconds``; ``probe``: a probe of a refused tier; see
        :meth:`TierEstimator.observe`)."""
        self.tiers.observe(self.backend, shard_idx, num_bytes, seconds, lower_bound=lower_bound, probe=probe)

    def record_load(self, decision: Decision, realised_s: float) -> None:
        """Record the whole load's realised seconds against ``decision.load_s``."""
        self.stats.record_load(decision.load_s, realised_s)

    def observe_step(self, num_prefill_tokens: int, step_s: float, context_tokens: int = 0) -> None:
        """Learn from one engine step (see :meth:`RateEstimator.observe`)."""
        self.rates.observe(num_prefill_tokens, step_s, context_tokens)
