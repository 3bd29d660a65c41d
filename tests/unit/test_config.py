"""RangeConfig: parsing ``kv_connector_extra_config`` (unknown keys and bad values are ConfigErrors naming the key)
and resolving the chunk size against the engine block size."""

from __future__ import annotations

import dataclasses
import math

import pytest

from range_connector.config import RangeConfig, TierConfig, TierTesting
from range_connector.config.keys import ENGINE_KEYS, TESTING_KEYS, TIER_KEYS
from range_connector.errors import ConfigError

pytestmark = pytest.mark.timeout(10)

URL_A = "valkey://127.0.0.1:7001"
URL_B = "valkey://127.0.0.1:7002"


def _raises_naming(key: str, extra: dict) -> ConfigError:
    with pytest.raises(ConfigError) as exc_info:
        RangeConfig.from_extra_config(extra)
    assert str(exc_info.value).startswith(f"{key}: "), str(exc_info.value)
    assert exc_info.value.key == key
    assert isinstance(exc_info.value, ValueError)
    return exc_info.value


# ---------------------------------------------------------------------- defaults
@pytest.mark.parametrize("extra", [None, {}])
def test_defaults(extra: dict | None) -> None:
    config = RangeConfig.from_extra_config(extra)

    assert config == RangeConfig()
    assert config.tier == TierConfig() and len(config.tiers) == 1
    assert config.tier.type == "valkey"
    assert config.tier.servers == ()
    assert config.num_shards == 1
    assert config.chunk_tokens is None
    assert config.runtime_dir is None
    assert config.tier.timeout_s == 5.0
    assert config.load_deadline_s == 30.0
    assert config.tier.start_timeout_s == 10.0
    assert config.verify_checksums is True
    assert TierConfig("memory").budget_bytes == 1 << 30
    assert config.tier.budget_bytes == (1 << 30) - (64 << 20)  # embedded servers: just under their 1 GiB limit
    assert config.namespace_salt == ""


def test_every_documented_key_is_a_field() -> None:
    assert {k.name for k in ENGINE_KEYS} == {f.name for f in dataclasses.fields(RangeConfig)}
    assert {k.name for k in TIER_KEYS} == {f.name for f in dataclasses.fields(TierConfig)} - {"shorthand", "index"}
    assert {k.name for k in TESTING_KEYS} == {f.name for f in dataclasses.fields(TierTesting)}


def test_good_values_are_kept() -> None:
    config = RangeConfig.from_extra_config(
        {
            "backend": "memory",
            "num_shards": 4,
            "chunk_tokens": 512,
            "runtime_dir": "/tmp/rc",
            "backend_timeout_s": 1,  # an int is a fine number of seconds
            "load_deadline_s": 2.5,
            "start_timeout_s": 0.25,
            "verify_checksums": False,
            "memory_capacity_bytes": 0,
            "namespace_salt": "rev-abc",
            "tier_delay_s": 0,
            "tier_bandwidth_bytes_per_s": 10**9,
            "tier_control_file": "/tmp/rc/tier.json",
        }
    )

    tier = config.tier
    assert tier.type == "memory" and config.num_shards == 4 and config.chunk_tokens == 512
    assert tier.timeout_s == 1.0 and isinstance(tier.timeout_s, float)
    assert config.load_deadline_s == 2.5 and tier.start_timeout_s == 10.0  # (for embedded valkey servers only)
    assert config.verify_checksums is False and tier.capacity_bytes == 0 and tier.budget_bytes == 0
    assert config.runtime_dir == "/tmp/rc" and config.namespace_salt == "rev-abc"
    assert tier.testing.delay_s == 0.0 and tier.testing.bandwidth_bytes_per_s == 1e9
    assert tier.testing.control_file == "/tmp/rc/tier.json" and tier.testing.slows_tier
    assert not RangeConfig.from_extra_config({"tier_delay_s": 0.0}).tier.testing.slows_tier
    assert RangeConfig.from_extra_config({"tier_delay_s": 0.01}).tier.testing.slows_tier


def test_valkey_urls_set_the_shard_count() -> None:
    assert RangeConfig.from_extra_config({"valkey_urls": [URL_A, URL_B]}).num_shards == 2
    assert RangeConfig.from_extra_config({"valkey_urls": [URL_A, URL_B], "num_shards": 2}).num_shards == 2
    single = RangeConfig.from_extra_config({"valkey_urls": URL_A})  # a string: one URL, with a warning
    assert single.tier.servers == (URL_A,) and single.num_shards == 1


# ---------------------------------------------------------------------- unknown keys
@pytest.mark.parametrize(
    "key", ["chunk_size", "backend_timeout", "Backend", "num_shard", "valkey_url", "capacity_bytes", ""]
)
def test_unknown_key_is_an_error_naming_it(key: str) -> None:
    error = _raises_naming(key, {key: 1})
    assert "unknown key" in str(error)


def test_unknown_key_is_reported_even_next_to_good_keys() -> None:
    _raises_naming("chunk_size", {"backend": "memory", "chunk_size": 256})


# ---------------------------------------------------------------------- bad values
BAD_VALUES = [
    ("backend", "redis"),
    ("backend", "Valkey"),
    ("backend", ""),
    ("backend", None),
    ("backend", 1),
    ("valkey_urls", ["localhost:6379"]),
    ("valkey_urls", ["http://127.0.0.1:6379"]),
    ("valkey_urls", "not a url"),
    ("valkey_urls", [URL_A, 7002]),
    ("valkey_urls", [None]),
    ("valkey_urls", {"shard0": URL_A}),
    ("valkey_urls", 6379),
    ("num_shards", 0),
    ("num_shards", -1),
    ("num_shards", True),
    ("num_shards", "2"),
    ("num_shards", 2.0),
    ("num_shards", None),
    ("chunk_tokens", 0),
    ("chunk_tokens", -256),
    ("chunk_tokens", False),
    ("chunk_tokens", "256"),
    ("chunk_tokens", 256.5),
    ("memory_capacity_bytes", -1),
    ("memory_capacity_bytes", True),
    ("memory_capacity_bytes", "1GiB"),
    ("memory_capacity_bytes", 1.5e9),
    ("verify_checksums", "true"),
    ("verify_checksums", 1),
    ("verify_checksums", None),
    ("runtime_dir", 1),
    ("runtime_dir", ["/tmp"]),
    ("namespace_salt", None),
    ("namespace_salt", 3),
    ("tier_control_file", 1),
    ("tier_control_file", None),
] + [
    (key, value)
    for key in ("tier_delay_s", "tier_bandwidth_bytes_per_s")
    for value in (-1, -0.5, math.nan, math.inf, "5", True, None, [5])
] + [
    (key, value)
    for key in ("backend_timeout_s", "load_deadline_s", "start_timeout_s")
    for value in (0, 0.0, -1, -0.5, math.nan, math.inf, -math.inf, "5", True, None, [5])
]


@pytest.mark.parametrize(("key", "value"), BAD_VALUES, ids=[f"{k}={v!r}" for k, v in BAD_VALUES])
def test_bad_value_is_an_error_naming_the_key(key: str, value: object) -> None:
    _raises_naming(key, {key: value})


def test_num_shards_not_matching_valkey_urls_is_an_error() -> None:
    error = _raises_naming("num_shards", {"valkey_urls": [URL_A, URL_B], "num_shards": 3})
    assert "3" in str(error) and "2" in str(error)


@pytest.mark.parametrize("url", ["valkey://127.0.0.1:notaport", "valkey://127.0.0.1:99999"])
def test_valkey_url_with_a_bad_port_is_an_error(url: str) -> None:
    _raises_naming("valkey_urls", {"valkey_urls": [url]})


# ---------------------------------------------------------------------- resolve
@pytest.mark.parametrize(
    ("block_size", "num_shards", "expected_chunk_tokens"),
    [
        (128, 1, 256),
        (128, 2, 256),
        (128, 4, 512),
        (32, 1, 256),
        (16, 1, 256),
        (16, 8, 256),
        (48, 1, 288),  # 256 rounded up to a multiple of 48
        (512, 1, 512),
        (1, 1, 256),
    ],
)
def test_resolve_default_chunk_tokens(block_size: int, num_shards: int, expected_chunk_tokens: int) -> None:
    config = RangeConfig.from_extra_config({"num_shards": num_shards}).resolve(block_size)

    assert config.chunk_tokens == expected_chunk_tokens
    assert config.chunk_tokens % (block_size * num_shards) == 0
    assert config.resolve(block_size) == config  # idempotent


def test_resolve_keeps_a_valid_explicit_chunk() -> None:
    config = RangeConfig.from_extra_config({"chunk_tokens": 1024, "num_shards": 2})

    assert config.resolve(128).chunk_tokens == 1024
    assert config.chunk_tokens == 1024


def test_resolve_does_not_modify_the_original() -> None:
    config = RangeConfig.from_extra_config({})
    resolved = config.resolve(128)

    assert config.chunk_tokens is None
    assert resolved is not config and resolved.chunk_tokens == 256


@pytest.mark.parametrize(("chunk_tokens", "block_size"), [(100, 128), (256, 96), (200, 16), (130, 128)])
def test_resolve_chunk_not_a_multiple_of_block_size(chunk_tokens: int, block_size: int) -> None:
    config = RangeConfig.from_extra_config({"chunk_tokens": chunk_tokens})

    with pytest.raises(ConfigError) as exc_info:
        config.resolve(block_size)

    message = str(exc_info.value)
    assert message.startswith("chunk_tokens: ")
    assert str(chunk_tokens) in message and str(block_size) in message


@pytest.mark.parametrize(
    ("chunk_tokens", "block_size", "num_shards"), [(256, 128, 4), (384, 128, 2), (64, 16, 3), (128, 32, 8)]
)
def test_resolve_chunk_not_a_multiple_of_block_times_shards(
    chunk_tokens: int, block_size: int, num_shards: int
) -> None:
    config = RangeConfig.from_extra_config({"chunk_tokens": chunk_tokens, "num_shards": num_shards})

    with pytest.raises(ConfigError) as exc_info:
        config.resolve(block_size)

    message = str(exc_info.value)
    assert message.startswith("chunk_tokens: ")
    assert str(chunk_tokens) in message and str(num_shards) in message


# ---------------------------------------------------------------------- frozen
def test_config_is_frozen() -> None:
    config = RangeConfig.from_extra_config({})

    with pytest.raises(dataclasses.FrozenInstanceError):
        config.chunk_tokens = 512  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.tier.type = "memory"  # type: ignore[misc]
    with pytest.raises((AttributeError, TypeError)):
        config.extra_field = 1  # type: ignore[attr-defined]
    assert config.chunk_tokens is None and config.tier.type == "valkey"


def test_config_is_hashable_and_comparable() -> None:
    a = RangeConfig.from_extra_config({"backend": "memory"})
    b = RangeConfig.from_extra_config({"backend": "memory"})

    assert a == b and hash(a) == hash(b)
