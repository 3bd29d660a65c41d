"""The README stays true to the code: the two set-up commands come first and every config key is documented."""

from __future__ import annotations

from pathlib import Path

import pytest

from range_connector.config import CONFIG_KEYS

README = Path(__file__).resolve().parents[2] / "README.md"


@pytest.mark.timeout(10)
def test_readme_opens_with_the_two_commands() -> None:
    text = README.read_text()
    first_block = text.split("```", 2)[1]
    commands = [line.split("#")[0].strip() for line in first_block.strip().splitlines()]
    assert commands == ["make demo", "make test"]


@pytest.mark.timeout(10)
@pytest.mark.parametrize("key", sorted(CONFIG_KEYS))
def test_every_config_key_is_in_the_readme_table(key: str) -> None:
    assert f"| `{key}` |" in README.read_text()
