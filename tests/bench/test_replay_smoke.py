"""Smoke run of ``bench/replay.py``: one configuration (Range) on a tiny synthetic trace, as a subprocess.

Checks the exit status, the printed table, and that the JSON holds every measured request and the engine's
counters, and that both PNGs are written.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm")

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "bench" / "replay.py"
NUM_REQUESTS = 6
WARMUP = 1

pytestmark = pytest.mark.engine


@pytest.mark.timeout(400)
def test_replay_smoke(tmp_path: Path) -> None:
    out = tmp_path / "replay.json"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--configs", "range", "--synthetic-requests", str(NUM_REQUESTS),
         "--warmup", str(WARMUP), "--time-scale", "0.1", "--no-local-prefix-cache", "--no-progress",
         "--out", str(out)],
        capture_output=True, text=True, timeout=380, cwd=str(REPO),
    )
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    assert "external hit tokens (vLLM, admitted)" in proc.stdout and "transform: tokens x 0.0625" in proc.stdout
    hits_row = next(line for line in proc.stdout.splitlines() if line.strip().startswith("hits == loaded + failed"))
    assert hits_row.split()[-1] == "yes"  # vLLM's external hits agree with what Range loaded and verified
    doc = json.loads(out.read_text())
    (report,) = doc["reports"]
    assert report["label"] == "range" and report["summary"]["num_ok"] == NUM_REQUESTS - WARMUP
    assert len(report["results"]) == NUM_REQUESTS - WARMUP and len(report["warmup_results"]) == WARMUP
    engine = report["engine"]
    assert engine["totals"]["prompt_tokens"] == report["summary"]["prompt_tokens"]
    assert engine["totals"]["external_hit_tokens"] == report["summary"]["cached_tokens"]
    assert doc["trace"]["format"] == "synthetic" and doc["machine"]["cpus"] >= 1
    for suffix in ("-ttft-cdf.png", "-ttft-over-time.png"):
        png = tmp_path / f"replay{suffix}"
        assert png.stat().st_size > 1000, png
