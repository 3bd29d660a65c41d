"""Embedded Valkey sizes in the config: ``tiers[i].embedded_maxmemory_bytes`` (per shard server), the default byte
budget just under it, and a budget above the limit refused naming both keys. No server: the check against running
servers' limits is in ``tests/backends/test_valkey_servers_closed.py``."""

from __future__ import annotations

import pytest

from range_connector.config import RangeConfig
from range_connector.config.keys import embedded_budget_bytes
from range_connector.errors import ConfigError

MiB = 1 << 20


def _tier(**keys):
    return RangeConfig.from_extra_config({"tiers": [{"type": "valkey", **keys}]}).tier


@pytest.mark.timeout(10)
def test_budget_defaults_to_the_limit_less_a_sixteenth_or_16_mib() -> None:
    assert embedded_budget_bytes(1 << 30) == (1 << 30) - 64 * MiB == 1006632960
    assert embedded_budget_bytes(64 * MiB) == 48 * MiB  # the 16 MiB floor
    assert _tier().budget_bytes == 1006632960  # embedded, nothing set: 1 GiB servers
    assert _tier(embedded_maxmemory_bytes=256 * MiB).budget_bytes == 240 * MiB
    assert _tier(capacity_bytes=100 * MiB).budget_bytes == 100 * MiB
    assert _tier(capacity_bytes=0).budget_bytes == 0  # explicitly none
    # Configured servers keep the old default (no budget): their limit is not ours to know.
    assert _tier(servers=["valkey://10.0.0.1:6379"]).budget_bytes == 0


@pytest.mark.timeout(10)
def test_budget_above_the_embedded_limit_names_both_keys() -> None:
    with pytest.raises(ConfigError, match=r"^tiers\[0\]\.capacity_bytes: 134217728 is above .*"
                                          r"tiers\[0\]\.embedded_maxmemory_bytes = 67108864"):
        _tier(capacity_bytes=128 * MiB, embedded_maxmemory_bytes=64 * MiB)
    assert _tier(capacity_bytes=64 * MiB, embedded_maxmemory_bytes=64 * MiB).budget_bytes == 64 * MiB


@pytest.mark.timeout(10)
@pytest.mark.parametrize("value", [0, -1, 1.5, True, 16 * MiB])
def test_bad_embedded_limit_is_refused_by_name(value) -> None:
    with pytest.raises(ConfigError, match=r"^tiers\[0\]\.embedded_maxmemory_bytes: "):
        _tier(embedded_maxmemory_bytes=value)


@pytest.mark.timeout(10)
def test_embedded_limit_is_for_valkey_tiers_only() -> None:
    with pytest.raises(ConfigError, match=r"^tiers\[0\]\.embedded_maxmemory_bytes: is for valkey tiers"):
        RangeConfig.from_extra_config({"tiers": [{"type": "file", "embedded_maxmemory_bytes": 64 * MiB}]})
