"""Fixtures of the backend tests: ``store``, the one parameter of the conformance suite (every backend).

The suite's classes (``test_conformance_*.py``) take ``store`` and so run once per backend; the backends themselves
are built by the :class:`tests.backends.conformance.Store` it yields. Valkey servers come from the fixtures of
``tests/conftest.py``.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.backends.conformance import FileStore, LatencyStore, MemoryStore, Store, ValkeyStore


@pytest.fixture(params=["memory", "latency", "file", "valkey", "valkey-db1"])
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
    url = request.getfixturevalue("valkey_servers").urls[0]
    s = ValkeyStore(url, request, db=1 if request.param == "valkey-db1" else 0)
    s._admin.flushdb()
    try:
        yield s
    finally:
        s.close()
