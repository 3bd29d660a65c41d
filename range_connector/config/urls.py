"""Valkey server URLs: parsed once (:func:`parse_server_url`) for the config check and for both clients, and shown
with their credentials removed (:func:`redact_url`).

A ``tiers[i].servers`` entry (or ``valkey_urls`` item) is one of::

    valkey://[user[:password]@]host[:port][/db]      plain TCP (redis:// is the same)
    valkeys://[user[:password]@]host[:port][/db]     TLS (rediss:// is the same)
    unix://[user[:password]@]/path/to.sock[?db=n]    a unix socket

with ``db``, ``username`` and ``password`` also accepted as query parameters (as valkey-py reads them). Every
message, log line and exception that names a server goes through :func:`redact_url`, so a password never reaches a
log file or a client's error body. Pure: no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from urllib.parse import parse_qsl, unquote, urlsplit, urlunsplit

#: what replaces a password (and a user name's password part) in a shown URL
REDACTED = "***"
#: URL schemes of TCP servers, plain and TLS
TCP_SCHEMES = ("valkey", "redis")
TLS_SCHEMES = ("valkeys", "rediss")
UNIX_SCHEME = "unix"
DEFAULT_PORT = 6379
_QUERY_KEYS = ("db", "username", "password")


@dataclass(frozen=True, slots=True)
class ServerUrl:
    """One parsed server URL.

    Attributes:
        shown: the URL as messages show it (credentials redacted).
        host: TCP host name or address (``""`` for a unix socket).
        port: TCP port (``0`` for a unix socket).
        unix_path: the socket's path, or ``None`` for TCP.
        db: database index selected on connect (0: the default).
        username: ACL user, or ``None`` (the server's default user).
        password: the password from the URL, or ``None`` (never shown: not in ``repr``).
        tls: whether the connection is TLS (``valkeys://``, ``rediss://``).
    """

    shown: str
    host: str
    port: int
    unix_path: str | None
    db: int
    username: str | None
    password: str | None = field(repr=False)
    tls: bool


def parse_server_url(url: str) -> ServerUrl:
    """Parse a server URL (module docstring for the forms).

    Raises:
        ValueError: not such a URL; the message shows the URL redacted, never its password.
    """
    shown = redact_url(url)

    def bad(why: str) -> ValueError:
        return ValueError(f"{shown!r} is not a valkey://, valkeys:// or unix:// server URL: {why}")

    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as exc:
        raise bad(str(exc)) from None
    scheme = parts.scheme.lower()
    if scheme not in (*TCP_SCHEMES, *TLS_SCHEMES, UNIX_SCHEME):
        raise bad(f"unknown scheme {parts.scheme!r}")
    query: dict[str, str] = {}
    for name, value in parse_qsl(parts.query, keep_blank_values=True):
        if name not in _QUERY_KEYS:
            raise bad(f"unknown parameter {name!r} (Range reads only {', '.join(_QUERY_KEYS)})")
        if name in query:
            raise bad(f"parameter {name!r} given twice")
        query[name] = value
    if parts.fragment:
        raise bad("a fragment (#...) is not part of a server URL")
    username = unquote(parts.username) if parts.username else query.get("username") or None
    password = unquote(parts.password) if parts.password else query.get("password") or None
    db_text = query.get("db")
    if scheme == UNIX_SCHEME:
        if parts.hostname or port is not None:
            raise bad("a unix socket URL has no host or port: unix:///path/to.sock")
        if not parts.path or parts.path == "/":
            raise bad("no socket path")
        host, port, unix_path = "", 0, unquote(parts.path)
    else:
        if not parts.hostname:
            raise bad("no host")
        if port is not None and not 0 < port < 65536:
            raise bad(f"port {port} is out of range")
        path = parts.path.strip("/")
        if path and db_text is not None:
            raise bad("the database is given twice (path and ?db=)")
        db_text = path or db_text
        host, port, unix_path = parts.hostname, DEFAULT_PORT if port is None else port, None
    try:
        db = 0 if db_text in (None, "") else int(db_text)
    except ValueError:
        raise bad(f"database {db_text!r} is not an integer") from None
    if db < 0:
        raise bad(f"database {db} is negative")
    return ServerUrl(shown, host, port, unix_path, db, username, password, scheme in TLS_SCHEMES)


def redact_url(url: str) -> str:
    """The URL with its password (and any query value named ``password``) replaced by ``***``.

    Args:
        url: any string; what is not a URL with credentials comes back unchanged.

    Returns:
        ``valkey://user:***@host:port/db`` for ``valkey://user:secret@host:port/db``; ``valkey://***@host`` when
        only a user part is given (``valkey://secret@host``: some clients read that as a password).
    """
    try:
        parts = urlsplit(url)
    except ValueError:
        return REDACTED
    netloc = parts.netloc
    if "@" in netloc:
        userinfo, _, hostport = netloc.rpartition("@")
        user, sep, _password = userinfo.partition(":")
        netloc = f"{user}:{REDACTED}@{hostport}" if sep and user else f"{REDACTED}@{hostport}"
    query = parts.query
    if "password=" in query.lower():
        query = "&".join(f"{k}={REDACTED}" if k.lower() == "password" else f"{k}{'=' if s else ''}{v}"
                         for k, s, v in (item.partition("=") for item in query.split("&")))
    shown = urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))
    if not netloc and url.startswith(f"{parts.scheme}://"):  # unix:///path: urlunsplit drops the empty host
        shown = f"{parts.scheme}://{shown[len(parts.scheme) + 1:]}"
    return shown
