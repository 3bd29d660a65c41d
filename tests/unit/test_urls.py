"""Credentials never survive :func:`redact_url`; URLs without credentials come back unchanged."""

import pytest

from range_connector.backends.valkey.urls import redact_url


@pytest.mark.parametrize(("url", "shown"), [
    ("valkey://127.0.0.1:6379", "valkey://127.0.0.1:6379"),
    ("valkey://user:s3cret@host:1/2", "valkey://user:***@host:1/2"),
    ("valkey://:s3cret@host:1", "valkey://***@host:1"),
    ("valkey://s3cret@host", "valkey://***@host"),
    ("valkeys://user:s3cret@host:9", "valkeys://user:***@host:9"),
    ("unix:///run/v.sock?db=1&password=s3cret", "unix:///run/v.sock?db=1&password=***"),
    ("unix:///run/v.sock", "unix:///run/v.sock"),
])
def test_redact_url(url: str, shown: str) -> None:
    assert redact_url(url) == shown
    assert "s3cret" not in redact_url(url)
