"""Clients of a runtime dir's embedded Valkey servers for tests, benches and the demo, authenticated with the
runtime dir's password (the servers refuse clients without it).

:func:`embedded_client` opens a valkey-py client on one shard's server; :func:`embedded_urls` is
:func:`range_connector.backends.valkey.servers.embedded_urls`: the recorded servers' URLs with the password. Neither
starts a server (``ensure_servers`` does); show a URL only through
:func:`range_connector.backends.valkey.urls.redact_url`.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from range_connector.backends.valkey.servers import embedded_urls

if TYPE_CHECKING:
    import valkey

__all__ = ["embedded_client", "embedded_urls"]


def embedded_client(runtime_dir: str | Path, shard_idx: int = 0, *, timeout_s: float = 5.0) -> valkey.Valkey:
    """A valkey-py client of shard ``shard_idx``'s server in ``runtime_dir``, authenticated; the caller closes it.

    Args:
        runtime_dir: the runtime dir the servers were started in.
        shard_idx: ``0 <= shard_idx < num_shards`` of the recorded set.
        timeout_s: socket and connect timeout of the client, seconds.

    Raises:
        IndexError: no server is recorded for ``shard_idx``.
        BackendError: the record or the password file is unreadable.
    """
    import valkey

    urls = embedded_urls(Path(runtime_dir))
    if not 0 <= shard_idx < len(urls):
        raise IndexError(f"no embedded server recorded for shard {shard_idx} in {runtime_dir} ({len(urls)} recorded)")
    return valkey.Valkey.from_url(urls[shard_idx], socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
