"""The one results JSON of ``bench/gpu_check.sh``: its steps' outputs merged, and the schema it must follow.

``python bench/gpu_check_report.py OUT_DIR --mode cpu|cuda --rc-tests N --rc-data-path N --rc-sweep N`` reads what
the steps left in ``OUT_DIR`` (``tests.xml``: pytest's JUnit XML; ``data_path.json``: the no-vLLM round trip of
``tests/unit/data_path_child.py``; ``sweep.json``: :mod:`bench.gpu_sweep`) and writes ``OUT_DIR/gpu_check.json``::

    {"schema": "range-gpu-check/1", "mode": "cpu" | "cuda", "ok": bool,
     "steps": {"tests": {"rc": int, "passed": int, "failed": int, "skipped": int, "skip_reasons": [str]},
               "data_path": {"rc": int, "cases": {case: {"byte_exact": bool, "failed_blocks": [int], ...}}},
               "sweep": {"rc": int, "io_path": "gds" | "compat" | "posix" | "none" | "unknown",
                         "probe": {"io_path": str, "reason": str, "device_loads": bool} | null,
                         "limits": {"h2d_pinned_gib_per_s": float, "d2d_gib_per_s": float},
                         "tiers": {tier: {"gib_per_s": [float], "first_layer_s": [float], "flatness": float,
                                          "byte_exact": bool, "check_catches_corruption": bool,
                                          "io_path": str | null}}}}}

``io_path`` is the I/O path the file tier's loads ran with this machine's set-up: ``"gds"`` (kvikio cuFile into
device memory), ``"compat"`` (kvikio's compatibility mode into device memory), ``"posix"`` (POSIX reads into host
banks: no CUDA, or the start-up GPUDirect probe failed or chose it; ``probe`` says which and why). Each file tier
has its own (``file-device``: files read into device memory with kvikio's compatibility mode allowed, on CUDA).

``ok`` is true when every step exited 0, no test failed, every load was byte-exact, and the corruption check caught
its flipped byte. Exit status: 0 when ``ok``, else 1. :func:`validate` lists what a document lacks (the smoke test
``tests/bench/test_gpu_check_smoke.py`` uses it). Standard library only.
"""

from __future__ import annotations

import argparse
import json
import sys
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

SCHEMA = "range-gpu-check/1"
#: the values of ``steps.sweep.io_path`` (module docstring; ``"none"``: written by checks before the probe existed)
IO_PATHS = ("gds", "compat", "posix", "none", "unknown")


def junit_counts(path: Path) -> dict[str, Any]:
    """``passed``, ``failed`` (failures and errors), ``skipped`` and the distinct skip reasons of a JUnit XML file
    (all zero, with a reason, when the file is missing)."""
    if not path.exists():
        return {"passed": 0, "failed": 0, "skipped": 0, "skip_reasons": [f"{path.name} missing"]}
    root = ET.parse(path).getroot()
    cases = list(root.iter("testcase"))
    failed = sum(1 for c in cases if c.find("failure") is not None or c.find("error") is not None)
    skips = [c.find("skipped") for c in cases]
    reasons = sorted({(s.get("message") or "").strip() for s in skips if s is not None})
    skipped = sum(1 for s in skips if s is not None)
    return {"passed": len(cases) - failed - skipped, "failed": failed, "skipped": skipped, "skip_reasons": reasons}


def _load(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        return {"error": f"{path.name}: {type(exc).__name__}: {exc}"}


def build(out_dir: Path, mode: str, rcs: dict[str, int]) -> dict:
    """The results document (module docstring) from the files the steps wrote in ``out_dir``."""
    data = _load(out_dir / "data_path.json")
    sweep = _load(out_dir / "sweep.json")
    tiers = {}
    for tier, t in sweep.get("tiers", {}).items():
        pts = t["points"]
        tiers[tier] = {"num_chunks": [p["num_chunks"] for p in pts], "gib_per_s": [p["gib_per_s"] for p in pts],
                       "first_layer_s": [p["first_layer_s"] for p in pts], "flatness": t["flatness"],
                       "byte_exact": all(p["byte_exact"] and not p["failed_blocks"] for p in pts),
                       "check_catches_corruption": all(p["check_catches_corruption"] for p in pts),
                       "io_path": pts[-1].get("io_path") if pts else None}
    steps = {
        "tests": {"rc": rcs["tests"], **junit_counts(out_dir / "tests.xml")},
        "data_path": {"rc": rcs["data_path"], "cases": data.get("cases", {}), "vllm_modules": data.get("vllm_modules"),
                      **({"error": data["error"]} if "error" in data else {})},
        "sweep": {"rc": rcs["sweep"], "io_path": sweep.get("gds", {}).get("io_path", "unknown"),
                  "probe": sweep.get("gds", {}).get("probe"),
                  "gds": sweep.get("gds"), "gpu_name": sweep.get("gpu_name"), "torch": sweep.get("torch"),
                  "limits": sweep.get("limits", {}), "tiers": tiers,
                  **({"error": sweep["error"]} if "error" in sweep else {})},
    }
    ok = (all(s["rc"] == 0 for s in steps.values()) and steps["tests"]["failed"] == 0
          and bool(steps["data_path"]["cases"])
          and all(c["byte_exact"] and not c["failed_blocks"] for c in steps["data_path"]["cases"].values())
          and bool(tiers) and all(t["byte_exact"] and t["check_catches_corruption"] for t in tiers.values()))
    return {"schema": SCHEMA, "mode": mode, "ok": ok, "steps": steps}


def validate(doc: dict) -> list[str]:
    """What ``doc`` lacks of the schema (module docstring): an empty list when it follows it."""
    problems = []
    for key, kind in (("schema", str), ("mode", str), ("ok", bool), ("steps", dict)):
        if not isinstance(doc.get(key), kind):
            problems.append(f"{key}: not a {kind.__name__}")
    if problems:
        return problems
    if doc["schema"] != SCHEMA:
        problems.append(f"schema: {doc['schema']!r}, not {SCHEMA!r}")
    steps = doc["steps"]
    for step, keys in (("tests", ("rc", "passed", "failed", "skipped", "skip_reasons")), ("data_path", ("rc", "cases")),
                       ("sweep", ("rc", "io_path", "limits", "tiers"))):
        for key in keys:
            if key not in steps.get(step, {}):
                problems.append(f"steps.{step}.{key}: missing")
    sweep = steps.get("sweep", {})
    for key in ("h2d_pinned_gib_per_s", "d2d_gib_per_s"):
        if not isinstance(sweep.get("limits", {}).get(key), float):
            problems.append(f"steps.sweep.limits.{key}: not a float")
    for tier, t in sweep.get("tiers", {}).items():
        for key in ("gib_per_s", "first_layer_s", "flatness", "byte_exact", "check_catches_corruption", "io_path"):
            if key not in t:
                problems.append(f"steps.sweep.tiers.{tier}.{key}: missing")
    if sweep.get("io_path") not in IO_PATHS:
        problems.append(f"steps.sweep.io_path: {sweep.get('io_path')!r}")
    return problems


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--mode", choices=("cpu", "cuda"), required=True)
    for step in ("tests", "data-path", "sweep"):
        parser.add_argument(f"--rc-{step}", type=int, required=True)
    args = parser.parse_args()
    doc = build(args.out_dir, args.mode, {"tests": args.rc_tests, "data_path": args.rc_data_path,
                                          "sweep": args.rc_sweep})
    (args.out_dir / "gpu_check.json").write_text(json.dumps(doc, indent=2))
    problems = validate(doc)
    summary = {"ok": doc["ok"] and not problems, "mode": doc["mode"], "problems": problems,
               "tests": {k: doc["steps"]["tests"][k] for k in ("passed", "failed", "skipped")},
               "data_path_byte_exact": {c: v["byte_exact"] for c, v in doc["steps"]["data_path"]["cases"].items()},
               "io_path": doc["steps"]["sweep"]["io_path"], "limits": doc["steps"]["sweep"]["limits"],
               "tiers": {t: {"gib_per_s": [round(x, 3) for x in v["gib_per_s"]], "flatness": round(v["flatness"], 3),
                             "first_layer_s": [round(x, 5) for x in v["first_layer_s"]],
                             **({"io_path": v["io_path"]} if v["io_path"] else {})}
                         for t, v in doc["steps"]["sweep"]["tiers"].items()}}
    print(json.dumps(summary, indent=1))
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
