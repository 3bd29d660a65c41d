"""Valkey URLs as users write them, and as messages and logs may show them (credentials removed).

A ``valkey_urls`` entry or ``tiers[i].servers`` item may carry a user and a password
(``valkey://user:secret@host:6379/0``). Every message, log line and exception that names a server goes through
:func:`redact_url`, so a password never reaches a log file or a client's error body.
"""

from __future__ import annotations

from urllib.parse import urlsplit, urlunsplit

#: what replaces a password (and a user name's password part) in a shown URL
REDACTED = "***"


def redact_url(url: str) -> str:
    """The URL with its password (and any query value named ``password``) replaced by ``***``.

    Args:
        url: any string; what is not a URL with credentials comes back unchanged.

    Returns:
        ``valkey://user:***@host:port/db`` for ``valkey://user:secret@host:port/db``; ``valkey://***@host`` when
        only a password-like user part is given (``valkey://secret@host``: valkey-py reads that as a password).
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
