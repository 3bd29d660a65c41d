"""The worker-side data path runs with torch alone: in a process where every vLLM import raises, the real
``RangeWorker`` saves KV and loads it back byte for byte through every load path (lent views, banks, direct receive),
from the DRAM and file tiers, pipelined, synchronous and asynchronous (:mod:`tests.unit.data_path_child`).

The import rule behind it (only ``compat``, ``connector``, ``spec`` and ``plugin`` import vLLM) is checked statically
in ``test_import_rules.py``; this test is the run-time half, so a lazy import inside a function that only runs on
some path cannot hide.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
CHILD = REPO / "tests" / "unit" / "data_path_child.py"


@pytest.mark.timeout(120)
def test_save_and_load_round_trip_without_vllm() -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, str(CHILD)], capture_output=True, text=True, timeout=110, cwd=str(REPO),
                          env=env)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    doc = json.loads(proc.stdout.strip().splitlines()[-1])
    assert doc["vllm_modules"] == []
    assert doc["connector_import_refused"] is True  # (the blocker was in force: the connector needs vLLM)
    assert len(doc["cases"]) == 5
    for name, case in doc["cases"].items():
        assert case["failed_blocks"] == [], name
        assert case["loaded_blocks"] == case["expected_blocks"] > 0, name
        assert case["byte_exact"] is True, name
        # the forced path ran: a direct receive lands rows in place (no copy), banks and views copy once per layer
        assert (case["copy_launches"] == 0) == ("direct" in name), name
