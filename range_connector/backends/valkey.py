"""Valkey tier: one server per shard, values read and written whole, batched in pipelines.

Each call is one pipeline (one round trip) with a socket deadline; connection errors and timeouts become
:class:`BackendError` / :class:`BackendTimeoutError` naming the server. The server's own eviction is left off
(``noeviction``): a write refused for memory is a failed save, never a lost entry that lookups still promise.
"""

from __future__ import annotations

from collections.abc import Sequence

import valkey
import valkey.exceptions as vex

from range_connector.backends.base import Backend, Buffer
from range_connector.errors import BackendError, BackendTimeoutError

#: Valkey's default ``proto-max-bulk-len`` (bytes), used when the server does not let us read it.
DEFAULT_MAX_BULK_BYTES = 512 * 1024 * 1024


class ValkeyBackend(Backend):
    """One shard on one Valkey server.

    Args:
        url: ``valkey://host:port[/db]``.
        timeout_s: deadline of every call (socket connect and read timeout), seconds.

    Raises:
        BackendError: the server does not answer at construction (start-up errors name the URL).
    """

    is_shared = True

    def __init__(self, url: str, timeout_s: float = 5.0) -> None:
        self.url = url
        self._client = valkey.Valkey.from_url(
            url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s, health_check_interval=0
        )
        try:
            self._client.ping()
            limits = self._client.config_get("proto-max-bulk-len")
            max_bulk = int(limits.get("proto-max-bulk-len", DEFAULT_MAX_BULK_BYTES))
        except vex.ResponseError:  # CONFIG may be disabled on managed servers
            max_bulk = DEFAULT_MAX_BULK_BYTES
        except (vex.ConnectionError, vex.TimeoutError, OSError) as exc:
            raise BackendError(f"{url}: Valkey server does not answer ({exc})") from exc
        super().__init__(url, max_bulk)

    def _run(self, commands: int, fill) -> list:
        pipe = self._client.pipeline(transaction=False)
        fill(pipe)
        try:
            out = pipe.execute(raise_on_error=True)
        except vex.TimeoutError as exc:
            raise BackendTimeoutError(f"{self.url}: no answer within the deadline ({exc})") from exc
        except (vex.ValkeyError, OSError) as exc:
            raise BackendError(f"{self.url}: {type(exc).__name__}: {exc}") from exc
        self._count(round_trips=1, commands=commands)
        return out

    def lookup_prefix(self, keys: Sequence[bytes]) -> int:
        if not keys:
            return 0
        found = self._run(len(keys), lambda p: [p.exists(k) for k in keys])
        for n, present in enumerate(found):
            if not present:
                return n
        return len(keys)

    def put_many(self, items: Sequence[tuple[bytes, Buffer]]) -> None:
        if not items:
            return
        self._check_sizes(items)
        self._run(len(items), lambda p: [p.set(k, memoryview(v)) for k, v in items])
        self._count(bytes_written=sum(memoryview(v).nbytes for _, v in items))

    def get_many(self, keys: Sequence[bytes]) -> list[bytes | None]:
        if not keys:
            return []
        out = self._run(len(keys), lambda p: [p.get(k) for k in keys])
        self._count(bytes_read=sum(len(v) for v in out if v is not None), allocations=len(keys))
        return out

    def delete_many(self, keys: Sequence[bytes]) -> int:
        if not keys:
            return 0
        return int(self._run(1, lambda p: p.delete(*keys))[0])

    def ping(self) -> None:
        self._run(1, lambda p: p.ping())

    def close(self) -> None:
        self._client.close()
        self._client.connection_pool.disconnect()
