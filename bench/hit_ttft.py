"""A hit as fast as resident KV: the TTFT of one prompt whose prefix is resident, on a Range tier, or not cached.

The prompt is a ``--prefix-tokens`` prefix (4,096 by default: 512 MiB of KV on the bench GQA model, 128 KiB a token)
and a ``--suffix-tokens`` suffix (32), sent with ``max_tokens = 1`` to a real vLLM CPU API server (random tokens of the
tokenizer's normal vocabulary; every suffix starts with a token of its own):

* engine ``none`` (no connector, vLLM's own prefix cache on): ``--cold-repeats`` prompts of fresh prefixes are
  **(c) not cached**; then the first of those prefixes with ``--repeats`` fresh suffixes is **(a) resident** (vLLM's
  prefix cache holds the prefix; ``usage.cached_tokens`` must say so);
* Range engines (vLLM's prefix cache off, so the prefix can only come from the tier), whose ``--repeats`` prompts
  of one prefix and fresh suffixes are **(b) a hit on the tier**, loaded again every time and counted from outside:
  vLLM's ``usage.cached_tokens`` and Range's ``vllm:range_tier_loaded_tokens_total`` on ``/metrics``. The first runs
  every asked tier as a hierarchy (DRAM, Valkey, file): its one cold prompt saves the prefix to all of them
  (``(c)`` with Range saving, reported too; the hits wait for ``vllm:range_saved_chunks_total``) and its hits come
  from the nearest tier; each further engine runs one farther tier alone and loads the same prefix from it, saved
  by the first (one embedded Valkey server and one file directory for all). Before the first stops, its far copies
  must be on the far tiers, counted from outside (the files' bytes on disk, the server's ``used_memory``); each Range
  engine's ``vllm:range_tier_far_copies_skipped_total`` and ``vllm:range_saves_skipped_total`` are in the JSON
  (``not_written``) and the table says when they are not 0.

A cold prefill of 4,096 tokens takes about 100 s on one core of the development machine (the bench model's
attention over 32 layers), so (c) defaults to 3 samples where (a) and (b) take 10; ``--warmup`` hits before them
are left out (first-load costs).

Next to them, in the same run: **the plain copy** of the same bytes into a KV cache of the engine's layout (one
``index_copy_`` per layer of the prefix's blocks into random block slots, the engine's own copy primitive on CPU),
and **the tier's wire time** for the same bytes (Range's backend reading one stripe of ``num_layers`` whole layer
values of ``prefix_tokens x bytes per token per layer`` each, as a save of that prefix lays them out, into a
preallocated buffer, on the same server or directory, after the engine has stopped). Medians of ``--repeats``.

The goals (issue 18, item 2; the Range paper's "within 70 ms of already resident"):
``(b) - (a)`` on DRAM at most 1.5x the copy; on Valkey and file at most 1.2x the tier's wire time; ``(b)`` at least
3x faster than ``(c)``. The JSON (``<results-dir>/hit-ttft-<time>.json``) keeps every sample, the medians, the
ratios and the verdicts; nothing here asserts them (``--smoke`` runs the tiny model at small size for the tests).

Usage::

    python bench/hit_ttft.py                                   # bench model, 4,096 + 32 tokens, 10 repeats
    python bench/hit_ttft.py --tiers dram,valkey --repeats 5
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from collections.abc import Callable
from typing import Any

import bench_common  # noqa: F401  (puts the repository on sys.path)
import torch

from range_connector.backends.base import RangeRead, StripeWrite
from range_connector.backends.factory import open_shard_backends
from range_connector.backends.valkey.servers import ensure_servers, server_status, stop_servers
from range_connector.bench.replay_metrics import snapshot_metrics
from range_connector.bench.trace_prompts import normal_vocab_token_ids
from range_connector.config import RangeConfig
from range_connector.testing.client import complete, scrape_metrics, wait_for_metric
from range_connector.testing.processes import unwind_on_sigterm
from range_connector.testing.server_process import ServerProcess, connector_config
from range_connector.testing.tiny_models import build_model, kv_bytes_per_token

TIERS = ("dram", "valkey", "file")
GOALS = {"dram": ("copy", 1.5), "valkey": ("wire", 1.2), "file": ("wire", 1.2)}
MIN_SPEEDUP_OVER_RECOMPUTE = 3.0
GIB = 1 << 30


def _log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def _median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def tier_extra(tiers: list[str], shared_dir: Path, capacity_bytes: int, range_extra: dict[str, Any]) -> dict[str, Any]:
    """``kv_connector_extra_config`` of Range on ``tiers`` (nearest first), one shard, on one embedded Valkey server
    and one file directory under ``shared_dir`` (so that an engine on one tier finds what another engine saved)."""
    tables = {"dram": {"type": "memory", "capacity_bytes": capacity_bytes},
              "valkey": {"type": "valkey", "capacity_bytes": capacity_bytes},
              "file": {"type": "file", "directory": str(shared_dir / "files"), "capacity_bytes": capacity_bytes}}
    if "valkey" in tiers:
        ensure_servers(1, shared_dir / "valkey", maxmemory_bytes=capacity_bytes + capacity_bytes // 8)
    return {**range_extra, "tiers": [tables[t] for t in tiers], "num_shards": 1,
            "runtime_dir": str(shared_dir / "valkey")}


def make_prompts(vocab: list[int], seed: int, num_prefixes: int, num_suffixes: int, prefix_tokens: int,
                 suffix_tokens: int) -> tuple[list[list[int]], list[list[int]]]:
    """``num_prefixes`` prefixes ``[prefix_tokens]`` and ``num_suffixes`` suffixes ``[suffix_tokens]`` (token ids),
    every prefix and every suffix starting with a different token, so that no two share a block."""
    rng = random.Random(seed)
    firsts = rng.sample(vocab, num_prefixes + num_suffixes)
    prefixes = [[firsts[i], *(rng.choice(vocab) for _ in range(prefix_tokens - 1))] for i in range(num_prefixes)]
    suffixes = [[firsts[num_prefixes + i], *(rng.choice(vocab) for _ in range(suffix_tokens - 1))]
                for i in range(num_suffixes)]
    return prefixes, suffixes


def measure_copy_s(num_layers: int, prefix_blocks: int, block_bytes_per_layer: int, repeats: int) -> list[float]:
    """Seconds of copying ``[num_layers, prefix_blocks]`` blocks of ``block_bytes_per_layer`` bytes into random
    slots of a ``[num_layers, 4 * prefix_blocks]``-block cache (one ``index_copy_`` per layer, rows as int64: the
    fastest scatter of vLLM's CPU layout measured here, docs NOTES-vllm-cpu)."""
    row = block_bytes_per_layer // 8
    src = torch.randint(0, 1 << 62, (num_layers, prefix_blocks, row), dtype=torch.int64)
    dst = torch.zeros(num_layers, 4 * prefix_blocks, row, dtype=torch.int64)
    out = []
    for r in range(repeats + 1):
        idx = torch.randperm(4 * prefix_blocks, generator=torch.Generator().manual_seed(r))[:prefix_blocks]
        t0 = time.perf_counter()
        for layer in range(num_layers):
            dst[layer].index_copy_(0, idx, src[layer])
        if r:  # the first copy touches fresh pages: left out
            out.append(time.perf_counter() - t0)
    if not torch.equal(dst[num_layers - 1][idx], src[num_layers - 1]):
        raise RuntimeError("plain copy: destination rows differ from the source")
    return out


def measure_wire_s(extra: dict[str, Any], num_layers: int, layer_bytes: int, repeats: int) -> list[float]:
    """Seconds of Range's backend reading one stripe of ``[num_layers]`` whole values of ``layer_bytes`` (written
    here under a throw-away id, dropped after) into one preallocated buffer; the bytes are compared once."""
    config = RangeConfig.from_extra_config(extra)
    backend = open_shard_backends(config)[0]
    values = [random.Random(layer).randbytes(layer_bytes) for layer in range(num_layers)]
    stripe_id = f"hitttftwire{random.getrandbits(32):08x}"
    try:
        if not backend.write_stripe(StripeWrite(stripe_id, values, [])):
            raise RuntimeError(f"wire: the {config.tiers[0].type} tier refused a {num_layers * layer_bytes} B stripe")
        buf = bytearray(num_layers * layer_bytes)
        view = memoryview(buf)
        reads = [RangeRead(stripe_id, layer, 0, layer_bytes, layer_bytes,
                           view[layer * layer_bytes:(layer + 1) * layer_bytes]) for layer in range(num_layers)]
        out = []
        for r in range(repeats + 1):
            t0 = time.perf_counter()
            ok = backend.read_ranges(reads)
            elapsed = time.perf_counter() - t0
            if not all(ok):
                raise RuntimeError(f"wire: {ok.count(False)} of {num_layers} reads failed")
            if r:  # the first read warms connections and pages: left out
                out.append(elapsed)
        if bytes(view[:layer_bytes]) != values[0] or bytes(view[-layer_bytes:]) != values[-1]:
            raise RuntimeError("wire: the bytes read differ from the bytes written")
        return out
    finally:
        backend.drop_stripes([stripe_id])
        backend.close()


def tier_bytes_outside(shared_dir: Path) -> dict[str, int | None]:
    """What the shared tiers hold, counted from outside Range: bytes of the file tier's files on disk and the Valkey
    server's ``used_memory`` (``INFO memory``); ``None`` for a tier not started."""
    files = shared_dir / "files"
    disk = sum(f.stat().st_size for f in files.rglob("*") if f.is_file()) if files.is_dir() else None
    valkey = [s.used_memory_bytes for s in server_status(shared_dir / "valkey")] if (shared_dir / "valkey").is_dir() \
        else []
    return {"file_bytes_on_disk": disk, "valkey_used_memory_bytes": valkey[0] if valkey else None}


def wait_far_copies(shared_dir: Path, tiers: list[str], prefix_bytes: int, timeout_s: float = 120.0) -> None:
    """Wait until each far tier of ``tiers`` holds at least ``prefix_bytes`` (counted from outside); log if not."""
    keys = {"valkey": "valkey_used_memory_bytes", "file": "file_bytes_on_disk"}
    deadline = time.monotonic() + timeout_s
    while True:
        held = tier_bytes_outside(shared_dir)
        short = {t: held[keys[t]] for t in tiers[1:] if t in keys and (held[keys[t]] or 0) < prefix_bytes}
        if not short:
            return
        if time.monotonic() > deadline:
            _log(f"far tiers still short of the prefix's {prefix_bytes} B after {timeout_s:.0f} s: {short}")
            return
        time.sleep(0.5)


def run_engine(name: str, args: argparse.Namespace, model_dir: Path, run_dir: Path, kv_config: str | None,
               prefixes: list[list[int]], suffixes: list[list[int]], chunks_per_prefix: int, cold: bool,
               before_stop: Callable[[], None] | None = None) -> dict:
    """Start one engine; send the cold prompts (one per prefix, unless not ``cold``: another engine saved the
    prefix), then ``prefixes[0]`` with every suffix, one at a time; call ``before_stop``; stop it. TTFTs, and per hit
    the counters that show where its prefix came from."""
    extra_args = ["--enable-prompt-tokens-details"]
    if kv_config is not None:
        extra_args.append("--no-enable-prefix-caching")
    server = ServerProcess(model_dir, work_dir=run_dir, max_model_len=args.max_model_len, block_size=args.block_size,
                           kv_transfer_config=kv_config, kvcache_space_gib=args.kvcache_space_gib,
                           omp_threads_bind=args.omp_threads_bind, extra_args=extra_args,
                           log_path=run_dir / "vllm.log")
    cold_s: list[float] = []
    rows: list[dict[str, Any]] = []
    with server:
        startup_s = server.wait_ready(timeout_s=args.startup_timeout_s)
        _log(f"{name}: ready after {startup_s:.1f} s (log {server.log_path})")
        saved = scrape_metrics(server.base_url).get("vllm:range_saved_chunks_total", 0.0)
        for prefix in prefixes if cold else []:
            cold_answer = complete(server.base_url, prompt_token_ids=prefix + suffixes[-1], max_tokens=1,
                            timeout_s=args.request_timeout_s)
            cold_s.append(cold_answer.ttft_s)
            _log(f"{name}: cold {cold_answer.ttft_s:.3f} s (cached {cold_answer.cached_tokens})")
        if kv_config is not None and cold:  # the saves must be on the tier before the hits look them up
            saved += chunks_per_prefix * len(prefixes)
            wait_for_metric(server.base_url, "vllm:range_saved_chunks_total", saved, timeout_s=60.0)
        for i, suffix in enumerate(suffixes[:-1]):
            snap_before = snapshot_metrics([server.base_url])  # (counters, and the hook seconds by label)
            hit = complete(server.base_url, prompt_token_ids=prefixes[0] + suffix, max_tokens=1,
                           timeout_s=args.request_timeout_s)
            snap_after = snapshot_metrics([server.base_url])
            before = snap_before.counters.get(server.base_url, {})
            after = snap_after.counters.get(server.base_url, {})
            delta = {k.removeprefix("vllm:"): after.get(k, 0.0) - before.get(k, 0.0) for k in (
                "vllm:range_tier_loaded_tokens_total", "vllm:range_failed_tokens_total",
                "vllm:range_load_deadline_misses_total", "vllm:range_load_seconds_sum")}
            # where Range's part of the hit went: seconds inside each connector hook (vllm:range_hook_seconds_total)
            earlier = snap_before.hook_seconds.get(server.base_url, {})
            delta["hook_s"] = {h: round(v - earlier.get(h, 0.0), 4)
                               for h, v in snap_after.hook_seconds.get(server.base_url, {}).items()
                               if v - earlier.get(h, 0.0) > 0.0005}
            hit_ok = (hit.cached_tokens or 0) >= args.prefix_tokens
            if kv_config is not None:
                hit_ok = hit_ok and delta["range_tier_loaded_tokens_total"] >= args.prefix_tokens
            rows.append({"repeat": i - args.warmup, "hit_ttft_s": hit.ttft_s, "hit_cached_tokens": hit.cached_tokens,
                         "hit_ok": hit_ok, **delta})
            hooks = ", ".join(f"{h} {v:.3f} s" for h, v in sorted(delta["hook_s"].items(), key=lambda kv: -kv[1]))
            _log(f"{name}: hit {i - args.warmup}: {hit.ttft_s:.3f} s (cached {hit.cached_tokens}, "
                 f"{'ok' if hit_ok else 'MISSING'})" + (f"; in Range's hooks: {hooks}" if hooks else ""))
        # what Range did not write, from its own /metrics: far copies of a hierarchy (write-through) and saves
        final = scrape_metrics(server.base_url) if kv_config is not None else {}
        not_written = {k.removeprefix("vllm:"): final.get(k, 0.0) for k in (
            "vllm:range_tier_far_copies_skipped_total", "vllm:range_saves_skipped_total")}
        if before_stop is not None:
            before_stop()
    measured = [r for r in rows if r["repeat"] >= 0]
    return {"startup_s": startup_s, "kv_transfer_config": kv_config, "rows": rows, "cold_ttft_s": cold_s,
            "not_written": not_written,
            "cold_ttft_s_median": _median(cold_s),
            "hit_ttft_s_median": _median([r["hit_ttft_s"] for r in measured if r["hit_ok"]]),
            "num_hits_ok": sum(r["hit_ok"] for r in measured), "num_repeats": len(measured)}


def verdicts(result: dict[str, Any]) -> dict[str, Any]:
    """Ratios and pass/fail of the goals from the medians (``None`` where a number is missing)."""
    none = result["engines"]["none"]
    resident_s, cold_s = none["hit_ttft_s_median"], none["cold_ttft_s_median"]
    out = {}
    for tier, eng in result["engines"].items():
        if tier == "none":
            continue
        hit_s = eng["hit_ttft_s_median"]
        ref_name, limit = GOALS[tier]
        ref_s = result["copy_s_median"] if ref_name == "copy" else eng.get("wire_s_median")
        excess_s = hit_s - resident_s if hit_s is not None and resident_s is not None else None
        excess_ratio = excess_s / ref_s if excess_s is not None and ref_s else None
        speedup = cold_s / hit_s if hit_s and cold_s else None
        out[tier] = {"hit_minus_resident_s": excess_s, "reference": ref_name, "reference_s": ref_s,
                     "excess_over_reference": excess_ratio, "excess_limit": limit,
                     "excess_ok": excess_ratio is not None and excess_ratio <= limit,
                     "speedup_over_not_cached": speedup, "speedup_min": MIN_SPEEDUP_OVER_RECOMPUTE,
                     "speedup_ok": speedup is not None and speedup >= MIN_SPEEDUP_OVER_RECOMPUTE,
                     "all_hits": eng["num_hits_ok"] == eng["num_repeats"]}
    return out


def format_table(result: dict[str, Any]) -> str:
    def f(x: float | None, unit: str = " s") -> str:
        return "-" if x is None else f"{x:.3f}{unit}"

    none = result["engines"]["none"]
    lines = [f"{'case':<28}{'TTFT p50':>12}{'(b)-(a)':>10}{'reference':>18}{'ratio':>8}{'(c)/(b)':>9}",
             f"{'(a) resident (vLLM cache)':<28}{f(none['hit_ttft_s_median']):>12}",
             f"{'(c) not cached':<28}{f(none['cold_ttft_s_median']):>12}"]
    for tier, v in result["verdicts"].items():
        eng = result["engines"][tier]
        ref = f"{v['reference']} {f(v['reference_s'])}"
        lines.append(f"{'(b) Range ' + tier:<28}{f(eng['hit_ttft_s_median']):>12}{f(v['hit_minus_resident_s']):>10}"
                     f"{ref:>18}{f(v['excess_over_reference'], 'x'):>8}{f(v['speedup_over_not_cached'], 'x'):>9}"
                     f"  {'ok' if v['excess_ok'] else 'over'}/{'ok' if v['speedup_ok'] else 'under'}"
                     f"{'' if v['all_hits'] else ' (misses!)'}")
    for tier in result["verdicts"]:
        eng = result["engines"][tier]
        if eng["cold_ttft_s"]:
            lines.append(f"{'(c) Range saving to ' + '+'.join(eng['tiers']):<28}{f(eng['cold_ttft_s_median']):>12}")
    for tier in result["verdicts"]:
        skipped = result["engines"][tier].get("not_written", {})
        if any(skipped.values()):
            lines.append(f"NOT WRITTEN by Range {tier}: {skipped} (see vllm:range_tier_far_copies_skipped_total)")
    lines.append(f"plain copy of {result['prefix_kv_bytes'] / GIB:.3f} GiB into the KV cache: "
                 f"{f(result['copy_s_median'])} (median of {len(result['copy_s'])})")
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true", help="tiny model, 256 + 32 tokens, 1 repeat, tier valkey")
    p.add_argument("--tiers", default=",".join(TIERS), help="comma-separated Range tiers (dram, valkey, file)")
    p.add_argument("--prefix-tokens", type=int, default=4096)
    p.add_argument("--suffix-tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=10, help="measured hits per engine (median of these)")
    p.add_argument("--warmup", type=int, default=1, help="unmeasured hits first (first-load costs)")
    p.add_argument("--cold-repeats", type=int, default=3, help="cold prompts of the engine without a connector")
    p.add_argument("--model-size", default="bench", choices=("tiny", "bench"))
    p.add_argument("--block-size", type=int, default=128)
    p.add_argument("--kvcache-space-gib", type=int, default=3)
    p.add_argument("--tier-capacity-bytes", type=int, default=2 * GIB, help="each tier's budget")
    p.add_argument("--range-extra", default="{}", help="JSON merged into Range's kv_connector_extra_config")
    p.add_argument("--omp-threads-bind", default=None)
    p.add_argument("--startup-timeout-s", type=float, default=300.0)
    p.add_argument("--request-timeout-s", type=float, default=300.0)
    p.add_argument("--results-dir", default=str(bench_common.REPO / "bench" / "results"))
    p.add_argument("--out", default=None, help="JSON path (default <results-dir>/hit-ttft-<time>.json)")
    args = p.parse_args(argv)
    if args.smoke:
        args.model_size, args.prefix_tokens, args.repeats, args.warmup, args.cold_repeats = "tiny", 256, 1, 0, 1
        args.tiers, args.kvcache_space_gib, args.tier_capacity_bytes = "valkey", 1, 256 << 20
    tiers = [t.strip() for t in args.tiers.split(",") if t.strip()]
    bad = [t for t in tiers if t not in TIERS]
    if bad or not tiers:
        p.error(f"--tiers: unknown tier {bad[0] if bad else '(none)'!r} (known: {', '.join(TIERS)})")
    args.tier_list = tiers
    if args.prefix_tokens <= 0 or args.prefix_tokens % args.block_size:
        p.error(f"--prefix-tokens: {args.prefix_tokens} is not a positive multiple of --block-size {args.block_size}")
    if min(args.suffix_tokens, args.repeats, args.cold_repeats) <= 0 or args.warmup < 0:
        p.error("--suffix-tokens, --repeats and --cold-repeats must be positive, --warmup not negative")
    try:
        args.range_extra_dict = json.loads(args.range_extra)
        if not isinstance(args.range_extra_dict, dict):
            raise ValueError("not a JSON object")
    except ValueError as exc:
        p.error(f"--range-extra: {exc}")
    args.max_model_len = args.prefix_tokens + args.suffix_tokens + args.block_size
    return args


def main(argv: list[str] | None = None) -> int:
    """Run every engine and the two references; exit 0 when every engine ran and every hit was taken."""
    args = parse_args(argv)
    unwind_on_sigterm()
    load_start = [round(x, 2) for x in os.getloadavg()]
    model_dir = build_model("gqa", args.model_size)
    bytes_per_token = kv_bytes_per_token(model_dir)
    num_layers = json.loads((model_dir / "config.json").read_text())["num_hidden_layers"]
    layer_bytes = args.prefix_tokens * bytes_per_token // num_layers
    vocab = normal_vocab_token_ids(model_dir)
    chunk_tokens = int(args.range_extra_dict.get("chunk_tokens", max(256, args.block_size)))
    num_suffixes = args.warmup + args.repeats + 1  # the last one ends the cold prompts
    result: dict[str, Any] = {
        "config": {k: v for k, v in vars(args).items() if k != "range_extra_dict"},
        "prefix_kv_bytes": args.prefix_tokens * bytes_per_token, "kv_bytes_per_token": bytes_per_token,
        "num_layers": num_layers, "engines": {}, "wire_s": {}}
    _log(f"model {model_dir}: {num_layers} layers, {bytes_per_token} B of KV a token; prefix "
         f"{args.prefix_tokens} tokens = {result['prefix_kv_bytes'] / GIB:.3f} GiB")
    result["copy_s"] = measure_copy_s(num_layers, args.prefix_tokens // args.block_size,
                                      args.block_size * bytes_per_token // num_layers, args.repeats)
    result["copy_s_median"] = _median(result["copy_s"])
    work_dir = Path(tempfile.mkdtemp(prefix="range-hit-ttft-"))
    shared_dir = work_dir / "tiers"
    # The first Range engine runs every asked tier as a hierarchy (nearest first): its one cold prompt saves the
    # prefix to all of them (write-through) and its hits come from the nearest; each further engine runs one
    # farther tier alone and loads the same prefix from it without computing it again (100 s a time here).
    order = [t for t in TIERS if t in args.tier_list]
    engines = [("none", None), (order[0], order), *((t, [t]) for t in order[1:])]
    try:
        for idx, (name, tiers) in enumerate(engines):
            run_dir = work_dir / name
            run_dir.mkdir(parents=True)
            prefixes, suffixes = make_prompts(vocab, 1_000 if name == "none" else 2_000,
                                              args.cold_repeats if name == "none" else 1, num_suffixes,
                                              args.prefix_tokens, args.suffix_tokens)
            extra = None if tiers is None else tier_extra(tiers, shared_dir, args.tier_capacity_bytes,
                                                          args.range_extra_dict)
            # the hierarchy writes its far copies after the near one: they must be on the far tiers before it stops
            far_landed = None if tiers is None or len(tiers) < 2 else (
                lambda tiers=tiers: wait_far_copies(shared_dir, tiers, result["prefix_kv_bytes"]))
            eng = run_engine(name, args, model_dir, run_dir, None if extra is None else connector_config(extra),
                             prefixes, suffixes, args.prefix_tokens // chunk_tokens, cold=idx <= 1,
                             before_stop=far_landed)
            eng["tiers"] = tiers
            if tiers is not None:  # after the engine stopped: what the tiers hold, and what Range did not write
                eng["tier_bytes_after"] = tier_bytes_outside(shared_dir)
                _log(f"{name}: tiers after it: {eng['tier_bytes_after']}; not written: {eng['not_written']}")
            if name in ("valkey", "file"):
                eng["wire_s"] = measure_wire_s(tier_extra([name], shared_dir, args.tier_capacity_bytes, {}),
                                               num_layers, layer_bytes, args.repeats)
                eng["wire_s_median"] = _median(eng["wire_s"])
            result["engines"][name] = eng
    except Exception as exc:  # noqa: BLE001  (one line and the exit status; the traceback is the engines' logs)
        _log(f"FAILED: {type(exc).__name__}: {exc} (logs under {work_dir})")
        return 1
    finally:
        stop_servers(shared_dir / "valkey")
    result["verdicts"] = verdicts(result)
    result["run"] = {"command": [sys.executable, *sys.argv], "model": str(model_dir), "loadavg_start": load_start,
                     "machine": bench_common.machine_info(), "versions": bench_common.versions(),
                     "git": bench_common.git_state()}
    out = Path(args.out) if args.out else Path(args.results_dir) / f"hit-ttft-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print()
    print(format_table(result))
    print(f"JSON: {out}")
    for name in result["engines"]:  # the engines' logs stay next to the JSON (the tier data does not)
        log = work_dir / name / "vllm.log"
        if log.is_file():
            shutil.copyfile(log, out.with_name(f"{out.stem}-{name}.log"))
            print(f"log: {out.with_name(f'{out.stem}-{name}.log')}")
    shutil.rmtree(work_dir, ignore_errors=True)
    return 0 if all(v["all_hits"] for v in result["verdicts"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
