"""Shared pieces of the fault suite: real Valkey servers per test, the oracle, and the baseline checks.

Every fault test drives the real scheduler and worker halves (``tests/unit/scheduler_worker_harness.py``) against
real Valkey servers, injects one fault, and then checks:

* the **oracle** (:func:`assert_oracle`): every block the reader was promised holds exactly the bytes a writer
  saved for it, or it is reported failed (vLLM recomputes it) — never wrong bytes silently;
* the **baseline** (:class:`Baseline`): no lease left on any server, no transfer bank in use, and once the engines
  are closed, as many threads in this process and client connections on each server as before the test.

Key names come from the deployment's own prefix (``deployment_key_prefix``), not from a literal.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import pytest
import valkey

from range_connector.backends.base import deployment_key_prefix
from range_connector.config.keys import DEFAULT_DEPLOYMENT
from range_connector.backends.valkey.client import ValkeyBackend
from tests.unit.scheduler_worker_harness import BLOCK, Engine, StepResult, same_block

#: bound of waits for background threads and connections to wind down (only a leak or a hang reaches it)
SETTLE_S = 10.0


def key_prefix() -> str:
    """The Valkey tier's key prefix (stripes ``<prefix>s:``, leases ``<prefix>l:``, ...)."""
    return deployment_key_prefix(DEFAULT_DEPLOYMENT)


def admin(url: str) -> valkey.Valkey:
    """A plain valkey-py client for the test's own inspection and damage (not counted as Range's)."""
    return valkey.Valkey.from_url(url, socket_timeout=5.0)


def scan_keys(url: str, kind: str) -> list[bytes]:
    """Keys of one kind (``"s"`` stripe values, ``"l"`` leases, ``"t"`` tickets, ...) on a server."""
    with contextlib.closing(admin(url)) as c:
        return sorted(c.scan_iter(match=f"{key_prefix()}{kind}:*", count=1000))


def stripe_value_key(stripe_id: str, layer_idx: int) -> str:
    """The key of one layer value of a stripe."""
    return f"{key_prefix()}s:{stripe_id}:{layer_idx}"


def num_clients(url: str) -> int:
    """Client connections on the server, the inspecting one excluded."""
    with contextlib.closing(admin(url)) as c:
        return len(c.client_list()) - 1


def wait_until(predicate: Callable[[], bool], timeout_s: float = SETTLE_S) -> bool:
    """Poll ``predicate`` until it holds or ``timeout_s`` passed (a hang guard, not a measurement)."""
    end = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > end:
            return False
        time.sleep(0.01)
    return True


@dataclass
class Baseline:
    """Threads of this process and connections per server before the test; :meth:`check` compares after it.

    Attributes:
        urls: the servers to watch (those that are still running at the end are checked).
    """

    urls: list[str]
    threads: int = 0
    clients: dict[str, int] = field(default_factory=dict)

    def record(self) -> None:
        self.threads = threading.active_count()
        self.clients = {url: num_clients(url) for url in self.urls}

    def check_live(self, engines: Sequence[Engine], urls: Sequence[str] | None = None, *,
                   lease_expiry_s: float = 0.0) -> None:
        """While the engines still run: no lease in any scheduler's book, no transfer bank in use, and no lease on
        any server (``lease_expiry_s``: the leases whose release could not reach the server, frozen at the time,
        expire by themselves within that: waited for, bounded)."""
        for e in engines:
            assert e.sched.num_leases == 0
            for w in e.workers:
                assert w.banks.in_use == 0
        for url in self.urls if urls is None else urls:
            assert wait_until(lambda url=url: scan_keys(url, "l") == [], timeout_s=lease_expiry_s + 0.01), (
                f"leases left on {url}: {scan_keys(url, 'l')}")

    def check_closed(self, urls: Sequence[str] | None = None) -> None:
        """After every engine was closed: threads and connections back to what they were."""
        assert wait_until(lambda: threading.active_count() <= self.threads), (
            f"{threading.active_count()} threads, {self.threads} before: "
            f"{sorted(t.name for t in threading.enumerate())}")
        for url in self.urls if urls is None else urls:
            assert wait_until(lambda url=url: num_clients(url) <= self.clients[url]), (
                f"{num_clients(url)} clients on {url}, {self.clients[url]} before")


def assert_oracle(writers: Sequence[tuple[Engine, list[int]]], reader: Engine, req_id: str, ext: int,
                  results: Sequence[StepResult]) -> int:
    """Every block ``reader`` was promised for ``req_id`` (its first ``ext`` tokens) holds, chunk by chunk, the
    bytes one writer saved for it, or was reported failed in one of ``results``.

    Args:
        writers: ``(engine, block ids of the request)`` of each engine that saved the prompt (its blocks keep the
            saved bytes).
        reader: the engine that loaded it.
        ext: external tokens promised.
        results: the reader's steps since the promise.

    Returns:
        How many promised blocks were delivered (not reported failed).
    """
    invalid = set().union(*(r.invalid_block_ids for r in results)) if results else set()
    blocks = reader.running[req_id].block_ids if req_id in reader.running else []
    chunk_blocks = reader.chunk_tokens // BLOCK
    delivered = 0
    for first in range(0, ext // BLOCK, chunk_blocks):
        idxs = range(first, min(first + chunk_blocks, ext // BLOCK))
        live = [i for i in idxs if blocks[i] not in invalid]
        if not live:
            continue
        assert any(all(same_block(w.kv, w_blocks[i], reader.kv, blocks[i]) for i in live) for w, w_blocks in writers), (
            f"blocks {list(live)} of {req_id} hold bytes no writer saved and were not reported failed")
        delivered += len(live)
    return delivered


@pytest.fixture
def servers(valkey_server_sets) -> Callable[[int], list[str]]:
    """``start(n)`` -> URLs of ``n`` fresh Valkey servers for this test (they may be killed, frozen or
    reconfigured)."""
    def start(n: int) -> list[str]:
        return list(valkey_server_sets(n).urls)
    return start


class BackendMaker:
    """``make(urls, **kw)`` -> one ValkeyBackend per URL (``timeout_s`` 2 s unless given); :meth:`close_all`
    closes every one made (an engine of the harness closes wrapped backends' wrappers only)."""

    def __init__(self) -> None:
        self.made: list[ValkeyBackend] = []

    def __call__(self, urls: Sequence[str], **kw) -> list[ValkeyBackend]:
        kw.setdefault("timeout_s", 2.0)
        out = [ValkeyBackend(url, **kw) for url in urls]
        self.made.extend(out)
        return out

    def close_all(self) -> None:
        for b in self.made:
            with contextlib.suppress(Exception):
                b.close()


@pytest.fixture
def backends_for() -> Iterator[BackendMaker]:
    """A :class:`BackendMaker`; whatever the test did not close is closed at teardown."""
    maker = BackendMaker()
    yield maker
    maker.close_all()


@contextlib.contextmanager
def empty_server_on(url: str, workdir) -> Iterator[None]:
    """A fresh, empty valkey-server on the port of ``url`` (a shard restarted after a crash, its data lost), stopped
    (by pid) at exit."""
    import subprocess
    from urllib.parse import urlparse

    from range_connector.backends.valkey.servers import valkey_server_binary

    port = urlparse(url).port
    proc = subprocess.Popen([str(valkey_server_binary()), "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                             "--appendonly", "no", "--dir", str(workdir)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        def up() -> bool:
            try:
                with contextlib.closing(admin(url)) as c:
                    return bool(c.ping())
            except valkey.ValkeyError:
                return False

        assert wait_until(up), f"restarted server on {url} did not answer"
        yield
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=5.0)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5.0)


def run_bounded(fn: Callable[[], object], timeout_s: float = SETTLE_S) -> object:
    """Run ``fn`` on a thread and return its result; fail (instead of hanging the suite) if it outlives
    ``timeout_s`` — a call that should have ended at its own deadline."""
    out: dict[str, object] = {}

    def run() -> None:
        try:
            out["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 (handed to the test)
            out["error"] = exc

    t = threading.Thread(target=run, name="fault-call")
    t.start()
    t.join(timeout_s)
    assert not t.is_alive(), f"call still running after {timeout_s} s: it outlived its deadline"
    if "error" in out:
        raise out["error"]  # type: ignore[misc]
    return out.get("value")
