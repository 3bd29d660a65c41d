"""Child process of ``test_data_path_without_vllm.py``: the worker-side data path with vLLM made unimportable.

``sys.modules["vllm"] = None`` comes before any other import, so every ``import vllm...`` in this process raises
``ImportError``. Then the real worker half saves random KV and loads it back into CPU KV tensors through each path
(DRAM tier lending views; banks; direct receive from the DRAM and file tiers; pipelined, synchronous and
asynchronous delivery) and prints one JSON line: per case, whether the load was byte-exact and which blocks failed,
plus the vLLM modules this process holds (none) and whether vLLM's own import was refused.

``--device cuda --layout flash`` runs the same cases into CUDA KV tensors in FlashAttention's layout
(``bench/gpu_check.sh``): there the "direct" cases stage through banks, as every load into device memory does.
"""

from __future__ import annotations

import sys

sys.modules["vllm"] = None  # type: ignore[assignment]  (before anything else: any vLLM import now raises)

import argparse  # noqa: E402
import importlib  # noqa: E402
import json  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from bench.worker_roundtrip import KVShape, RoundTrip, config  # noqa: E402
from range_connector.backends.file.backend import FileBackend  # noqa: E402
from range_connector.backends.memory import MemoryBackend  # noqa: E402

#: (case, tier type, the stored path forced: "views" | "direct" | "banks", load mode)
CASES = [
    ("memory-views-pipelined", "memory", "views", "pipelined"),
    ("memory-banks-pipelined", "memory", "banks", "pipelined"),
    ("memory-direct-sync", "memory", "direct", "sync"),
    ("file-direct-pipelined", "file", "direct", "pipelined"),
    ("file-banks-async", "file", "banks", "async"),
]


def backends(tier: str, path: str, root: Path) -> tuple[list, list]:
    """``(save backends, load backends)`` of one shard; the file tier gets one instance per worker, as two
    processes would have."""
    if tier == "memory":
        b = MemoryBackend(None)
        saver = loader = b
    else:
        saver, loader = FileBackend(root, timeout_s=30.0), FileBackend(root, timeout_s=30.0)
    if path != "views":
        loader.supports_views = False
    if path == "banks":
        loader.supports_scatter = False
    return [saver], [loader]


def run_case(tier: str, path: str, mode: str, root: Path, device: str = "cpu", layout: str = "cpu") -> dict:
    cfg = config(tier, directory=str(root) if tier == "file" else None)
    shape = KVShape(layout=layout)
    save_b, load_b = backends(tier, path, root)
    rt = RoundTrip.build(cfg, shape, save_b, load_b, num_chunks=4, device=device)
    dst_ids = rt.pick_dst_ids()
    try:
        failed = rt.load(dst_ids, mode=mode)
        if mode == "async":
            deadline = time.monotonic() + 60.0
            while "load" not in rt.loader.get_finished(set()) and time.monotonic() < deadline:
                time.sleep(0.01)
            failed |= rt.loader.take_failed_block_ids()
        if device != "cpu":
            import torch

            torch.cuda.synchronize()  # (the comparison reads on the current stream; this is only belt and braces)
        stats = dict(rt.loader.stats)
        return {"device": rt.loader.device.kind, "byte_exact": rt.matches(dst_ids), "failed_blocks": sorted(failed),
                "loaded_blocks": stats.get("loaded_blocks", 0), "expected_blocks": len(dst_ids),
                "copy_launches": stats.get("copy_launches", 0)}
    finally:
        rt.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", help="where the KV tensors live: cpu or cuda")
    parser.add_argument("--layout", default="cpu", choices=("cpu", "flash"), help="KV layout (bench/worker_roundtrip)")
    args = parser.parse_args()
    out: dict = {"cases": {}, "device": args.device, "layout": args.layout}
    with tempfile.TemporaryDirectory() as tmp:
        for name, tier, path, mode in CASES:
            out["cases"][name] = run_case(tier, path, mode, Path(tmp) / name, args.device, args.layout)
    out["vllm_modules"] = sorted(m for m, mod in sys.modules.items() if m.split(".")[0] == "vllm" and mod is not None)
    try:
        importlib.import_module("range_connector.connector")  # (imports vLLM: must be refused here)
        out["connector_import_refused"] = False
    except ImportError:
        out["connector_import_refused"] = True
    print(json.dumps(out))


if __name__ == "__main__":
    main()
