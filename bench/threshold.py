"""The threshold sweep (issue 6): does the cost gate load exactly when loading beats recomputing?

Three vLLM CPU API servers (:class:`~range_connector.testing.server_process.ServerProcess`) on the bench GQA model (32
layers, 128 KiB of KV per token), each reused for every cell:

* ``always``: Range connector, file tier (``backend`` ``"file"``, its own directory, in the page cache) behind the
  latency wrapper, ``load_mode`` ``"pipelined"``: every stored prefix is loaded. Its loads get a deadline that no
  prediction of the cost model's estimators can exceed (:func:`never_late_deadline_s`), so that none is refused for a
  predicted late finish (docs/architecture.md, "The path of one request", step 4): whether it loads cannot depend on
  how fast this machine happened to be;
* ``never``: no connector: every prompt is recomputed;
* ``gate``: the same connector with ``load_mode`` ``"auto"``, seeded with the calibration file written here.

Both connector engines read one tier control file (the file tier's ``testing.control_file``), so the tier's
bandwidth is switched between cells while the engines run.

1. **Calibration** (before the gate starts, since it reads the file at start-up): ``R`` from a prefill sweep on
   ``never`` (:func:`range_connector.cli.calibrate.measure_prefill`, fresh random prompts, fitted by
   :func:`~range_connector.cost.calibration_file.fit_prefill_rate`: ``overhead + c1·n + c2·n²/2``); the hit line from
   ``always`` with the tier uncapped: TTFT of a stored prompt minus that overhead, against the bytes loaded,
   fitted as ``T0 + bytes/B0`` (:func:`~range_connector.cost.calibration_file.fit_tier_line`). ``T0`` is the engine's
   fixed cost of a hit, ``B0`` the fastest delivery the engine achieves here (copies and checksums included).
2. **Placement.** Per prompt length ``n`` (hit ``h``, one token left to compute) the break-even delivered
   bandwidth is ``B_be(n) = h·s / (C(0, n) - T0)`` (``C``: the fitted prefill time; ``B_be → B* = s·R`` for long
   prompts and small ``T0``). The grid's delivered bandwidths are ``--speed-factors`` times the geometric mean of
   ``B_be`` over the lengths; the wrapper's cap giving a delivered ``B`` is ``1/(1/B - 1/B0)``.
3. **Grid.** After each change of bandwidth, ``--settle-requests`` unmeasured loads let the gate learn the new
   speed (the cells measure its decisions; the slow-tier scenario, its adaptation). Per (bandwidth, length) cell,
   a fresh prompt is sent once to ``always`` and ``gate`` (not measured: it is computed and stored), then ``--runs``
   rounds, each sending the prompt to the three engines in rotated order, vLLM's own prefix cache emptied before every
   request (``/reset_prefix_cache``, ``VLLM_SERVER_DEV_MODE``); ``max_tokens = 1``; TTFT as the client sees it; tokens
   loaded per request from the ``/metrics`` counter ``vllm:external_prefix_cache_hits_total`` (and, on ``gate``, its
   decision from ``vllm:range_gate_decisions_total``: taken, shortened, refused or probe). Per cell: medians, the
   oracle ``min(always, never)``, the gate's ratio to it. Summary: share of cells with the gate within 10% of the oracle
   (target >= 90%) and the regret ``sum(gate - oracle) / sum(oracle)`` (target <= 5%).
4. **Slow tier** (``gate`` only, the longest prompt): requests one after another with the tier fast, then switched
   to slow (``--slow-factor``), then fast again; per request the tokens loaded (full hit / partial: a probe or a
   shortened hit / none) and TTFT. Reported: requests until the gate stops taking the full hit, partial loads per
   second while slow, requests until the full hit is taken again.

Writes ``bench/results/threshold-<time>.json`` and ``.png`` (heat maps: always vs never, gate vs oracle).

Usage::

    .venv/bin/python bench/threshold.py            # bench model, 4 lengths x 4 bandwidths, 5 runs (~15 min)
    .venv/bin/python bench/threshold.py --smoke    # tiny model, 2 x 2, 2 runs (the smoke test)
    .venv/bin/python bench/threshold.py --lengths 513,1025,2049,3073 --speed-factors 0.3,0.6,0.85,1.2,1.7,3 --runs 7
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import busy_cores, git_state, log, machine_info, versions, wait_quiet  # noqa: E402  (puts the repo on the path)

from range_connector.backends.latency import write_control_file  # noqa: E402
from range_connector.cli.calibrate import measure_prefill, model_facts  # noqa: E402
from range_connector.cost.calibration_file import (  # noqa: E402
    Calibration,
    fit_prefill_rate,
    fit_tier_line,
    write_calibration,
)
from range_connector.cost.estimators import MAX_T0_S, MIN_BANDWIDTH_BYTES_PER_S  # noqa: E402
from range_connector.cost.model import PrefillRate, TierEstimate  # noqa: E402
from range_connector.testing.client import complete, reset_prefix_cache, scrape_metrics, wait_for_metric  # noqa: E402
from range_connector.testing.processes import unwind_on_sigterm  # noqa: E402
from range_connector.testing.server_process import ServerProcess, connector_config  # noqa: E402
from range_connector.testing.tiny_models import build_model  # noqa: E402

FORMAT_VERSION = 1
WAYS = ("always", "never", "gate")
HITS = "vllm:external_prefix_cache_hits_total"
PROMPT_TOKENS = "vllm:prompt_tokens_total"
BLOCK_SIZE = 128
CHUNK_TOKENS = 256
_FIRST_SAFE_TOKEN_ID = 16
UNRESOLVED_B0_BYTES_PER_S = 1e11  # hit times that do not grow with bytes: the path is faster than we can resolve
#: how long vLLM may take to publish a request's step stats on /metrics; only a hang takes longer
METRICS_WAIT_S = 60.0


# ---------------------------------------------------------------------------------------------------- engines
class Engine:
    """One API server of the sweep, and the requests sent to it."""

    def __init__(self, way: str, model: Path, work: Path, args: argparse.Namespace, extra: dict | None) -> None:
        self.way = way
        #: the gate's decision for each request is read from its counters (the gate engine only)
        self.counts_decisions = extra is not None and extra.get("load_mode") == "auto"
        ktc = None if extra is None else connector_config(extra)
        self.server = ServerProcess(model, work_dir=work / way, max_model_len=args.max_model_len,
                                    block_size=BLOCK_SIZE, kv_transfer_config=ktc, kvcache_space_gib=1,
                                    extra_env={"VLLM_SERVER_DEV_MODE": "1"})

    @property
    def url(self) -> str:
        return self.server.base_url

    def send(self, ids: list[int], timeout_s: float) -> dict[str, Any]:
        """Empty vLLM's prefix cache, send ``ids`` (``max_tokens = 1``); TTFT and tokens loaded by the connector (and
        on the gate engine, ``decisions``: the gate's decisions counted for the request, by kind)."""
        if not reset_prefix_cache(self.url):
            raise RuntimeError(f"{self.way}: /reset_prefix_cache refused (blocks still held)")
        before = scrape_metrics(self.url)
        decided = gate_decisions(self.url) if self.counts_decisions else {}
        t_s = time.monotonic()
        ttft_s = complete(self.url, prompt_token_ids=ids, max_tokens=1, timeout_s=timeout_s).ttft_s
        # vLLM publishes step stats asynchronously: wait until this request's prompt tokens are counted (its hit and
        # the gate's decision are published with them or before). A scrape from before that must never be read as
        # "nothing loaded".
        counted = before.get(PROMPT_TOKENS, 0.0) + len(ids)
        after = wait_for_metric(self.url, PROMPT_TOKENS, counted, timeout_s=METRICS_WAIT_S)
        if after.get(PROMPT_TOKENS, 0.0) < counted:
            raise RuntimeError(f"{self.way}: the request's prompt tokens were not on /metrics after "
                               f"{METRICS_WAIT_S:g} s, so its loaded tokens cannot be read")
        out = {"t_s": t_s, "ttft_s": ttft_s, "loaded_tokens": int(after.get(HITS, 0.0) - before.get(HITS, 0.0))}
        if self.counts_decisions:
            now = gate_decisions(self.url)
            out["decisions"] = {k: n - decided.get(k, 0) for k, n in now.items() if n > decided.get(k, 0)}
        return out


def never_late_deadline_s(hit_tokens: int, bytes_per_token: float) -> float:
    """A load deadline, seconds, that no prediction of the cost model can exceed for a hit of up to ``hit_tokens``:
    the estimators keep ``T0 <= MAX_T0_S`` and ``B >= MIN_BANDWIDTH_BYTES_PER_S`` (range_connector/cost/estimators.py),
    so a predicted load ``T0 + h·s/B`` is at most this. As ``min_load_deadline_s`` and ``load_deadline_s`` of a fixed
    load mode, no hit is refused for a predicted late finish, and only a hang cuts a load short."""
    return math.ceil(MAX_T0_S + hit_tokens * bytes_per_token / MIN_BANDWIDTH_BYTES_PER_S) + 1.0


def hit_of(n: int) -> int:
    """Tokens the connector offers for a stored ``n``-token prompt: whole chunks, one token left, whole blocks."""
    return min(n // CHUNK_TOKENS * CHUNK_TOKENS, n - 1) // BLOCK_SIZE * BLOCK_SIZE


def fresh_prompt(rng: np.random.Generator, n: int, vocab_size: int) -> list[int]:
    return rng.integers(_FIRST_SAFE_TOKEN_ID, vocab_size, size=n).tolist()


def set_tier(control_file: Path, cap_bytes_per_s: float) -> None:
    """Set the tier's bandwidth cap (0: uncapped) and wait out the wrappers' 100 ms re-read period."""
    write_control_file(control_file, delay_s=0.0, bandwidth_bytes_per_s=float(cap_bytes_per_s), frozen=False)
    time.sleep(0.3)


# ---------------------------------------------------------------------------------------------------- calibration
def calibrate(never: Engine, always: Engine, control_file: Path, args: argparse.Namespace, s: float,
              vocab: int, rng: np.random.Generator) -> dict[str, Any]:
    """``R`` (prefill curve and fixed overhead) on ``never``; ``T0`` and ``B0`` from hits on ``always`` (uncapped)."""
    lengths = args.lengths
    log(f"calibration: prefill sweep on 'never' ({lengths}, {args.cal_repeats} each)")
    prefill_points = measure_prefill(never.url, lengths, repeats=args.cal_repeats, vocab_size=vocab,
                                     report=log)
    try:
        rate, overhead_s = fit_prefill_rate(prefill_points)
        prefill_resolved = True
    except ValueError as exc:  # the times do not grow with length: prefill too fast to resolve against the noise
        n_max, t_max = max(prefill_points)
        rate, overhead_s, prefill_resolved = PrefillRate.constant(n_max / t_max), 0.0, False
        log(f"calibration: {exc}; R from the longest prompt alone ({n_max / t_max:.0f} tokens/s, no overhead)")
    set_tier(control_file, 0.0)
    log("calibration: hits on 'always' with the tier uncapped")
    hit_points: list[tuple[int, float]] = []
    raw_hits = []
    for n in lengths:
        ids, h = fresh_prompt(rng, n, vocab), hit_of(n)
        always.send(ids, args.request_timeout_s)  # computed and stored
        times = []
        for _ in range(args.cal_repeats):
            r = always.send(ids, args.request_timeout_s)
            if r["loaded_tokens"] != h:
                raise RuntimeError(f"calibration: 'always' loaded {r['loaded_tokens']} of {h} tokens (n = {n})")
            times.append(r["ttft_s"])
        med = statistics.median(times)
        raw_hits.append((n, h, med))
        hit_points.append((int(h * s), med - rate.time_s(h, n)))  # minus the one-token suffix
        log(f"  hit {h:>6} of {n:>6} tokens: {med * 1e3:8.1f} ms (median of {args.cal_repeats})")
    # Hit TTFT = overhead + T0 + bytes/B0: the line's intercept less the request overhead fitted on 'never'.
    try:
        fit, fitted = fit_tier_line(hit_points), True
        b0_bytes_per_s, intercept_s = fit.bandwidth_bytes_per_s, fit.t0_s
    except ValueError:  # transfers too short to resolve (tiny model): B0 unmeasurably fast, T0 from the mean
        b0_bytes_per_s, intercept_s, fitted = UNRESOLVED_B0_BYTES_PER_S, statistics.fmean(t for _, t in hit_points), False
    line = TierEstimate(b0_bytes_per_s, max(0.0, intercept_s - overhead_s))
    cal = Calibration(rate, overhead_s, {"file": (line,)}, s, str(args.model_dir), time.time(),
                      tuple(prefill_points), {"file": (tuple((b, max(0.0, t - overhead_s)) for b, t in hit_points),)})
    return {"calibration": cal, "rate": rate, "overhead_s": overhead_s, "prefill_resolved": prefill_resolved,
            "t0_s": line.t0_s,
            "b0_bytes_per_s": line.bandwidth_bytes_per_s, "b0_resolved": fitted,
            "prefill_points": prefill_points, "hit_points": raw_hits,
            "r_tokens_per_s": rate.tokens_per_s(0), "b_star_bytes_per_s": s * rate.tokens_per_s(0)}


def break_even_bytes_per_s(n: int, s: float, rate: PrefillRate, t0_s: float) -> float:
    """``B_be(n) = h·s / (C(0, n) - T0)``: delivered bandwidth at which loading ``hit_of(n)`` ties recomputing."""
    spare_s = rate.time_s(0, n) - t0_s
    return math.inf if spare_s <= 0 else hit_of(n) * s / spare_s


def cap_for(delivered: float, b0: float) -> float:
    """Wrapper cap giving ``delivered`` bytes/s when the uncapped path delivers ``b0`` (0: uncapped, too fast)."""
    return 0.0 if delivered >= 0.95 * b0 else 1.0 / (1.0 / delivered - 1.0 / b0)


# ---------------------------------------------------------------------------------------------------- measurement
def run_grid(engines: dict[str, Engine], control_file: Path, cal: dict[str, Any], args: argparse.Namespace,
             s: float, vocab: int, rng: np.random.Generator, cells: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Measure every cell (appended to ``cells`` as it completes, so an interrupted run keeps them)."""
    rate, t0, b0 = cal["rate"], cal["t0_s"], cal["b0_bytes_per_s"]
    be = {n: break_even_bytes_per_s(n, s, rate, t0) for n in args.lengths}
    finite = [b for b in be.values() if math.isfinite(b)]
    ref = math.exp(statistics.fmean(math.log(b) for b in finite)) if finite else b0 / 4
    order = 0
    for factor in args.speed_factors:
        delivered = factor * ref
        cap = cap_for(delivered, b0)
        delivered = b0 if cap == 0 else 1.0 / (1.0 / cap + 1.0 / b0)
        set_tier(control_file, cap)
        settle_gate(engines["gate"], args, vocab, rng)
        for n in args.lengths:
            ids = fresh_prompt(rng, n, vocab)
            for way in ("always", "gate"):
                engines[way].send(ids, args.request_timeout_s)  # not measured: computes and stores the prompt
            runs: dict[str, list[dict[str, Any]]] = {w: [] for w in WAYS}
            for _ in range(args.runs):
                for way in WAYS[order % 3:] + WAYS[:order % 3]:
                    runs[way].append(engines[way].send(ids, args.request_timeout_s))
                order += 1
            cell = {"prompt_tokens": n, "hit_tokens": hit_of(n), "speed_factor": factor, "cap_bytes_per_s": cap,
                    "delivered_bytes_per_s": delivered, "break_even_bytes_per_s": be[n],
                    "bandwidth_over_break_even": delivered / be[n] if math.isfinite(be[n]) else 0.0,
                    "runs": runs}
            for way in WAYS:
                cell[f"{way}_ttft_s"] = statistics.median(r["ttft_s"] for r in runs[way])
            cell["oracle"] = "always" if cell["always_ttft_s"] < cell["never_ttft_s"] else "never"
            cell["oracle_ttft_s"] = min(cell["always_ttft_s"], cell["never_ttft_s"])
            cell["gate_over_oracle"] = cell["gate_ttft_s"] / cell["oracle_ttft_s"]
            cell["gate_loaded_tokens"] = [r["loaded_tokens"] for r in runs["gate"]]
            cells.append(cell)
            log(f"  B = {delivered / 1e9:6.3f} GB/s ({cell['bandwidth_over_break_even']:4.2f} x B_be) n = {n:>5}: "
                f"always {cell['always_ttft_s'] * 1e3:7.1f} ms, never {cell['never_ttft_s'] * 1e3:7.1f} ms, "
                f"gate {cell['gate_ttft_s'] * 1e3:7.1f} ms ({cell['gate_over_oracle']:.3f} x oracle), "
                f"gate loaded {cell['gate_loaded_tokens']}")
    return cells


def settle_gate(gate: Engine, args: argparse.Namespace, vocab: int, rng: np.random.Generator) -> None:
    """After the tier's speed changed: ``--settle-requests`` unmeasured loads of one stored prompt, so the cells
    measure the gate's decisions at a known speed, not its adaptation to the change (the slow-tier scenario measures
    that). A refusing gate re-measures the tier only by probes, at most one per ``probe_every_refusals`` offers:
    the default is enough for one probe and the decision after it."""
    if args.settle_requests <= 0:
        return
    ids = fresh_prompt(rng, args.lengths[len(args.lengths) // 2], vocab)
    gate.send(ids, args.request_timeout_s)  # computes and stores it
    for _ in range(args.settle_requests):
        gate.send(ids, args.request_timeout_s)


def summarise_grid(cells: list[dict[str, Any]]) -> dict[str, Any]:
    oracle = sum(c["oracle_ttft_s"] for c in cells)
    ratios = [c["bandwidth_over_break_even"] for c in cells]
    return {
        "num_cells": len(cells),
        "share_within_10pct": sum(c["gate_over_oracle"] <= 1.10 for c in cells) / len(cells),
        "regret": sum(c["gate_ttft_s"] - c["oracle_ttft_s"] for c in cells) / oracle,
        "worst_gate_over_oracle": max(c["gate_over_oracle"] for c in cells),
        "cells_always_better_measured": sum(c["oracle"] == "always" for c in cells),
        "cells_never_better_measured": sum(c["oracle"] == "never" for c in cells),
        "cells_above_break_even_predicted": sum(r > 1 for r in ratios),
        "cells_below_break_even_predicted": sum(r <= 1 for r in ratios),
        "cells_within_30pct_of_break_even_predicted": sum(abs(r - 1) <= 0.3 for r in ratios),
        "cells_within_30pct_measured": sum(abs(c["always_ttft_s"] / c["never_ttft_s"] - 1) <= 0.3 for c in cells),
        "targets": {"share_within_10pct": 0.9, "regret": 0.05},
    }


def gate_decisions(url: str) -> dict[str, int]:
    """The gate's decisions so far, by kind (``vllm:range_gate_decisions_total{decision=...}``, Range's own counter:
    ``taken``, ``shortened``, ``refused``, ``probe``)."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{url}/metrics", timeout=10.0).text
    out: dict[str, int] = {}
    for f in text_string_to_metric_families(text):
        for sample in f.samples:
            if sample.name == "vllm:range_gate_decisions_total" and "decision" in sample.labels:
                kind = sample.labels["decision"]
                out[kind] = out.get(kind, 0) + int(sample.value)
    return out


def gate_probes(url: str) -> int:
    """The gate's probes so far (``vllm:range_gate_decisions_total{decision="probe"}``)."""
    return gate_decisions(url).get("probe", 0)


def run_slow_tier(gate: Engine, control_file: Path, fast_cap: float, slow_cap: float, args: argparse.Namespace,
                  vocab: int, rng: np.random.Generator) -> dict[str, Any]:
    n = max(args.lengths)
    h, ids = hit_of(n), fresh_prompt(rng, n, vocab)
    set_tier(control_file, fast_cap)
    gate.send(ids, args.request_timeout_s)  # stores the prompt
    requests = []
    for phase, cap, count in (("fast", fast_cap, args.slow_phases[0]), ("slow", slow_cap, args.slow_phases[1]),
                              ("recovered", fast_cap, args.slow_phases[2])):
        set_tier(control_file, cap)
        for i in range(count):
            probes_before = gate_probes(gate.url)
            r = gate.send(ids, args.request_timeout_s)
            r.update(phase=phase, idx_in_phase=i, probes=gate_probes(gate.url) - probes_before,
                     decision="full" if r["loaded_tokens"] >= h else "partial" if r["loaded_tokens"] else "none")
            requests.append(r)
            log(f"  {phase:>9} #{i}: loaded {r['loaded_tokens']:>5} of {h} tokens ({r['decision']}), "
                f"TTFT {r['ttft_s'] * 1e3:7.1f} ms" + (f", {r['probes']} background probe(s)" if r["probes"] else ""))

    def first(phase: str, pred) -> int | None:
        return next((r["idx_in_phase"] + 1 for r in requests if r["phase"] == phase and pred(r)), None)

    slow = [r for r in requests if r["phase"] == "slow"]
    slow_s = (slow[-1]["t_s"] + slow[-1]["ttft_s"] - slow[0]["t_s"]) if slow else 0.0
    partial = sum(r["decision"] == "partial" for r in slow)
    return {"prompt_tokens": n, "hit_tokens": h, "fast_cap_bytes_per_s": fast_cap, "slow_cap_bytes_per_s": slow_cap,
            "probe_interval_s_config": args.probe_interval_note,
            "requests": requests,
            "requests_until_full_hit_dropped": first("slow", lambda r: r["decision"] != "full"),
            "requests_until_full_hit_retaken": first("recovered", lambda r: r["decision"] == "full"),
            "slow_requests_full": sum(r["decision"] == "full" for r in slow),
            "slow_requests_partial": partial, "slow_requests_none": sum(r["decision"] == "none" for r in slow),
            "slow_phase_s": slow_s, "slow_partial_loads_per_s": partial / slow_s if slow_s else None,
            "slow_background_probes": sum(r["probes"] for r in slow),
            "slow_background_probes_per_s": sum(r["probes"] for r in slow) / slow_s if slow_s else None,
            "median_ttft_s": {p: statistics.median(r["ttft_s"] for r in requests if r["phase"] == p)
                              for p in ("fast", "slow", "recovered") if any(r["phase"] == p for r in requests)}}


# ---------------------------------------------------------------------------------------------------- output
def plot(doc: dict[str, Any], png: Path) -> str:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        return f"no plot: {exc}"
    cells = doc["cells"]
    lengths = sorted({c["prompt_tokens"] for c in cells})
    factors = sorted({c["speed_factor"] for c in cells})
    cell = {(c["speed_factor"], c["prompt_tokens"]): c for c in cells}
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.8))
    panels = (("always / never (median TTFT): < 1 loading pays", lambda c: c["always_ttft_s"] / c["never_ttft_s"],
               "RdBu_r", (0.25, 4.0)),
              ("gate / oracle (median TTFT)", lambda c: c["gate_over_oracle"], "Reds", (0.8, 1.5)))
    for ax, (title, value, cmap, (lo, hi)) in zip(axes, panels):
        grid = np.array([[value(cell[(f, n)]) if (f, n) in cell else np.nan for n in lengths] for f in factors])
        norm = matplotlib.colors.LogNorm(lo, hi)
        im = ax.imshow(grid, origin="lower", cmap=cmap, norm=norm, aspect="auto")
        for i, f in enumerate(factors):
            for j, n in enumerate(lengths):
                c = cell.get((f, n))
                if c is None:  # an interrupted run
                    continue
                extra = f"\n{c['oracle'][0].upper()}" if "gate" in title else ""
                ax.text(j, i, f"{grid[i, j]:.2f}{extra}", ha="center", va="center", fontsize=8)
        ax.set_xticks(range(len(lengths)), [str(n) for n in lengths])
        ax.set_yticks(range(len(factors)),
                      [f"{next(c for c in cells if c['speed_factor'] == f)['delivered_bytes_per_s'] / 1e9:.2f} GB/s "
                       f"({f:g}x)" for f in factors])
        ax.set_xlabel("prompt tokens")
        ax.set_ylabel("tier delivered bandwidth (x mean B_be)")
        ax.set_title(title, fontsize=10)
        fig.colorbar(im, ax=ax)
    s = doc["summary"]
    fig.suptitle(f"threshold sweep: gate within 10% of oracle in {s['share_within_10pct']:.0%} of cells, "
                 f"regret {s['regret']:+.1%} (A/N: oracle is always/never)", fontsize=10)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return str(png)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    ints = lambda t: [int(x) for x in t.split(",")]  # noqa: E731
    floats = lambda t: [float(x) for x in t.split(",")]  # noqa: E731
    p.add_argument("--smoke", action="store_true", help="tiny model, 2 lengths x 2 bandwidths, 2 runs")
    p.add_argument("--model-size", choices=("tiny", "bench"), default=None, help="default: bench (tiny with --smoke)")
    p.add_argument("--lengths", type=ints, default=None, help="prompt tokens (default 513,769,1025,1281)")
    p.add_argument("--speed-factors", type=floats, default=None,
                   help="delivered bandwidths as multiples of the mean break-even bandwidth (default 0.45,0.8,1.25,2.2)")
    p.add_argument("--runs", type=int, default=None, help="measured rounds per cell (default 5)")
    p.add_argument("--cal-repeats", type=int, default=3, help="requests per length in calibration")
    p.add_argument("--settle-requests", type=int, default=None,
                   help="unmeasured gate requests after each change of tier speed (default 6; 2 with --smoke)")
    p.add_argument("--slow-factor", type=float, default=0.2, help="slow tier, as a multiple of mean B_be")
    p.add_argument("--slow-phases", type=ints, default=None, help="requests fast,slow,recovered (default 5,10,8)")
    p.add_argument("--no-slow-tier", action="store_true", help="skip the slow-tier scenario")
    p.add_argument("--load-deadline-s", type=float, default=None,
                   help="connector load_deadline_s of the gate engine (default: the connector's, 30 s); the always "
                        "engine's is at least this, and long enough that no load is refused as late")
    p.add_argument("--request-timeout-s", type=float, default=120.0)
    p.add_argument("--start-timeout-s", type=float, default=600.0)
    p.add_argument("--wait-quiet-s", type=float, default=0.0,
                   help="before calibration and the grid, wait up to this long for other work to use < 0.5 core")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=None, help="JSON path (default bench/results/threshold-<time>.json)")
    args = p.parse_args(argv)
    smoke = args.smoke
    args.model_size = args.model_size or ("tiny" if smoke else "bench")
    args.lengths = args.lengths or ([513, 1025] if smoke else [513, 769, 1025, 1281])
    args.speed_factors = args.speed_factors or ([0.5, 2.0] if smoke else [0.45, 0.8, 1.25, 2.2])
    args.runs = args.runs or (2 if smoke else 5)
    if args.settle_requests is None:
        args.settle_requests = 2 if smoke else 6
    args.slow_phases = args.slow_phases or ([2, 3, 3] if smoke else [5, 10, 8])
    if smoke:
        args.cal_repeats = min(args.cal_repeats, 2)
    for name in ("lengths", "speed_factors", "slow_phases"):
        if any(v <= 0 for v in getattr(args, name)) if name != "slow_phases" else any(v < 0 for v in args.slow_phases):
            p.error(f"--{name.replace('_', '-')}: values must be positive")
    if len(args.slow_phases) != 3 or args.runs < 1 or min(args.lengths) <= CHUNK_TOKENS:
        p.error("--slow-phases needs 3 counts, --runs >= 1, every length > 256 (one chunk)")
    args.max_model_len = max(args.lengths) + 16
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from range_connector.cost.gate import GateConfig
    unwind_on_sigterm()

    args.probe_interval_note = GateConfig().probe_interval_s
    args.model_dir = build_model("gqa", args.model_size)
    facts = model_facts(args.model_dir)
    s, vocab = float(facts.bytes_per_token), facts.vocab_size
    rng = np.random.default_rng([args.seed, time.time_ns()])
    stamp = time.strftime("%Y%m%d-%H%M%S")
    out = args.out or Path(__file__).resolve().parent / "results" / f"threshold-{stamp}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    doc: dict[str, Any] = {"format_version": FORMAT_VERSION, "command": shlex.join([sys.argv[0], *(argv or sys.argv[1:])]),
                           "machine": machine_info(), "versions": versions(), "git": git_state(),
                           "config": {"smoke": args.smoke, "model": str(args.model_dir), "model_size": args.model_size,
                                      "bytes_per_token": s, "num_layers": facts.num_layers, "lengths": args.lengths,
                                      "speed_factors": args.speed_factors, "runs": args.runs,
                                      "block_size": BLOCK_SIZE, "chunk_tokens": CHUNK_TOKENS, "backend": "file"}}
    with tempfile.TemporaryDirectory(prefix="range-threshold-") as tmp:
        work = Path(tmp)
        control_file, cal_file = work / "tier.json", work / "calibration.json"
        write_control_file(control_file, delay_s=0.0, bandwidth_bytes_per_s=0.0, frozen=False)
        # The file tier (page cache) behind the wrapper: reads are charged by the bytes read. (The DRAM tier lends
        # whole stripes as views, which the wrapper charges in full: a one-chunk probe would cost a whole prompt.)
        common = {"chunk_tokens": CHUNK_TOKENS}

        def file_tier(directory: Path) -> list[dict[str, Any]]:
            return [{"type": "file", "directory": str(directory), "testing": {"control_file": str(control_file)}}]

        if args.load_deadline_s is not None:
            common["load_deadline_s"] = args.load_deadline_s
        # "always" loads every hit: its deadline is one no prediction can exceed, so no load is refused for a
        # predicted late finish (on a busy machine its estimators may well predict loads slower than recomputing)
        always_deadline_s = max(common.get("load_deadline_s", 0.0),
                                never_late_deadline_s(hit_of(max(args.lengths)), s))
        engines = {"never": Engine("never", args.model_dir, work, args, None),
                   "always": Engine("always", args.model_dir, work, args,
                                    {**common, "load_mode": "pipelined", "tiers": file_tier(work / "kv-always"),
                                     "min_load_deadline_s": always_deadline_s, "load_deadline_s": always_deadline_s})}
        doc["config"]["always_load_deadline_s"] = always_deadline_s
        try:
            for e in engines.values():
                e.server.start()
            for e in engines.values():
                log(f"{e.way}: ready in {e.server.wait_ready(args.start_timeout_s):.0f} s ({e.url})")
            doc["machine"]["busy_cores_before_calibration"] = wait_quiet(0.5, args.wait_quiet_s)
            cal = calibrate(engines["never"], engines["always"], control_file, args, s, vocab, rng)
            write_calibration(cal["calibration"], cal_file)
            log(f"R = {cal['r_tokens_per_s']:.0f} tokens/s at context 0, overhead {cal['overhead_s'] * 1e3:.1f} ms, "
                f"T0 = {cal['t0_s'] * 1e3:.1f} ms, B0 = {cal['b0_bytes_per_s'] / 1e9:.2f} GB/s, "
                f"B* = s.R = {cal['b_star_bytes_per_s'] / 1e9:.3f} GB/s")
            engines["gate"] = Engine("gate", args.model_dir, work, args,
                                     {**common, "load_mode": "auto", "calibration_file": str(cal_file),
                                      "tiers": file_tier(work / "kv-gate")})
            engines["gate"].server.start()
            log(f"gate: ready in {engines['gate'].server.wait_ready(args.start_timeout_s):.0f} s")
            doc["calibration"] = {k: v for k, v in cal.items() if k not in ("calibration", "rate")}
            doc["calibration"]["file"] = cal["calibration"].to_json()
            doc["machine"]["busy_cores_before_grid"] = round(wait_quiet(0.5, args.wait_quiet_s) or busy_cores(1.0), 2)
            log(f"grid: {len(args.speed_factors)} bandwidths x {len(args.lengths)} lengths x {args.runs} runs")
            doc["cells"] = []
            run_grid(engines, control_file, cal, args, s, vocab, rng, doc["cells"])
            doc["summary"] = summarise_grid(doc["cells"])
            if not args.no_slow_tier:
                caps = sorted(c["cap_bytes_per_s"] for c in doc["cells"])
                fast = 0.0 if 0.0 in caps else max(caps)
                be_ref = min(c["delivered_bytes_per_s"] / c["speed_factor"] for c in doc["cells"])
                slow = cap_for(args.slow_factor * be_ref, cal["b0_bytes_per_s"])
                log(f"slow tier: fast cap {fast / 1e9:.3f} GB/s (0: none), slow cap {slow / 1e9:.3f} GB/s")
                doc["slow_tier"] = run_slow_tier(engines["gate"], control_file, fast, slow, args, vocab, rng)
        except KeyboardInterrupt:  # keep what was measured
            doc["interrupted"] = True
            log("interrupted: writing the cells measured so far")
        finally:
            doc["engine_logs_tail"] = {w: e.server.log_tail(15) for w, e in engines.items()}
            for e in engines.values():
                e.server.stop()
    doc["elapsed_s"] = time.monotonic() - started
    doc["machine"]["loadavg_end"] = machine_info()["loadavg"]
    if doc.get("cells") and "summary" not in doc:
        doc["summary"] = summarise_grid(doc["cells"])
    doc["plot"] = plot(doc, out.with_suffix(".png")) if doc.get("cells") else None
    out.write_text(json.dumps(doc, indent=1))
    if "summary" not in doc:
        log(f"wrote {out} (no cell measured)")
        return 1
    sm = doc["summary"]
    log(f"gate within 10% of the oracle in {sm['share_within_10pct']:.0%} of {sm['num_cells']} cells "
        f"(target 90%), regret {sm['regret']:+.2%} (target <= 5%), worst {sm['worst_gate_over_oracle']:.3f}x; "
        f"oracle always/never: {sm['cells_always_better_measured']}/{sm['cells_never_better_measured']}")
    if "slow_tier" in doc:
        st = doc["slow_tier"]
        log(f"slow tier: full hit dropped after {st['requests_until_full_hit_dropped']} request(s), retaken after "
            f"{st['requests_until_full_hit_retaken']}; while slow: {st['slow_requests_full']} full, "
            f"{st['slow_requests_partial']} partial, {st['slow_requests_none']} none in {st['slow_phase_s']:.1f} s, "
            f"{st['slow_background_probes']} background probe(s)")
    log(f"wrote {out} ({doc['elapsed_s']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
