"""Soak: a bounded replay on the tiny GQA model with tier faults and hostile requests injected at random times.

One vLLM CPU API server (:class:`~range_connector.testing.server_process.ServerProcess`) with Range on embedded Valkey
servers (``--num-shards``, each with its memory limit and password), vLLM's own prefix cache off (every repeated
prefix must come from Range or be recomputed) and float32 weights (so that a prefix loaded and one recomputed in
another split give the same greedy tokens). Client threads (``--concurrency``) send the prompts of a trace
(``--trace`` Mooncake ``.jsonl``; default the synthetic trace) in trace order, looping, for ``--duration-s``. A
fault thread injects, at random times (exponential gaps of mean ``--fault-every-s``), one fault of a kind chosen in
turn:

* ``kill``: SIGKILL one shard's server, then start it again, empty, on the same port (``ensure_servers``);
* ``freeze``: SIGSTOP one shard's server for longer than the tier's ``timeout_s``, then SIGCONT;
* ``corrupt``: flip one byte in each of a few stored stripe values on one shard (``SETRANGE``);
* ``hostile``: one request with malformed ``kv_transfer_params`` (as in tests/integration/test_api_server.py),
  which must be answered.

**Oracle.** Each distinct prompt's first answer (computed: nothing is stored yet, or what is stored is its own KV)
is its reference; every later answer of the same prompt must have the same greedy tokens. An answer that differs is
an oracle violation; a request that fails or times out past ``--request-timeout-s`` counts as hung or failed.

**Report** (``bench/results/soak-<time>.json`` and a PNG of RSS over time): requests served, faults injected per
kind, recomputed tokens and load errors (the engine's ``/metrics``), oracle violations (must be 0), engine deaths
(0), requests failed or hung (0), leaked leases (lease keys left on the shards once the load is idle: 0), and each
process's resident memory over time (engine processes and Valkey servers; bounded: the last quarter's mean over the
second quarter's).

Usage::

    .venv/bin/python bench/soak.py                       # 20 minutes
    .venv/bin/python bench/soak.py --duration-s 300 --fault-every-s 5
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shlex
import signal
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench_common import git_state, log, machine_info, versions  # noqa: I001 (puts the repo on sys.path)

import httpx

from range_connector.backends.valkey.servers import ensure_servers, server_status, stop_servers
from range_connector.bench.synthetic_trace import synthetic_trace
from range_connector.bench.trace_prompts import PromptBuilder, normal_vocab_token_ids
from range_connector.bench.trace_transforms import prepare_trace
from range_connector.bench.traces import read_trace
from range_connector.testing.client import scrape_metrics
from range_connector.testing.embedded import embedded_client
from range_connector.testing.processes import process_group_pids, unwind_on_sigterm
from range_connector.testing.server_process import ServerProcess, connector_config
from range_connector.testing.tiny_models import build_model

FORMAT_VERSION = 1
BLOCK_SIZE = 128
CHUNK_TOKENS = 256
MAX_MODEL_LEN = 2048
FAULT_KINDS = ("kill", "freeze", "corrupt", "hostile")
#: malformed kv_transfer_params a client can send (each must be answered)
HOSTILE_PARAMS: list[Any] = [
    {"range": {"version": 1, "settings": {"namespace": "00"}, "num_tokens": "x"}},
    {"range": {"settings": {"namespace": "00"}, "num_tokens": None}},
    {"range": {"settings": {"namespace": "00"}, "num_tokens": float("inf")}},
    {"range": {"settings": {"namespace": "00"}, "num_tokens": 1 << 62}},
    {"range": {"num_tokens": 5, "settings": ["namespace"]}},
    {"range": {"num_tokens": 5, "settings": {"namespace": "x" * 1_000_000}}},
    {"range": [1, 2, 3]},
    {"do_remote_decode": "yes"},
    {"do_remote_decode": True, "range_expect": "everything"},
]
METRICS = ("vllm:range_loaded_tokens_total", "vllm:range_failed_tokens_total", "vllm:range_load_integrity_errors_total",
           "vllm:range_load_backend_errors_total", "vllm:range_load_deadline_misses_total",
           "vllm:range_rejected_request_inputs_total", "vllm:external_prefix_cache_hits_total",
           "vllm:prompt_tokens_total")


@dataclass
class Tally:
    """What the client and fault threads count (under :attr:`lock`)."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    served: int = 0
    failed: int = 0
    hostile_answered: int = 0
    hostile_failed: int = 0
    violations: list[dict[str, Any]] = field(default_factory=list)
    reference: dict[int, list[int]] = field(default_factory=dict)  # prompt index -> greedy tokens of its first answer
    faults: Counter[str] = field(default_factory=Counter)
    fault_log: list[dict[str, Any]] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


def _complete(base_url: str, prompt: list[int], max_tokens: int, timeout_s: float,
              params: Any = None) -> list[int] | None:
    """Greedy tokens of one completion, or ``None`` when the request failed."""
    body: dict[str, Any] = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
                            "return_token_ids": True}
    if params is not None:
        body["kv_transfer_params"] = params
    response = httpx.post(f"{base_url}/v1/completions", content=json.dumps(body),  # (json.dumps allows Infinity)
                          headers={"Content-Type": "application/json"}, timeout=timeout_s)
    if response.status_code != 200:
        return None
    choice = response.json()["choices"][0]
    ids = choice.get("token_ids")
    return list(ids) if ids is not None else [hash(choice.get("text", ""))]


def client_loop(idx: int, base_url: str, prompts: list[list[int]], args: argparse.Namespace, stop: threading.Event,
                tally: Tally) -> None:
    order = list(range(len(prompts)))
    pos = idx * (len(order) // max(1, args.concurrency))
    while not stop.is_set():
        p = order[pos % len(order)]
        pos += 1
        try:
            tokens = _complete(base_url, prompts[p], args.max_tokens, args.request_timeout_s)
        except httpx.HTTPError as exc:
            tokens = None
            with tally.lock:
                tally.errors.append(f"prompt {p}: {type(exc).__name__}: {exc}")
        with tally.lock:
            if tokens is None:
                tally.failed += 1
                continue
            tally.served += 1
            ref = tally.reference.setdefault(p, tokens)
            if tokens != ref:
                tally.violations.append({"prompt_idx": p, "t_s": time.monotonic(), "expected": ref[:8],
                                         "got": tokens[:8]})


def inject(kind: str, runtime_dir: Path, num_shards: int, base_url: str, args: argparse.Namespace,
           rng: random.Random, tally: Tally) -> dict[str, Any]:
    """Inject one fault of ``kind``; return what was done."""
    shard = rng.randrange(num_shards)
    if kind == "kill":
        pid = server_status(runtime_dir)[shard].pid
        os.kill(pid, signal.SIGKILL)
        time.sleep(args.down_s)
        ensure_servers(num_shards, runtime_dir)  # the same port and password, empty
        return {"shard": shard, "pid": pid}
    if kind == "freeze":
        pid = server_status(runtime_dir)[shard].pid
        os.kill(pid, signal.SIGSTOP)
        try:
            time.sleep(args.freeze_s)
        finally:
            os.kill(pid, signal.SIGCONT)
        return {"shard": shard, "pid": pid, "frozen_s": args.freeze_s}
    if kind == "corrupt":
        client = embedded_client(runtime_dir, shard)
        keys = [k for k in client.scan_iter(match="*:s:*", count=1000)][:2000]
        picked = rng.sample(keys, min(len(keys), args.corrupt_values))
        for key in picked:
            size = client.strlen(key)
            if size:
                offset = rng.randrange(size)
                byte = client.getrange(key, offset, offset)
                client.setrange(key, offset, bytes([byte[0] ^ 0xFF]) if byte else b"\xff")
        client.close()
        return {"shard": shard, "values": len(picked)}
    params = HOSTILE_PARAMS[tally.faults["hostile"] % len(HOSTILE_PARAMS)]
    try:
        answered = _complete(base_url, [11, 12, 13, 14] * 8, 2, args.request_timeout_s, params) is not None
    except httpx.HTTPError:
        answered = False
    with tally.lock:
        tally.hostile_answered += answered
        tally.hostile_failed += not answered
    return {"answered": answered}


def fault_loop(runtime_dir: Path, num_shards: int, base_url: str, args: argparse.Namespace, stop: threading.Event,
               tally: Tally, started: float) -> None:
    rng = random.Random(args.seed)
    turn = 0
    while not stop.wait(rng.expovariate(1.0 / args.fault_every_s)):
        kind = FAULT_KINDS[turn % len(FAULT_KINDS)]
        turn += 1
        t_s = time.monotonic() - started
        try:
            what = inject(kind, runtime_dir, num_shards, base_url, args, rng, tally)
        except Exception as exc:  # noqa: BLE001 (a fault that could not be injected is reported, not fatal)
            what = {"error": f"{type(exc).__name__}: {exc}"}
        with tally.lock:
            if "error" not in what:
                tally.faults[kind] += 1
            tally.fault_log.append({"kind": kind, "t_s": round(t_s, 2), **what})


def rss_bytes(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def sample_rss(server: ServerProcess, runtime_dir: Path) -> dict[str, int]:
    """Resident bytes of each engine process (by pid) and of each shard's server (by shard, whatever its pid)."""
    out: dict[str, int] = {}
    for pid in process_group_pids(server.pid) if server.pid else []:
        rss = rss_bytes(pid)
        if rss:
            out[f"engine-{pid}"] = rss
    for status in server_status(runtime_dir):
        rss = rss_bytes(status.pid) if status.alive else None
        if rss:
            out[f"valkey-shard-{status.shard_idx}"] = rss
    return out


def count_leases(runtime_dir: Path, num_shards: int) -> int:
    total = 0
    for shard in range(num_shards):
        client = embedded_client(runtime_dir, shard)
        total += sum(1 for _ in client.scan_iter(match="*:l:*", count=1000))
        client.close()
    return total


def rss_summary(series: list[tuple[float, dict[str, int]]]) -> dict[str, Any]:
    """Per process: first, max and last resident bytes, and the last quarter's mean over the second quarter's."""
    names = sorted({n for _, sample in series for n in sample})
    out: dict[str, Any] = {}
    n = len(series)
    for name in names:
        values = [sample[name] for _, sample in series if name in sample]
        q2 = [s[name] for _, s in series[n // 4: n // 2] if name in s]
        q4 = [s[name] for _, s in series[3 * n // 4:] if name in s]
        growth = (sum(q4) / len(q4)) / (sum(q2) / len(q2)) if q2 and q4 else None
        out[name] = {"first_bytes": values[0], "max_bytes": max(values), "last_bytes": values[-1],
                     "last_over_second_quarter": round(growth, 3) if growth else None}
    return out


def plot(series: list[tuple[float, dict[str, int]]], faults: list[dict[str, Any]], png: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4.5))
    for name in sorted({n for _, s in series for n in s}):
        pts = [(t, s[name] / 2**20) for t, s in series if name in s]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], label=name.split("-")[0] if name.startswith("engine")
                else name, lw=1)
    for f in faults:
        ax.axvline(f["t_s"], color={"kill": "red", "freeze": "blue", "corrupt": "orange"}.get(f["kind"], "grey"),
                   alpha=0.15, lw=0.8)
    ax.set_xlabel("time (s)")
    ax.set_ylabel("resident memory (MiB)")
    ax.set_title("Soak: RSS per process (vertical lines: faults; red kill, blue freeze, orange corrupt)")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--duration-s", type=float, default=1200.0, help="length of the faulted replay (default 20 min)")
    p.add_argument("--trace", type=Path, default=None, help="Mooncake .jsonl (default: the synthetic trace)")
    p.add_argument("--num-prompts", type=int, default=40, help="trace requests replayed, looping")
    p.add_argument("--num-shards", type=int, default=2)
    p.add_argument("--concurrency", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--fault-every-s", type=float, default=20.0, help="mean seconds between two faults")
    p.add_argument("--tier-timeout-s", type=float, default=1.0, help="the tier's timeout_s")
    p.add_argument("--freeze-s", type=float, default=2.5, help="how long a frozen shard stays stopped")
    p.add_argument("--down-s", type=float, default=1.0, help="how long a killed shard stays down")
    p.add_argument("--corrupt-values", type=int, default=3, help="stripe values flipped per corrupt fault")
    p.add_argument("--request-timeout-s", type=float, default=120.0)
    p.add_argument("--rss-every-s", type=float, default=5.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=None)
    return p.parse_args(argv)


def build_prompts(model_dir: Path, args: argparse.Namespace) -> tuple[list[list[int]], dict[str, Any]]:
    trace = read_trace(args.trace) if args.trace else synthetic_trace(max(args.num_prompts, 10), seed=args.seed)
    trace = prepare_trace(trace, count=args.num_prompts, token_scale=1 / 16 if args.trace else 1 / 8,
                          max_model_len=MAX_MODEL_LEN - args.max_tokens - 8, conversations=args.trace is not None,
                          seed=args.seed)
    prompts = PromptBuilder(normal_vocab_token_ids(model_dir), seed=args.seed).prompts(trace)
    return [p for p in prompts if len(p) > 16], trace.describe()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    unwind_on_sigterm()
    model_dir = build_model("gqa", "tiny")
    prompts, trace_info = build_prompts(model_dir, args)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    out = args.out or Path(__file__).resolve().parent / "results" / f"soak-{stamp}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    doc: dict[str, Any] = {"format_version": FORMAT_VERSION, "command": shlex.join([sys.argv[0], *(argv or sys.argv[1:])]),
                           "machine": machine_info(), "versions": versions(), "git": git_state(),
                           "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
                           "trace": trace_info, "num_prompts": len(prompts)}
    tally = Tally()
    series: list[tuple[float, dict[str, int]]] = []
    deaths = 0
    with tempfile.TemporaryDirectory(prefix="range-soak-") as tmp:
        runtime_dir = Path(tmp) / "runtime"
        kv = connector_config({"runtime_dir": str(runtime_dir), "chunk_tokens": CHUNK_TOKENS,
                               "tiers": [{"type": "valkey", "timeout_s": args.tier_timeout_s, "retry_s": 2.0}],
                               "num_shards": args.num_shards, "load_deadline_s": 10.0})
        server = ServerProcess(model_dir, work_dir=Path(tmp) / "vllm", block_size=BLOCK_SIZE,
                               max_model_len=MAX_MODEL_LEN, kv_transfer_config=kv,
                               extra_args=["--no-enable-prefix-caching", "--dtype", "float32"])
        stop = threading.Event()
        threads: list[threading.Thread] = []
        try:
            server.start()
            log(f"engine ready in {server.wait_ready(600.0):.0f} s; {len(prompts)} prompts, "
                f"{args.duration_s:.0f} s, a fault every {args.fault_every_s:g} s on average")
            before = scrape_metrics(server.base_url)
            started = time.monotonic()
            threads = [threading.Thread(target=client_loop, args=(i, server.base_url, prompts, args, stop, tally),
                                        daemon=True) for i in range(args.concurrency)]
            threads.append(threading.Thread(target=fault_loop, daemon=True, args=(
                runtime_dir, args.num_shards, server.base_url, args, stop, tally, started)))
            for t in threads:
                t.start()
            next_report = started + 60.0
            while (now := time.monotonic()) < started + args.duration_s:
                if server.returncode is not None:
                    deaths += 1
                    log(f"engine died (exit {server.returncode}); stopping")
                    break
                series.append((round(now - started, 1), sample_rss(server, runtime_dir)))
                if now >= next_report:
                    with tally.lock:
                        log(f"{now - started:5.0f} s: served {tally.served}, failed {tally.failed}, faults "
                            f"{dict(tally.faults)}, violations {len(tally.violations)}")
                    next_report += 60.0
                time.sleep(args.rss_every_s)
            stop.set()
            for t in threads:
                t.join(timeout=args.request_timeout_s + 30.0)
            hung = [t.name for t in threads if t.is_alive()]
            ensure_servers(args.num_shards, runtime_dir)  # (a fault may have left one down)
            time.sleep(3.0)  # the last releases
            alive = server.returncode is None and httpx.get(f"{server.base_url}/health", timeout=10).status_code == 200
            after = scrape_metrics(server.base_url) if alive else {}
            leases = count_leases(runtime_dir, args.num_shards)
            doc["result"] = {
                "duration_s": round(time.monotonic() - started, 1),
                "requests_served": tally.served,
                "requests_failed": tally.failed,
                "threads_hung": hung,
                "faults": {k: tally.faults[k] for k in FAULT_KINDS},
                "hostile_answered": tally.hostile_answered,
                "hostile_failed": tally.hostile_failed,
                "oracle_violations": len(tally.violations),
                "violations": tally.violations[:20],
                "engine_deaths": deaths + (0 if alive else 1),
                "leaked_leases": leases,
                "metrics_delta": {m: after.get(m, 0.0) - before.get(m, 0.0) for m in METRICS},
                "rss": rss_summary(series),
                "client_errors": tally.errors[:20],
            }
            doc["fault_log"] = tally.fault_log
            doc["rss_series"] = [{"t_s": t, **s} for t, s in series]
        except KeyboardInterrupt:
            doc["interrupted"] = True
            stop.set()
        finally:
            doc["engine_log_tail"] = server.log_tail(30)
            server.stop()
            stop_servers(runtime_dir)
    out.write_text(json.dumps(doc, indent=1))
    png = out.with_suffix(".png")
    if series:
        plot(series, tally.fault_log, png)
    res = doc.get("result", {})
    log(json.dumps({k: v for k, v in res.items() if k not in ("rss", "violations", "client_errors")}, indent=1))
    for name, r in res.get("rss", {}).items():
        log(f"  {name:22s} first {r['first_bytes'] / 2**20:7.1f} MiB  max {r['max_bytes'] / 2**20:7.1f} MiB  "
            f"last/second-quarter {r['last_over_second_quarter']}")
    log(f"wrote {out}" + (f" and {png}" if series else ""))
    required_zero = ("oracle_violations", "engine_deaths", "leaked_leases", "requests_failed", "hostile_failed")
    return 0 if res and all(res.get(k) == 0 for k in required_zero) and not res.get("threads_hung") else 1


if __name__ == "__main__":
    sys.exit(main())
