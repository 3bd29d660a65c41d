"""The object-count sweep's acceptance of issue 21 (``bench/granularity_report.py``): the "LMCache MP + Range adapter"
row flat across N and faster than "LMCache MP + resp adapter" at every N, judged from the rows alone (synthetic
rows: what the shim's children measure is ``bench/granularity.py``'s run, not a test)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "bench"))

from granularity_report import analyse  # noqa: E402

CHUNKS = [32, 64, 128, 256, 512, 1024]
PAYLOAD_TOKENS = 4096


def rows(path: str, times_s: list[float]) -> list[dict]:
    return [{"path": path, "chunk_tokens": c, "status": "ok", "restore_s_median": t} for c, t in zip(CHUNKS, times_s)]


def verdict(range_s: list[float], resp_s: list[float]) -> dict:
    doc = analyse(rows("lmcache_mp_l2_range", range_s) + rows("lmcache_mp_l2_resp", resp_s) +
                  rows("range_valkey", [0.2] * 6), CHUNKS, PAYLOAD_TOKENS)
    return doc["acceptance"]["lmcache_range_adapter"]


def test_flat_and_faster_passes() -> None:
    v = verdict([0.20, 0.201, 0.202, 0.199, 0.2, 0.203], [0.45, 0.4, 0.3, 0.25, 0.23, 0.22])
    assert v["flat"] and v["faster_at_every_N"]
    assert v["max_over_min"] == pytest.approx(0.203 / 0.199)
    assert set(v["per_N"]) == {str(PAYLOAD_TOKENS // c * 32) for c in CHUNKS}


def test_a_slope_or_one_slower_point_fails() -> None:
    assert not verdict([0.3, 0.28, 0.25, 0.22, 0.2, 0.2], [0.45, 0.4, 0.3, 0.25, 0.23, 0.22])["flat"]
    v = verdict([0.22] * 6, [0.45, 0.4, 0.3, 0.25, 0.23, 0.22])
    assert v["flat"] and not v["faster_at_every_N"]  # (as fast, not faster, at the coarsest N)
    assert v["per_N"][str(PAYLOAD_TOKENS // 1024 * 32)]["range_over_resp"] == pytest.approx(1.0)


def test_the_range_adapter_row_is_not_a_baseline_of_range() -> None:
    doc = analyse(rows("lmcache_mp_l2_range", [0.1] * 6) + rows("lmcache_mp_l2_resp", [0.3] * 6) +
                  rows("range_valkey", [0.2] * 6), CHUNKS, PAYLOAD_TOKENS)
    fastest = doc["acceptance"]["range_valkey_vs_fastest_lmcache"]["finest"]["any_lmcache_path"]["fastest"]
    assert fastest == "lmcache_mp_l2_resp"


def test_without_the_rows_there_is_no_verdict() -> None:
    doc = analyse(rows("range_valkey", [0.2] * 6), CHUNKS, PAYLOAD_TOKENS)
    assert doc["acceptance"]["lmcache_range_adapter"] is None
