"""The config tree: ``tiers`` with per-tier ``security`` and ``testing`` tables, the flat one-tier shorthand (still
accepted, with a warning that names the new spelling), contradictory settings refused naming both keys, and the
reference in ``docs/configuration.md`` rendered from the declarations."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from range_connector.config import RangeConfig, TierConfig, TierTesting
from range_connector.config.parse import with_tier_settings
from range_connector.config.reference import render
from range_connector.errors import ConfigError

pytestmark = pytest.mark.timeout(10)

DOC = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"
URL_A = "valkey://127.0.0.1:7001"
URL_B = "valkey://127.0.0.1:7002"


def _error(extra: dict) -> ConfigError:
    with pytest.raises(ConfigError) as exc_info:
        RangeConfig.from_extra_config(extra)
    return exc_info.value


def test_the_reference_matches_the_declarations() -> None:
    assert DOC.read_text() == render(), (
        "docs/configuration.md is out of date: python -m range_connector.config.reference > docs/configuration.md")


def test_a_tree_config_is_parsed_into_its_tables() -> None:
    config = RangeConfig.from_extra_config({
        "chunk_tokens": 512, "load_mode": "async",
        "tiers": [{"type": "valkey", "servers": [URL_A, URL_B], "capacity_bytes": 1 << 30, "timeout_s": 2,
                   "testing": {"delay_s": 0.01, "control_file": "/tmp/t.json"}, "security": {}}]})
    assert config.num_shards == 2 and config.chunk_tokens == 512 and config.load_mode == "async"
    assert config.tier == TierConfig("valkey", servers=(URL_A, URL_B), capacity_bytes=1 << 30, timeout_s=2.0,
                                     testing=TierTesting(delay_s=0.01, control_file="/tmp/t.json"))
    assert not config.tier.shorthand and config.tier.key_name("servers") == "tiers[0].servers"


def test_the_flat_shorthand_gives_the_same_tree_and_warns_with_the_new_spelling(
        caplog: pytest.LogCaptureFixture) -> None:
    flat = {"backend": "file", "file_dir": "/data/kv", "shard_capacity_bytes": 4096, "backend_timeout_s": 3.0,
            "tier_delay_s": 0.5, "chunk_tokens": 256}
    with caplog.at_level(logging.WARNING), pytest.warns(DeprecationWarning):
        old = RangeConfig.from_extra_config(flat)
    message = next(r.getMessage() for r in caplog.records if "deprecated" in r.getMessage())
    for name, path in (("backend", "type"), ("file_dir", "directory"), ("shard_capacity_bytes", "capacity_bytes"),
                       ("backend_timeout_s", "timeout_s"), ("tier_delay_s", "testing.delay_s")):
        assert f"{name} -> tiers[0].{path}" in message
    spelled = json.loads(message.split(" write ", 1)[1].split(" instead ", 1)[0])
    new = RangeConfig.from_extra_config({"chunk_tokens": 256, **spelled})
    assert new == old and old.tier.directory == "/data/kv" and old.tier.budget_bytes == 4096
    assert old.tier.shorthand and old.tier.key_name("directory") == "file_dir"


def test_no_flat_key_no_warning(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        RangeConfig.from_extra_config({"chunk_tokens": 256, "tiers": [{"type": "memory"}]})
        RangeConfig.from_extra_config({"load_mode": "auto"})
    assert not [r for r in caplog.records if "deprecated" in r.getMessage()]


def test_a_string_of_valkey_urls_is_taken_as_one_url_with_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        config = RangeConfig.from_extra_config({"valkey_urls": URL_A})
    assert config.tier.servers == (URL_A,)
    assert any("valkey_urls is a string" in r.getMessage() and f'["{URL_A}"]' in r.getMessage()
               for r in caplog.records)
    error = _error({"tiers": [{"servers": URL_A}]})  # the new spelling takes no such shortcut
    assert error.key == "tiers[0].servers" and "not a list" in str(error)


@pytest.mark.parametrize(("extra", "key", "other"), [
    ({"min_load_deadline_s": 5.0, "load_deadline_s": 2.0}, "min_load_deadline_s", "load_deadline_s"),
    ({"min_load_deadline_s": 31.0}, "min_load_deadline_s", "load_deadline_s = 30.0"),
    ({"backend": "memory", "valkey_urls": [URL_A]}, "valkey_urls", "backend is 'memory'"),
    ({"backend": "valkey", "file_dir": "/tmp/x"}, "file_dir", "backend is 'valkey'"),
    ({"tiers": [{"type": "memory", "servers": [URL_A]}]}, "tiers[0].servers", "tiers[0].type is 'memory'"),
    ({"tiers": [{"type": "valkey", "directory": "/x"}]}, "tiers[0].directory", "tiers[0].type is 'valkey'"),
    ({"tiers": [{"servers": [URL_A, URL_B]}], "num_shards": 3}, "num_shards", "tiers[0].servers"),
    ({"valkey_urls": [URL_A, URL_B], "num_shards": 3}, "num_shards", "valkey_urls"),
    ({"tiers": [{"type": "memory"}], "backend": "memory"}, "backend", "`tiers` is set too"),
])
def test_contradictory_settings_are_refused_naming_both_keys(extra: dict, key: str, other: str) -> None:
    error = _error(extra)
    assert error.key == key and str(error).startswith(f"{key}: ") and other in str(error), str(error)


@pytest.mark.parametrize(("extra", "key"), [
    ({"tiers": []}, "tiers"),
    ({"tiers": {"type": "memory"}}, "tiers"),
    ({"tiers": [{"type": "memory"}, {"type": "file"}, {"type": "valkey"}, {"type": "file"}]}, "tiers"),
    ({"tiers": [{"type": "file"}, {"type": "memory"}]}, "tiers[1].type"),
    ({"tiers": [{"type": "memory"}, {"type": "file"}, {"type": "file"}]}, "tiers[2].type"),
    ({"tiers": [{"type": "memory"}, {"type": "valkey", "timeout_s": 0}]}, "tiers[1].timeout_s"),
    ({"tiers": [{"type": "memory"}, {"type": "file", "servers": [URL_A]}]}, "tiers[1].servers"),
    ({"tiers": [{"type": "memory"}, {"servers": [URL_A]}], "num_shards": 2}, "num_shards"),
    ({"tiers": ["memory"]}, "tiers[0]"),
    ({"tiers": [{"type": "redis"}]}, "tiers[0].type"),
    ({"tiers": [{"kind": "memory"}]}, "tiers[0].kind"),
    ({"tiers": [{"timeout_s": 0}]}, "tiers[0].timeout_s"),
    ({"tiers": [{"capacity_bytes": -1}]}, "tiers[0].capacity_bytes"),
    ({"tiers": [{"testing": {"delay_s": -1}}]}, "tiers[0].testing.delay_s"),
    ({"tiers": [{"testing": {"speed": 1}}]}, "tiers[0].testing.speed"),
    ({"tiers": [{"testing": 5}]}, "tiers[0].testing"),
    ({"tiers": [{"security": {"password": "x"}}]}, "tiers[0].security.password"),
])
def test_bad_tree_values_name_their_path(extra: dict, key: str) -> None:
    assert _error(extra).key == key


def test_a_hierarchy_keeps_each_tiers_settings_and_names_its_keys_by_place() -> None:
    config = RangeConfig.from_extra_config({"tiers": [
        {"type": "memory", "capacity_bytes": 1 << 20}, {"type": "valkey", "servers": [URL_A, URL_B], "timeout_s": 2},
        {"type": "file", "directory": "/nvme/range"}]})
    assert [t.type for t in config.tiers] == ["memory", "valkey", "file"] and config.has_memory_tier
    assert config.num_shards == 2  # (the shard count is the stored layout's: the valkey tier's servers)
    assert config.for_tier(1).tier.timeout_s == 2 and config.for_tier(1).tier.key_name("servers") == "tiers[1].servers"
    assert config.for_tier(2).tier.directory == "/nvme/range" and config.tiers[0].capacity_bytes == 1 << 20
    unset = {"tiers": [{"type": "memory"}, {"type": "valkey", "servers": [URL_A],
                                             "security": {"password_env": "RANGE_TEST_UNSET_VARIABLE"}}]}
    assert _error(unset).key == "tiers[1].security.password_env"


def test_with_tier_settings_keeps_the_users_spelling() -> None:
    tree = with_tier_settings({"tiers": [{"type": "valkey", "timeout_s": 2}]}, servers=(URL_A,))
    assert tree == {"tiers": [{"type": "valkey", "timeout_s": 2, "servers": [URL_A]}]}
    assert with_tier_settings({"load_mode": "auto"}, type="valkey", servers=[URL_A]) == {
        "load_mode": "auto", "tiers": [{"type": "valkey", "servers": [URL_A]}]}
    flat = with_tier_settings({"tier_delay_s": 0.1}, type="valkey", servers=[URL_A])
    assert flat == {"tier_delay_s": 0.1, "backend": "valkey", "valkey_urls": [URL_A]}
    for extra in (tree, flat):
        assert RangeConfig.from_extra_config(extra).tier.servers == (URL_A,)
