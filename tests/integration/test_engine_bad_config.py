"""A real CPU engine whose Valkey tier names a server where nothing listens fails at start-up, naming the key the
user wrote (``valkey_urls``, the flat shorthand) and its new spelling (``tiers[0].servers``) and the address; it
neither hangs nor starts without its tier.

Run through the one-process harness (the start-up check is the connector's, in the scheduler's constructor, the same
under ``vllm serve``; the API server's own start and exit are covered by ``test_api_server.py`` and the README quick
start).
"""

from __future__ import annotations

import pytest

from range_connector.testing.tiny_models import build_model
from tests.integration.harness import run_engine_expecting_failure

pytestmark = [pytest.mark.engine, pytest.mark.timeout(300)]


def test_unreachable_valkey_url_fails_start_up_naming_the_key(tmp_path):
    model = build_model("gqa", "tiny")
    log = run_engine_expecting_failure(tmp_path, "unreachable", {
        "model": str(model), "connector": {"valkey_urls": ["valkey://127.0.0.1:1"]}, "steps": [
            {"op": "generate", "prompts": [[11, 12, 13]]}]}, timeout_s=240)
    assert "ConfigError: valkey_urls" in log or "ConfigError: tiers[0].servers" in log, log[-3000:]
    assert "valkey_urls" in log and "tiers[0].servers" in log  # the key written, and the deprecation's new spelling
    assert "127.0.0.1:1" in log
    assert "token_ids" not in log  # (no generate step ran)
