"""Partitioned bandwidth over shaped links (issue 18, item 6): restore a fixed KV payload from S = 1, 2, 4, 8 Valkey
servers, one per shard, each in its own network namespace behind a link shaped with ``tc ... tbf``.

On one 2-core machine more servers cannot deliver more bandwidth (``bench/partition.py``: they share the cores).
Here every server sits behind its own link of ``--shaped-rate-mbit`` in each direction (``bench/shaped_links.py``),
a rate low enough that S = 8 links together stay under what one unshaped loopback server delivers, so each shard's
read is bound by its link, as on separate hosts. The servers know nothing of each other: the client (the real
:class:`~range_connector.worker.facade.RangeWorker`, or one fetch thread per shard) reads every shard's server
directly. The cases, paths, payload and byte-exact checks are ``bench/partition.py``'s :class:`Case` (the payload
saved by a real ``RangeWorker`` and looked up with a real ``RangeScheduler``); one more case restores the same
payload from one unshaped loopback server in the same run: the figure the S = 8 links must stay under.

Per restore, from every server's own ``INFO``: bytes sent (``total_net_output_bytes``) and commands
(``INFO commandstats`` deltas); from each shaper: bytes sent through it (``tc -s qdisc``, headers included). The
acceptance check (S servers deliver >= 0.75 * S times one server's bandwidth, up to S = 8) is printed as a verdict.
Writes ``bench/results/partition-shaped-<time>.json`` and ``.png``. Needs root (CAP_NET_ADMIN) and iproute2.

Usage::

    .venv/bin/python bench/partition_shaped.py                          # 128 MiB, 200 Mbit/s links, 3 rounds
    .venv/bin/python bench/partition_shaped.py --smoke                  # 16 MiB, S = 1, 2, 1000 Mbit/s, 1 round
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import MIB, busy_cores, git_state, log, machine_info, versions, wait_quiet  # noqa: E402
from bench_kv_layout import BLOCK_SIZE, BYTES_PER_TOKEN_PER_LAYER, KV, NUM_LAYERS, Payload  # noqa: E402
from partition import PATHS, Case, summarise  # noqa: E402
from shaped_links import ShapedServer, clean_stale, probe_netns  # noqa: E402

from range_connector.backends.valkey.servers import ensure_servers, stop_servers  # noqa: E402

FORMAT_VERSION = 1
ACCEPT_FRACTION = 0.75  # S servers must deliver >= 0.75 * S times one server's bandwidth
HOUSEKEEPING = ("info", "auth", "hello", "ping", "client|setinfo", "select")  # not the restore's own commands


def command_calls(url: str) -> dict[str, int]:
    """``{command: calls}`` from one server's ``INFO commandstats`` (subcommands as ``client|setinfo``)."""
    import valkey

    c = valkey.Valkey.from_url(url, socket_timeout=30)
    try:
        stats = c.info("commandstats")
    finally:
        c.close()
    return {k.removeprefix("cmdstat_"): int(v["calls"]) for k, v in stats.items()}


def restore_counted(case: Case, path: str, kind: str, shaped: dict[str, ShapedServer]) -> None:
    """``case.restore(path, kind)`` with the servers' command counts and the shapers' byte counts around it; both
    attached to the timed round's record (``commands``: per server, housekeeping left out; ``shaper_bytes``)."""
    calls0 = [command_calls(u) for u in case.server_urls]
    q0 = [shaped[u].qdisc_sent_bytes() for u in case.server_urls if u in shaped]
    case.restore(path, kind)
    if kind != "timed":
        return
    calls1 = [command_calls(u) for u in case.server_urls]
    q1 = [shaped[u].qdisc_sent_bytes() for u in case.server_urls if u in shaped]
    rec = case.records[path][-1]
    rec["commands"] = [{k: n - a.get(k, 0) for k, n in b.items() if n - a.get(k, 0) and k not in HOUSEKEEPING}
                       for a, b in zip(calls0, calls1)]
    rec["shaper_bytes"] = [{d: b[d] - a[d] for d in a} for a, b in zip(q0, q1)]


def row_of(case: Case, path: str, payload_bytes: int) -> dict[str, Any]:
    """``partition.summarise``'s row plus MiB/s, each server's commands and shaper bytes (last timed round)."""
    row = summarise(case, path, payload_bytes)
    if row["status"] == "ok":
        last = case.records[path][-1]
        row.update({"mib_per_s": payload_bytes / MIB / row["restore_s_median"],
                    "server_commands_last": last.get("commands"), "shaper_bytes_last": last.get("shaper_bytes"),
                    "server_mib_per_s": [b / MIB / row["restore_s_median"] for b in row["server_bytes_median"]]})
    for key in ("timeline_last", "overlap_last"):  # the request timelines stay in the records, not the table
        row.pop(key, None)
    return row


def analyse(rows: list[dict[str, Any]], args: argparse.Namespace) -> dict[str, Any]:
    """Per path: ratio to S = 1 for every S, the acceptance check, and whether S_max links stay under the unshaped
    server (the premise of the simulation)."""
    link_mib_per_s = args.shaped_rate_mbit * 1e6 / 8 / MIB
    out: dict[str, Any] = {"link_mib_per_s": link_mib_per_s, "accept_fraction": ACCEPT_FRACTION, "per_path": {}}
    ok = {(r["path"], r["placement"], r["num_shards"]): r for r in rows if r["status"] == "ok"}
    for path in args.paths:
        base, loop = ok.get((path, "shaped", 1)), ok.get((path, "loopback", 1))
        if base is None:
            out["per_path"][path] = {"verdict": "FAIL", "reason": "no S = 1 result"}
            continue
        per = {}
        for s in args.shard_counts:
            r = ok.get((path, "shaped", s))
            if r is None:
                per[f"S{s}"] = {"passed": False, "reason": "no result"}
                continue
            ratio = r["mib_per_s"] / base["mib_per_s"]
            per[f"S{s}"] = {"mib_per_s": r["mib_per_s"], "ratio_vs_S1": ratio, "required_ratio": ACCEPT_FRACTION * s,
                            "passed": ratio >= ACCEPT_FRACTION * s - 1e-9,
                            "link_utilisation": r["mib_per_s"] / (s * link_mib_per_s)}
        s_max = max(args.shard_counts)
        premise = {"s_max_links_mib_per_s": s_max * link_mib_per_s,
                   "unshaped_mib_per_s": loop["mib_per_s"] if loop else None,
                   "holds": bool(loop and s_max * link_mib_per_s < loop["mib_per_s"])}
        passed = all(v["passed"] for v in per.values()) and premise["holds"]
        out["per_path"][path] = {"per_s": per, "premise": premise, "verdict": "PASS" if passed else "FAIL"}
    return out


def plot(doc: dict[str, Any], png: Path) -> str:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        return f"no plot: {exc} (pip install -e '.[bench]')"
    an, cfg = doc["analysis"], doc["config"]
    fig, (ax_bw, ax_ratio) = plt.subplots(1, 2, figsize=(12, 5))
    s_all = cfg["shard_counts"]
    ax_bw.plot(s_all, [s * an["link_mib_per_s"] for s in s_all], "k:", label="S x link rate")
    for i, (path, res) in enumerate(an["per_path"].items()):
        per = res.get("per_s", {})
        ss = [s for s in s_all if "mib_per_s" in per.get(f"S{s}", {})]
        ax_bw.plot(ss, [per[f"S{s}"]["mib_per_s"] for s in ss], "o-", color=f"C{i}", label=f"{path}, shaped")
        ax_ratio.plot(ss, [per[f"S{s}"]["ratio_vs_S1"] for s in ss], "o-", color=f"C{i}", label=path)
        unshaped = res.get("premise", {}).get("unshaped_mib_per_s")
        if unshaped:
            ax_bw.axhline(unshaped, color=f"C{i}", ls="--", lw=1, label=f"{path}, one unshaped loopback server")
    ax_ratio.plot(s_all, s_all, "k:", label="S (ideal)")
    ax_ratio.plot(s_all, [ACCEPT_FRACTION * s for s in s_all], "r--", lw=1, label=f"{ACCEPT_FRACTION} x S (required)")
    for ax in (ax_bw, ax_ratio):
        ax.set_xscale("log", base=2)
        ax.set_xticks(s_all, [str(s) for s in s_all])
        ax.set_xlabel("S (servers, one per shard)")
        ax.legend(fontsize=8)
    ax_bw.set_yscale("log")
    ax_bw.set_ylabel("delivered MiB/s (median)")
    ax_ratio.set_ylabel("bandwidth / bandwidth at S = 1")
    m = doc["machine"]
    fig.suptitle(f"{cfg['payload_bytes'] / MIB:.0f} MiB restored over {cfg['shaped_rate_mbit']:g} Mbit/s links "
                 f"(tbf, one netns per server); {m['cpu_count']} cores, load {m['loadavg'][0]}", fontsize=10)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return str(png)


def print_report(doc: dict[str, Any]) -> None:
    an = doc["analysis"]
    log("=" * 112)
    log(f"{'case':12s} {'path':7s} {'MiB/s':>8s} {'ratio':>6s} {'restore s':>9s}  per server: MiB sent (INFO) / "
        f"data commands / MiB through the read shaper")
    for r in doc["rows"]:
        if r["status"] != "ok":
            log(f"{r['case']:12s} {r['path']:7s} {r['status']}: {r.get('reason')}")
            continue
        ratio = an["per_path"].get(r["path"], {}).get("per_s", {}).get(f"S{r['num_shards']}", {}).get("ratio_vs_S1")
        n = len(r["server_bytes_median"])
        shaper = [f"{q['reads'] / MIB:.1f}" for q in r["shaper_bytes_last"] or []] or ["-"] * n
        per = ", ".join(f"{b / MIB:.1f}/{sum(c.values())}/{q}"
                        for b, c, q in zip(r["server_bytes_median"], r["server_commands_last"] or [{}] * n, shaper))
        log(f"{r['case']:12s} {r['path']:7s} {r['mib_per_s']:8.1f} "
            f"{'' if ratio is None or r['placement'] != 'shaped' else f'{ratio:.2f}x':>6s} "
            f"{r['restore_s_median']:9.3f}  [{per}]" + ("" if r["byte_exact"] else "  NOT BYTE-EXACT"))
    log(f"link rate {doc['config']['shaped_rate_mbit']:g} Mbit/s = {an['link_mib_per_s']:.2f} MiB/s per direction")
    for path, res in an["per_path"].items():
        if "per_s" not in res:
            log(f"  {path}: {res['verdict']} ({res['reason']})")
            continue
        pre = res["premise"]
        checks = ", ".join(f"{k} {v.get('ratio_vs_S1', float('nan')):.2f}x (>= {v.get('required_ratio', 0):.2f}: "
                           f"{'ok' if v['passed'] else 'NO'})" for k, v in res["per_s"].items())
        log(f"  {path}: {checks}")
        log(f"  {path}: premise: {max(doc['config']['shard_counts'])} links = {pre['s_max_links_mib_per_s']:.1f} "
            f"MiB/s < one unshaped loopback server = {pre['unshaped_mib_per_s'] or float('nan'):.1f} MiB/s: "
            f"{'yes' if pre['holds'] else 'NO'}")
        log(f"  {path}: VERDICT {res['verdict']} (S servers >= {ACCEPT_FRACTION} x S x one server's bandwidth)")
    log("=" * 112)


def other_benchmarks() -> list[str]:
    """Other benchmark processes running now (``pgrep -af 'bench/|range_connector.bench'``), this one left out."""
    try:
        out = subprocess.run(["pgrep", "-af", "bench/|range_connector.bench"], capture_output=True, text=True,
                             timeout=10).stdout
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [ln for ln in out.splitlines() if ln.split()[0] not in (str(os.getpid()), str(os.getppid()))]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true", help="16 MiB, S = 1, 2, 1000 Mbit/s, 1 timed round (for tests)")
    p.add_argument("--shaped-rate-mbit", type=float, default=None,
                   help="tbf rate of each server's link, each direction, Mbit/s (default 200; smoke 1000)")
    p.add_argument("--burst-kib", type=int, default=256, help="tbf bucket, KiB")
    p.add_argument("--latency-ms", type=float, default=50.0, help="tbf queue limit as a wait, ms")
    p.add_argument("--shard-counts", default=None, help="comma-separated S values (default 1,2,4,8; smoke 1,2)")
    p.add_argument("--paths", default=",".join(PATHS), help=f"restore paths, of {','.join(PATHS)}")
    p.add_argument("--payload-mib", type=int, default=None, help="payload in MiB (default 128; smoke 16)")
    p.add_argument("--repeats", type=int, default=None, help="timed rounds (default 3; smoke 1)")
    p.add_argument("--warmup", type=int, default=None, help="untimed rounds first (default 1; smoke 0)")
    p.add_argument("--results-dir", default=str(Path(__file__).resolve().parent / "results"))
    p.add_argument("--out", default=None, help="JSON path (default <results-dir>/partition-shaped-<time>.json)")
    p.add_argument("--max-busy-cores", type=float, default=0.5,
                   help="quiet = other processes keep fewer cores busy than this (with --wait-quiet-s)")
    p.add_argument("--wait-quiet-s", type=float, default=0.0, help="wait up to this long for a quiet machine first")
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("--seed", type=int, default=4321)
    args = p.parse_args(argv)
    args.shaped_rate_mbit = args.shaped_rate_mbit or (1000.0 if args.smoke else 200.0)
    args.shard_counts = [int(s) for s in (args.shard_counts or ("1,2" if args.smoke else "1,2,4,8")).split(",")]
    args.paths = [x for x in args.paths.split(",") if x]
    if 1 not in args.shard_counts or any(s < 1 for s in args.shard_counts) or set(args.paths) - set(PATHS):
        p.error("--shard-counts must include 1 (the reference) and be >= 1; --paths must be of worker,fetch")
    args.payload_mib = args.payload_mib or (16 if args.smoke else 128)
    args.repeats = args.repeats or (1 if args.smoke else 3)
    args.warmup = (0 if args.smoke else 1) if args.warmup is None else args.warmup
    # One chunk splits into whole blocks on every shard: one block per shard at the largest S.
    args.chunk_tokens = BLOCK_SIZE * max(args.shard_counts)
    args.payload_bytes = args.payload_mib * MIB
    per_chunk = args.chunk_tokens * NUM_LAYERS * BYTES_PER_TOKEN_PER_LAYER
    if args.payload_bytes % per_chunk:
        p.error(f"--payload-mib: the payload must be whole chunks of {per_chunk / MIB:g} MiB")
    args.payload_tokens = args.payload_bytes // (NUM_LAYERS * BYTES_PER_TOKEN_PER_LAYER)
    args.payload_blocks = args.payload_tokens // BLOCK_SIZE
    args.run_tag = f"{os.getpid()}-{time.time_ns()}"
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    reason = probe_netns()
    if reason is not None:
        log(f"partition_shaped: cannot shape links here: {reason}")
        return 2
    torch.set_num_threads(1)
    command = shlex.join([sys.executable, *(sys.argv if argv is None else [str(Path(__file__)), *argv])])
    stale = clean_stale()
    wait_quiet(args.max_busy_cores, args.wait_quiet_s)
    machine, others_before = machine_info(), other_benchmarks()
    stamp = time.strftime("%Y%m%d-%H%M%S")
    out_json = Path(args.out) if args.out else Path(args.results_dir) / f"partition-shaped-{stamp}.json"
    out_json.parent.mkdir(parents=True, exist_ok=True)
    log(f"partition_shaped: {args.payload_mib} MiB, S = {args.shard_counts}, {args.shaped_rate_mbit:g} Mbit/s links, "
        f"load {machine['loadavg']}, {machine['cpu_model']} x{machine['cpu_count']}"
        + (f"; removed stale {stale}" if stale else ""))
    t_start = time.monotonic()
    payload = Payload(2 * args.payload_blocks, args.payload_blocks, args.seed)
    dst = KV(2 * args.payload_blocks)
    tmp = Path(tempfile.mkdtemp(prefix="range-partition-shaped-"))
    limit_bytes = max(1 << 30, 4 * args.payload_bytes)
    servers = [ShapedServer(i, args.shaped_rate_mbit, args.burst_kib, args.latency_ms, limit_bytes, tmp / "shaped")
               for i in range(max(args.shard_counts))]
    cases: list[Case] = []
    busy_before = None
    try:
        urls = [s.start() for s in servers]
        shaped = dict(zip(urls, servers))
        loop_url = ensure_servers(1, tmp / "loopback", maxmemory_bytes=limit_bytes)[0]  # the password, as shaped
        cases = [Case(s, "shaped", urls[:s], args, payload, dst, args.chunk_tokens) for s in args.shard_counts]
        cases.append(Case(1, "loopback", [loop_url], args, payload, dst, args.chunk_tokens))
        for case in cases:
            try:
                case.setup()
            except Exception as exc:
                case.error, case.traceback = f"{type(exc).__name__}: {exc}", traceback.format_exc()[-3000:]
        busy_before = busy_cores(1.0)
        live = [c for c in cases if c.error is None]
        rounds = ["warmup"] * args.warmup + ["timed"] * args.repeats
        for i, kind in enumerate(rounds):  # every case and path once per round, order rotated
            for case in live[i % len(live):] + live[:i % len(live)]:
                for path in args.paths:
                    if case.error is None:
                        try:
                            restore_counted(case, path, kind, shaped)
                        except Exception as exc:
                            case.error = f"{type(exc).__name__}: {exc}"
                            case.traceback = traceback.format_exc()[-3000:]
            log(f"  round {i + 1}/{len(rounds)} ({kind}) done, load {os.getloadavg()[0]:.2f}")
        rows = [row_of(c, p, args.payload_bytes) for c in cases for p in args.paths]
        links = [{"ns": s.ns, "host_dev": s.host_dev, "ns_dev": s.ns_dev, "server_addr": s.server_addr,
                  "tbf": " ".join(s.tbf_args())} for s in servers]
    finally:
        for c in cases:
            c.close()
        for s in servers:
            s.close()
        with contextlib.suppress(Exception):
            stop_servers(tmp / "loopback")
    doc: dict[str, Any] = {
        "format_version": FORMAT_VERSION, "tool": "bench/partition_shaped.py", "command": command, "started": stamp,
        "wall_s": round(time.monotonic() - t_start, 1), "machine": machine, "busy_cores_before_rounds": busy_before,
        "machine_end": {"loadavg": [round(x, 2) for x in os.getloadavg()]}, "versions": versions(),
        "git": git_state(), "other_benchmarks": {"before": others_before, "after": other_benchmarks()},
        "config": {"payload_bytes": args.payload_bytes, "payload_tokens": args.payload_tokens,
                   "chunk_tokens": args.chunk_tokens, "shard_counts": args.shard_counts, "paths": args.paths,
                   "repeats": args.repeats, "warmup": args.warmup, "smoke": args.smoke,
                   "shaped_rate_mbit": args.shaped_rate_mbit, "burst_kib": args.burst_kib,
                   "latency_ms": args.latency_ms, "links": links,
                   "timing": "restore: from the load request (tickets looked up) until every layer is in the KV "
                             "tensors (worker) or in the staging buffers (fetch); INFO, tc and checks outside",
                   "note": "INFO replies of the snapshots (a few KiB) are inside the bytes-per-server deltas; "
                           "shaper bytes include TCP/IP headers"},
        "errors": {c.name: getattr(c, "traceback", c.error) for c in cases if c.error},
        "rows": rows,
    }
    doc["analysis"] = analyse(rows, args)
    doc["plot"] = None if args.no_plot else plot(doc, out_json.with_suffix(".png"))
    out_json.write_text(json.dumps(doc, indent=1))
    print_report(doc)
    log(f"JSON: {out_json}" + (f"\nplot: {doc['plot']}" if doc["plot"] else ""))
    log(f"wall time {doc['wall_s']:.0f} s")
    return 1 if doc["errors"] or not all(r.get("byte_exact") for r in rows if r["status"] == "ok") else 0


if __name__ == "__main__":
    sys.exit(main())
