"""``range-connector calibrate``: the command's parser and handler.

The measurement (the prefill sweep, the timed stripe reads, the fits and the break-even table) is
:mod:`range_connector.cli.calibrate`, imported when the handler runs; this module turns the options into
:class:`~range_connector.cli.calibrate.CalibrateOptions` (``--quick`` picks the shorter defaults), runs it and
prints ``R``, ``s`` and the break-even table. Bad options raise :class:`~range_connector.errors.ConfigError` naming
the option (the entry point exits 2), all of them before an engine or a server starts
(:func:`~range_connector.cli.calibrate_options.check_options`).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from range_connector.cli.common import EXIT_OK, Parser, positive_float, positive_int, positive_ints, print_table
from range_connector.errors import ConfigError

__all__ = ["add_commands"]


def add_commands(subparsers: argparse._SubParsersAction[Parser]) -> None:
    """Register ``calibrate``."""
    cal = subparsers.add_parser(
        "calibrate", help="measure prefill rate R and tier speed B, T0; write the calibration file; print B* table",
        description="Measure the served model's prefill rate (a short sweep against a vLLM server, started here on "
        "--model or running at --url) and each backend's delivered bandwidth and fixed latency (reads of synthetic "
        "stripes, removed afterwards); write the calibration file and print the break-even table.")
    what = cal.add_mutually_exclusive_group()
    what.add_argument("--model", help="model directory: its config gives s, layers and vocabulary; an engine is "
                      "started on it (without a connector) unless --url is given")
    what.add_argument("--tiny", action="store_true", help="use the tiny GQA test model (built if needed)")
    cal.add_argument("--url", help="http://host:port of a running vLLM API server to measure instead")
    cal.add_argument("--backends", type=lambda t: tuple(x for x in t.split(",") if x), default=None,
                     help="comma-separated backends to measure (default: the config's backend; '' for none)")
    cal.add_argument("--extra-config", default="{}", help="kv_connector_extra_config JSON (tiers, "
                     "num_shards, ...); embedded Valkey servers are used when it names none")
    cal.add_argument("--keep-servers", action="store_true", help="leave running the embedded Valkey servers this "
                     "run started (by default they are stopped at the end; servers already running are never stopped)")
    cal.add_argument("--output", type=Path, default=Path("range-calibration.json"), help="calibration file")
    cal.add_argument("--quick", action="store_true", help="fewer and shorter prompts, smaller reads, fewer repeats")
    cal.add_argument("--prompt-tokens", type=positive_ints, help="prompt lengths of the prefill sweep")
    cal.add_argument("--prefill-repeats", type=positive_int, help="requests per prompt length")
    cal.add_argument("--read-mib", type=positive_ints, help="sizes of the timed stripe reads, MiB")
    cal.add_argument("--read-repeats", type=positive_int, help="reads per size")
    cal.add_argument("--skip-prefill", action="store_true", help="do not measure R (see --tokens-per-s)")
    cal.add_argument("--tokens-per-s", type=positive_float, help="record this constant R when skipping prefill")
    cal.add_argument("--bytes-per-token", type=positive_float, help="s, KV bytes per token (default: --model)")
    cal.add_argument("--num-layers", type=positive_int, help="layer values per stripe (default: --model)")
    cal.add_argument("--vocab-size", type=positive_int, help="token ids drawn below this (default: --model)")
    cal.add_argument("--engine-t0-s", type=float, default=0.0, help="engine seconds per hit added to every T0")
    cal.add_argument("--start-timeout-s", type=positive_float, default=300.0, help="engine start-up deadline")
    cal.add_argument("--table-tokens", type=positive_ints,
                     help="prompt lengths of the table's saving columns (default 1024,4096,16384,65536)")
    cal.set_defaults(handler=_calibrate)


def _calibrate(args: argparse.Namespace) -> int:
    from range_connector.cli import calibrate as c
    from range_connector.config import RangeConfig

    try:
        extra = json.loads(args.extra_config)
    except ValueError as exc:
        raise ConfigError("--extra-config", f"not JSON ({exc})") from None
    if not isinstance(extra, dict):
        raise ConfigError("--extra-config", "not a JSON object")
    backends = args.backends if args.backends is not None else tuple(  # (every tier of a hierarchy)
        t.type for t in RangeConfig.from_extra_config(extra).tiers)
    model = args.model
    if args.tiny:
        from range_connector.testing.tiny_models import build_model

        model = str(build_model("gqa", "tiny"))
    opts = c.CalibrateOptions(
        output=args.output, model=model, url=args.url, backends=tuple(backends), extra_config=extra,
        prompt_tokens=args.prompt_tokens or (c.QUICK_PROMPT_TOKENS if args.quick else c.FULL_PROMPT_TOKENS),
        prefill_repeats=args.prefill_repeats or (2 if args.quick else 5),
        read_bytes=tuple(m * c.MiB for m in args.read_mib) if args.read_mib else (
            c.QUICK_READ_BYTES if args.quick else c.FULL_READ_BYTES),
        read_repeats=args.read_repeats or (3 if args.quick else 5), skip_prefill=args.skip_prefill,
        tokens_per_s=args.tokens_per_s, bytes_per_token=args.bytes_per_token, num_layers=args.num_layers,
        vocab_size=args.vocab_size, engine_t0_s=args.engine_t0_s, start_timeout_s=args.start_timeout_s,
        table_tokens=args.table_tokens or c.TABLE_PROMPT_TOKENS, keep_servers=args.keep_servers)
    calibration = c.run_calibration(opts)  # (every option is checked before anything starts)
    try:
        header, rows = c.break_even_rows(calibration, opts.table_tokens)
    except ValueError:
        print("no break-even table: it needs R (measured or --tokens-per-s) and s (--model or --bytes-per-token)")
        return EXIT_OK
    rate = calibration.prefill
    print()
    print(f"R = {rate.tokens_per_s():,.0f} tokens/s at context 0 (attention term {rate.attention_s_per_token2:.3g} "
          f"s/token^2, fixed {calibration.prefill_overhead_s * 1e3:.1f} ms per request removed); "
          f"s = {calibration.bytes_per_token:,.0f} bytes/token")
    print_table([header, *rows])
    measured = max((n for n, _ in calibration.prefill_points), default=None)
    if measured is not None and max(opts.table_tokens) > measured:
        print(f"(savings above {measured} tokens extrapolate the fitted prefill curve)")
    return EXIT_OK
