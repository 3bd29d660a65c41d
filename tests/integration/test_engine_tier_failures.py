"""A tier that freezes or dies while the engine serves: every request still completes, within a bound, with the
same tokens (a miss, then recompute), and the tier is used again once it is back."""

from __future__ import annotations

import pytest

from range_connector.backends.valkey.servers import stop_servers
from range_connector.testing.tiny_models import build_model
from tests.integration.harness import prompt_ids, run_engine

pytestmark = [pytest.mark.engine, pytest.mark.timeout(600)]

TIMEOUT_S = 1.0
RETRY_S = 2.0


def test_frozen_then_killed_valkey_turns_into_recompute(tmp_path):
    model = build_model("gqa", "tiny")
    x = prompt_ids(model, 600)
    rt = str(tmp_path / "runtime")
    connector = {"runtime_dir": rt, "backend_timeout_s": TIMEOUT_S, "backend_retry_s": RETRY_S,
                 "load_deadline_s": 3.0}
    try:
        res = run_engine(tmp_path, "faults", {"model": str(model), "connector": connector, "steps": [
            {"op": "generate", "prompts": [x]},                                   # 0 cold: saves
            {"op": "reset_prefix_cache"},
            {"op": "signal_servers", "runtime_dir": rt, "signal": "STOP"},
            {"op": "generate", "prompts": [x]},                                   # 3 frozen tier
            {"op": "signal_servers", "runtime_dir": rt, "signal": "CONT"},
            {"op": "sleep", "seconds": RETRY_S + 0.5},
            {"op": "reset_prefix_cache"},
            {"op": "generate", "prompts": [x]},                                   # 7 tier back: hit
            {"op": "signal_servers", "runtime_dir": rt, "signal": "KILL"},
            {"op": "reset_prefix_cache"},
            {"op": "generate", "prompts": [x]},                                   # 10 dead tier
            {"op": "generate", "prompts": [x[:500]]},                             # 11 still serving
        ]})
    finally:
        stop_servers(rt)
    cold = res[0]
    assert cold["external_hits"] == 0
    frozen = res[3]
    assert frozen["external_hits"] == 0 and frozen["token_ids"] == cold["token_ids"]
    # One lookup timeout and (at most) one save timeout, then the back-off: no hang.
    assert frozen["elapsed_s"] < cold["elapsed_s"] + 2 * TIMEOUT_S + 3.0
    back = res[7]
    assert back["external_hits"] == 512 and back["token_ids"] == cold["token_ids"]
    dead = res[10]
    assert dead["external_hits"] == 0 and dead["token_ids"] == cold["token_ids"]
    assert dead["elapsed_s"] < cold["elapsed_s"] + 2 * TIMEOUT_S + 3.0
    assert len(res[11]["token_ids"][0]) > 0
