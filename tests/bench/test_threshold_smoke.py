"""Smoke run of ``bench/threshold.py``: three real vLLM CPU engines on the tiny GQA model (always load, never load,
the gate seeded with the calibration file the script writes), a 2 x 2 grid of prompt lengths x tier bandwidths
with 2 runs per cell, and the slow-tier scenario. Checks the JSON's structure, that ``always`` loaded every stored
prefix, and that the gate engine ran with the connector: every request it was sent was weighed by the gate (its store
was filled and the stored prompt found, or the gate refused it unseen) and vLLM did what the gate decided (vLLM's
external hit counter against the gate's decision counter).

Nothing checked depends on how fast this machine is: ``always`` gets a load deadline that no prediction of the cost
model can exceed (so its hits are never refused as late; it once was, on a busy machine: ``[512, 0]``), and *which*
decisions the gate takes, and the TTFTs, are the benchmark's measurements, reported and not asserted.

Runs the script as a subprocess; on this 2-core machine most of the time is the three engines starting (the gate
starts after calibration, since it reads the calibration file at start-up).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from range_connector.cost.estimators import MAX_T0_S, MIN_BANDWIDTH_BYTES_PER_S

pytest.importorskip("vllm")

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "bench" / "threshold.py"

pytestmark = pytest.mark.engine


@pytest.mark.timeout(1260)
def test_threshold_smoke(tmp_path: Path) -> None:
    out = tmp_path / "threshold.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--smoke", "--out", str(out)], capture_output=True,
                          text=True, timeout=1200, cwd=str(REPO))
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    check_threshold_doc(json.loads(out.read_text()))


def check_threshold_doc(doc: dict) -> None:
    """What the smoke run's JSON must show (apart from the run, so that it can be checked on a doctored copy)."""
    cfg = doc["config"]
    assert cfg["smoke"] is True and cfg["model_size"] == "tiny"
    cal = doc["calibration"]
    assert cal["r_tokens_per_s"] > 0 and cal["t0_s"] >= 0 and cal["overhead_s"] >= 0
    assert cal["file"]["schema"] == "range-connector-calibration" and cal["file"]["tiers"]["file"]

    cells = doc["cells"]
    assert sorted((c["speed_factor"], c["prompt_tokens"]) for c in cells) == [
        (f, n) for f in (0.5, 2.0) for n in (513, 1025)]
    for c in cells:
        assert all(len(c["runs"][way]) == 2 for way in ("always", "never", "gate"))
        assert all(c[f"{way}_ttft_s"] > 0 for way in ("always", "never", "gate"))
        assert c["oracle_ttft_s"] == min(c["always_ttft_s"], c["never_ttft_s"])
        assert c["gate_over_oracle"] == pytest.approx(c["gate_ttft_s"] / c["oracle_ttft_s"])
        # always loads the whole stored prefix every time; never has no connector
        assert [r["loaded_tokens"] for r in c["runs"]["always"]] == [c["hit_tokens"]] * 2
        assert all(r["loaded_tokens"] == 0 for r in c["runs"]["never"])
        assert all(0 <= n <= c["hit_tokens"] for n in c["gate_loaded_tokens"])
        # vLLM took what the gate decided: a refusal or a probe loads nothing, a taken hit all of it, a shortened one
        # a part. A request with no decision found no hit to weigh (its lookup missed: on the slowed tier a lookup
        # can time out, and lookups are then misses for the tier's retry_s), and loads nothing.
        for r in c["runs"]["gate"]:
            kinds = r["decisions"]
            assert set(kinds) <= {"taken", "shortened", "refused", "probe"}, kinds
            if set(kinds) <= {"refused", "probe"}:
                assert r["loaded_tokens"] == 0, r
            elif kinds == {"taken": 1}:
                assert r["loaded_tokens"] == c["hit_tokens"], r
            elif kinds == {"shortened": 1}:
                assert 0 < r["loaded_tokens"] < c["hit_tokens"], r
    # (why always is never refused as late: no load the estimators can predict outlasts its deadline)
    max_hit = max(c["hit_tokens"] for c in cells)
    assert cfg["always_load_deadline_s"] >= MAX_T0_S + max_hit * cfg["bytes_per_token"] / MIN_BANDWIDTH_BYTES_PER_S

    s = doc["summary"]
    assert s["num_cells"] == 4 and 0 <= s["share_within_10pct"] <= 1
    assert s["cells_always_better_measured"] + s["cells_never_better_measured"] == 4
    assert s["regret"] == pytest.approx(sum(c["gate_ttft_s"] - c["oracle_ttft_s"] for c in cells)
                                        / sum(c["oracle_ttft_s"] for c in cells))

    st = doc["slow_tier"]
    assert [r["phase"] for r in st["requests"]] == ["fast"] * 2 + ["slow"] * 3 + ["recovered"] * 3
    assert all(r["decision"] in ("full", "partial", "none") and r["ttft_s"] > 0 for r in st["requests"])
    assert st["slow_cap_bytes_per_s"] > 0
    assert doc["plot"] and Path(doc["plot"]).is_file()
