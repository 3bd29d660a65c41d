"""Valkey tier: one server per shard, values read and written whole, batched in pipelines.

Each call is one pipeline (one round trip) with a socket deadline; connection errors and timeouts become
:class:`BackendError` / :class:`BackendTimeoutError` naming the server. The server's own eviction is left off
(``noeviction``): a write refused for memory is a failed save, never a lost entry that lookups still promise.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from concurrent.futures import Future

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
        self.timeout_s = timeout_s
        try:
            self._client = valkey.Valkey.from_url(
                url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s, health_check_interval=0
            )
        except ValueError as exc:
            raise BackendError(f"{url}: not a usable Valkey URL ({exc})") from exc
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
        """Execute one pipeline within ``timeout_s`` for the whole call.

        The socket timeout bounds each read; a server that trickles its reply byte by byte would pass it, so the
        pipeline runs in a helper thread and the caller stops waiting at the deadline. The connections are then
        dropped (the late reply can never be read by a later call) and the helper thread ends with an error that
        nobody waits for.
        """
        pipe = self._client.pipeline(transaction=False)
        fill(pipe)
        done: Future[list] = Future()

        def execute() -> None:
            try:
                done.set_result(pipe.execute(raise_on_error=True))
            except BaseException as exc:  # handed to the caller through the future
                done.set_exception(exc)

        threading.Thread(target=execute, name="range-valkey-call", daemon=True).start()
        try:
            out = done.result(timeout=self.timeout_s)
        except TimeoutError as exc:
            self._client.connection_pool.disconnect()
            raise BackendTimeoutError(f"{self.url}: no complete answer within {self.timeout_s:g} s") from exc
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
        views = [(k, _byte_view(v)) for k, v in items]
        self._run(len(items), lambda p: [p.set(k, v) for k, v in views])
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


def _byte_view(value: Buffer) -> memoryview:
    """A flat byte view of a contiguous buffer (valkey-py takes ``len()`` of a memoryview as its byte length).

    Raises:
        ValueError: the buffer is not contiguous.
    """
    view = memoryview(value)
    if not view.contiguous:
        raise ValueError("Valkey values must be contiguous buffers")
    return view.cast("B") if view.ndim != 1 or view.format != "B" else view
