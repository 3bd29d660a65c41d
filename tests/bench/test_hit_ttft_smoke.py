"""Smoke run of ``bench/hit_ttft.py``: two real vLLM CPU engines on the tiny GQA model (no connector; Range on an
embedded Valkey server), one 256 + 32-token prompt pair each, the plain-copy and wire-time
references.

Checks the JSON's structure and that every hit was a hit, counted outside the script's own arithmetic: vLLM's
``usage.cached_tokens`` for the resident case, and for each Range tier vLLM's ``cached_tokens`` together with
Range's ``vllm:range_tier_loaded_tokens_total`` on the engine's ``/metrics`` (the script exits 1 when one is short).
The TTFTs and the verdicts are the benchmark's measurements: reported, never asserted.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm")

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "bench" / "hit_ttft.py"

pytestmark = pytest.mark.engine


@pytest.mark.timeout(900)
def test_hit_ttft_smoke(tmp_path: Path) -> None:
    out = tmp_path / "hit.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--smoke", "--out", str(out)], capture_output=True,
                          text=True, timeout=840, cwd=str(REPO))
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    result = json.loads(out.read_text())
    assert set(result["engines"]) == {"none", "valkey"}
    assert result["prefix_kv_bytes"] == 256 * result["kv_bytes_per_token"]
    for name, eng in result["engines"].items():
        assert eng["num_repeats"] == 1 and eng["num_hits_ok"] == 1, (name, eng["rows"])
        (row,) = eng["rows"]
        assert row["hit_cached_tokens"] >= 256, (name, row)
        if name != "none":
            assert row["range_tier_loaded_tokens_total"] >= 256, (name, row)
            assert row["range_failed_tokens_total"] == 0, (name, row)
    assert len(result["engines"]["valkey"]["wire_s"]) == 1 and result["engines"]["valkey"]["wire_s_median"] > 0
    assert len(result["copy_s"]) == 1 and result["copy_s_median"] > 0
    assert set(result["verdicts"]) == {"valkey"} and result["verdicts"]["valkey"]["reference"] == "wire"
    assert "(b) Range valkey" in proc.stdout and "plain copy" in proc.stdout
