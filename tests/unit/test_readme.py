"""The README stays true to the code: the two set-up commands come first, and every config key is in the reference
(``docs/configuration.md``, rendered from the declarations: ``tests/unit/test_config_tree.py`` checks it whole)."""

from __future__ import annotations

from pathlib import Path

import pytest

from range_connector.config.keys import ENGINE_KEYS, FLAT_TIER_KEYS, TESTING_KEYS, TIER_KEYS

README = Path(__file__).resolve().parents[2] / "README.md"
REFERENCE = README.parent / "docs" / "configuration.md"
ALL_KEYS = sorted({k.name for k in (*ENGINE_KEYS, *TIER_KEYS, *TESTING_KEYS)} | set(FLAT_TIER_KEYS))


@pytest.mark.timeout(10)
def test_readme_opens_with_the_two_commands() -> None:
    text = README.read_text()
    first_block = text.split("```", 2)[1]
    commands = [line.split("#")[0].strip() for line in first_block.strip().splitlines()]
    assert commands == ["make demo", "make test"]


@pytest.mark.timeout(10)
@pytest.mark.parametrize("key", ALL_KEYS)
def test_every_config_key_is_in_the_reference(key: str) -> None:
    assert f"| `{key}` |" in REFERENCE.read_text()
