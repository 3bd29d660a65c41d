"""The cost gate: one call per lookup for the scheduler, the estimators and decisions behind it, and their counters.

* :class:`CostGate`: a :class:`~range_connector.cost.estimators.RateEstimator` and a
  :class:`~range_connector.cost.estimators.TierEstimator`, seeded from a
  :class:`~range_connector.cost.calibration_file.Calibration` (or :class:`GateConfig`'s seeds), feeding
  :func:`~range_connector.cost.decision.decide`; it learns from the engine's steps and the workers' load timings and
  rate-limits the probes of a refused tier.
* :class:`GateConfig`: its parameters.
* :class:`DecisionStats`: counters of decisions and predicted vs realised load seconds.
"""

from __future__ import annotations

import collections
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from range_connector.cost.decision import Action, Decision, decide
from range_connector.cost.estimators import RateEstimator, TierEstimator
from range_connector.cost.model import PrefillRate, TierEstimate, load_time_s, recompute_time_s

if TYPE_CHECKING:
    from range_connector.cost.calibration_file import Calibration

__all__ = ["CostGate", "DecisionStats", "GateConfig"]


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
        self._num_shards = num_shards  # (of the tiers that live elsewhere, in a hierarchy)
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
        """Decide one lookup (side-effect free except for the probe clock; see
        :func:`~range_connector.cost.decision.decide`).

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

    def decide_runs(self, prompt_tokens: int, num_computed_tokens: int, runs: Sequence[tuple[str, int]]) -> Decision:
        """Decide a hit that several tiers deliver, run by run (a tier hierarchy): each candidate is the hit up to
        the end of one run (the DRAM run alone, DRAM and Valkey, ...), weighed with what its runs cost together
        (:meth:`run_estimate`), and may itself be shortened (:func:`~range_connector.cost.decision.decide`); the
        candidate with the shortest predicted prefill is taken, so a far tier slower than recompute for this prompt
        is left out while the near one still serves. No probe here (the caller probes a left-out tier).

        Args:
            runs: ``[(tier type, end token)]`` in chain order, ends increasing (the last is the hit, block-rounded).

        Raises:
            ValueError: inconsistent inputs.
        """
        args = self._decide_args()
        best: Decision | None = None
        for k, (_, end) in enumerate(runs):
            if end <= num_computed_tokens:
                continue
            d = decide(prompt_tokens, num_computed_tokens, end,
                       **{**args, "tier": self.run_estimate(runs[:k + 1], num_computed_tokens)})
            if best is None or (d.action is not Action.REFUSE and (
                    best.action is Action.REFUSE or d.with_load_s < best.with_load_s)):
                best = d
        if best is None:
            return decide(prompt_tokens, num_computed_tokens, num_computed_tokens, **args)
        return best

    def run_estimate(self, runs: Sequence[tuple[str, int]], num_computed_tokens: int) -> TierEstimate:
        """One ``(B, T0)`` for a load of positions ``[num_computed_tokens, end of the last run)`` made of ``runs``
        (``[(tier type, end token)]``): ``T0 = sum of each tier's T0``, ``B = bytes / sum(bytes_i / B_i)``, so that
        ``T0 + bytes/B`` is the sum of the runs' own load times (one tier after the other on each shard)."""
        t0_s, seconds, nbytes, start = 0.0, 0.0, 0.0, num_computed_tokens
        for tier_type, end in runs:
            n = max(0, end - max(start, num_computed_tokens))
            start = max(start, end)
            if n == 0:
                continue
            est = self.tiers.combined(tier_type, 1 if tier_type == "memory" else self._num_shards)
            t0_s += est.t0_s
            seconds += n * self.bytes_per_token / est.bandwidth_bytes_per_s
            nbytes += n * self.bytes_per_token
        if nbytes == 0:
            return self.tiers.combined(self.backend, self.num_shards)
        return TierEstimate(nbytes / seconds if seconds > 0 else float("inf"), t0_s)

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

    def predict_s(self, num_computed_tokens: int, hit_tokens: int,
                  runs: Sequence[tuple[str, int]] | None = None) -> tuple[float, float]:
        """Predicted seconds to load prompt positions ``[num_computed_tokens, hit_tokens)`` and to recompute them
        instead (``T0 + h·s/B`` and ``Y``: :func:`~range_connector.cost.model.load_time_s`,
        :func:`~range_connector.cost.model.recompute_time_s`),
        for a load whose mode the configuration chose.

        Raises:
            ValueError: ``hit_tokens < num_computed_tokens`` or a negative count.
        """
        tier = self.run_estimate(runs, num_computed_tokens) if runs else self.tiers.combined(self.backend,
                                                                                             self.num_shards)
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
        ``load_deadline_s``). docs/architecture.md, "The path of one request": a slow tier holds a request no longer
        than this.
        """
        return min(max_s, max(min_s, min(2.0 * load_s, recompute_s)))

    def commit(self, decision: Decision) -> None:
        """Count a decision vLLM acted on (call once per request, not once per lookup)."""
        self.stats.record(decision)

    def shard_bytes(self, decision: Decision) -> int:
        """Bytes each shard delivers for ``decision``'s load."""
        return round(decision.num_new_tokens * self.bytes_per_token / self.num_shards)

    def observe_load(self, shard_idx: int, num_bytes: int, seconds: float, *, lower_bound: bool = False,
                     probe: bool = False, tier: str | None = None) -> None:
        """Learn from one shard's finished load (worker-measured, submission to last byte; ``lower_bound``: it ran
        out of its deadline after ``seconds``; ``probe``: a probe of a refused tier; ``tier``: the tier type it
        read, in a hierarchy (default the gate's); see :meth:`TierEstimator.observe`)."""
        self.tiers.observe(tier or self.backend, shard_idx, num_bytes, seconds, lower_bound=lower_bound, probe=probe)

    def record_load(self, decision: Decision, realised_s: float) -> None:
        """Record the whole load's realised seconds against ``decision.load_s``."""
        self.stats.record_load(decision.load_s, realised_s)

    def observe_step(self, num_prefill_tokens: int, step_s: float, context_tokens: int = 0) -> None:
        """Learn from one engine step (see :meth:`RateEstimator.observe`)."""
        self.rates.observe(num_prefill_tokens, step_s, context_tokens)
