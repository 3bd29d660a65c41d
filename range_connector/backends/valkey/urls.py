"""How the Valkey tier reaches a server: its URL (parsed and redacted by :mod:`range_connector.config.urls`, whose
names are re-exported here), plus the credentials and TLS files of ``tiers[i].security`` (:class:`ValkeyAccess`).

A ``valkey_urls`` entry or ``tiers[i].servers`` item may carry a user and a password
(``valkey://user:secret@host:6379/0``). Every message, log line and exception that names a server goes through
:func:`redact_url`, so a password never reaches a log file or a client's error body.

Precedence: a ``username`` or password in :class:`ValkeyAccess` (the config) replaces the URL's; what the config
leaves unset comes from the URL. Both clients of a server (the RESP reader of the bulk path and valkey-py for
scripts and small commands) are built from the same :class:`ServerUrl` and :class:`ValkeyAccess`.
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass, field

from range_connector.config.urls import (
    REDACTED,
    ServerUrl,
    parse_server_url,
    redact_url,
)

__all__ = ["REDACTED", "ServerUrl", "ValkeyAccess", "parse_server_url", "redact_url", "tls_context"]


@dataclass(frozen=True, slots=True)
class ValkeyAccess:
    """Credentials and TLS files for a server, on top of its URL.

    Attributes:
        username: ACL user sent with ``AUTH`` (``None``: the URL's, else the server's default user).
        password: password sent with ``AUTH`` (``None``: the URL's, else none); never in ``repr``.
        tls_ca_file: PEM file of the certificate authorities that sign the server's certificate (``None``: the
            system's); TLS URLs only.
        tls_cert_file: PEM client certificate (``None``: none), for servers that require one.
        tls_key_file: PEM private key of ``tls_cert_file`` (``None``: in ``tls_cert_file`` itself).
    """

    username: str | None = None
    password: str | None = field(default=None, repr=False)
    tls_ca_file: str | None = None
    tls_cert_file: str | None = None
    tls_key_file: str | None = None

    @property
    def has_tls_files(self) -> bool:
        """Whether any TLS file is set (they apply to TLS URLs only)."""
        return bool(self.tls_ca_file or self.tls_cert_file or self.tls_key_file)

    def credentials(self, url: ServerUrl) -> tuple[str | None, str | None]:
        """``(username, password)`` for ``url``: the config's where set, else the URL's."""
        return self.username or url.username, self.password or url.password


def tls_context(access: ValkeyAccess) -> ssl.SSLContext:
    """A client TLS context: the server's certificate is verified (against ``tls_ca_file``, or the system's
    authorities) and must name the host dialled; TLS 1.2 or later; the client certificate loaded when given.

    Raises:
        OSError: a file cannot be read; ``ssl.SSLError``: a file is not a PEM certificate/key, or the key does not
            match the certificate.
    """
    context = ssl.create_default_context(cafile=access.tls_ca_file or None)
    context.check_hostname = True
    context.verify_mode = ssl.CERT_REQUIRED
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    if access.tls_cert_file:
        context.load_cert_chain(access.tls_cert_file, access.tls_key_file or None)
    return context
