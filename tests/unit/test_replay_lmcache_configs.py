"""The replay's LMCache configurations (``range_connector.bench.lmcache_configs``): which L2 adapter each selects,
the MP server command and vLLM connector config they build, and the Valkey counters read around a replay (on a real
server). No LMCache and no engine: what those run is ``tests/lmcache`` and the benchmark itself."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import valkey

from range_connector.bench.lmcache_configs import (
    LMCACHE_CONFIGS,
    l2_adapters,
    lmcache_server,
    valkey_counters,
    valkey_delta,
)
from range_connector.errors import ConfigError
from range_connector.lmcache.config import RangeL2Config

URL = "valkey://127.0.0.1:6399"


def fake_venv(tmp_path: Path) -> Path:
    (tmp_path / "venv" / "bin").mkdir(parents=True)
    (tmp_path / "venv" / "bin" / "python").touch()
    (tmp_path / "venv" / "lib" / "python3.11" / "site-packages").mkdir(parents=True)
    return tmp_path / "venv"


def l2_args(command: list[str]) -> list[dict]:
    return [json.loads(command[i + 1]) for i, a in enumerate(command) if a == "--l2-adapter"]


def test_each_configuration_selects_its_l2_adapter_on_the_same_server() -> None:
    assert l2_adapters("lmcache", None) == []
    [resp] = l2_adapters("lmcache-resp", URL)
    assert (resp["type"], resp["host"], resp["port"]) == ("resp", "127.0.0.1", 6399)
    [plugin] = l2_adapters("lmcache-range", URL)
    assert (plugin["type"], plugin["module_path"], plugin["class_name"]) == (
        "plugin", "range_connector.lmcache.adapter", "RangeL2Adapter")
    config = RangeL2Config.from_params(plugin["adapter_params"])  # (what the adapter checks at the server's start)
    assert (config.type, config.servers, config.num_shards) == ("valkey", (URL,), 1)


def test_bad_configurations_are_refused() -> None:
    with pytest.raises(ValueError, match="not an LMCache configuration"):
        l2_adapters("lmcache-disk", URL)
    for config in ("lmcache-resp", "lmcache-range"):
        with pytest.raises(ValueError, match="needs a Valkey server URL"):
            l2_adapters(config, None)
    with pytest.raises(ConfigError, match="adapter_params.servers"):  # (the Range adapter's own check)
        RangeL2Config.from_params({**l2_adapters("lmcache-range", URL)[0]["adapter_params"], "servers": []})


@pytest.mark.parametrize("config", LMCACHE_CONFIGS)
def test_mp_server_command_and_connector_config(config: str, tmp_path: Path) -> None:
    server = lmcache_server(config, fake_venv(tmp_path), tmp_path, URL if config != "lmcache" else None, 0.375)
    cmd = server.command()
    assert cmd[1:3] == ["-m", "lmcache.v1.multiprocess.server"]
    l1 = float(cmd[cmd.index("--l1-size-gb") + 1])
    assert l1 == (1.0 if config == "lmcache" else 0.375)  # a small L1 where an L2 serves most hits
    assert l2_args(cmd) == l2_adapters(config, URL if config != "lmcache" else None)
    assert str(server.port) == cmd[cmd.index("--port") + 1]
    assert cmd[cmd.index("--prometheus-port") + 1] != "9090"
    kv = server.kv_transfer_config()
    assert kv["kv_connector"] == "LMCacheMPConnector"
    assert kv["kv_connector_extra_config"]["lmcache.mp.port"] == server.port
    assert kv["kv_connector_extra_config"]["lmcache.mp.mp_transfer_mode"] == "lmcache_driven"
    assert server.engine_pythonpath().endswith("site-packages")


def test_lmcache_server_needs_the_environment(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match="setup_lmcache_env.sh"):
        lmcache_server("lmcache-range", tmp_path / "missing", tmp_path, URL, 0.375)


def test_valkey_counters_count_what_the_server_sent(valkey_servers) -> None:
    url = valkey_servers.urls[0]
    client = valkey.Valkey.from_url(url)
    try:
        client.set("replay-counters-test", b"x" * 100_000)
        before = valkey_counters(url)
        for _ in range(3):
            client.get("replay-counters-test")
        delta = valkey_delta(before, valkey_counters(url))
    finally:
        client.delete("replay-counters-test")
        client.close()
    assert delta["get"] == 3
    assert delta["sent_bytes"] >= 300_000
    assert "set" not in delta
