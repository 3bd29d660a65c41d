"""``make demo``: what Range is for on the CPU, replaying one trace: P/D and a fleet, each against what users run.

Run ``python -m range_connector.bench.demo`` (``make demo``; ``make demo TRACE=file`` adds ``--trace file``). It

1. builds (or finds) the model, ``tiny_models.build_model("gqa", "bench")`` by default (see *Model* below);
2. starts one embedded Valkey server per shard (2 shards) in ``<demo dir>/run/valkey``, a prefill engine
   (``kv_role`` ``kv_producer``, core 0) and a decode engine (``kv_role`` ``kv_consumer``, core 1), both with Range
   on those servers, then ``range-connector proxy`` in front of them;
3. replays the trace through the proxy (:func:`range_connector.bench.replay.run_replay`: each request at its arrival
   time, streamed, greedy, ``ignore_eos``), reading both engines' ``/metrics`` around it, and stops all of that
   (``range-pd``);
4. replays the same trace against one vLLM engine without a connector (``none``, core 0, vLLM's own prefix cache
   on, like the two P/D engines);
5. unless ``--no-fleet``, replays it twice more through ``range-connector proxy --policy prefix_aware`` in front of
   two ``kv_both`` engines (core 0 and core 1, started in parallel, vLLM's prefix cache on;
   :func:`range_connector.bench.fleet.run_fleet`): without a connector (``prefix-none``, what users run today) and
   with Range on two embedded Valkey shards both engines share (``prefix-range``);
6. prints the P/D table (:func:`range_connector.bench.replay_report.format_comparison`: ``range-pd`` against
   ``none``, with ratios), then the fleet table (``prefix-range`` against ``prefix-none``) and each fleet engine's
   shares (from its own prefix cache, loaded from the shared tier), each table followed by a verdict line that
   says whether Range was faster or slower than the alternative at TTFT p50 and p99 (:func:`ttft_verdict`, from
   the reports), then how to add LMCache's column (:func:`lmcache_hint`), then the paths of the JSON (all four
   reports) and the two PNGs in ``<demo dir>/results``.

The trace: by default the built-in synthetic Mooncake-format trace
(:func:`range_connector.bench.synthetic_trace.synthetic_trace`: 40 requests, multi-turn conversations over shared system
prompts, Poisson arrivals at 1/s), token counts x 1/16 (hash block 512 -> 32 tokens; prompts of 43-867 tokens,
19,406 in all; at best 76% of them can come from a prefix cache). ``--trace FILE`` replays a real Mooncake
``.jsonl`` (or Azure ``.csv``) file instead: 100 requests of whole conversations
(:func:`range_connector.bench.trace_transforms.sample_conversations`; contiguous slices share almost nothing), token
counts x 1/32, arrivals compressed to span ``--duration-s`` (90 s). Every transform is printed and kept in the JSON.

Counting: vLLM counts a P/D prompt on both engines (the prefill engine computes it, the decode engine admits it
again), so the ``range-pd`` column's engine rows (prompt tokens, local and tier hits, their shares, engine TTFT)
are the decode engine's; both engines' totals are in the JSON. The decode engine's TTFT starts when the proxy
forwards the request, after prefill, so it is shorter than the client's.

Model (measured here, 29 November 2026: one engine on one core, the 2-core machine's load average 8 from other
work, no prefix caching, prompts of 256 / 1,024 / 2,048 tokens, 33 output tokens):

=========================================  ===========================  ============  ===========
model                                      prefill tokens/s             TTFT 2,048    TPOT
=========================================  ===========================  ============  ===========
``tiny`` (4 layers, 2 KiB of KV a token)   5,640 / 5,680 / 4,570        0.45 s        15-18 ms
``bench`` (32 layers, 128 KiB a token)     805 / 373 / 291              7.0 s         31-70 ms
=========================================  ===========================  ============  ===========

The bench model is fast enough: the scaled synthetic trace needs about 5,000 tokens of prefill that no prefix cache
can serve (15-20 s of one core) within its 47 s of arrivals. P/D and ``none`` take about 5 minutes once the model is
built, the fleet phase about 5 more (each engine start is 35-50 s on 2 cores). It is the one worth showing: its KV
per token is an 8B Llama's, so the 2.5 GB of KV the decode engine loads is real work for the tier, where the tiny
model's 2 KiB a token would make every load free. ``--model-size tiny`` runs the demo on the tiny model instead.

Counting in the fleet: each prompt is counted once, on the engine that served it, so the fleet columns' engine rows
sum both engines; a tier hit there is a prefix that engine's own cache did not hold (computed by the other engine,
or by itself and evicted since).

Engines: block size 64 tokens and chunks of 128 (one block per shard per chunk; at the default 128/256 most of these
short prompts would end inside their last, unsaved chunk), ``--enforce-eager``, ``max_model_len`` 4096, KV cache
1 GiB each (prefill, decode, ``none``, the fleet's engines: the machine is shared; 2 GiB ran it out of memory once).
Range's settings are the same in P/D and in the fleet.

Everything it started (engines, proxy, Valkey) is stopped on success, on errors and on Ctrl-C or SIGTERM. Exit
status: 0 when every request of every replay (P/D, ``none`` and the fleet's two) succeeded and the decode engine
loaded tokens from the tier; 1, with one ``FAILED:`` line, otherwise (whether ``prefix-range`` loaded anything from
the tier is reported, not required); 130 when interrupted.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shlex
import shutil
import signal
import sys
import time
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any

from range_connector.bench.stack import (
    BLOCK_TOKENS,
    CHUNK_TOKENS,
    MAX_MODEL_LEN_TOKENS,
    NUM_SHARDS,
    PROXY_TIMEOUT_S,
    STARTUP_TIMEOUT_S,
    Cleanup,
    DemoError,
    ProxyProcess,
    engine_server,
    log,
    one_line,
    replay_primed,
)
from range_connector.testing.server_process import connector_config

if TYPE_CHECKING:
    from collections.abc import Sequence

    from range_connector.bench.replay import ReplayReport, ReplayRequest
    from range_connector.bench.replay_metrics import EngineCounts
    from range_connector.bench.traces import Trace

__all__ = ["FLEET_CONFIGS", "decode_engine_view", "failures", "lmcache_hint", "load_trace", "main", "results_text",
           "ttft_verdict"]

DEMO_DIR = Path(".cache") / "range-connector" / "demo"
SYNTHETIC_REQUESTS = 40
SYNTHETIC_TOKEN_SCALE = 1 / 16
TRACE_REQUESTS = 100
TRACE_TOKEN_SCALE = 1 / 32
TRACE_DURATION_S = 90.0
PRIME_SEED = 987_654_321  # the priming prompt shares no block with the trace's (seed 0)
#: the fleet phase's configurations (:data:`range_connector.bench.fleet.CONFIGS`), its baseline first
FLEET_CONFIGS = ("prefix-none", "prefix-range")
#: what each configuration's baseline is, in words (the verdict lines name it)
BASELINE_NAMES = {"none": "one engine without a connector",
                  "prefix-none": "two engines behind the prefix-aware proxy without a connector"}

_T0 = time.monotonic()


def load_trace(trace_path: str | None, *, count: int | None, token_scale: float | None,
               duration_s: float, max_model_len: int = MAX_MODEL_LEN_TOKENS) -> Trace:
    """The demo's trace, sliced and scaled (every transform is recorded in ``Trace.transforms``).

    Args:
        trace_path: A Mooncake ``.jsonl`` or Azure ``.csv`` file; ``None`` for the synthetic trace.
        count: Requests (default 40 synthetic, 100 of whole conversations from a file).
        token_scale: Factor on token counts and the hash block (default 1/16 synthetic, 1/32 from a file).
        duration_s: A file's sampled arrivals are compressed (never stretched) to span this many seconds.
        max_model_len: Longer prompts are cut to fit the engines.

    Returns:
        The :class:`range_connector.bench.traces.Trace`.

    Raises:
        TraceError: The file is unreadable or malformed, or an argument is out of range (named).
        OSError: The file cannot be opened.
    """
    from range_connector.bench.synthetic_trace import synthetic_trace
    from range_connector.bench.trace_transforms import prepare_trace
    from range_connector.bench.traces import read_trace
    from range_connector.errors import TraceError

    if not duration_s > 0:
        raise TraceError(f"--duration-s: {duration_s} must be > 0")
    if trace_path is None:
        base = synthetic_trace(count or SYNTHETIC_REQUESTS, seed=0, request_rate_per_s=1.0)
        return prepare_trace(base, token_scale=token_scale or SYNTHETIC_TOKEN_SCALE, max_model_len=max_model_len)
    base = read_trace(trace_path)
    count = count or TRACE_REQUESTS
    sampled = prepare_trace(base, count=count, conversations=True, seed=0)
    span_s = sampled.describe()["duration_s"]
    time_scale = min(1.0, duration_s / span_s) if span_s > 0 else 1.0
    return prepare_trace(base, count=count, conversations=True, seed=0, time_scale=time_scale,
                         token_scale=token_scale or TRACE_TOKEN_SCALE, max_model_len=max_model_len)


def decode_engine_view(engine: EngineCounts | None, decode_url: str) -> EngineCounts | None:
    """The engine counts of a P/D replay as the decode engine saw them.

    vLLM counts a P/D prompt on both engines, so sums over both halve every share. This keeps the decode engine's
    entry of ``per_engine`` as ``totals`` (the connector check and the verified tier share follow from them) and
    shares (tier hits / prompt tokens), its own TTFT (``extra["per_engine_ttft_s"]``; without it, the mean from the
    ``_sum``/``_count`` counters and no percentiles), the tokens it loaded per tier as shares of its prompt tokens
    (``extra["served_by_tier_share"]``), and both engines' sums under ``extra["both_engines"]``.

    Args:
        engine: ``ReplayReport.engine`` (a :class:`range_connector.bench.replay_metrics.EngineCounts`), or ``None``.
        decode_url: The decode engine's URL as given in ``metrics_urls``.

    Returns:
        A new ``EngineCounts``; ``engine`` itself when it is ``None`` or lacks the decode engine (unreadable).
    """
    if engine is None or decode_url not in engine.per_engine:
        return engine
    decode = dict(engine.per_engine[decode_url])
    prompt, count = decode["prompt_tokens"], decode["engine_ttft_count"]
    ttft = engine.extra.get("per_engine_ttft_s", {}).get(decode_url) or {
        "count": count, "mean": decode["engine_ttft_sum_s"] / count if count else None,
        "p50": None, "p90": None, "p99": None}
    by_tier = engine.extra.get("tier_tokens_per_engine", {}).get(decode_url, {})
    return dataclasses.replace(
        engine, totals=decode, engine_ttft_s=dict(ttft),
        external_hit_share=decode["external_hit_tokens"] / prompt if prompt else None,
        local_hit_share=decode["local_hit_tokens"] / prompt if prompt else None,
        extra={**engine.extra, "engine_rows_from": f"decode engine {decode_url}",
               "served_by_tier_share": {tier: n / prompt for tier, n in sorted(by_tier.items()) if n} if prompt else {},
               "both_engines": {"totals": engine.totals, "engine_ttft_s": engine.engine_ttft_s}})


def run_disaggregated(model_dir: Path, run_dir: Path, requests: list[ReplayRequest], trace: Trace,
                      prime: list[int]) -> ReplayReport:
    """Valkey (2 shards), prefill and decode engines with Range, the proxy; replay through the proxy; stop all.

    Returns:
        The ``range-pd`` :class:`range_connector.bench.replay.ReplayReport` (engine rows: :func:`decode_engine_view`).

    Raises:
        DemoError, ServerError: A process did not start (the message names its log).
    """
    from range_connector.backends.valkey.servers import ensure_servers, server_status, stop_servers
    from range_connector.backends.valkey.urls import redact_url

    valkey_dir = run_dir / "valkey"
    with Cleanup() as cleanup:
        cleanup.callback(lambda: log(f"stopped {stop_servers(valkey_dir)} Valkey server(s)"))
        urls = ensure_servers(NUM_SHARDS, valkey_dir)
        log(f"Valkey: {NUM_SHARDS} shards at {', '.join(map(redact_url, urls))} (runtime dir {valkey_dir})")
        # The engines find the servers and their password through runtime_dir: no password on a command line.
        common = {"chunk_tokens": CHUNK_TOKENS, "num_shards": NUM_SHARDS, "runtime_dir": str(valkey_dir),
                  "tiers": [{"type": "valkey"}]}
        prefill = engine_server(model_dir, run_dir, "prefill", "0", 1, connector_config(common, role="kv_producer"))
        decode = engine_server(model_dir, run_dir, "decode", "1", 1, connector_config(common, role="kv_consumer"))
        cleanup.callback(lambda: log("stopped the prefill and decode engines"))
        for name, server in (("prefill", prefill), ("decode", decode)):
            cleanup.enter_context(server)
            log(f"{name} engine starting on {server.base_url} (core {server.omp_threads_bind}, log {server.log_path})")
        for name, server in (("prefill", prefill), ("decode", decode)):
            log(f"{name} engine ready after {server.wait_ready(timeout_s=STARTUP_TIMEOUT_S):.0f} s")
        proxy = cleanup.enter_context(ProxyProcess(["--prefill", prefill.base_url, "--decode", decode.base_url],
                                                     run_dir / "proxy.log"))
        proxy.wait_ready(PROXY_TIMEOUT_S)
        log(f"proxy ready on {proxy.url} (log {proxy.log_path})")
        report = replay_primed(proxy.url, requests, trace, "range-pd", [prefill.base_url, decode.base_url], prime)
        both = report.engine
        report.engine = decode_engine_view(both, decode.base_url)
        tier = [{"shard": s.shard_idx, "used_memory_bytes": s.used_memory_bytes, "num_keys": s.num_keys}
                for s in server_status(valkey_dir)]
        report.options.update(valkey=tier, logs={"prefill": str(prefill.log_path), "decode": str(decode.log_path),
                                                 "proxy": str(proxy.log_path)},
                              engines={"prefill": prefill.command(), "decode": decode.command()})
        if both is not None and prefill.base_url in both.per_engine:
            p = both.per_engine[prefill.base_url]
            log(f"prefill engine: {p['prompt_tokens']:.0f} prompt tokens, {p['local_hit_tokens']:.0f} from its own "
                 f"prefix cache; Valkey now holds {sum(t['used_memory_bytes'] or 0 for t in tier) / 2**20:.0f} MiB "
                 f"in {sum(t['num_keys'] or 0 for t in tier)} keys over {len(tier)} shards")
        log("range-pd: done; stopping the proxy, the engines and Valkey")
    return report


def run_baseline(model_dir: Path, run_dir: Path, requests: list[ReplayRequest], trace: Trace,
                 prime: list[int]) -> ReplayReport:
    """One vLLM engine without a connector (core 0); replay; stop it. Returns the ``none`` report."""
    with Cleanup() as cleanup:
        server = cleanup.enter_context(engine_server(model_dir, run_dir, "none", "0", 1, None))
        cleanup.callback(lambda: log("stopped the engine without a connector"))
        log(f"none: engine without a connector starting on {server.base_url} (core 0, log {server.log_path})")
        log(f"none: ready after {server.wait_ready(timeout_s=STARTUP_TIMEOUT_S):.0f} s")
        report = replay_primed(server.base_url, requests, trace, "none", [server.base_url], prime)
        report.options.update(logs={"none": str(server.log_path)}, engines={"none": server.command()})
    return report


def run_fleet_phase(model_dir: Path, run_dir: Path, requests: list[ReplayRequest], trace: Trace,
                    prime: list[int]) -> list[ReplayReport]:
    """The fleet phase: :data:`FLEET_CONFIGS` one after the other (:func:`range_connector.bench.fleet.run_fleet`).

    Returns:
        One report per configuration, in :data:`FLEET_CONFIGS`' order (``prefix-none`` first).

    Raises:
        DemoError, ServerError: A process did not start (the message names its log).
    """
    from range_connector.bench.fleet import run_fleet

    return [run_fleet(config, model_dir, run_dir, requests, trace, prime) for config in FLEET_CONFIGS]


def _ttft_s(report: ReplayReport, quantile: str) -> float | None:
    value = (report.summary.get("ttft_s") or {}).get(quantile)
    return None if value is None else float(value)


def ttft_verdict(report: ReplayReport, baseline: ReplayReport) -> str:
    """One line: is ``report`` (a Range configuration) faster or slower than ``baseline`` at client TTFT p50 and p99?

    Args:
        report: The Range configuration's replay (``range-pd``, ``prefix-range``).
        baseline: What a user would otherwise run, on the same trace (``none``, ``prefix-none``).

    Returns:
        E.g. ``"verdict, range-pd against none (one engine without a connector): Range is slower at TTFT p50 (0.670 s
        against 0.190 s, 3.53x) and faster at TTFT p99 (1.500 s against 2.000 s, 0.75x)"``. "As fast" only for equal
        values; a quantile that one of the two lacks (no request succeeded) is "not comparable".
    """
    parts = []
    for quantile in ("p50", "p99"):
        value_s, base_s = _ttft_s(report, quantile), _ttft_s(baseline, quantile)
        if value_s is None or base_s is None:
            lacking = report.label if value_s is None else baseline.label
            parts.append(f"not comparable at TTFT {quantile} ({lacking} has no successful request)")
            continue
        word = "faster" if value_s < base_s else "slower" if value_s > base_s else "as fast"
        ratio = f", {value_s / base_s:.2f}x" if base_s > 0 else ""
        parts.append(f"{word} at TTFT {quantile} ({value_s:.3f} s against {base_s:.3f} s{ratio})")
    name = BASELINE_NAMES.get(baseline.label)
    against = f"{baseline.label} ({name})" if name else baseline.label
    return f"verdict, {report.label} against {against}: Range is {' and '.join(parts)}"


def lmcache_hint(*, trace_path: str | None, count: int | None, token_scale: float | None, model_size: str,
                 trace: Trace) -> str:
    """One line: how to put LMCache's MP connector next to Range and no connector (``bench/replay.py``, one engine
    each), on the demo's trace, model and block size.

    Args:
        trace_path, count, token_scale: The demo's ``--trace``, ``--count`` and ``--token-scale``.
        model_size: The demo's ``--model-size``.
        trace: The trace the demo replayed (a ``--trace`` file's time factor is read from its transforms).
    """
    options = ["--configs none,range,lmcache", f"--model-size {model_size}", f"--block-size {BLOCK_TOKENS}",
               f"--max-model-len {MAX_MODEL_LEN_TOKENS}"]
    if trace_path is None:
        options.append(f"--synthetic-requests {count or SYNTHETIC_REQUESTS}")
        options.append(f"--token-scale {token_scale or SYNTHETIC_TOKEN_SCALE:g}")
    else:
        options += [f"--trace {shlex.quote(trace_path)}", "--conversations", f"--count {count or TRACE_REQUESTS}",
                    f"--token-scale {token_scale or TRACE_TOKEN_SCALE:g}"]
        time_notes = [note.removeprefix("time x ") for note in trace.transforms if note.startswith("time x ")]
        if time_notes:
            options.append(f"--time-scale {time_notes[-1]}")
    return ("LMCache's column (one engine each; LMCache lives in its own environment): "
            f"bash bench/setup_lmcache_env.sh, then .venv/bin/python bench/replay.py {' '.join(options)}")


def results_text(pd_report: ReplayReport, none_report: ReplayReport, fleet_reports: Sequence[ReplayReport],
                 lmcache_line: str) -> str:
    """What the demo prints after its runs: the P/D table and its verdict, the fleet's table, per-engine shares and
    verdict (when it ran), and how to add LMCache.

    Args:
        pd_report, none_report: The ``range-pd`` and ``none`` replays.
        fleet_reports: The fleet's replays, baseline first (:func:`run_fleet_phase`); empty with ``--no-fleet``.
        lmcache_line: :func:`lmcache_hint`.
    """
    from range_connector.bench.fleet import NUM_SHARDS as FLEET_SHARDS
    from range_connector.bench.fleet import per_engine_lines
    from range_connector.bench.replay_report import format_comparison

    lines = ["P/D: range-pd = prefill engine (core 0) + decode engine (core 1) with Range, "
             f"{NUM_SHARDS} Valkey shards, behind the proxy (engine rows: the decode engine's); "
             "none = one engine (core 0), no connector",
             format_comparison([none_report, pd_report]), ttft_verdict(pd_report, none_report)]
    if fleet_reports:
        baseline, *others = fleet_reports
        lines += ["", "Fleet: two kv_both engines (cores 0 and 1) behind range-connector proxy --policy prefix_aware; "
                      f"prefix-none = no connector, prefix-range = Range on {FLEET_SHARDS} Valkey shards both share "
                      "(engine rows: both engines)",
                  format_comparison(fleet_reports, baseline=baseline.label), "per engine:",
                  *per_engine_lines(fleet_reports), *(ttft_verdict(report, baseline) for report in others)]
    lines += ["", lmcache_line]
    return "\n".join(lines)


def failures(reports: Sequence[ReplayReport], pd_report: ReplayReport) -> list[str]:
    """What makes the demo fail: failed requests in any replay, or a decode engine that loaded nothing from the tier.

    Returns:
        One phrase per failure (joined into the ``FAILED:`` line); empty when the demo succeeded.
    """
    failed = [f"{r.label}: {r.summary['num_errors']} of {r.summary['num_requests']} requests failed "
              f"({', '.join(f'{k} x{v}' for k, v in r.summary['errors'].items())})"
              for r in reports if r.summary["num_errors"]]
    check = pd_report.engine.connector_check if pd_report.engine is not None else None
    if check is None or check["loaded_tokens"] <= 0:  # Range's verified count, not vLLM's admission count
        failed.append("range-pd: the decode engine loaded no token from the tier")
    return failed


def _raise_keyboard_interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="Range connector demo, replaying one trace: disaggregated prefill against "
                                            "one engine without a connector, then two engines behind the "
                                            "prefix-aware proxy without and with Range.")
    p.add_argument("--trace", default=None, help="Mooncake .jsonl or Azure .csv to replay (default: synthetic)")
    p.add_argument("--count", type=int, default=None,
                   help=f"requests (default {SYNTHETIC_REQUESTS} synthetic, {TRACE_REQUESTS} from --trace)")
    p.add_argument("--token-scale", type=float, default=None,
                   help=f"token-count factor (default {SYNTHETIC_TOKEN_SCALE:g} synthetic, "
                        f"{TRACE_TOKEN_SCALE:g} from --trace)")
    p.add_argument("--duration-s", type=float, default=TRACE_DURATION_S,
                   help=f"--trace arrivals are compressed to span this many seconds (default {TRACE_DURATION_S:g})")
    p.add_argument("--model-size", choices=("bench", "tiny"), default="bench", help="GQA model size (default bench)")
    p.add_argument("--demo-dir", type=Path, default=DEMO_DIR, help=f"work folder (default {DEMO_DIR})")
    p.add_argument("--no-fleet", dest="fleet", action="store_false",
                   help=f"skip the fleet phase ({', '.join(FLEET_CONFIGS)}; about 5 minutes)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Run the demo (see the module docstring). Returns the exit status: 0 ok, 1 failed, 130 interrupted."""
    args = _parse_args(argv)
    previous_sigterm = signal.signal(signal.SIGTERM, _raise_keyboard_interrupt)
    load_start = os.getloadavg()
    try:
        from range_connector.backends.valkey.servers import stop_servers
        from range_connector.bench.replay_report import outputs_equal, ratios, write_json, write_plots
        from range_connector.bench.run_info import run_extra
        from range_connector.bench.trace_prompts import PromptBuilder, normal_vocab_token_ids
        from range_connector.errors import TraceError
        from range_connector.testing.tiny_models import build_model

        demo_dir = args.demo_dir.resolve()
        run_dir = demo_dir / "run"
        for valkey_dir in (run_dir / "valkey", *(run_dir / config / "valkey" for config in FLEET_CONFIGS)):
            if valkey_dir.is_dir() and (stopped := stop_servers(valkey_dir)):
                log(f"stopped {stopped} Valkey server(s) left by an earlier demo run in {valkey_dir}")
        shutil.rmtree(run_dir, ignore_errors=True)
        run_dir.mkdir(parents=True)
        try:
            trace = load_trace(args.trace, count=args.count, token_scale=args.token_scale, duration_s=args.duration_s)
        except (TraceError, OSError) as exc:
            raise DemoError(f"--trace: {exc}") from exc
        info = trace.describe()
        for line in trace.describe_lines():
            log(line)
        log(f"building (or finding) the {args.model_size} GQA model")
        model_dir = build_model("gqa", args.model_size)
        vocab = normal_vocab_token_ids(model_dir)
        from range_connector.bench.replay import build_requests

        requests = build_requests(trace, PromptBuilder(vocab, seed=0))
        prime = PromptBuilder(vocab, seed=PRIME_SEED).block(0, 64).tolist()
        log(f"model {model_dir}; machine load average {load_start[0]:.1f} on {os.cpu_count()} cores")
        pd_report = run_disaggregated(model_dir, run_dir, requests, trace, prime)
        none_report = run_baseline(model_dir, run_dir, requests, trace, prime)
        fleet_reports = run_fleet_phase(model_dir, run_dir, requests, trace, prime) if args.fleet else []
        reports = [none_report, pd_report, *fleet_reports]
        out = demo_dir / "results" / f"demo-{time.strftime('%Y%m%d-%H%M%S')}.json"
        verdicts = [ttft_verdict(pd_report, none_report),
                    *(ttft_verdict(report, fleet_reports[0]) for report in fleet_reports[1:])]
        fleet_json: dict[str, Any] = {}
        if fleet_reports:
            fleet_baseline = fleet_reports[0].label
            fleet_json = {f"ratios_vs_{fleet_baseline}": ratios(fleet_reports, fleet_baseline),
                          f"outputs_equal_to_{fleet_baseline}": outputs_equal(fleet_reports, fleet_baseline)}
        extra = run_extra([sys.executable, "-m", "range_connector.bench.demo", *(argv or sys.argv[1:])],
                          model=str(model_dir), trace=info, loadavg_start=load_start, wall_s=time.monotonic() - _T0,
                          engine_settings={"block_tokens": BLOCK_TOKENS, "chunk_tokens": CHUNK_TOKENS,
                                           "num_shards": NUM_SHARDS, "max_model_len_tokens": MAX_MODEL_LEN_TOKENS},
                          comparisons={"none": ["range-pd"],
                                       **({fleet_reports[0].label: [r.label for r in fleet_reports[1:]]}
                                          if fleet_reports else {})},
                          verdicts=verdicts, **fleet_json)
        write_json(out, reports, extra=extra, compared=[pd_report.label])
        pngs = write_plots(out.with_suffix(""), reports)
        print()
        print(results_text(pd_report, none_report, fleet_reports,
                           lmcache_hint(trace_path=args.trace, count=args.count, token_scale=args.token_scale,
                                        model_size=args.model_size, trace=trace)))
        print()
        print(f"trace: {info['source']}; " + "; ".join(info["transforms"]))
        print(f"JSON: {out}")
        for path in pngs:
            print(f"PNG: {path}")
        print(f"machine load average {load_start[0]:.1f} -> {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores; "
              f"demo took {time.monotonic() - _T0:.0f} s")
        failed = failures(reports, pd_report)
        if failed:
            print(f"FAILED: {'; '.join(failed)}", flush=True)
            return 1
        return 0
    except KeyboardInterrupt:
        log("interrupted; everything the demo started is stopped")
        return 130
    except Exception as exc:  # noqa: BLE001 - one line, processes already stopped by the phases' cleanup
        print(f"FAILED: {type(exc).__name__}: {one_line(exc)}", flush=True)
        return 1
    finally:
        signal.signal(signal.SIGTERM, previous_sigterm)


if __name__ == "__main__":
    sys.exit(main())
