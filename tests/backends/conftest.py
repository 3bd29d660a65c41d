"""Fixtures of the backend tests: ``store``, the one parameter of the conformance suite (every backend).

The suite's classes (``test_conformance_*.py``) take ``store`` and so run once per backend; the backends themselves
are built by the :class:`tests.backends.conformance.Store` it yields. Valkey servers come from the fixtures of
``tests/conftest.py``, except the password-protected one of ``valkey-auth-db1`` (:func:`auth_valkey_url`).
"""

from __future__ import annotations

from collections.abc import Iterator
from urllib.parse import urlsplit

import pytest
import valkey

from tests.backends.conformance import (
    FileStore,
    LatencyStore,
    MemoryStore,
    Store,
    ValkeyStore,
)

AUTH_PASSWORD = "conformance-Pa55word"


@pytest.fixture(scope="session")
def auth_valkey_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """``valkey://:<password>@127.0.0.1:<port>``: one embedded server of the session that requires a password."""
    from range_connector.backends.valkey.servers import (
        ensure_servers,
        stop_servers,
        valkey_server_binary,
    )
    from range_connector.errors import ServerStartError

    try:
        valkey_server_binary()
    except ServerStartError as exc:  # pragma: no cover - depends on the environment
        pytest.skip(f"no valkey-server binary: {exc}")
    runtime_dir = tmp_path_factory.mktemp("valkey-auth")
    try:
        [url] = ensure_servers(1, runtime_dir)
        admin = valkey.Valkey.from_url(url, socket_timeout=5.0)
        try:
            admin.config_set("requirepass", AUTH_PASSWORD)
        finally:
            admin.close()
        parts = urlsplit(url)
        yield f"valkey://:{AUTH_PASSWORD}@{parts.hostname}:{parts.port}"
    finally:
        stop_servers(runtime_dir, timeout_s=2.0)


@pytest.fixture(params=["memory", "latency", "file", "valkey", "valkey-auth-db1"])
def store(request: pytest.FixtureRequest, tmp_path) -> Iterator[Store]:
    if request.param == "memory":
        yield MemoryStore()
        return
    if request.param == "latency":
        yield LatencyStore()
        return
    if request.param == "file":
        s = FileStore(tmp_path)
        try:
            yield s
        finally:
            s.close()
        return
    if request.param == "valkey-auth-db1":  # AUTH and SELECT 1 on every connection of both clients
        s = ValkeyStore(request.getfixturevalue("auth_valkey_url"), request, db=1)
    else:
        s = ValkeyStore(request.getfixturevalue("valkey_servers").urls[0], request)
    s._admin.flushdb()
    try:
        yield s
    finally:
        s.close()
