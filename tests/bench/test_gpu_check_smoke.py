"""``bench/gpu_check.sh --cpu``: the prepared device check runs its steps here at smoke size and writes the same
results JSON as on the GPU machine (schema: ``bench/gpu_check_report.py``); and its verdict turns false when a load
was not byte-exact or the corruption check missed its flipped byte (so a green check means something)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench.gpu_check_report import build, validate

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "bench" / "gpu_check.sh"


@pytest.mark.timeout(300)
def test_gpu_check_cpu_mode_writes_a_valid_results_json(tmp_path: Path) -> None:
    env = {**os.environ, "OUT": str(tmp_path), "PYTHON": sys.executable}
    proc = subprocess.run(["bash", str(SCRIPT), "--cpu"], capture_output=True, text=True, timeout=280, cwd=str(REPO),
                          env=env)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-4000:]}\n{proc.stderr[-3000:]}"
    doc = json.loads((tmp_path / "gpu_check.json").read_text())
    assert validate(doc) == []
    assert doc["ok"] is True and doc["mode"] == "cpu"
    tests = doc["steps"]["tests"]
    assert tests["failed"] == 0 and tests["passed"] > 0
    assert all(c["byte_exact"] for c in doc["steps"]["data_path"]["cases"].values())
    assert doc["steps"]["data_path"]["vllm_modules"] == []
    tiers = doc["steps"]["sweep"]["tiers"]
    assert {"memory", "file"} <= set(tiers)
    # which I/O path the file tier's loads ran: on CPU, POSIX into host banks (no GPUDirect probe without CUDA)
    assert doc["steps"]["sweep"]["io_path"] == tiers["file"]["io_path"] == "posix"
    assert tiers["memory"]["io_path"] is None
    assert all(t["byte_exact"] and t["check_catches_corruption"] for t in tiers.values())
    assert (tmp_path / "gpu_check.log").stat().st_size > 0


def _write_steps(out: Path, *, byte_exact: bool = True, caught: bool = True) -> None:
    point = {"num_chunks": 2, "gib_per_s": 1.0, "first_layer_s": 0.001, "byte_exact": byte_exact,
             "check_catches_corruption": caught, "failed_blocks": 0}
    (out / "sweep.json").write_text(json.dumps({
        "gds": {"io_path": "none"}, "limits": {"h2d_pinned_gib_per_s": 1.0, "d2d_gib_per_s": 2.0},
        "tiers": {"memory": {"points": [point], "flatness": 1.0}}}))
    (out / "data_path.json").write_text(json.dumps({"cases": {"c": {"byte_exact": True, "failed_blocks": []}},
                                                    "vllm_modules": []}))
    (out / "tests.xml").write_text('<testsuites><testsuite><testcase name="t"/></testsuite></testsuites>')


@pytest.mark.timeout(10)
@pytest.mark.parametrize(("byte_exact", "caught", "ok"), [(True, True, True), (False, True, False),
                                                          (True, False, False)])
def test_the_verdict_fails_on_a_wrong_load_or_a_blind_check(tmp_path: Path, byte_exact: bool, caught: bool,
                                                           ok: bool) -> None:
    _write_steps(tmp_path, byte_exact=byte_exact, caught=caught)
    doc = build(tmp_path, "cpu", {"tests": 0, "data_path": 0, "sweep": 0})
    assert validate(doc) == [] and doc["ok"] is ok
    assert doc["steps"]["tests"]["passed"] == 1
