"""What Range is compared with in the object-count sweep (``bench/granularity.py``): the baseline rows.

* :class:`ResidentCase`: in this process, the payload already resident in one contiguous image, copied into the
  destination blocks with one ``index_copy_`` per layer. The sweep drives it like a Range case, interleaved with
  Range-DRAM's: ``setup()``, ``restore(path, kind, cold)``, ``close()``, its rows in ``rows``.
* :func:`run_shim`: one ``bench/lmcache_shim.py`` subprocess, run with ``.venv-lmcache/bin/python`` under a timeout,
  for one (shim path, chunk size): LMCache 0.5.6's paths, plain valkey-py with one key per object, the shim's own
  resident copy. It returns one sweep row (``status`` ``ok``, ``error`` or ``timeout``, with the reason), never
  raises for a failed child; :func:`lmcache_unavailable_reason` says why the LMCache environment cannot run, or
  ``None``.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import time
from pathlib import Path
from typing import Any

import torch
from bench_common import REPO
from bench_kv_layout import BLOCK_SIZE, BYTES_PER_TOKEN_PER_LAYER, KV, NUM_KV_HEADS, NUM_LAYERS, Payload

LMCACHE_PATHS = ("local_cpu", "resp", "valkey", "mp_l2_resp", "mp_l2_range")
SHIM_PATHS = LMCACHE_PATHS + ("plain_valkey_per_object", "resident")
LMCACHE_VALKEY_PATHS = ("resp", "valkey", "mp_l2_resp", "mp_l2_range")
#: LMCache's rows that store through Range (not a baseline Range is compared with: a row of its own, issue 21)
LMCACHE_OVER_RANGE_PATHS = ("mp_l2_range",)
#: display names of the LMCache multi-process rows
ROW_LABELS = {"lmcache_mp_l2_resp": "LMCache MP + resp adapter", "lmcache_mp_l2_range": "LMCache MP + Range adapter"}
LMCACHE_VENV_PYTHON = REPO / ".venv-lmcache" / "bin" / "python"
SHIM = REPO / "bench" / "lmcache_shim.py"


# ---------------------------------------------------------------------------------------------------- resident
class ResidentCase:
    """The same bytes already in one contiguous image, one ``index_copy_`` per layer into the same blocks."""

    def __init__(self, chunk_tokens: int, args: argparse.Namespace, payload: Payload) -> None:
        self.C, self.args, self.payload = chunk_tokens, args, payload
        self.rows: dict[str, dict[str, Any]] = {}
        self.error: str | None = None
        self.gen = torch.Generator().manual_seed(args.seed + 99)

    def setup(self) -> None:
        self.dst = KV(self.payload.kv.num_blocks) if self.args.dst_per_case else self.args.shared_dst

    def restore(self, path: str, kind: str, cold: bool = False) -> None:
        if kind == "breakdown":
            return
        row = self.rows.get(path)
        if row is None:
            row = self.rows[path] = {
                "path": path, "family": "reference", "chunk_tokens": self.C,
                "num_chunks": self.args.payload_tokens // self.C,
                "num_objects": self.args.payload_tokens // self.C * NUM_LAYERS,
                "payload_bytes": self.args.payload_bytes, "layered_delivery": True,
                "driven_by": "in this process: contiguous [layers, blocks, block bytes] image of the payload, one "
                             "index_copy_ per layer into the destination blocks (no per-object work)",
                "per_repeat": [], "warmup_restore_s": [],
            }
        dst, image = self.dst, self.payload.image
        dst.buf.zero_()
        dst_ids = torch.randperm(dst.num_blocks, generator=self.gen)[:self.args.payload_blocks]
        t0 = time.perf_counter()
        first = None
        for layer in range(NUM_LAYERS):
            dst.rows[layer].index_copy_(0, dst_ids, image[layer])
            if first is None:
                first = time.perf_counter()
        t1 = time.perf_counter()
        if not self.payload.equal_at(dst, dst_ids):
            raise RuntimeError("resident copy differs")
        if kind == "warmup":
            row["warmup_restore_s"].append(t1 - t0)
            return
        row["per_repeat"].append({"restore_s": t1 - t0, "first_layer_s": first - t0, "lookup_s": 0.0,
                                  "byte_exact": True, "loadavg_1m": round(os.getloadavg()[0], 2),
                                  "client_counts_restore": {"copy_launches": NUM_LAYERS}})

    def close(self) -> None:
        pass


# ---------------------------------------------------------------------------------------------------- LMCache shim
def lmcache_unavailable_reason() -> str | None:
    if not LMCACHE_VENV_PYTHON.exists():
        return (f"{LMCACHE_VENV_PYTHON.relative_to(REPO)} is missing; create it with "
                f"`bash bench/setup_lmcache_env.sh` (LMCache 0.5.6 in a separate venv)")
    if not SHIM.exists():
        return f"{SHIM.relative_to(REPO)} is missing"
    try:
        r = subprocess.run([str(LMCACHE_VENV_PYTHON), "-c", "import lmcache, torch, valkey"], capture_output=True,
                           timeout=120, text=True)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"{LMCACHE_VENV_PYTHON} does not run: {exc}"
    if r.returncode:
        return (f"{LMCACHE_VENV_PYTHON} cannot import lmcache ({r.stderr.strip()[-300:]}); "
                f"repair it with `bash bench/setup_lmcache_env.sh`")
    return None


def run_shim(path: str, chunk_tokens: int, args: argparse.Namespace, valkey_url: str | None,
             workdir: Path) -> dict[str, Any]:
    out = workdir / f"shim-{path}-{chunk_tokens}.json"
    cmd = [str(LMCACHE_VENV_PYTHON), str(SHIM), "--payload-bytes", str(args.payload_bytes), "--chunk-tokens",
           str(chunk_tokens), "--num-layers", str(NUM_LAYERS), "--kv-bytes-per-token-per-layer",
           str(BYTES_PER_TOKEN_PER_LAYER), "--num-kv-heads", str(NUM_KV_HEADS), "--block-size", str(BLOCK_SIZE),
           "--path", path, "--repeats", str(args.lmcache_repeats), "--warmup", str(args.warmup),
           "--timeout-s", str(args.lmcache_timeout_s), "--retries", "1", "--seed", str(args.seed), "--out", str(out)]
    if valkey_url:
        cmd += ["--valkey-url", valkey_url]
    name = {"plain_valkey_per_object": "plain_valkey_per_object", "resident": "resident_shim"}.get(
        path, f"lmcache_{path}")
    row: dict[str, Any] = {"path": name, "family": "lmcache" if path in LMCACHE_PATHS else "reference",
                           "shim_path": path, "chunk_tokens": chunk_tokens, "shim_command": shlex.join(cmd)}
    t = time.monotonic()
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=2 * args.lmcache_timeout_s + 60,
                           cwd=str(REPO))
        row["shim_wall_s"] = round(time.monotonic() - t, 2)
        if not out.exists():
            row.update(status="error", reason=f"shim exited {r.returncode} without output: "
                                              f"{(r.stderr or r.stdout).strip()[-500:]}")
            return row
        doc = json.loads(out.read_text())
        res = doc["results"][0]
        keep = ("status", "reason", "num_objects", "object_bytes", "payload_bytes", "granularity",
                "restore_s_all", "restore_s_median", "gib_per_s", "first_layer_s_median", "lookup_s_median",
                "shim_copy_s_median", "verify_s_median", "client_counts_restore", "client_s_medians", "server_commands_restore",
                "server_commands_lookup", "driven_by", "layered_delivery", "verified", "copy_mode",
                "torch_threads", "lmcache_use_layerwise", "lmcache_chunk_size", "lmcache_keys", "repeats_done",
                "warmup_restore_s", "store_s", "attempts", "valkey_py_parser", "mp_object_shape")
        row.update({k: res[k] for k in keep if k in res})
        if res.get("per_repeat"):
            row["restore_s_min"] = min(p["restore_s"] for p in res["per_repeat"])
        row["byte_exact"] = bool(res.get("verified"))
        row["shim_versions"] = doc.get("meta", {}).get("versions")
    except subprocess.TimeoutExpired:
        row.update(status="timeout", reason=f"shim did not finish within {2 * args.lmcache_timeout_s + 60} s",
                   shim_wall_s=round(time.monotonic() - t, 2))
    except (OSError, ValueError, KeyError, IndexError) as exc:
        row.update(status="error", reason=f"{type(exc).__name__}: {exc}")
    return row
