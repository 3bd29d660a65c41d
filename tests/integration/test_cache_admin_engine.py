"""``range-connector cache`` next to a real engine: the namespace computed offline equals the engine's, and
``cache lookup``'s answer (tokens, and the tier they come from) equals the external hit the engine then reports.

One engine process, paused between its steps (the harness's ``mark``/``wait_for``) while the test acts on its tiers
from outside: Valkey (two real servers, one per shard) in front of files."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from range_connector.cli import main
from range_connector.testing.tiny_models import build_model
from tests.integration.harness import ENGINE_TIMEOUT_S, run_engine, text_corpus

pytestmark = [pytest.mark.engine, pytest.mark.timeout(600)]


def _wait_for(path, engine) -> None:
    """Until the engine writes ``path``; its own failure (or running past its deadline) fails the test."""
    deadline = time.monotonic() + ENGINE_TIMEOUT_S
    while not path.exists():
        if engine.done():
            engine.result()  # (raises the engine's failure with its log tail)
            raise AssertionError(f"the engine ended without writing {path}")
        assert time.monotonic() < deadline, f"the engine did not reach {path.name}"
        time.sleep(0.1)


def test_offline_lookup_equals_the_engines_hit_and_namespace(tmp_path, valkey_server_sets, capsys):
    from transformers import AutoTokenizer

    model = build_model("gqa", "tiny")
    text = text_corpus()[:3000]
    x = AutoTokenizer.from_pretrained(str(model))(text, add_special_tokens=True)["input_ids"]
    assert len(x) > 512  # (two full chunks at least)
    (tmp_path / "prompt.txt").write_text(text)
    servers = valkey_server_sets(2)
    connector = {"tiers": [{"type": "valkey", "servers": list(servers.urls)},
                           {"type": "file", "directory": str(tmp_path / "kv")}],
                 "num_shards": 2, "chunk_tokens": 256}
    config = tmp_path / "range.json"
    config.write_text(json.dumps(connector))
    saved, go = tmp_path / "saved", tmp_path / "go"
    spec = {"model": str(model), "connector": connector, "steps": [
        {"op": "generate", "prompts": [[0]], "max_tokens": 1, "kv_transfer_params": {"range_describe": True}},  # 0
        {"op": "generate", "prompts": [x]},                                                     # 1: saves x
        {"op": "mark", "path": str(saved)}, {"op": "wait_for", "path": str(go)},                # 2, 3
        {"op": "reset_prefix_cache"}, {"op": "generate", "prompts": [x]},                       # 4, 5
        {"op": "range_metrics"},                                                                # 6
    ]}
    with ThreadPoolExecutor(1) as pool:
        engine = pool.submit(run_engine, tmp_path, "cache-admin", spec)
        try:
            _wait_for(saved, engine)
            assert main(["cache", "stats", "--config", str(config), "--json"]) == 0
            rows = json.loads(capsys.readouterr().out)["rows"]
            assert {(r["tier_type"], r["shard_idx"]) for r in rows if r["num_tickets"]} == {
                (t, s) for t in ("valkey", "file") for s in (0, 1)}
            # Valkey's copy goes: the hit must now come from the file tier, and the lookup must say so.
            assert main(["cache", "clear", "--config", str(config), "--tier", "valkey", "--yes"]) == 0
            capsys.readouterr()
            lookup = subprocess.run(
                [sys.executable, "-m", "range_connector.cli", "cache", "lookup", "--config", str(config),
                 "--model", str(model), "--prompt-file", str(tmp_path / "prompt.txt"), "--block-size", "128",
                 "--json"], capture_output=True, text=True, timeout=300)
        finally:
            go.touch()
        res = engine.result()
    assert lookup.returncode == 0, lookup.stderr[-3000:]
    answer = json.loads(lookup.stdout)
    assert answer["namespace_hex"] == res[0]["kv_transfer_params"][0]["range"]["settings"]["namespace"]
    assert answer["num_prompt_tokens"] == len(x)
    assert res[1]["external_hits"] == 0
    hit = res[5]["external_hits"]
    assert hit >= 512 and answer["hit_tokens"] == hit
    assert [(t["tier_type"], t["served_tokens"], t["stored_tokens"]) for t in answer["tiers"]] == [
        ("valkey", 0, 0), ("file", hit, hit)]
    loaded = {m["labels"]["tier"]: m["value"] for m in res[6]["metrics"]
              if m["name"] == "vllm:range_tier_loaded_tokens" and m["value"]}
    assert loaded == {"file": hit}
    assert res[5]["token_ids"] == res[1]["token_ids"]
