"""Valkey tier: one server per shard; stripes as one value per layer, tickets as small keys, Range's own LRU.

Keys, all under the deployment's prefix ``rc3:<deployment>:`` (:func:`~range_connector.backends.base.
deployment_key_prefix`): ``s:<stripe>:<layer>`` layer values, ``m:<stripe>`` manifest (bytes, layers, ticket keys,
deployment), ``t:...`` tickets (see tickets.py), ``lru`` (sorted set of stripes by last use, seconds), ``used``
(bytes of stripes), ``w:<stripe>`` write guards, ``l:<stripe>`` lease counters with a time-to-live, ``epoch`` (times
the deployment was cleared). Each deployment thus has its own LRU and byte budget on a shared server, and
:meth:`ValkeyBackend.clear` removes only its keys. Eviction runs inside the server as one Lua script (atomic: a
stripe is either leased and kept, or removed with every ticket that still points at it; the scripts:
:mod:`~range_connector.backends.valkey.scripts`). The server's own eviction stays off (``noeviction``); a write
refused for memory is a skipped save.

A write is three steps: the reservation (registers the stripe and records the reset epoch), the values, and the
commit (one script, in the same round trip as the values) that publishes the tickets only if the stripe is still
registered in that epoch; a clear in between makes the commit remove the values instead.

Each call is one pipeline (or one script) with a deadline for the whole call; connection errors and timeouts become
:class:`BackendError` / :class:`BackendTimeoutError` naming the server. Calls on the RESP path run in the caller's
thread (every socket operation is bounded by the call's deadline); valkey-py calls run on the backend's executor of
:data:`~range_connector.backends.valkey.calls.CALL_WORKERS` threads, and one that passes its deadline shuts down
only the connection it borrowed (:mod:`~range_connector.backends.valkey.calls`).
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Sequence

import msgpack
import valkey.exceptions as vex

from range_connector.backends.base import (
    Backend,
    Buffer,
    RangeRead,
    StripeWrite,
    deployment_key_prefix,
)
from range_connector.backends.valkey.calls import CallRunner, clients_for
from range_connector.backends.valkey.pool import RespPool
from range_connector.backends.valkey.resp import RespReplyTooLargeError
from range_connector.backends.valkey.scripts import (
    CLEAR_LUA,
    CLEARED_LUA,
    COMMIT_LUA,
    FORGET_LUA,
    LEASE_LUA,
    RELEASE_LUA,
    RESERVE_LUA,
)
from range_connector.backends.valkey.urls import (
    ValkeyAccess,
    parse_server_url,
    redact_url,
)
from range_connector.config.keys import DEFAULT_DEPLOYMENT
from range_connector.errors import BackendError, BackendTimeoutError

logger = logging.getLogger("vllm." + __name__)

#: Valkey's default ``proto-max-bulk-len`` (bytes), used when the server does not let us read it.
DEFAULT_MAX_BULK_BYTES = 512 * 1024 * 1024
#: keys one SCAN step of :meth:`ValkeyBackend.clear` asks for (and one script call removes)
CLEAR_BATCH_KEYS = 1000
class ValkeyBackend(Backend):
    """One shard on one Valkey server.

    Args:
        url: ``valkey://[user:password@]host:port[/db]``, ``valkeys://...`` (TLS) or ``unix:///path.sock[?db=n]``
            (:mod:`range_connector.config.urls`).
        timeout_s: deadline of every call, seconds (the whole call, not one socket read).
        capacity_bytes: Range's byte budget for stripes on this server (``None``: none; the server's memory limit
            is then the only bound).
        access: credentials that replace the URL's, and the TLS files (default: the URL's credentials, the
            system's certificate authorities).
        deployment: the deployment whose keys this instance reads and writes (``rc3:<deployment>:...``).

    Attributes:
        url: the server's URL with its credentials redacted (what every message and log line shows).

    Raises:
        BackendError: the URL is unusable, TLS files are given for a URL that is not TLS or cannot be loaded, the
            server does not answer, refuses the credentials or the TLS handshake at construction (the message
            names the redacted URL).
    """

    is_shared = True
    supports_scatter = True

    def __init__(self, url: str, timeout_s: float = 5.0, capacity_bytes: int | None = None, *,
                 access: ValkeyAccess | None = None, deployment: str = DEFAULT_DEPLOYMENT) -> None:
        self.deployment = deployment
        #: the deployment's key prefix (str for the scripts, bytes for the data path)
        self.prefix = deployment_key_prefix(deployment)
        self._p = self.prefix.encode()
        try:
            target = parse_server_url(url)
        except ValueError as exc:
            raise BackendError(f"{redact_url(url)}: not a usable Valkey URL ({exc})") from None
        access = access or ValkeyAccess()
        #: the server as every message names it (credentials redacted)
        self.url = target.shown
        self.timeout_s = timeout_s
        self._calls = CallRunner(self.url, timeout_s)
        self._client, setup = clients_for(target, access, timeout_s)
        try:
            self._client.ping()
            limits = self._client.config_get("proto-max-bulk-len")
            max_bulk = int(limits.get("proto-max-bulk-len", DEFAULT_MAX_BULK_BYTES))
        except vex.ResponseError:  # CONFIG may be disabled on managed servers, or not granted to this ACL user
            max_bulk = DEFAULT_MAX_BULK_BYTES
        except vex.AuthenticationError as exc:
            self._client.close()
            raise BackendError(f"{self.url}: the server refused the credentials ({exc}); set them in the URL or in "
                               "tiers[i].security (username, password_env)") from exc
        except (vex.ConnectionError, vex.TimeoutError, OSError) as exc:
            self._client.close()
            raise BackendError(f"{self.url}: Valkey server does not answer ({exc})") from exc
        except vex.ValkeyError as exc:  # e.g. an HTTP server on that port: the reply is not RESP
            self._client.close()
            raise BackendError(f"{self.url}: not a Valkey server ({type(exc).__name__}: {exc})") from exc
        super().__init__(self.url, max_bulk - 1024, capacity_bytes)
        try:
            policy = self._client.config_get("maxmemory-policy").get("maxmemory-policy", "noeviction")
        except vex.ValkeyError:
            policy = "unknown"
        if policy not in ("noeviction", "unknown"):
            logger.warning("%s: maxmemory-policy is %s; Range manages capacity itself and expects noeviction "
                           "(the server may drop stripes that tickets still promise: those loads then fail and are "
                           "recomputed)", self.url, policy)
        self._reserve = self._client.register_script(RESERVE_LUA)
        self._forget = self._client.register_script(FORGET_LUA)
        self._release = self._client.register_script(RELEASE_LUA)
        self._lease = self._client.register_script(LEASE_LUA)
        self._clear = self._client.register_script(CLEAR_LUA)
        self._cleared = self._client.register_script(CLEARED_LUA)
        # The bulk data path (stripe values, tickets) goes through our own RESP connection, which reads replies
        # straight into the caller's buffers: measured here 3.6-4.1 GiB/s from one loopback server against about
        # 0.5 GiB/s for valkey-py's parser (which allocates a bytes object per reply that must then be copied).
        # Loads into a host-memory KV cache give it the KV rows themselves (ScatterDest): the reply lands in the
        # destination blocks with no bank and no copy (measurements: range_connector/worker/direct_receive.py).
        # Every URL kind takes it (TCP, unix socket, TLS; AUTH and SELECT sent once per connection); valkey-py,
        # with the same credentials and TLS settings, stays for scripts and small commands. One connection is
        # opened now, so that a refused AUTH or TLS handshake on this path fails at start-up too.
        self._resp = RespPool(target.host, target.port, timeout_s, max_connections=2, setup=setup)
        try:
            with self._resp.connection() as conn:
                conn.execute([(b"PING",)])
        except BackendError:
            self._resp.close()
            self._client.close()
            raise
        try:  # (read directly, not through _call: construction is not counted among the tier's round trips)
            self.epoch_hint = int(self._client.mget([f"{self.prefix}epoch"])[0] or 0)
        except (vex.ValkeyError, OSError, ValueError):
            self.epoch_hint = 0

    # ------------------------------------------------------------------ plumbing
    def _call(self, commands: int, fn, deadline: float | None = None):
        """Run ``fn()`` (one valkey-py round trip of ``commands`` commands) on the backend's executor within
        ``timeout_s`` or until ``deadline`` (:meth:`CallRunner.run <range_connector.backends.valkey.calls.
        CallRunner.run>`), and count it.

        Raises:
            BackendTimeoutError: no complete answer by the deadline.
            BackendError: the server refused or lost the call, or the backend is closed.
        """
        out = self._calls.run(fn, deadline)
        self._count(round_trips=1, commands=commands)
        return out

    def _pipeline(self, commands: int, fill, deadline: float | None = None) -> list:
        def run() -> list:
            pipe = self._client.pipeline(transaction=False)
            fill(pipe)
            return pipe.execute(raise_on_error=True)

        return self._call(commands, run, deadline)

    # ------------------------------------------------------------------ protocol
    def _resp_run(self, commands: list, dests: list | None = None, deadline: float | None = None) -> list:
        """One pipeline on the RESP path within ``timeout_s`` or until ``deadline`` (bulk replies into ``dests``)."""
        if deadline is None:
            deadline = time.monotonic() + self.timeout_s
        wait_s = deadline - time.monotonic()
        if wait_s <= 0:
            raise BackendTimeoutError(f"{self.url}: no complete answer within {self.timeout_s:g} s")
        try:
            with self._resp.connection(wait_s=wait_s) as conn:
                if dests is None:
                    out = conn.execute(commands, deadline_s=deadline)
                else:
                    out = conn.execute_into(commands, dests, deadline_s=deadline)
        except RespReplyTooLargeError as exc:
            raise ValueError(f"{self.url}: a stored value is larger than its ticket says ({exc})") from exc
        self._count(round_trips=1, commands=len(commands))
        return out

    def get_tickets(self, keys: Sequence[bytes]) -> list[bytes | None]:
        if not keys:
            return []
        return self._resp_run([(b"MGET", *[self._p + k for k in keys])])[0]

    def write_stripe(self, write: StripeWrite) -> bool:
        self._check_write(write)
        deadline = time.monotonic() + self.timeout_s  # one deadline for the reservation, the data and the commit
        need = write.nbytes
        sid = write.stripe_id
        p = self.prefix
        tickets = [(self._p + k, v) for k, v in write.tickets]
        # Bytes (not bin) for the ticket keys: the eviction script's cmsgpack cannot read msgpack's bin type.
        manifest = msgpack.packb([need, len(write.layer_values), [k for k, _ in tickets], self.deployment],
                                 use_bin_type=False)
        now = repr(time.time()).encode()
        guard_ms = max(1000, int(2000 * self.timeout_s))
        reserve_args = [p, need, -1 if self.capacity_bytes is None else self.capacity_bytes, sid, manifest, now,
                        guard_ms, "" if write.epoch is None else str(write.epoch)]
        # The stripe is registered (manifest, LRU entry, bytes, guard with the reset epoch) before its values are
        # sent: a write that fails half-way leaves a listed stripe that eviction removes, never values that nothing
        # accounts for. With a budget the reservation may refuse, so it is a round trip of its own; without one it
        # cannot, and goes first in the values' round trip.
        commands: list[tuple] = []
        if self.capacity_bytes is not None:
            if not int(self._call(1, lambda: self._reserve(args=reserve_args), deadline)):
                return False
        else:
            commands.append((b"EVAL", RESERVE_LUA.encode(), b"0", *[str(a).encode() if not isinstance(a, bytes)
                                                                   else a for a in reserve_args]))
        views = [_byte_view(v) for v in write.layer_values]
        commands += [(b"SET", f"{p}s:{sid}:{i}".encode(), v) for i, v in enumerate(views)]
        # The tickets are published after the values (a reader that sees a ticket finds its stripe), by the commit
        # script, only if no clear came since the reservation.
        commit_args = [p.encode(), sid.encode(), str(len(views)).encode(), *[x for kv in tickets for x in kv]]
        try:
            commands.append((b"EVAL", COMMIT_LUA.encode(), b"0", *commit_args))
            committed = self._resp_run(commands, deadline=deadline)[-1]
        except BackendTimeoutError:
            raise  # no time left to clean up: the registered stripe ages out (its guard expires by itself)
        except BackendError:
            try:  # best effort, within what is left of the deadline; otherwise eviction removes it later
                self._call(1, lambda: self._forget(args=[p, sid]), deadline)
            except BackendError:
                pass
            raise
        if not int(committed):  # the deployment was cleared since the save was gathered: nothing is stored
            self.refresh_epoch()
            return False
        self._count(bytes_written=need)
        return True

    def read_ranges(self, reads: Sequence[RangeRead]) -> list[bool]:
        if not reads:
            return []
        _check_reads(self.url, reads)
        # A read is a use: refresh the LRU score of the stripes read (XX: a stripe that is gone stays gone).
        touch = [b"ZADD", f"{self.prefix}lru".encode(), b"XX"]
        now = repr(time.time()).encode()
        for sid in dict.fromkeys(r.stripe_id for r in reads):
            touch += [now, sid.encode()]
        commands = []
        for r in reads:
            key = f"{self.prefix}s:{r.stripe_id}:{r.layer_idx}".encode()
            if r.offset == 0 and r.length == r.value_bytes:
                commands.append((b"GET", key))
            else:
                commands.append((b"GETRANGE", key, str(r.offset).encode(), str(r.offset + r.length - 1).encode()))
        lengths = self._resp_run([*commands, tuple(touch)], [*(r.dest for r in reads), None])[:-1]
        out = []
        for r, n in zip(reads, lengths):
            if n <= 0:  # GET of a missing key is nil; GETRANGE of one is ""
                out.append(False)
            elif n != r.length:
                raise ValueError(f"{self.url}: stripe {r.stripe_id} layer {r.layer_idx} returned {n} bytes for "
                                 f"the range [{r.offset}, {r.offset + r.length})")
            else:
                out.append(True)
        self._count(bytes_read=sum(r.length for r, ok in zip(reads, out) if ok))
        return out

    def lease(self, stripe_ids: Sequence[str], ttl_s: float) -> str:
        token = uuid.uuid4().hex
        if not stripe_ids:
            return token
        ttl_ms = max(1, int(ttl_s * 1000))
        keys = [f"{self.prefix}l:{sid}" for sid in stripe_ids]
        args = [token, ttl_ms, f"{self.prefix}lru", time.time(), *stripe_ids]
        self._call(1, lambda: self._lease(keys=keys, args=args))
        return token

    def release(self, stripe_ids: Sequence[str], token: str | None = None) -> None:
        if stripe_ids:
            keys = [f"{self.prefix}l:{sid}" for sid in stripe_ids]
            self._call(1, lambda: self._release(keys=keys, args=[token or ""]))

    def delete_tickets(self, keys: Sequence[bytes]) -> None:
        if keys:
            self._call(1, lambda: self._client.delete(*[self._p + k for k in keys]))

    def drop_stripes(self, stripe_ids: Sequence[str]) -> None:
        if stripe_ids:
            # The eviction script's own drop, once per stripe, in one pipeline (values, manifest, tickets, bytes).
            self._pipeline(len(stripe_ids),
                           lambda p: [self._forget(args=[self.prefix, sid], client=p) for sid in stripe_ids])

    def used_bytes(self) -> int:
        return int(self._call(1, lambda: self._client.get(f"{self.prefix}used")) or 0)

    def refresh_epoch(self) -> None:
        try:
            # (MGET, not GET: GET counts the bulk reads in INFO commandstats, which tests compare with the loads)
            self.epoch_hint = int(self._call(1, lambda: self._client.mget([f"{self.prefix}epoch"]))[0] or 0)
        except (BackendError, ValueError) as exc:
            logger.debug("%s: reset epoch not read: %s", self.url, exc)

    def clear(self) -> None:
        """Remove every key of this deployment (see :meth:`Backend.clear`): first ``epoch`` goes up, so that
        writes reserved before it refuse to commit, then SCAN steps of :data:`CLEAR_BATCH_KEYS` keys, each removed by
        one script call (a stripe with its values, tickets and bytes), each round trip within ``timeout_s``; other
        deployments' keys are never matched (names cannot hold glob characters)."""
        p = self.prefix
        self._call(1, lambda: self._client.incr(f"{p}epoch"))
        cursor = 0
        while True:
            cursor, keys = self._call(1, lambda c=cursor: self._client.scan(c, match=f"{p}*", count=CLEAR_BATCH_KEYS))
            if keys:
                self._call(1, lambda ks=keys: self._clear(keys=ks, args=[p]))
            if int(cursor) == 0:
                break
        left = int(self._call(1, lambda: self._cleared(args=[p])))
        if left:
            logger.info("%s: deployment %s cleared; %d bytes written since are kept", self.url, self.deployment, left)

    def ping(self) -> None:
        self._call(1, self._client.ping)

    def close(self) -> None:
        """Close the connections and stop the executor: calls in flight are given up (their connections shut
        down), later calls raise :class:`BackendError`. Returns once the executor's threads have ended."""
        self._calls.close()
        self._resp.close()
        self._client.close()
        self._client.connection_pool.disconnect()


def _check_reads(name: str, reads: Sequence[RangeRead]) -> None:
    """Reject reads outside the value their ticket describes before any I/O (GETRANGE would clamp them, or count a
    negative offset from the end, and hand back other bytes).

    Raises:
        ValueError: a read is empty, starts before 0, ends past ``value_bytes``, or does not match its ``dest``.
    """
    for r in reads:
        if r.length < 1 or r.offset < 0 or r.offset + r.length > r.value_bytes or r.dest.nbytes != r.length:
            raise ValueError(f"{name}: read [{r.offset}, {r.offset + r.length}) into a {r.dest.nbytes}-byte dest is "
                             f"outside stripe {r.stripe_id} layer {r.layer_idx} of {r.value_bytes} bytes")


def _byte_view(value: Buffer) -> memoryview:
    """A flat byte view of a contiguous buffer (valkey-py takes ``len()`` of a memoryview as its byte length).

    Raises:
        ValueError: the buffer is not contiguous.
    """
    view = memoryview(value)
    if not view.contiguous:
        raise ValueError("Valkey values must be contiguous buffers")
    return view.cast("B") if view.ndim != 1 or view.format != "B" else view
