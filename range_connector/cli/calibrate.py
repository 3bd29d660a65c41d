"""``range-connector calibrate``: measure ``R``, ``B`` and ``T0`` here, write the calibration file, print the table.

* ``R``: a short prefill sweep against a vLLM API server (a running one given by URL, or one started on the model
  without a connector): for each prompt length, fresh random token ids (so neither vLLM's prefix cache nor a
  connector can hit), ``max_tokens = 1``, the client's time to first token; the median per length is fitted with
  ``overhead + c1·n + c2·n²/2`` (:func:`~range_connector.cost.calibration_file.fit_prefill_rate`), which removes the
  fixed per-request overhead (HTTP, scheduling, the one decode step) from the rate.
* ``B`` and ``T0``: for each configured backend and shard, synthetic stripes of the model's layer count written
  through the real backend classes, each read whole in one ``read_ranges`` call (as a load reads them), median of
  a few reads per size, fitted with ``T0 + bytes/B`` (:func:`~range_connector.cost.calibration_file.fit_tier_line`).
  The stripes are dropped afterwards. The engine's own fixed cost of a hit is not visible from here:
  ``engine_t0_s`` adds it to every tier's ``T0`` when known.
* The break-even table per backend (:func:`break_even_rows`): ``B``, ``T0``, ``B* = s·R``, the shortest prompt that
  can win, and the predicted saving of loading a whole prompt at a few lengths.

Every option is checked before anything starts (:func:`~range_connector.cli.calibrate_options.check_options`), and
the tiers are measured before the prefill sweep, so a bad option or a tier that fails is found before the engine's
start-up.
"""

from __future__ import annotations

import contextlib
import logging
import statistics
import tempfile
import time
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from range_connector.backends.base import Backend, RangeRead, StripeWrite
from range_connector.backends.valkey.urls import redact_url
from range_connector.cli.calibrate_options import (  # (the options and their checks; importable from here too)
    FULL_PROMPT_TOKENS,
    FULL_READ_BYTES,
    MAX_MODEL_LEN_MARGIN_TOKENS,
    QUICK_PROMPT_TOKENS,
    QUICK_READ_BYTES,
    TABLE_PROMPT_TOKENS,
    CalibrateOptions,
    MiB,
    ModelFacts,
    check_options,
    model_facts,
    tier_config,
)
from range_connector.config import RangeConfig
from range_connector.cost.calibration_file import Calibration, fit_prefill_rate, fit_tier_line
from range_connector.cost.model import (
    PrefillRate,
    TierEstimate,
    break_even_bandwidth_bytes_per_s,
    combine_shards,
    load_time_s,
    min_winning_prompt_tokens,
)
from range_connector.errors import ConfigError

__all__ = [
    "FULL_PROMPT_TOKENS", "FULL_READ_BYTES", "QUICK_PROMPT_TOKENS", "QUICK_READ_BYTES", "TABLE_PROMPT_TOKENS",
    "CalibrateOptions", "MiB", "ModelFacts", "break_even_rows", "build_calibration", "check_options",
    "measure_prefill", "measure_tier", "model_facts", "run_calibration", "tier_config", "unique_backends",
]

logger = logging.getLogger(__name__)

_FIRST_SAFE_TOKEN_ID = 16  # random prompts avoid the tokenizer's special tokens at the start of the vocabulary


def measure_prefill(base_url: str, prompt_tokens: Sequence[int], *, repeats: int, vocab_size: int, seed: int = 0,
                    timeout_s: float = 120.0, report: Callable[[str], None] = print) -> list[tuple[int, float]]:
    """Median client TTFT of ``max_tokens = 1`` requests with fresh random prompts, per length.

    One warm-up request is sent first and not counted.

    Args:
        base_url: ``http://host:port`` of a vLLM API server.
        prompt_tokens: lengths to measure (each below the server's ``max_model_len``).
        repeats: requests per length.
        vocab_size: token ids are drawn from ``[16, vocab_size)``.
        seed: random seed of the prompts (mixed with the time, so reruns do not hit).
        timeout_s: per-request timeout, seconds.
        report: where progress lines go.

    Returns:
        ``[(prompt tokens, median seconds)]``.

    Raises:
        httpx.HTTPError: the server failed a request.
    """
    from range_connector.testing.client import complete

    rng = np.random.default_rng([seed, time.time_ns()])

    def ttft(n: int) -> float:
        ids = rng.integers(_FIRST_SAFE_TOKEN_ID, vocab_size, size=n).tolist()
        return complete(base_url, prompt_token_ids=ids, max_tokens=1, timeout_s=timeout_s).ttft_s

    ttft(min(prompt_tokens))
    points = []
    for n in prompt_tokens:
        median_s = statistics.median(ttft(n) for _ in range(repeats))
        report(f"  prefill {n:>6} tokens: {median_s * 1e3:8.1f} ms (median of {repeats})")
        points.append((n, median_s))
    return points


#: the clock tier reads are timed with (seconds; tests replace it with one driven by the bytes read)
_clock: Callable[[], float] = time.perf_counter


def measure_tier(backend: Backend, read_bytes: Sequence[int], *, num_layers: int, repeats: int,
                 report: Callable[[str], None] = print) -> list[tuple[int, float]]:
    """Median seconds to read a stripe of ``num_layers`` equal layer values whole, per total size.

    Each size is written once as a stripe of this tool's own (no tickets), read ``repeats`` times into one
    preallocated buffer with one ``read_ranges`` call per read, then dropped.

    Args:
        backend: one shard's backend.
        read_bytes: total bytes per read (split over the layers; capped at the tier's value limit per layer).
        num_layers: layer values per stripe.
        repeats: reads per size.
        report: where progress lines go.

    Returns:
        ``[(bytes read, median seconds)]``.

    Raises:
        BackendError: the tier failed; ``RuntimeError`` if a stripe could not be stored or read back.
    """
    sizes = sorted({max(1, min(total // num_layers, backend.max_value_bytes)) for total in read_bytes})
    payload = np.random.default_rng(0).integers(0, 256, size=max(sizes) * num_layers, dtype=np.uint8)
    dest = bytearray(max(sizes) * num_layers)
    points = []
    for layer_bytes in sizes:
        sid = uuid.uuid4().hex
        values = [memoryview(payload[i * layer_bytes:(i + 1) * layer_bytes]) for i in range(num_layers)]
        if not backend.write_stripe(StripeWrite(sid, values, ())):
            raise RuntimeError(f"{redact_url(backend.name)}: no room for a {layer_bytes * num_layers}-byte calibration stripe")
        try:
            view = memoryview(dest)
            reads = [RangeRead(sid, i, 0, layer_bytes, layer_bytes, view[i * layer_bytes:(i + 1) * layer_bytes])
                     for i in range(num_layers)]
            times = []
            for _ in range(repeats):
                start = _clock()
                ok = backend.read_ranges(reads)
                times.append(_clock() - start)
                if not all(ok):
                    raise RuntimeError(f"{redact_url(backend.name)}: calibration stripe {sid} was not read back")
        finally:
            backend.drop_stripes([sid])
        total, median_s = layer_bytes * num_layers, statistics.median(times)
        report(f"  read {total / MiB:8.1f} MiB: {median_s * 1e3:8.2f} ms ({total / median_s / 1e9:.2f} GB/s)")
        points.append((total, median_s))
    return points


def build_calibration(prefill_points: Sequence[tuple[int, float]], tier_points: dict[str, list[list[tuple[int, float]]]],
                      *, bytes_per_token: float | None, model: str | None, tokens_per_s: float | None = None,
                      engine_t0_s: float = 0.0) -> Calibration:
    """Fit measurements into a :class:`Calibration`.

    Args:
        prefill_points: ``[(prompt tokens, seconds)]`` (may be empty: then ``tokens_per_s`` or no prefill).
        tier_points: ``{backend: [num_shards] [(bytes, seconds)]}``.
        bytes_per_token: ``s`` of the model.
        model: what was measured.
        tokens_per_s: a constant ``R`` to record when the prefill was not measured.
        engine_t0_s: fixed engine seconds per hit added to every tier's ``T0``.

    Raises:
        ValueError: measurements that cannot be fitted (see the fit functions).
    """
    prefill, overhead = (None, 0.0)
    if prefill_points:
        prefill, overhead = fit_prefill_rate(prefill_points)
    elif tokens_per_s:
        prefill = PrefillRate.constant(tokens_per_s)
    tiers = {}
    for name, shards in tier_points.items():
        fits = [fit_tier_line(points) for points in shards]
        tiers[name] = tuple(TierEstimate(f.bandwidth_bytes_per_s, f.t0_s + engine_t0_s) for f in fits)
    return Calibration(prefill, overhead, tiers, bytes_per_token, model, time.time(),
                       tuple((int(n), float(s)) for n, s in prefill_points),
                       {name: tuple(tuple(p) for p in shards) for name, shards in tier_points.items()})


def break_even_rows(calibration: Calibration, prompt_tokens: Sequence[int] = TABLE_PROMPT_TOKENS,
                    ) -> tuple[tuple[str, ...], list[tuple[str, ...]]]:
    """The break-even table: one row per backend.

    Columns: backend, shards, delivered ``B`` (GB/s, all shards read in parallel), ``T0`` (ms), ``B*`` (GB/s),
    the shortest prompt that wins (tokens; ``never`` when ``B <= B*``), and for each prompt length the predicted
    saving of loading all of it, ``recompute - load`` in seconds and as a share of recompute (negative: a loss).

    Raises:
        ValueError: the calibration has no prefill rate or no ``bytes_per_token``.
    """
    if calibration.prefill is None or not calibration.bytes_per_token:
        raise ValueError("calibration: the table needs a prefill rate and bytes_per_token")
    rate, s = calibration.prefill, calibration.bytes_per_token
    header = ("BACKEND", "SHARDS", "B_GB/S", "T0_MS", "B*_GB/S", "SHORTEST_WIN_TOKENS",
              *(f"SAVE@{n}" for n in prompt_tokens))
    rows = []
    for name, shards in calibration.tiers.items():
        tier = combine_shards(shards)
        shortest = min_winning_prompt_tokens(tier.t0_s, rate, s, tier.bandwidth_bytes_per_s)
        cells = []
        for n in prompt_tokens:
            recompute = rate.time_s(0, n)
            saving = recompute - load_time_s(n, s, tier.bandwidth_bytes_per_s, tier.t0_s)
            cells.append(f"{saving:+.3f}s ({saving / recompute:+.0%})")
        rows.append((name, str(len(shards)), f"{tier.bandwidth_bytes_per_s / 1e9:.2f}", f"{tier.t0_s * 1e3:.2f}",
                     f"{break_even_bandwidth_bytes_per_s(s, rate) / 1e9:.2f}",
                     "never" if shortest is None else str(shortest), *cells))
    return header, rows


def unique_backends(backends: Sequence[Backend]) -> list[Backend]:
    """One backend per distinct instance (the DRAM tier is one instance for every shard)."""
    return list({id(b): b for b in backends}.values())


def _own_embedded_servers(config: RangeConfig, keep: bool, report: Callable[[str], None],
                          cleanup: contextlib.ExitStack) -> None:
    """Start the tier's embedded servers now, and have ``cleanup`` stop them if this run started every one of them
    (servers that were already running, even in part, are someone else's and are left alone), unless ``keep``."""
    from range_connector.backends.valkey.servers import start_embedded, stop_servers

    runtime_dir = Path(config.resolved_runtime_dir)
    servers = start_embedded(config.num_shards, runtime_dir, start_timeout_s=config.tier.start_timeout_s,
                             maxmemory_bytes=config.tier.embedded_maxmemory_bytes)
    if len(servers.started_shard_idxs) < len(servers.urls):
        report(f"embedded Valkey servers in {runtime_dir} were already running: left running")
    elif keep:
        report(f"started {len(servers.urls)} embedded Valkey server(s) in {runtime_dir}; kept (--keep-servers): "
               f"`range-connector valkey stop --runtime-dir {runtime_dir}` stops them")
    else:
        cleanup.callback(lambda: report(f"stopped {stop_servers(runtime_dir)} embedded Valkey server(s) this run "
                                        f"started in {runtime_dir}"))


def run_calibration(opts: CalibrateOptions, report: Callable[[str], None] = print) -> Calibration:
    """Measure, fit and write the calibration file (see the module docstring). The options are checked first
    (:func:`check_options`); then the tiers are measured (embedded servers started and stopped as needed), then
    the prefill sweep runs: a tier that fails is found before the engine starts.

    Raises:
        ConfigError: bad options or config (names the option or key); BackendError: a tier failed;
        ServerError: the engine did not start.
    """
    from range_connector.backends.factory import open_shard_backends

    facts, configs = check_options(opts)
    s = opts.bytes_per_token or (facts.bytes_per_token if facts else None)
    num_layers = opts.num_layers or (facts.num_layers if facts else None)
    vocab = opts.vocab_size or (facts.vocab_size if facts else None)
    tier_points: dict[str, list[list[tuple[int, float]]]] = {}
    for name in opts.backends:
        with contextlib.ExitStack() as cleanup:
            if configs[name].tier.embedded:
                _own_embedded_servers(configs[name], opts.keep_servers, report, cleanup)
            backends = open_shard_backends(configs[name])
            cleanup.callback(lambda bs=backends: [b.close() for b in unique_backends(bs)])
            tier_points[name] = []
            for shard_idx, backend in enumerate(unique_backends(backends)):
                report(f"{name} shard {shard_idx}: {redact_url(backend.name)}")
                tier_points[name].append(measure_tier(backend, opts.read_bytes, num_layers=num_layers,
                                                      repeats=opts.read_repeats, report=report))
    prefill_points: list[tuple[int, float]] = []
    if not opts.skip_prefill:
        if opts.url:
            report(f"prefill sweep against {opts.url}")
            prefill_points = measure_prefill(opts.url, opts.prompt_tokens, repeats=opts.prefill_repeats,
                                             vocab_size=vocab)
        else:
            from range_connector.testing.server_process import ServerProcess

            with tempfile.TemporaryDirectory(prefix="range-calibrate-") as work, ServerProcess(
                    opts.model, work_dir=work,
                    max_model_len=max(opts.prompt_tokens) + MAX_MODEL_LEN_MARGIN_TOKENS) as server:
                report(f"starting vLLM on {opts.model} (no connector) ...")
                server.wait_ready(timeout_s=opts.start_timeout_s)
                report(f"prefill sweep against {server.base_url}")
                prefill_points = measure_prefill(server.base_url, opts.prompt_tokens,
                                                 repeats=opts.prefill_repeats, vocab_size=vocab)
    calibration = build_calibration(prefill_points, tier_points, bytes_per_token=s,
                                    model=opts.model or opts.url, tokens_per_s=opts.tokens_per_s,
                                    engine_t0_s=opts.engine_t0_s)
    from range_connector.cost.calibration_file import write_calibration

    try:
        report(f"wrote {write_calibration(calibration, opts.output)}")
    except OSError as exc:  # (checked at the start; the disk may have filled up since)
        raise ConfigError("--output", f"cannot write the calibration file: {exc}") from exc
    return calibration
