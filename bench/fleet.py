"""A fleet of two engines behind ``range-connector proxy``: round robin or prefix-aware, without or with Range.

For each configuration in ``--configs`` (one at a time) this starts two vLLM engines (``kv_both``; core 0 and core
1, vLLM's own prefix cache on, as users run them), ``range-connector proxy --engine A --engine B --policy P`` in
front of them, replays one trace through the proxy at its arrival times, and stops everything (the runner is
:func:`range_connector.bench.fleet.run_fleet`, which the demo's fleet phase uses too):

* ``rr-none``: round robin, no connector;
* ``prefix-none``: prefix-aware routing, no connector (what users run today);
* ``rr-range``: round robin, both engines with Range on the same Valkey shards (2, embedded);
* ``prefix-range``: prefix-aware routing and Range.

It prints one table (``bench/replay.py``'s) with the ratios against the first configuration, and the share of
prompt tokens each engine loaded from the shared tier. With vLLM's prefix cache on, a tier hit is a prefix the
engine's own cache no longer (or never) held: computed by the other engine, or by itself and evicted since; the
second engine's share is reported per engine so that the split shows. It writes ``bench/results/fleet-<time>.json``
and the replay's PNGs. Not run by ``make test``; about 2.5 minutes a configuration on a 2-core machine.

Example::

    .venv/bin/python bench/fleet.py                      # the synthetic trace (40 requests), the bench GQA model
    .venv/bin/python bench/fleet.py --trace mooncake_conversation_trace.jsonl --count 100
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from range_connector.bench import demo  # noqa: E402
from range_connector.bench.stack import log  # noqa: E402
from range_connector.bench.fleet import CONFIGS, NUM_SHARDS, per_engine_lines, run_fleet  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated, run in this order")
    p.add_argument("--trace", default=None, help="Mooncake .jsonl or Azure .csv (default: the synthetic trace)")
    p.add_argument("--count", type=int, default=None, help="requests (default: the demo's)")
    p.add_argument("--token-scale", type=float, default=None, help="token-count factor (default: the demo's)")
    p.add_argument("--duration-s", type=float, default=demo.TRACE_DURATION_S, help="--trace arrivals span this")
    p.add_argument("--kv-cache-gib", type=int, default=1, help="each engine's KV cache, GiB (default 1)")
    p.add_argument("--model-size", choices=("bench", "tiny"), default="bench")
    p.add_argument("--range-extra", default="{}", help="JSON merged into Range's kv_connector_extra_config, e.g. "
                   "'{\"save_mode\": \"async\"}'")
    p.add_argument("--work-dir", type=Path, default=Path(".cache") / "range-connector" / "fleet")
    args = p.parse_args(argv)
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    if unknown := [c for c in configs if c not in CONFIGS]:
        p.error(f"--configs: unknown configuration {unknown[0]!r} (known: {', '.join(CONFIGS)})")
    try:
        range_extra = json.loads(args.range_extra)
    except ValueError as exc:
        p.error(f"--range-extra: not JSON: {exc}")
    if not isinstance(range_extra, dict):
        p.error("--range-extra: give a JSON object")
    if args.kv_cache_gib < 1:
        p.error("--kv-cache-gib: give at least 1")
    results = REPO / "bench" / "results"
    results.mkdir(parents=True, exist_ok=True)  # an unwritable results folder fails before any engine starts

    from range_connector.bench.replay import build_requests
    from range_connector.bench.replay_report import format_comparison, write_json, write_plots
    from range_connector.bench.trace_prompts import PromptBuilder, normal_vocab_token_ids
    from range_connector.testing.tiny_models import build_model

    load_start = os.getloadavg()
    trace = demo.load_trace(args.trace, count=args.count, token_scale=args.token_scale, duration_s=args.duration_s)
    for line in trace.describe_lines():
        log(line)
    model_dir = build_model("gqa", args.model_size)
    vocab = normal_vocab_token_ids(model_dir)
    requests = build_requests(trace, PromptBuilder(vocab, seed=0))
    prime = PromptBuilder(vocab, seed=demo.PRIME_SEED).block(0, 64).tolist()
    run_dir = args.work_dir.resolve() / "run"
    reports = [run_fleet(config, model_dir, run_dir, requests, trace, prime, kv_cache_gib=args.kv_cache_gib,
                         range_extra=range_extra)
               for config in configs]
    out = results / f"fleet-{time.strftime('%Y%m%d-%H%M%S')}.json"
    write_json(out, reports, extra={"command": [sys.executable, *sys.argv], "model": str(model_dir),
                                    "trace": trace.describe(), "kv_cache_gib_per_engine": args.kv_cache_gib,
                                    "range_extra": range_extra,
                                    "machine": {"cpus": os.cpu_count(), "loadavg_start": load_start,
                                                "loadavg_end": os.getloadavg()}})
    pngs = write_plots(out.with_suffix(""), reports)
    print()
    print(format_comparison(reports))
    print()
    print("per engine:")
    print("\n".join(per_engine_lines(reports)))
    print(f"two kv_both engines (cores 0 and 1) behind range-connector proxy --engine ... --policy P; "
          f"*-range: Range on {NUM_SHARDS} shared Valkey shards")
    print(f"JSON: {out}")
    for path in pngs:
        print(f"PNG: {path}")
    print(f"machine load average {load_start[0]:.1f} -> {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    return 0 if all(not r.summary["num_errors"] for r in reports) else 1


if __name__ == "__main__":
    sys.exit(main())
