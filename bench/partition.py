"""The partitioned-bandwidth sweep (issue 4, item 7): restore a fixed KV payload from S = 1, 2, 4 Valkey servers (one
per shard) and from one shared server holding the same S shards, in the same run.

The payload (default 256 MiB) is KV of the bench GQA model's layout (``bench/bench_kv_layout.py``: 32 layers, 8
KV heads, head size 128, bf16, block size 32; 128 KiB per token), saved once per case by a real
:class:`~range_connector.worker.facade.RangeWorker` over S
:class:`~range_connector.backends.valkey.client.ValkeyBackend` shards (one stripe per shard: the same bytes and tickets
that P rank writers store, see ``tests/unit/test_pcp_rank_view.py``) and looked up with a real
:class:`~range_connector.scheduler.facade.RangeScheduler` (``stored_prefix``: the min over shards). Cases:
``partitioned`` (shard s on server s) for S = 1, 2, 4, and ``shared`` (all S shards on one more server) for
S = 2, 4; S = 1 is both. Two restore paths per case, rounds interleaved across cases (order rotated):

* ``worker``: a PCP=1 reader (a decode engine) restores with the real ``RangeWorker.start_load`` into freshly zeroed
  KV tensors at shuffled block ids (banks, checksums, index copies included); byte-exact check outside the timing.
* ``fetch``: one thread per shard issues that shard's batched read (``ValkeyBackend.read_ranges``: one pipelined GET
  per layer value) into a staging buffer: the tier's delivered fetch bandwidth with no client-side copy; checked
  against the stripes' per-layer checksums outside the timing.

Per restore: wall time, client CPU (``time.process_time``, every thread), and from every server's own ``INFO``:
bytes sent (``total_net_output_bytes``) and CPU seconds (``used_cpu_user`` + ``used_cpu_sys``) deltas, plus a
timeline of every read request (server, start, end) and how much of the restore had requests to two or more servers
in flight. Writes ``bench/results/partition-<time>.json`` and ``.png`` (bandwidth per case; the timelines).

Usage::

    .venv/bin/python bench/partition.py             # 256 MiB, 5 timed rounds
    .venv/bin/python bench/partition.py --smoke     # 16 MiB, 2 timed rounds (also run by the tests)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path
from typing import Any

import torch
import xxhash

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import (  # noqa: E402  (also puts the repository on sys.path)
    GIB,
    MIB,
    busy_cores,
    git_state,
    log,
    machine_info,
    median,
    versions,
    wait_quiet,
)
from bench_kv_layout import BLOCK_SIZE, BYTES_PER_TOKEN_PER_LAYER, KV, NUM_LAYERS, Payload  # noqa: E402

from range_connector.backends.base import RangeRead  # noqa: E402
from range_connector.backends.valkey.client import ValkeyBackend  # noqa: E402
from range_connector.backends.valkey.servers import ensure_servers, stop_servers  # noqa: E402
from range_connector.config import RangeConfig, TierConfig  # noqa: E402
from range_connector.kv.metadata import ChunkTransfer, RangeConnectorMetadata, RequestTransfer  # noqa: E402
from range_connector.kv.namespace import namespace_fingerprint, prefix_hash_chain  # noqa: E402
from range_connector.scheduler.facade import RangeScheduler  # noqa: E402
from range_connector.worker.facade import RangeWorker  # noqa: E402

FORMAT_VERSION = 1
SHARD_COUNTS = (1, 2, 4)
CHUNK_TOKENS = 128  # 4 blocks of 32 (16 MiB of KV): whole blocks for 1, 2 and 4 shards
LAYER_BLOCK_BYTES = BLOCK_SIZE * BYTES_PER_TOKEN_PER_LAYER
PATHS = ("worker", "fetch")


def server_info(url: str) -> dict[str, float]:
    """Bytes sent, CPU seconds and memory of one server, from its own ``INFO``."""
    import valkey

    c = valkey.Valkey.from_url(url, socket_timeout=30)
    try:
        stats, cpu, mem = c.info("stats"), c.info("cpu"), c.info("memory")
    finally:
        c.close()
    return {"net_output_bytes": float(stats["total_net_output_bytes"]),
            "cpu_s": float(cpu["used_cpu_user"]) + float(cpu["used_cpu_sys"]),
            "used_memory_bytes": float(mem["used_memory"])}


class Timeline:
    """Start and end of every read request, by server, and the thread that made it (thread-safe; times relative to
    :meth:`start`)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.t0 = 0.0
        self.requests: list[dict[str, float]] = []

    def start(self) -> None:
        self.t0, self.requests = time.perf_counter(), []

    def wrap(self, backend: ValkeyBackend, server_idx: int) -> None:
        """Record every ``read_ranges`` call of ``backend`` (an instance attribute; the class is untouched)."""
        inner = backend.read_ranges

        def read_ranges(reads, __inner=inner):  # type: ignore[no-untyped-def]
            t = time.perf_counter()
            try:
                return __inner(reads)
            finally:
                with self.lock:
                    self.requests.append({"server": server_idx, "start_s": t - self.t0,
                                          "end_s": time.perf_counter() - self.t0,
                                          "bytes": sum(r.length for r in reads),
                                          "thread": threading.current_thread().name})

        backend.read_ranges = read_ranges  # type: ignore[method-assign]

    def overlap(self) -> dict[str, float]:
        """Busy time (some request in flight), time with requests to >= 2 servers in flight, and their ratio."""
        events = sorted([(r["start_s"], 1, r["server"]) for r in self.requests]
                        + [(r["end_s"], -1, r["server"]) for r in self.requests])
        in_flight: dict[int, int] = {}
        busy = multi = 0.0
        last = events[0][0] if events else 0.0
        for t, delta, server in events:
            live = [s for s, n in in_flight.items() if n > 0]
            busy += (t - last) if live else 0.0
            multi += (t - last) if len(live) >= 2 else 0.0
            in_flight[server] = in_flight.get(server, 0) + delta
            last = t
        return {"busy_s": busy, "multi_server_s": multi, "multi_server_fraction": multi / busy if busy else 0.0,
                "request_s_sum": sum(r["end_s"] - r["start_s"] for r in self.requests)}


class Case:
    """One (S, placement): the payload saved as S shards on ``urls`` (one URL per shard, maybe repeated)."""

    def __init__(self, num_shards: int, placement: str, urls: list[str], args: argparse.Namespace,
                 payload: Payload, dst: KV, chunk_tokens: int = CHUNK_TOKENS) -> None:
        self.S, self.placement, self.urls, self.args, self.payload, self.dst = \
            num_shards, placement, urls, args, payload, dst
        self.chunk_tokens = chunk_tokens  # whole blocks per shard: a multiple of BLOCK_SIZE * num_shards
        self.name = f"S{num_shards}-{placement}"
        self.server_urls = list(dict.fromkeys(urls))
        self.records: dict[str, list[dict[str, Any]]] = {p: [] for p in PATHS}
        self.error: str | None = None
        self.gen = torch.Generator().manual_seed(args.seed + num_shards)
        self.timeline = Timeline()

    def setup(self) -> None:
        args, S = self.args, self.S
        tier = TierConfig("valkey", servers=tuple(self.urls), timeout_s=300.0)
        # (save_mode "sync": the save is stored when it returns, and the loads read the tickets it reported)
        config = RangeConfig(tiers=(tier,), num_shards=S, chunk_tokens=self.chunk_tokens,
                             load_deadline_s=600.0, save_mode="sync").resolve(BLOCK_SIZE)
        ns = namespace_fingerprint({"bench": "partition", "case": self.name, "run": args.run_tag})
        saver_b = [ValkeyBackend(u, timeout_s=300.0) for u in self.urls]
        saver = RangeWorker(config, BLOCK_SIZE, self.payload.kv.layer_names, self.payload.kv.num_blocks, saver_b)
        saver.register_kv_caches(self.payload.kv.layers)
        tokens = torch.randint(0, 128_000, (args.payload_tokens,), generator=self.gen).tolist()
        self.hashes = prefix_hash_chain(ns, b"", tokens, self.chunk_tokens)
        bpc, src = self.chunk_tokens // BLOCK_SIZE, self.payload.src_ids.tolist()
        chunks = tuple(ChunkTransfer(i, h, tuple(range(bpc)), tuple(src[i * bpc:(i + 1) * bpc]))
                       for i, h in enumerate(self.hashes))
        t = time.perf_counter()
        saver.save(RangeConnectorMetadata(saves=[RequestTransfer("save", chunks, args.payload_tokens)]))
        self.save_s = time.perf_counter() - t
        saver.close()
        if saver.stats.get("saved_chunks", 0) != len(self.hashes):
            raise RuntimeError(f"saved {saver.stats.get('saved_chunks', 0)} of {len(self.hashes)} chunks")
        sched = RangeScheduler(config, ns, BLOCK_SIZE, [ValkeyBackend(u, timeout_s=300.0) for u in self.urls],
                               can_load=True, can_save=False, num_layers=NUM_LAYERS,
                               layer_block_bytes=LAYER_BLOCK_BYTES)
        self.tickets = sched.stored_prefix(self.hashes)
        sched.close()
        if len(self.tickets) != len(self.hashes):
            raise RuntimeError(f"lookup found {len(self.tickets)} of {len(self.hashes)} chunks")
        self.loader_b = [ValkeyBackend(u, timeout_s=300.0) for u in self.urls]
        for s, b in enumerate(self.loader_b):
            self.timeline.wrap(b, self.server_urls.index(self.urls[s]))
        self.loader = RangeWorker(config, BLOCK_SIZE, self.dst.layer_names, self.dst.num_blocks, self.loader_b)
        self.loader.register_kv_caches(self.dst.layers)
        # The fetch path: one stripe per shard (every chunk), every layer value read whole into a staging buffer.
        self.stripes = [self.tickets[0][s] for s in range(S)]
        assert all(t.stripe_id == self.stripes[s].stripe_id for c in self.tickets for s, t in enumerate(c))
        self.staging = [torch.empty(NUM_LAYERS * t.layer_bytes, dtype=torch.uint8) for t in self.stripes]

    def restore(self, path: str, kind: str) -> None:
        before = [server_info(u) for u in self.server_urls]
        cpu0 = time.process_time()
        self.timeline.start()
        if path == "worker":
            wall_s = self._restore_worker()
        else:
            wall_s = self._fetch()
        client_cpu_s = time.process_time() - cpu0
        after = [server_info(u) for u in self.server_urls]
        exact = self._check(path)
        if kind != "timed":
            return
        self.records[path].append({
            "restore_s": wall_s, "client_cpu_s": client_cpu_s, "byte_exact": exact,
            "servers": [{"url": u, "net_output_bytes": a["net_output_bytes"] - b["net_output_bytes"],
                         "cpu_s": a["cpu_s"] - b["cpu_s"], "used_memory_bytes": a["used_memory_bytes"]}
                        for u, b, a in zip(self.server_urls, before, after)],
            "overlap": self.timeline.overlap(), "timeline": list(self.timeline.requests),
            "loadavg_1m": round(os.getloadavg()[0], 2)})

    def _restore_worker(self) -> float:
        dst = self.dst
        dst.buf.zero_()
        self.dst_ids = torch.randperm(dst.num_blocks, generator=self.gen)[:self.args.payload_blocks]
        ids, bpc = self.dst_ids.tolist(), self.chunk_tokens // BLOCK_SIZE
        chunks = tuple(ChunkTransfer(i, h, tuple(range(bpc)), tuple(ids[i * bpc:(i + 1) * bpc]), self.tickets[i])
                       for i, h in enumerate(self.hashes))
        meta = RangeConnectorMetadata(loads=[RequestTransfer(f"load-{time.monotonic_ns()}", chunks,
                                                             self.args.payload_tokens, mode="sync")])
        t = time.perf_counter()
        self.loader.start_load(meta)  # a synchronous load: every layer has landed when it returns
        failed = self.loader.take_failed_block_ids()
        wall_s = time.perf_counter() - t
        self.loader.take_loaded_block_log()
        self.loader.build_worker_meta()
        if failed:
            raise RuntimeError(f"{len(failed)} blocks failed to load: {dict(self.loader.stats)}")
        return wall_s

    def _fetch(self) -> float:
        errors: list[BaseException] = []

        def one(s: int) -> None:
            t, buf = self.stripes[s], memoryview(self.staging[s].numpy())
            reads = [RangeRead(t.stripe_id, layer, 0, t.layer_bytes, t.layer_bytes,
                               buf[layer * t.layer_bytes:(layer + 1) * t.layer_bytes]) for layer in range(NUM_LAYERS)]
            try:
                if not all(self.loader_b[s].read_ranges(reads)):
                    raise RuntimeError(f"shard {s}: stripe {t.stripe_id} is gone")
            except BaseException as exc:  # reported after the join
                errors.append(exc)

        threads = [threading.Thread(target=one, args=(s,), name=f"fetch-shard-{s}") for s in range(self.S)]
        t0 = time.perf_counter()
        for th in threads:
            th.start()
        for th in threads:
            th.join(300.0)
        wall_s = time.perf_counter() - t0
        if errors or any(th.is_alive() for th in threads):
            raise RuntimeError(f"fetch failed: {errors or 'a shard did not answer in 300 s'}")
        return wall_s

    def _check(self, path: str) -> bool:
        if path == "worker":
            return self.payload.equal_at(self.dst, self.dst_ids)
        return all(xxhash.xxh3_64_intdigest(memoryview(st.numpy())[layer * t.layer_bytes:(layer + 1) * t.layer_bytes])
                   == t.stripe_checksums[layer] for st, t in zip(self.staging, self.stripes)
                   for layer in range(NUM_LAYERS))

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.loader.close()


def summarise(case: Case, path: str, payload_bytes: int) -> dict[str, Any]:
    recs = case.records[path]
    row: dict[str, Any] = {"case": case.name, "path": path, "num_shards": case.S, "placement": case.placement,
                           "num_servers": len(case.server_urls), "status": "ok" if case.error is None else "error"}
    if case.error is not None or not recs:
        row["reason"] = case.error or "no timed restore"
        return row
    med = median([r["restore_s"] for r in recs])
    row.update({
        "restore_s_median": med, "restore_s_all": [r["restore_s"] for r in recs],
        "gib_per_s": payload_bytes / GIB / med, "byte_exact": all(r["byte_exact"] for r in recs),
        "client_cpu_s_median": median([r["client_cpu_s"] for r in recs]),
        "server_bytes_median": [median([r["servers"][i]["net_output_bytes"] for r in recs])
                                for i in range(len(case.server_urls))],
        "server_cpu_s_median": [median([r["servers"][i]["cpu_s"] for r in recs]) for i in range(len(case.server_urls))],
        "multi_server_fraction_median": median([r["overlap"]["multi_server_fraction"] for r in recs]),
        "overlap_last": recs[-1]["overlap"], "timeline_last": recs[-1]["timeline"],
        "save_s": case.save_s, "loadavg_1m": [r["loadavg_1m"] for r in recs]})
    return row


def analyse(rows: list[dict[str, Any]], payload_bytes: int, link_gbps: float) -> dict[str, Any]:
    """Ratios against S = 1 and against the shared server, bytes per server against 1/S, and the extrapolation
    model of the README (per-byte server and client CPU costs measured here, applied to P hosts)."""
    ok = {(r["path"], r["num_shards"], r["placement"]): r for r in rows if r["status"] == "ok"}
    out: dict[str, Any] = {"per_path": {}}
    for path in PATHS:
        base = ok.get((path, 1, "partitioned"))
        if base is None:
            continue
        per: dict[str, Any] = {}
        for s in SHARD_COUNTS[1:]:
            part, shared = ok.get((path, s, "partitioned")), ok.get((path, s, "shared"))
            if part is None:
                continue
            per[f"S{s}"] = {
                "bandwidth_ratio_vs_S1": part["gib_per_s"] / base["gib_per_s"],
                "partitioned_vs_shared": part["gib_per_s"] / shared["gib_per_s"] if shared else None,
                "bytes_per_server_vs_S1": [b / base["server_bytes_median"][0] for b in part["server_bytes_median"]],
                "expected_bytes_per_server_vs_S1": 1 / s,
                "multi_server_fraction": part["multi_server_fraction_median"]}
        out["per_path"][path] = per
    # Per-byte costs from the partitioned fetch rows (the tier's own work) and the worker rows (the client's).
    part = [r for r in rows if r["status"] == "ok" and r["placement"] == "partitioned"]
    c_server = median([sum(r["server_cpu_s_median"]) / payload_bytes for r in part if r["path"] == "fetch"])
    c_client_fetch = median([r["client_cpu_s_median"] / payload_bytes for r in part if r["path"] == "fetch"])
    c_client_worker = median([r["client_cpu_s_median"] / payload_bytes for r in part if r["path"] == "worker"])
    link = link_gbps * 1e9 / 8
    model = {"server_cpu_s_per_gib": (c_server or 0) * GIB, "client_cpu_s_per_gib_fetch": (c_client_fetch or 0) * GIB,
             "client_cpu_s_per_gib_worker": (c_client_worker or 0) * GIB, "link_gbps": link_gbps, "predicted": {}}
    if c_server and c_client_fetch:
        for p in (1, 2, 4, 8):
            # P PCP ranks, each on its own host with its own server: every cost is divided by P.
            t_ranks = max(c_server, c_client_fetch, 1 / link) * payload_bytes / p
            # One PCP=1 reader (a decode engine, one fetch thread per server) from P server hosts.
            t_reader = max(c_server * payload_bytes / p, c_client_fetch * payload_bytes, payload_bytes / link)
            model["predicted"][f"P{p}"] = {"pcp_ranks_gib_per_s": payload_bytes / GIB / t_ranks,
                                           "pcp1_reader_gib_per_s": payload_bytes / GIB / t_reader}
    out["model"] = model
    return out


def plot(doc: dict[str, Any], png: Path) -> str:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        return f"no plot: {exc} (pip install -e '.[bench]')"
    rows = [r for r in doc["rows"] if r["status"] == "ok"]
    fig, (ax_bw, *ax_tl) = plt.subplots(1, 1 + len(PATHS), figsize=(16, 5.5))
    labels = [f"{r['case']}\n{r['path']}" for r in rows]
    ax_bw.bar(range(len(rows)), [r["gib_per_s"] for r in rows],
              color=["tab:blue" if r["placement"] == "partitioned" else "tab:gray" for r in rows])
    ax_bw.set_xticks(range(len(rows)), labels, fontsize=7, rotation=60)
    ax_bw.set_ylabel("GiB/s (median)")
    ax_bw.set_title("restore bandwidth (blue: one server per shard, grey: one shared server)", fontsize=9)
    for ax, path in zip(ax_tl, PATHS):
        y = 0
        ticks = []
        for r in rows:
            if r["path"] != path:
                continue
            for req in r["timeline_last"]:
                ax.barh(y + req["server"], req["end_s"] - req["start_s"], left=req["start_s"], height=0.8,
                        color=f"C{req['server']}")
            ticks += [(y + s, f"{r['case']} server {s}") for s in range(r["num_servers"])]
            y += r["num_servers"] + 1
        ax.set_yticks([t for t, _ in ticks], [lbl for _, lbl in ticks], fontsize=7)
        ax.set_xlabel("seconds since the restore started (last timed round)")
        ax.set_title(f"{path}: read requests per server", fontsize=9)
    m = doc["machine"]
    fig.suptitle(f"{doc['config']['payload_bytes'] / MIB:.0f} MiB restored, {m['cpu_count']} cores shared by client "
                 f"and servers, load {m['loadavg'][0]}", fontsize=10)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return str(png)


def print_report(doc: dict[str, Any]) -> None:
    log("=" * 110)
    log(f"{'case':16s} {'path':7s} {'GiB/s':>7s} {'restore s':>10s} {'client cpu s':>12s}  bytes per server (MiB) "
        f"/ server cpu s / multi-server fraction")
    for r in doc["rows"]:
        if r["status"] != "ok":
            log(f"{r['case']:16s} {r['path']:7s} {r['status']}: {r.get('reason')}")
            continue
        per = ", ".join(f"{b / MIB:.1f}/{c:.3f}" for b, c in zip(r["server_bytes_median"], r["server_cpu_s_median"]))
        log(f"{r['case']:16s} {r['path']:7s} {r['gib_per_s']:7.2f} {r['restore_s_median']:10.4f} "
            f"{r['client_cpu_s_median']:12.4f}  [{per}] / {r['multi_server_fraction_median']:.2f}"
            + ("" if r["byte_exact"] else "  NOT BYTE-EXACT"))
    for path, per in doc["analysis"]["per_path"].items():
        for s, a in per.items():
            shared = a["partitioned_vs_shared"]
            log(f"  {path:7s} {s}/S1 bandwidth {a['bandwidth_ratio_vs_S1']:.2f}x; vs one shared server "
                f"{shared if shared is None else f'{shared:.2f}x'}; bytes per server vs S1 "
                f"{[round(b, 3) for b in a['bytes_per_server_vs_S1']]} "
                f"(1/S = {a['expected_bytes_per_server_vs_S1']:.3f})"
                f"; requests to >= 2 servers in flight {a['multi_server_fraction']:.0%} of the busy time")
    mdl = doc["analysis"]["model"]
    log(f"  model: server {mdl['server_cpu_s_per_gib']:.3f} CPU s/GiB, client {mdl['client_cpu_s_per_gib_fetch']:.3f} "
        f"(fetch) / {mdl['client_cpu_s_per_gib_worker']:.3f} (worker) CPU s/GiB; link {mdl['link_gbps']} Gb/s")
    for p, v in mdl["predicted"].items():
        log(f"    {p}: P ranks on own hosts {v['pcp_ranks_gib_per_s']:.2f} GiB/s, one PCP=1 reader "
            f"{v['pcp1_reader_gib_per_s']:.2f} GiB/s")
    log("=" * 110)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true", help="16 MiB, 2 timed rounds (for tests)")
    p.add_argument("--payload-mib", type=int, default=None, help="payload in MiB (default 256; smoke 16)")
    p.add_argument("--repeats", type=int, default=None, help="timed rounds (default 5; smoke 2)")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--link-gbps", type=float, default=100.0, help="per-host link speed for the model (Gb/s)")
    p.add_argument("--results-dir", default=str(Path(__file__).resolve().parent / "results"))
    p.add_argument("--out", default=None, help="JSON path (default <results-dir>/partition-<timestamp>.json)")
    p.add_argument("--max-busy-cores", type=float, default=0.5,
                   help="quiet = other processes keep fewer cores busy than this (with --wait-quiet-s)")
    p.add_argument("--wait-quiet-s", type=float, default=0.0, help="wait up to this long for a quiet machine first")
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("--seed", type=int, default=4321)
    args = p.parse_args(argv)
    args.payload_mib = args.payload_mib or (16 if args.smoke else 256)
    args.repeats = args.repeats or (2 if args.smoke else 5)
    args.payload_bytes = args.payload_mib * MIB
    per_chunk = CHUNK_TOKENS * NUM_LAYERS * BYTES_PER_TOKEN_PER_LAYER
    if args.payload_bytes % per_chunk:
        p.error(f"--payload-mib: the payload must be whole chunks of {per_chunk // MIB} MiB")
    args.payload_tokens = args.payload_bytes // (NUM_LAYERS * BYTES_PER_TOKEN_PER_LAYER)
    args.payload_blocks = args.payload_tokens // BLOCK_SIZE
    args.run_tag = f"{os.getpid()}-{time.time_ns()}"
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)
    command = shlex.join([sys.executable, *(sys.argv if argv is None else [str(Path(__file__)), *argv])])
    wait_quiet(args.max_busy_cores, args.wait_quiet_s)
    machine = machine_info()
    stamp = time.strftime("%Y%m%d-%H%M%S")
    out_json = Path(args.out) if args.out else Path(args.results_dir) / f"partition-{stamp}.json"
    out_json.parent.mkdir(parents=True, exist_ok=True)
    log(f"partition: {args.payload_mib} MiB, S = {SHARD_COUNTS}, load {machine['loadavg']}, "
        f"{machine['cpu_model']} x{machine['cpu_count']}")
    t_start = time.monotonic()
    payload = Payload(2 * args.payload_blocks, args.payload_blocks, args.seed)
    dst = KV(2 * args.payload_blocks)
    tmp = Path(tempfile.mkdtemp(prefix="range-partition-"))
    cases: list[Case] = []
    try:
        # Open servers, explicitly: the RESP path without AUTH is what is measured (bench/granularity.py
        # --security has AUTH and TLS beside it), with room for every case's payload (the cases are not removed
        # in between).
        limit_bytes = max(1 << 30, 4 * args.payload_bytes)
        part_urls = ensure_servers(max(SHARD_COUNTS), tmp / "partitioned", require_password=False,
                                   maxmemory_bytes=limit_bytes)
        shared_url = ensure_servers(1, tmp / "shared", require_password=False, maxmemory_bytes=limit_bytes)[0]
        for s in SHARD_COUNTS:
            cases.append(Case(s, "partitioned", part_urls[:s], args, payload, dst))
            if s > 1:
                cases.append(Case(s, "shared", [shared_url] * s, args, payload, dst))
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
                for path in PATHS:
                    if case.error is None:
                        try:
                            case.restore(path, kind)
                        except Exception as exc:
                            case.error = f"{type(exc).__name__}: {exc}"
                            case.traceback = traceback.format_exc()[-3000:]
            log(f"  round {i + 1}/{len(rounds)} ({kind}) done, load {os.getloadavg()[0]:.2f}")
        rows = [summarise(c, p, args.payload_bytes) for c in cases for p in PATHS]
    finally:
        for c in cases:
            c.close()
        for d in ("partitioned", "shared"):
            with contextlib.suppress(Exception):
                stop_servers(tmp / d)
    doc: dict[str, Any] = {
        "format_version": FORMAT_VERSION, "tool": "bench/partition.py", "command": command, "started": stamp,
        "wall_s": round(time.monotonic() - t_start, 1), "machine": machine, "busy_cores_before_rounds": busy_before,
        "machine_end": {"loadavg": [round(x, 2) for x in os.getloadavg()]}, "versions": versions(),
        "git": git_state(),
        "config": {"payload_bytes": args.payload_bytes, "payload_tokens": args.payload_tokens,
                   "chunk_tokens": CHUNK_TOKENS, "shard_counts": list(SHARD_COUNTS), "repeats": args.repeats,
                   "warmup": args.warmup, "smoke": args.smoke, "torch_threads": torch.get_num_threads(),
                   "timing": "restore: from the load request (tickets looked up) until every layer is in the KV "
                             "tensors (worker) or in the staging buffers (fetch); INFO snapshots and checks outside",
                   "note": "the INFO replies of the snapshots (a few KiB) are inside the bytes-per-server deltas"},
        "errors": {c.name: getattr(c, "traceback", c.error) for c in cases if c.error},
        "rows": rows,
    }
    doc["analysis"] = analyse(rows, args.payload_bytes, args.link_gbps)
    doc["plot"] = None if args.no_plot else plot(doc, out_json.with_suffix(".png"))
    out_json.write_text(json.dumps(doc, indent=1))
    print_report(doc)
    log(f"JSON: {out_json}")
    if doc["plot"]:
        log(f"plot: {doc['plot']}")
    log(f"wall time {doc['wall_s']:.0f} s")
    return 1 if doc["errors"] or not all(r.get("byte_exact") for r in rows if r["status"] == "ok") else 0


if __name__ == "__main__":
    sys.exit(main())
