"""The object-count sweep (issue 3, item 6): restore a fixed KV payload cut into 32x different object counts.

A fixed payload (default 512 MiB = 4,096 tokens) of KV for the bench GQA model (32 layers, 8 KV heads, head size
128, bf16: 4 KiB per token per layer, 128 KiB per token) sits in KV-cache tensors allocated the way vLLM allocates
them on CPU: one shared buffer, layer-major, each layer a view ``[num_blocks, 8, block_size, 256]`` (block size 32,
so every chunk size from 32 to 1,024 tokens is whole blocks). For each chunk size C, N = chunks x layers is the
number of logical objects a per-chunk, per-layer store (LMCache with layer-wise loading) creates for the payload:
4,096 objects at C = 32 down to 128 at C = 1,024.

How each path is driven (every path ends with the bytes in the same kind of registered KV tensors, at shuffled,
non-contiguous destination block ids, and is verified byte for byte outside the timing):

* ``range_<backend>``: Range's real code. A :class:`~range_connector.worker.facade.RangeWorker` registered on the source
  tensors saves the payload in one save batch (one :class:`RangeConnectorMetadata` with one
  :class:`RequestTransfer` of all chunks, hashed with the real prefix hash chain); a
  :class:`~range_connector.scheduler.facade.RangeScheduler` looks the tickets up (``stored_prefix``: timed separately as
  ``lookup``); a second ``RangeWorker`` registered on freshly zeroed destination tensors restores them with
  ``start_load`` and one ``wait_for_layer`` per layer in order, as attention calls it (timed as ``restore``: from
  the load request until every layer's bytes are in the destination blocks and verified — the step's load errors
  are collected inside the timed path; ``first_layer_s`` is when the first layer was handed over). Building
  the load metadata from the tickets (the scheduler's ``update_state_after_alloc`` work) is timed as ``plan``.
  Backends: ``memory`` (in-process DRAM tier; the scheduler keeps the index, learnt from the saving worker's
  metadata, as in the engine), ``valkey`` (one open loopback server from ``ensure_servers(require_password=False)`` in a private runtime dir;
  saver, loader and scheduler each have their own connection), ``file`` (when
  ``range_connector.backends.file.backend.FileBackend`` exists; ``file_warm`` with the page cache warm and ``file_cold``
  after dropping it between repeats, untimed: ``/proc/sys/vm/drop_caches`` when allowed, else
  ``posix_fadvise(DONTNEED)`` on every stripe file, reported as the method used). Range's restore is driven as a
  layer-pipelined load (``start_load``, then ``wait_for_layer`` per layer in order), so its first layer is handed
  over before the last one has landed.
* ``lmcache_<path>``, ``plain_valkey_per_object``, ``resident_shim``: ``bench/lmcache_shim.py`` run with
  ``.venv-lmcache/bin/python`` as one subprocess per (C, path), under a timeout, against the same Valkey server
  (see the shim's docstring for how LMCache 0.5.6 is driven). Missing environment: the reason is printed; create it
  with ``bash bench/setup_lmcache_env.sh``.
* ``resident``: in this process, a contiguous in-memory image of the same bytes copied into the same destination
  blocks with one ``index_copy_`` per layer (the "already resident" limit Range-DRAM is compared with).

Range rows (and ``resident``, measured with the DRAM tier) are taken tier by tier with every chunk size set up at
once and restored round after round, the order rotated each round, so that a busy spell on this shared machine
falls on every N alike; each round restores every N once (one warm-up round, ``--repeats`` timed rounds, then one
instrumented round whose per-part breakdown is reported but not counted). torch runs with one intra-op thread
here (``--torch-threads``), as the shim's children do and as vLLM's CPU worker does on 2 cores once a KV
connector reserves a core.

Reports per path and N: median of the timed repeats (after one warm-up), GiB/s, time to the first layer, lookup
time, client counters (Range: backend counters and the worker's ``copy_launches``), Valkey server-side command
counts (``INFO commandstats`` deltas) for the restore and the lookup; per path the per-object slope (least-squares
fit of median restore time against N); the max/min of Range's medians across N per backend; Range-Valkey against
the fastest LMCache path at the coarsest and finest N; Range-DRAM against resident at each N. Writes
``bench/results/granularity-<timestamp>.json`` and ``.png`` and prints a table with the machine and the command.

This script holds the measurement loop (the interleaved rounds, the per-row aggregates, the command line and the
result document). The Range rows are built in ``bench/granularity_range.py``, the baselines (resident, the shim
rows) in ``bench/granularity_baselines.py``, the analysis, table and plot in ``bench/granularity_report.py``; the KV
layout is in ``bench/bench_kv_layout.py`` and the machine and git helpers are in ``bench/bench_common.py``.

Usage::

    .venv/bin/python bench/granularity.py                 # full run (512 MiB, C = 32..1024, LMCache rows)
    .venv/bin/python bench/granularity.py --smoke         # 16 MiB, C = 32 and 128, 2 repeats, no LMCache
    .venv/bin/python bench/granularity.py --no-lmcache --chunk-tokens 32,1024
    .venv/bin/python bench/granularity.py --no-lmcache --backends valkey --security   # AUTH and TLS beside plain
    .venv/bin/python bench/granularity.py --no-lmcache --backends valkey --tiers       # half from DRAM, half Valkey

``--security`` restores the same payload three ways, interleaved in one group of rounds: ``range_valkey`` (plain
TCP, no AUTH), ``range_valkey_auth`` (a second embedded server with ``requirepass``; the password in the URL, so
every RESP connection sends ``AUTH`` once) and ``range_valkey_tls`` (``valkeys://`` through the TLS-terminating relay
of ``range_connector/testing/tls_relay.py``, run as a process of its own, in front of the plain server, with a CA made
for the run; the relay's encryption runs on the same machine). The JSON's ``security`` section has each row's median against
``range_valkey``'s at every chunk size (``auth_over_plain``, ``tls_over_plain``: > 1 is slower).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import shlex
import shutil
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

import torch
from bench_common import GIB, MIB, REPO, busy_cores, git_state, log, machine_info, median, versions, wait_quiet
from bench_kv_layout import BLOCK_SIZE, BYTES_PER_TOKEN_PER_LAYER, HEAD_SIZE, KV, NUM_KV_HEADS, NUM_LAYERS, Payload
from granularity_baselines import SHIM_PATHS, ResidentCase, lmcache_unavailable_reason, run_shim
from granularity_range import RangeCase, ServerStats, TieredCase, open_file_backend, valkey_data_path
from granularity_report import analyse, plot, print_report

FORMAT_VERSION = 1
DEFAULT_CHUNKS = (32, 64, 128, 256, 512, 1024)
SMOKE_CHUNKS = (32, 128)


# ---------------------------------------------------------------------------------------------------- rounds
def run_interleaved(cases: list, phases: list[tuple[str, bool]], args: argparse.Namespace) -> list[dict[str, Any]]:
    """Restore every case round after round (the order rotated each round), so that a busy spell of this shared
    machine falls on every N alike; ``phases``: ``[(path suffix, cold)]`` run one after the other."""
    for case in cases:
        try:
            case.setup()
        except Exception as exc:
            case.error = f"{type(exc).__name__}: {exc}"
            case.traceback = traceback.format_exc()[-3000:]
    live = [c for c in cases if c.error is None]
    for path_of, cold in phases:
        rounds = ["warmup"] * args.warmup + ["timed"] * args.repeats + ["breakdown"]
        for i, kind in enumerate(rounds):
            k = i % max(1, len(live))
            for case in live[k:] + live[:k]:
                if case.error is not None:
                    continue
                try:
                    case.restore(path_of(case), kind, cold)
                except Exception as exc:
                    case.error = f"{type(exc).__name__}: {exc}"
                    case.traceback = traceback.format_exc()[-3000:]
    rows = []
    for case in cases:
        paths = [path_of(case) for path_of, _ in phases]
        paths += [p for p in getattr(case, "rows", {}) if p not in paths]  # (a case that restores several parts)
        for path in paths:
            row = case.rows.get(path) or {"path": path, "chunk_tokens": case.C,
                                          "family": "range" if isinstance(case, RangeCase) else "reference",
                                          "num_objects": args.payload_tokens // case.C * NUM_LAYERS}
            if case.error is not None:
                row.update(status="error", reason=case.error, traceback=getattr(case, "traceback", None))
            else:
                per = row.get("per_repeat", [])
                row.update(aggregate(per, row.get("payload_bytes", args.payload_bytes)))
                row["byte_exact"] = bool(per) and all(r["byte_exact"] for r in per)
                row["status"] = "ok"
            rows.append(row)
        case.close()
    return rows


def aggregate(per_rep: list[dict[str, Any]], payload_bytes: int) -> dict[str, Any]:
    def col(k: str) -> list[float]:
        return [r[k] for r in per_rep if r.get(k) is not None]

    med = median(col("restore_s"))
    last = per_rep[-1] if per_rep else {}
    out = {
        "repeats_done": len(per_rep),
        "restore_s_all": col("restore_s"),
        "restore_s_median": med,
        "restore_s_min": min(col("restore_s")) if per_rep else None,
        "gib_per_s": payload_bytes / GIB / med if med else None,
        "first_layer_s_median": median(col("first_layer_s")),
        "lookup_s_median": median(col("lookup_s")),
        "plan_s_median": median(col("plan_s")),
        "client_counts_restore": last.get("client_counts_restore"),
        "worker_stats_restore": last.get("worker_stats_restore"),
        "client_counts_lookup": last.get("client_counts_lookup"),
        "server_commands_restore": last.get("server_commands_restore"),
        "server_commands_lookup": last.get("server_commands_lookup"),
    }
    return out


# ---------------------------------------------------------------------------------------------------- main
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true",
                   help="16 MiB payload, chunk sizes 32 and 128, 2 repeats, no LMCache (for tests)")
    p.add_argument("--payload-mib", type=int, default=None, help="payload in MiB (default 512; smoke 16)")
    p.add_argument("--chunk-tokens", default=None, help="comma-separated chunk sizes (default 32,...,1024)")
    p.add_argument("--repeats", type=int, default=None,
                   help="timed restores per Range/resident row (default 41: single Valkey restores on 2 shared cores\n"
                        "spread +-7%% around their median, so a median of fewer cannot show a 5%% flatness)")
    p.add_argument("--lmcache-repeats", type=int, default=5, help="timed restores per shim row (default 5)")
    p.add_argument("--warmup", type=int, default=1, help="untimed restores before the timed ones")
    p.add_argument("--backends", default="memory,valkey,file",
                   help="Range backends (memory, valkey, file; file only when FileBackend exists)")
    p.add_argument("--no-lmcache", action="store_true", help="skip the shim rows (LMCache, plain, resident_shim)")
    p.add_argument("--security", action="store_true",
                   help="with the valkey backend: also range_valkey_auth (AUTH) and range_valkey_tls (TLS relay) rows,\n"
                        "interleaved with range_valkey, and their ratios in the JSON's `security` section")
    p.add_argument("--tiers", action="store_true",
                   help="add the tier-hierarchy rows: half the payload from DRAM, half from Valkey, and each half "
                        "alone (needs valkey in --backends)")
    p.add_argument("--shim-paths", default=",".join(SHIM_PATHS), help="shim paths to run")
    p.add_argument("--lmcache-timeout-s", type=float, default=150.0, help="limit per shim child (one path, one C)")
    p.add_argument("--no-cold", action="store_true", help="skip the cold file rows")
    p.add_argument("--torch-threads", type=int, default=1,
                   help="torch intra-op threads here (default 1, as the shim's children use)")
    p.add_argument("--results-dir", default=str(REPO / "bench" / "results"))
    p.add_argument("--out", default=None, help="JSON path (default <results-dir>/granularity-<timestamp>.json)")
    p.add_argument("--file-dir", default=None, help="directory for the file backend's stripes (default: a temp dir)")
    p.add_argument("--max-busy-cores", type=float, default=0.3,
                   help="quiet = other processes keep fewer cores busy than this (with --wait-quiet-s)")
    p.add_argument("--wait-quiet-s", type=float, default=0.0,
                   help="before each tier and each shim chunk size, wait up to this long for a quiet machine")
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("--report", metavar="JSON", default=None,
                   help="only re-print the table of an earlier run (analysis recomputed from its rows)")
    p.add_argument("--seed", type=int, default=1234)
    args = p.parse_args(argv)
    args.payload_mib = args.payload_mib or (16 if args.smoke else 512)
    if args.chunk_tokens:
        args.chunks = [int(c) for c in args.chunk_tokens.split(",") if c.strip()]
    else:
        args.chunks = list(SMOKE_CHUNKS if args.smoke else DEFAULT_CHUNKS)
    args.repeats = args.repeats or (2 if args.smoke else 41)
    if args.smoke:
        args.no_lmcache = True
        args.lmcache_repeats = min(args.lmcache_repeats, 2)
    args.payload_bytes = args.payload_mib * MIB
    per_token = NUM_LAYERS * BYTES_PER_TOKEN_PER_LAYER
    if args.payload_bytes % per_token:
        p.error(f"payload must be whole tokens of {per_token} bytes")
    args.payload_tokens = args.payload_bytes // per_token
    args.payload_blocks = args.payload_tokens // BLOCK_SIZE
    for c in args.chunks:
        if c % BLOCK_SIZE or args.payload_tokens % c:
            p.error(f"chunk {c} must be a multiple of {BLOCK_SIZE} dividing {args.payload_tokens} tokens")
    args.backend_list = [b.strip() for b in args.backends.split(",") if b.strip()]
    args.run_tag = f"{os.getpid()}-{time.time_ns()}"
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.report:
        doc = json.loads(Path(args.report).read_text())
        doc["analysis"] = analyse(doc["rows"], doc["config"]["chunk_tokens"], doc["config"]["payload_tokens"])
        print_report(doc)
        return 0
    torch.set_num_threads(args.torch_threads)
    command = shlex.join([sys.executable, *(sys.argv if argv is None else [str(Path(__file__)), *argv])])
    wait_quiet(args.max_busy_cores, args.wait_quiet_s)
    machine = machine_info()
    git_at_start = git_state()  # the code this process imports now (others may commit while it runs)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    results_dir = Path(args.results_dir)
    results_dir.mkdir(parents=True, exist_ok=True)
    out_json = Path(args.out) if args.out else results_dir / f"granularity-{stamp}.json"
    notes: list[str] = []
    log(f"granularity: {args.payload_mib} MiB, C={args.chunks}, backends {args.backend_list}, load {machine['loadavg']}"
        f", {machine['cpu_model']} x{machine['cpu_count']}")
    t_start = time.monotonic()

    # KV tensors: source and destination, each with twice the payload's blocks (payload at shuffled block ids).
    num_blocks = 2 * args.payload_blocks
    payload = Payload(num_blocks, args.payload_blocks, args.seed)
    args.dst_per_case = False
    args.shared_dst = KV(num_blocks)  # every restore zeroes it first and writes new shuffled block ids

    tmp = Path(tempfile.mkdtemp(prefix="range-granularity-"))
    runtime_dir = tmp / "valkey-runtime"
    valkey_url = None
    stats = None
    secure: SecureServers | None = None
    rows: list[dict[str, Any]] = []
    try:
        need_valkey = "valkey" in args.backend_list or not args.no_lmcache
        if need_valkey:
            from range_connector.backends.valkey.servers import ensure_servers

            try:
                # An open server, explicitly: the range_valkey rows measure the RESP reader without AUTH (embedded
                # servers require a password by default); --security adds a second one whose password it sets.
                # Every case's payload stays stored for the interleaved rounds: the limit holds them all (the
                # TLS rows share the plain server).
                cases_per_server = len(args.chunks) * (2 if args.security else 1) + (len(args.chunks) if args.tiers
                                                                                     else 0)
                limit_bytes = max(1 << 30, int(1.25 * cases_per_server * args.payload_bytes) + (256 << 20))
                urls = ensure_servers(2 if args.security else 1, runtime_dir, require_password=False,
                                      maxmemory_bytes=limit_bytes)
                valkey_url = urls[0]
                stats = ServerStats(valkey_url)
                log(f"  valkey server {valkey_url} (runtime dir {runtime_dir})")
                if args.security and "valkey" in args.backend_list:
                    secure = SecureServers(valkey_url, urls[1], tmp / "pki")
                    log(f"  AUTH server {secure.auth_url_shown}, TLS relay {secure.tls_url} -> {valkey_url}")
            except Exception as exc:
                notes.append(f"no Valkey server: {type(exc).__name__}: {exc}")
                log(f"  no Valkey server: {exc}")
        file_factory, file_reason, file_root = None, "not requested", None
        if "file" in args.backend_list:
            file_root = Path(args.file_dir) if args.file_dir else tmp / "file-tier"
            file_root.mkdir(parents=True, exist_ok=True)
            file_factory, file_reason = open_file_backend(file_root)
            if file_factory is None:
                msg = f"file backend not available: {file_reason}"
                notes.append(msg)
                log(msg)
        shim_reason = None if args.no_lmcache else lmcache_unavailable_reason()
        if args.no_lmcache:
            notes.append("LMCache/plain/resident_shim rows skipped (" + ("--smoke" if args.smoke else "--no-lmcache")
                         + ")")
        elif shim_reason:
            notes.append(f"LMCache rows not run: {shim_reason}")
            log(f"LMCache rows not run: {shim_reason}")

        # Range rows and resident, interleaved across N within each tier.
        groups: list[tuple[str, list, list]] = []
        if "memory" in args.backend_list:
            groups.append(("memory + resident",
                           [RangeCase("memory", c, args, payload, None, None, None) for c in args.chunks]
                           + [ResidentCase(c, args, payload) for c in args.chunks],
                           [(lambda case: "range_memory" if isinstance(case, RangeCase) else "resident", False)]))
        else:
            groups.append(("resident", [ResidentCase(c, args, payload) for c in args.chunks],
                           [(lambda case: "resident", False)]))
        if "valkey" in args.backend_list and valkey_url and secure is not None:
            groups.append(("valkey + auth + tls", secure.cases(args, payload, valkey_url),
                           [(lambda case: case.row_path, False)]))
        elif "valkey" in args.backend_list and valkey_url:
            groups.append(("valkey", [RangeCase("valkey", c, args, payload, valkey_url, None, None)
                                      for c in args.chunks], [(lambda case: "range_valkey", False)]))
        if args.tiers and "valkey" in args.backend_list and valkey_url:
            groups.append(("dram + valkey", [TieredCase(c, args, payload, valkey_url) for c in args.chunks],
                           [(lambda case: "range_dram_valkey", False)]))
        if file_factory is not None:
            phases = [(lambda case: "range_file_warm", False)]
            if not args.no_cold:
                phases.append((lambda case: "range_file_cold", True))
            groups.append(("file", [RangeCase("file", c, args, payload, None, file_factory, file_root)
                                    for c in args.chunks], phases))
        for name, cases, phases in groups:
            if stats is not None:
                stats.flush()
            busy = wait_quiet(args.max_busy_cores, args.wait_quiet_s)
            busy = busy_cores(1.0) if busy is None else busy
            log(f"[{name}] {len(cases)} cases x {args.warmup + args.repeats + 1} rounds, interleaved across N "
                f"(load {os.getloadavg()[0]:.2f}, {busy:.2f} cores busy before)")
            t = time.monotonic()
            got = run_interleaved(cases, phases, args)
            for row in got:
                row["busy_cores_before"] = round(busy, 2)
                row["loadavg_after"] = round(os.getloadavg()[0], 2)
            for row in sorted(got, key=lambda r: (r["path"], -r["num_objects"])):
                _progress(row)
            log(f"  ({time.monotonic() - t:.0f} s)")
            rows.extend(got)
            del cases
            gc.collect()
            if file_root is not None and name == "file":
                shutil.rmtree(file_root, ignore_errors=True)

        # LMCache 0.5.6, plain per-object Valkey and the shim's resident copy: one subprocess per (C, path).
        if not args.no_lmcache and shim_reason is None:
            if stats is not None:
                stats.flush()
            shim_dir = tmp / "shim"
            shim_dir.mkdir()
            shim_paths = [p.strip() for p in args.shim_paths.split(",") if p.strip()]
            for c in args.chunks:
                busy = wait_quiet(args.max_busy_cores, args.wait_quiet_s)
                busy = busy_cores(1.0) if busy is None else busy
                log(f"[shim] C={c} N={args.payload_tokens // c * NUM_LAYERS} (load {os.getloadavg()[0]:.2f}, "
                    f"{busy:.2f} cores busy before)")
                for path in shim_paths:
                    row = run_shim(path, c, args, valkey_url, shim_dir)
                    row["busy_cores_before"] = round(busy, 2)
                    row["loadavg_after"] = round(os.getloadavg()[0], 2)
                    rows.append(row)
                    _progress(row)
    finally:
        if secure is not None:
            secure.close()
        if stats is not None:
            with contextlib.suppress(Exception):
                stats.flush()
            stats.close()
        if valkey_url is not None:
            from range_connector.backends.valkey.servers import stop_servers

            with contextlib.suppress(Exception):
                stop_servers(runtime_dir)
        shutil.rmtree(tmp, ignore_errors=True)

    doc: dict[str, Any] = {
        "format_version": FORMAT_VERSION,
        "tool": "bench/granularity.py",
        "command": command,
        "started": stamp,
        "wall_s": round(time.monotonic() - t_start, 1),
        "machine": machine,
        "machine_end": {"loadavg": [round(x, 2) for x in os.getloadavg()]},
        "versions": versions(),
        "range_valkey_data_path": valkey_data_path(),
        "git": git_at_start,
        "git_at_end": git_state(),
        "config": {
            "payload_bytes": args.payload_bytes, "payload_tokens": args.payload_tokens,
            "payload_blocks": args.payload_blocks, "chunk_tokens": args.chunks, "repeats": args.repeats,
            "lmcache_repeats": args.lmcache_repeats, "warmup": args.warmup, "smoke": args.smoke,
            "torch_threads": torch.get_num_threads(), "backends": args.backend_list,
            "layout": {"num_layers": NUM_LAYERS, "num_kv_heads": NUM_KV_HEADS, "head_size": HEAD_SIZE,
                       "dtype": "bfloat16", "block_size": BLOCK_SIZE,
                       "layer_view_shape": ["num_blocks", NUM_KV_HEADS, BLOCK_SIZE, 2 * HEAD_SIZE],
                       "bytes_per_token": NUM_LAYERS * BYTES_PER_TOKEN_PER_LAYER,
                       "num_blocks_src_and_dst": num_blocks, "allocation": "one shared buffer, layer-major"},
            "timing": ("restore: from the load request (tickets already looked up, load metadata built) until every "
                       "layer's bytes are in the destination blocks and checksums verified (Range verifies inside "
                       "start_load); lookup and plan timed separately; byte-equality check outside the timing; "
                       "destination zeroed and block ids reshuffled before every restore (untimed)"),
        },
        "notes": notes,
        "rows": rows,
    }
    doc["analysis"] = analyse(rows, args.chunks, args.payload_tokens)
    if args.tiers:
        doc["tiers"] = tier_ratios(rows)
        log(f"tiers (median restore, mixed over the halves): {json.dumps(doc['tiers']['ratios'])}")
    if args.security:
        doc["security"] = security_ratios(rows, secure)
        log(f"security (median restore against range_valkey): {json.dumps(doc['security']['ratios'])}")
    out_json.parent.mkdir(parents=True, exist_ok=True)
    png = out_json.with_suffix(".png")
    doc["plot"] = None if args.no_plot else plot(doc, png)
    out_json.write_text(json.dumps(doc, indent=1))
    print_report(doc)
    log(f"JSON: {out_json}")
    if doc["plot"]:
        log(f"plot: {doc['plot']}")
    log(f"wall time {doc['wall_s']:.0f} s")
    bad = [r for r in rows if r.get("family") == "range" and r.get("status") != "ok"]
    return 1 if bad else 0


class SecureServers:
    """``--security``: AUTH on a second embedded server (``requirepass`` set now) and a TLS relay in front of the
    plain one; :meth:`cases` builds the interleaved plain/AUTH/TLS cases."""

    PASSWORD = "granularity-bench-Pa55"

    def __init__(self, plain_url: str, auth_server_url: str, pki_dir: Path) -> None:
        from urllib.parse import urlsplit

        import valkey

        from range_connector.testing.tls_relay import RelayProcess, make_test_pki

        admin = valkey.Valkey.from_url(auth_server_url, socket_timeout=10)
        try:
            admin.config_set("requirepass", self.PASSWORD)
        finally:
            admin.close()
        auth = urlsplit(auth_server_url)
        self.auth_url = f"valkey://:{self.PASSWORD}@{auth.hostname}:{auth.port}"
        self.auth_url_shown = f"valkey://***@{auth.hostname}:{auth.port}"
        plain = urlsplit(plain_url)
        self.pki = make_test_pki(pki_dir)
        self.relay = RelayProcess(pki_dir, plain.hostname or "127.0.0.1", plain.port or 6379)
        self.tls_url = self.relay.url()

    def cases(self, args: argparse.Namespace, payload: Payload, plain_url: str) -> list[RangeCase]:
        from range_connector.backends.valkey.urls import ValkeyAccess

        out = []
        for path, url, access, stats_url in (
                ("range_valkey", plain_url, None, None),
                ("range_valkey_auth", self.auth_url, None, None),
                ("range_valkey_tls", self.tls_url, ValkeyAccess(tls_ca_file=str(self.pki.ca_file)), plain_url)):
            for c in args.chunks:
                case = RangeCase("valkey", c, args, payload, url, None, None)
                case.row_path, case.valkey_access, case.stats_url = path, access, stats_url
                out.append(case)
        return out

    def close(self) -> None:
        self.relay.close()


def tier_ratios(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Per chunk size: the mixed restore (half from DRAM, half from Valkey) over the sum of the two halves restored
    alone (acceptance: at most 1.1) and over the slower half (1.0 would be perfect overlap of the two tiers)."""
    medians: dict[str, dict[int, float]] = {}
    for r in rows:
        if r.get("status") == "ok" and r.get("restore_s_median") and r["path"] in TieredCase.PARTS:
            medians.setdefault(r["path"], {})[r["chunk_tokens"]] = r["restore_s_median"]
    mixed, dram, far = (medians.get(p, {}) for p in ("range_dram_valkey", "range_dram_half", "range_valkey_half"))
    ratios = {}
    for c in sorted(mixed):
        if c in dram and c in far:
            ratios[str(c)] = {"mixed_s": mixed[c], "dram_half_s": dram[c], "valkey_half_s": far[c],
                              "mixed_over_sum": round(mixed[c] / (dram[c] + far[c]), 4),
                              "mixed_over_slower": round(mixed[c] / max(dram[c], far[c]), 4)}
    return {"ratios": ratios, "note": "one TieredBackend per worker; a shard reads its tiers side by side (the "
                                      "DRAM copy and the Valkey receive share this machine's cores)"}


def security_ratios(rows: list[dict[str, Any]], secure: SecureServers | None) -> dict[str, Any]:
    """Each security row's median restore time over ``range_valkey``'s, per chunk size (> 1: slower)."""
    medians: dict[str, dict[int, float]] = {}
    for r in rows:
        if r.get("status") == "ok" and r.get("restore_s_median"):
            medians.setdefault(r["path"], {})[r["chunk_tokens"]] = r["restore_s_median"]
    plain = medians.get("range_valkey", {})
    ratios = {name: {str(c): round(t / plain[c], 4) for c, t in sorted(medians.get(path, {}).items()) if c in plain}
              for name, path in (("auth_over_plain", "range_valkey_auth"), ("tls_over_plain", "range_valkey_tls"))}
    return {"ratios": ratios,
            "gib_per_s": {p: {str(c): r["gib_per_s"] for r in rows if r["path"] == p and r.get("gib_per_s")
                              for c in [r["chunk_tokens"]]}
                          for p in ("range_valkey", "range_valkey_auth", "range_valkey_tls")},
            "setup": None if secure is None else {
                "auth": "second embedded server with requirepass; password in the URL (AUTH once per connection)",
                "tls": "valkeys:// through range_connector/testing/tls_relay.py (asyncio, a process of its own) in "
                       "front of the plain server; CA and server certificate made for the run "
                       f"({secure.pki.made_with})"}}


def _progress(row: dict[str, Any]) -> None:
    head = f"  {row['path']:24s} C={row['chunk_tokens']:5d} N={row.get('num_objects', '?')!s:>5s}"
    if row.get("status") == "ok" and row.get("restore_s_median") is not None:
        log(f"{head} {row['restore_s_median']:8.4f} s  {row.get('gib_per_s') or 0:5.2f} GiB/s  lookup "
            f"{(row.get('lookup_s_median') or 0) * 1e3:7.2f} ms")
    else:
        log(f"{head} {row.get('status')}: {row.get('reason')}")


if __name__ == "__main__":
    sys.exit(main())
