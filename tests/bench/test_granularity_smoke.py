"""Smoke run of ``bench/granularity.py``: the sweep's rows exist and Range restores byte-exact.

Runs ``bench/granularity.py --smoke --security`` (16 MiB payload, chunk sizes 32 and 128, 2 repeats, no LMCache;
Valkey also with AUTH and through a TLS relay) as a subprocess with loopback Valkey servers of its own, and checks
the JSON it writes.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "bench" / "granularity.py"
SMOKE_CHUNKS = (32, 128)
NUM_LAYERS = 32
SMOKE_TOKENS = 16 * 1024 * 1024 // (NUM_LAYERS * 4096)


def _file_backend_exists() -> bool:
    try:
        from range_connector.backends.file.backend import FileBackend  # noqa: F401
    except Exception:
        return False
    return True


@pytest.mark.timeout(120)
def test_granularity_smoke(tmp_path: Path) -> None:
    out = tmp_path / "granularity.json"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--smoke", "--security", "--results-dir", str(tmp_path), "--out", str(out)],
        capture_output=True, text=True, timeout=110, cwd=str(REPO),
    )
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    assert "Acceptance (issue 3)" in proc.stdout
    doc = json.loads(out.read_text())

    assert doc["config"]["smoke"] is True
    assert doc["config"]["chunk_tokens"] == list(SMOKE_CHUNKS)
    assert doc["config"]["payload_bytes"] == 16 << 20
    assert not any(r["path"].startswith("lmcache_") for r in doc["rows"]), "smoke mode runs no LMCache rows"

    expected = ["range_memory", "range_valkey", "range_valkey_auth", "range_valkey_tls", "resident"]
    if _file_backend_exists():
        expected.append("range_file_warm")
    else:
        assert any("file backend not available" in n for n in doc["notes"])
    rows = {(r["path"], r["chunk_tokens"]): r for r in doc["rows"]}
    for path in expected:
        for c in SMOKE_CHUNKS:
            row = rows.get((path, c))
            assert row is not None, f"no row for {path} at chunk {c}: {sorted(rows)}"
            assert row["status"] == "ok", f"{path} C={c}: {row.get('reason')}\n{row.get('traceback', '')}"
            assert row["num_objects"] == SMOKE_TOKENS // c * NUM_LAYERS
            assert row["repeats_done"] == 2
            assert len(row["restore_s_all"]) == 2 and row["restore_s_median"] > 0
            assert row["byte_exact"] is True
            if path.startswith("range_"):
                assert all(rep["byte_exact"] for rep in row["per_repeat"])
                assert 0 < row["first_layer_s_median"] < row["restore_s_median"]  # layer-pipelined: first layer early
                assert row["lookup_s_median"] is not None
                assert row["client_counts_restore"]["round_trips"] >= 1
    # Range's restore work does not grow with the object count (client side and, for Valkey, server side).
    for path in ("range_memory", "range_valkey"):
        counts = {json.dumps(rows[(path, c)]["client_counts_restore"], sort_keys=True) for c in SMOKE_CHUNKS}
        assert len(counts) == 1, f"{path} backend counters vary with N: {counts}"
        launches = {rows[(path, c)]["worker_stats_restore"].get("copy_launches") for c in SMOKE_CHUNKS}
        assert len(launches) == 1, f"{path} copy launches vary with N: {launches}"
    server = {json.dumps(rows[("range_valkey", c)]["server_commands_restore"], sort_keys=True) for c in SMOKE_CHUNKS}
    assert len(server) == 1, f"Valkey server commands vary with N: {server}"

    # --security: AUTH and TLS restore the same bytes with the same commands, and their ratios are reported.
    for c in SMOKE_CHUNKS:
        assert rows[("range_valkey_auth", c)]["server_commands_restore"] == rows[("range_valkey", c)][
            "server_commands_restore"]
    ratios = doc["security"]["ratios"]
    assert set(ratios["auth_over_plain"]) == set(ratios["tls_over_plain"]) == {str(c) for c in SMOKE_CHUNKS}
    assert all(v > 0 for r in ratios.values() for v in r.values())
    assert "***" in rows[("range_valkey_auth", 32)]["valkey_url"]

    analysis = doc["analysis"]
    assert set(analysis["acceptance"]["range_flat"]) >= {"range_memory", "range_valkey"}
    assert analysis["paths"]["range_memory"]["fit"] is not None
    if importlib.util.find_spec("matplotlib") is not None:
        assert doc["plot"] and Path(doc["plot"]).exists()
