"""A minimal RESP2 connection for the bulk data path: pipelined requests, replies read straight into caller buffers.

One call is one round trip: the commands are encoded into one list of buffers (large arguments such as SET payloads
by reference, never concatenated) sent with ``sendmsg``; bulk replies are then received with ``recv_into`` directly
into the caller's buffers (only bytes that arrived with the previous reply's tail are copied from the read buffer).
Each call has one absolute ``time.monotonic()`` deadline that bounds every socket operation, so a trickling server
cannot stretch it. A timeout, lost connection, protocol error or too-large reply closes the connection (it is out of
sync); error replies do not: the remaining replies are read, then :class:`RespCommandError` is raised. A connection
is not thread-safe; :class:`~range_connector.backends.valkey.pool.RespPool` lends one per thread.

A bulk reply may also be received into a :class:`~range_connector.backends.base.ScatterDest` (the rows of a KV
cache): ``recvmsg_into`` fills many of its pieces per system call, always without blocking and inside the
destination's gate; waiting for more bytes (``poll``, until a quarter MiB or the rest of the reply is there) happens
outside the gate, so whoever owns the pieces can close the gate at any moment and knows that nothing is written after
it has.

Beyond plain TCP a connection can go over a unix socket or TLS (:class:`RespSetup`), and sends ``AUTH`` and
``SELECT`` once, right after connecting. ``SSLSocket`` has neither ``sendmsg`` nor ``recvmsg_into``: over TLS the
pieces of a request are sent one ``send`` each, and a scattered reply is received one ``recv_into`` per piece (each
returns at most one TLS record, 16 KiB); bytes that the TLS layer already decrypted are not visible to ``poll``, so
``SSLSocket.pending()`` is asked before waiting.
"""

from __future__ import annotations

import math
import select
import socket
import ssl
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from range_connector.backends.base import ScatterDest
from range_connector.errors import BackendError, BackendTimeoutError

Arg = bytes | bytearray | memoryview | str | int

_INLINE_MAX_BYTES = 16 * 1024  # arguments at least this long are sent by reference, not copied into the header
_IOV_MAX = 1024  # Linux limit on buffers per sendmsg call
#: a scattered receive offers ``recvmsg_into`` at most about this many bytes of pieces, and waits (outside the gate)
#: until the socket holds that many (``SO_RCVLOWAT``) or the rest of the reply: each receive then lands a run of bytes
#: that is still in cache when the digest reads it back, with one wake-up per run instead of one per segment that
#: arrived. Measured (512 MiB as 32 GETs of 16 MiB into 64 KiB rows, checksummed, one loopback Valkey server,
#: 21 alternated rounds): median 0.126 s at 256 KiB, 0.133 s at 512 KiB, 0.129 s at 1 MiB, against 0.144 s when
#: each call was offered 8 MiB and woke for whatever had arrived (about 1 MiB a call). In ``bench/granularity.py``
#: (random destination blocks, reader thread beside the consumer) the change was within the noise: Range-Valkey
#: 0.156-0.171 s against 0.160-0.170 s in two alternated pairs of runs; the receive's kernel copy is what is left
#: there. Offering every remaining piece each call also made the Python work per reply grow with its pieces squared.
_SCATTER_RECV_BYTES = 256 * 1024
_READ_BUFFER_BYTES = 1024 * 1024  # many small replies per recv; smaller buffers or header-sized recvs were no faster
_TIMEOUT_SLACK_S = 0.01  # a socket operation may end this much after the deadline


class RespCommandError(BackendError):
    """The server answered one or more commands of a call with an error reply; the connection stays usable.

    Attributes:
        errors: ``[(command_idx, message), ...]`` for the commands that failed.
        results: what the call would have returned, with ``None`` at the failed commands.
    """

    def __init__(self, server: str, errors: list[tuple[int, str]], results: list) -> None:
        idx, message = errors[0]
        more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
        super().__init__(f"{server}: command {idx} failed: {message}{more}")
        self.errors = errors
        self.results = results


class RespReplyTooLargeError(BackendError):
    """A bulk reply is longer than the buffer given for it; the connection has been closed."""


@dataclass(frozen=True, slots=True)
class RespSetup:
    """How a connection reaches its server beyond ``host:port``, and what it sends once connected.

    Attributes:
        unix_path: connect to this unix socket instead of ``host:port``.
        db: database selected on connect (``SELECT``; 0: none sent).
        username: ACL user of ``AUTH`` (``None``: the default user).
        password: password of ``AUTH`` (``AUTH`` is sent when a user or a password is set); never in ``repr``.
        tls: client TLS context (``None``: plain); it decides what is verified.
        tls_server_name: the name the server's certificate must carry (default: ``host``).
        name: how messages name the server (a redacted URL; default ``host:port`` or the socket path).
    """

    unix_path: str | None = None
    db: int = 0
    username: str | None = None
    password: str | None = field(default=None, repr=False)
    tls: ssl.SSLContext | None = None
    tls_server_name: str | None = None
    name: str = ""


PLAIN = RespSetup()


class RespConnection:
    """One connection to a RESP2 server (Valkey/Redis): TCP, a unix socket or TLS.

    Args:
        host: server address (unused with ``setup.unix_path``).
        port: TCP port (unused with ``setup.unix_path``).
        timeout_s: connect timeout (connecting, the TLS handshake, ``AUTH`` and ``SELECT`` together), and the
            default deadline of calls that do not pass one, seconds.
        setup: unix socket, TLS, credentials and database (default: plain TCP, no ``AUTH``, database 0).

    Attributes:
        round_trips: calls whose requests were sent (one per ``execute``/``execute_into``).
        commands_sent: commands sent over the connection's lifetime.
        closed: whether the connection was closed (by :meth:`close` or after a failure).

    Raises:
        BackendError: the server cannot be reached, the TLS handshake fails (the server's certificate is not
            trusted or does not name ``tls_server_name``), or the server refuses ``AUTH`` or ``SELECT`` (message
            names the server as ``setup.name`` shows it, never the password).
        BackendTimeoutError: connecting took longer than ``timeout_s``.
    """

    def __init__(self, host: str, port: int, timeout_s: float, setup: RespSetup = PLAIN) -> None:
        self.server = setup.name or setup.unix_path or f"{host}:{port}"
        self.timeout_s = timeout_s
        self.round_trips = self.commands_sent = 0
        self.closed = False
        deadline_s = time.monotonic() + timeout_s
        self._sock = self._connect(host, port, timeout_s, setup)
        self._tls = setup.tls is not None
        # SO_RCVLOWAT batches a scattered receive on TCP only (poll ignores it on unix sockets; over TLS the bytes
        # on the socket are records, not the reply's bytes).
        self._use_rcvlowat = not self._tls and setup.unix_path is None
        self._sock_timeout_s = timeout_s
        self._buf = bytearray(_READ_BUFFER_BYTES)
        self._view = memoryview(self._buf)
        self._start = self._end = 0  # unread bytes are _buf[_start:_end]
        self._poller = select.poll()  # waits for bytes of a scatter receive (outside its gate)
        self._poller.register(self._sock, select.POLLIN)
        self._rcvlowat_bytes = 1  # the socket's SO_RCVLOWAT (raised only while a scattered receive waits)
        self._hello(setup, deadline_s)

    def _connect(self, host: str, port: int, timeout_s: float, setup: RespSetup) -> socket.socket:
        sock = None
        try:
            if setup.unix_path is not None:
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                sock.settimeout(timeout_s)
                sock.connect(setup.unix_path)
            else:
                sock = socket.create_connection((host, port), timeout=timeout_s)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if setup.tls is not None:  # the handshake runs here, bounded by the socket's timeout
                sock = setup.tls.wrap_socket(sock, server_hostname=setup.tls_server_name or host)
            return sock
        except TimeoutError as exc:
            _close_quietly(sock)
            raise BackendTimeoutError(f"{self.server}: connect timed out after {timeout_s:g} s") from exc
        except ssl.SSLCertVerificationError as exc:
            _close_quietly(sock)
            raise BackendError(f"{self.server}: TLS: the server's certificate was refused: "
                               f"{exc.verify_message or exc}") from exc
        except ssl.SSLError as exc:
            _close_quietly(sock)
            raise BackendError(f"{self.server}: TLS handshake failed: {exc}") from exc
        except OSError as exc:
            _close_quietly(sock)
            raise BackendError(f"{self.server}: cannot connect: {exc}") from exc

    def _hello(self, setup: RespSetup, deadline_s: float) -> None:
        """``AUTH`` and ``SELECT`` in one round trip, within the connect deadline (closes the connection on error)."""
        commands: list[tuple[Arg, ...]] = []
        if setup.username or setup.password:
            commands.append((b"AUTH", setup.username, setup.password or "") if setup.username
                            else (b"AUTH", setup.password or ""))
        if setup.db:
            commands.append((b"SELECT", setup.db))
        if not commands:
            return
        try:
            self._call(commands, [None] * len(commands), deadline_s, parse=True)
        except RespCommandError as exc:
            self.close()
            idx, message = exc.errors[0]
            what = "AUTH" if commands[idx][0] == b"AUTH" else f"SELECT {setup.db}"
            raise BackendError(f"{self.server}: the server refused {what}: {message}") from None

    def close(self) -> None:
        """Close the socket; later calls raise :class:`BackendError`. Idempotent."""
        if not self.closed:
            self.closed = True
            self._sock.close()

    def execute_into(
        self, commands: Sequence[Sequence[Arg]], dests: Sequence[memoryview | ScatterDest | None], *,
        deadline_s: float
    ) -> list[int]:
        """Send ``commands`` in one pipeline and read each reply, bulk payloads directly into ``dests``.

        Args:
            commands: ``[num_commands]`` commands, each ``[name, *args]``; large ``memoryview`` args are sent
                without copying.
            dests: ``[num_commands]`` writable contiguous buffers (any format; viewed as bytes) receiving the
                command's bulk reply, a :class:`ScatterDest` whose pieces receive it in order, or ``None`` to
                discard it.
            deadline_s: absolute ``time.monotonic()`` deadline of the whole call, seconds.

        Returns:
            ``[num_commands]``: for a bulk reply its length in bytes (written to ``dests[i][:length]``, or
            discarded), ``-1`` for nil, the value of an integer reply, ``0`` for a simple string, the element
            count of an array (elements discarded).

        Raises:
            ValueError: ``dests`` does not match ``commands``, a dest is read-only, or an arg is not contiguous.
            RespCommandError: error replies (raised after every reply was read).
            RespReplyTooLargeError: a bulk reply does not fit its dest (connection closed).
            BackendTimeoutError: the deadline passed (connection closed).
            BackendError: connection lost or protocol error, or a scatter destination's gate refused (connection
                closed).
        """
        if len(dests) != len(commands):
            raise ValueError(f"{len(commands)} commands but {len(dests)} dests")
        views = [None if d is None else ScatterDest(tuple(v for v in (_byte_view(p, writable=True) for p in d.pieces)
                                                          if v.nbytes), d.gate, d.digest)
                 if isinstance(d, ScatterDest) else _byte_view(d, writable=True) for d in dests]
        return self._call(commands, views, deadline_s, parse=False)

    def execute(self, commands: Sequence[Sequence[Arg]], *, deadline_s: float | None = None) -> list:
        """Send ``commands`` in one pipeline and return their parsed replies (for small replies: MGET, INFO...).

        Args:
            commands: ``[num_commands]`` commands, each ``[name, *args]``.
            deadline_s: absolute ``time.monotonic()`` deadline; default ``timeout_s`` from now.

        Returns:
            ``[num_commands]`` replies: bulk strings as ``bytes``, simple strings as ``str``, integers as ``int``,
            nil as ``None``, arrays as lists (an error element as a :class:`BackendError` instance).

        Raises:
            The same as :meth:`execute_into` (but never :class:`RespReplyTooLargeError`).
        """
        if deadline_s is None:
            deadline_s = time.monotonic() + self.timeout_s
        return self._call(commands, [None] * len(commands), deadline_s, parse=True)

    def _call(self, commands: Sequence[Sequence[Arg]], dests: list, deadline_s: float, *, parse: bool) -> list:
        if self.closed:
            raise BackendError(f"{self.server}: connection is closed")
        pieces = _encode(commands)
        results: list = []
        errors: list[tuple[int, str]] = []
        try:
            self._send(pieces, deadline_s)
            self.round_trips += 1
            self.commands_sent += len(commands)
            for idx, dest in enumerate(dests):
                reply = self._read_reply(dest, deadline_s, parse)
                if isinstance(reply, _ErrorReply):
                    errors.append((idx, str(reply)))
                    reply = None
                results.append(reply)
        except TimeoutError as exc:
            self.close()
            raise BackendTimeoutError(
                f"{self.server}: no complete reply within the deadline ({len(results)} of {len(commands)} read)"
            ) from exc
        except RespReplyTooLargeError:
            self.close()
            raise
        except (OSError, ValueError, BackendError) as exc:  # ValueError: a malformed length
            self.close()
            raise BackendError(f"{self.server}: {type(exc).__name__}: {exc}") from exc
        except BaseException:  # e.g. KeyboardInterrupt mid-reply: the stream is out of sync
            self.close()
            raise
        if errors:
            raise RespCommandError(self.server, errors, results)
        return results

    def _settimeout(self, deadline_s: float) -> None:
        """Bound the next socket operation by the deadline (re-armed only when it would overshoot by > slack)."""
        remaining_s = deadline_s - time.monotonic()
        if remaining_s <= 0:
            raise TimeoutError("deadline passed")
        if not remaining_s <= self._sock_timeout_s <= remaining_s + _TIMEOUT_SLACK_S:
            self._sock.settimeout(remaining_s)  # costs two fcntl calls, so not before every recv
            self._sock_timeout_s = remaining_s

    def _send(self, pieces: list[memoryview], deadline_s: float) -> None:
        if self._tls:  # SSLSocket has no sendmsg: one send per piece (the small parts are already merged)
            for piece in pieces:
                while piece.nbytes:
                    self._settimeout(deadline_s)
                    piece = piece[self._sock.send(piece):]
            return
        idx = 0
        while idx < len(pieces):
            self._settimeout(deadline_s)
            sent = self._sock.sendmsg(pieces[idx : idx + _IOV_MAX])
            while sent:
                size = pieces[idx].nbytes
                if sent < size:
                    pieces[idx] = pieces[idx][sent:]
                    break
                sent -= size
                idx += 1

    def _fill(self, deadline_s: float) -> None:
        """Receive more bytes into the read buffer (compacting it first)."""
        if self._start == self._end:
            self._start = self._end = 0
        elif self._start > 0:
            n = self._end - self._start
            self._view[:n] = self._view[self._start : self._end]
            self._start, self._end = 0, n
        if self._end == len(self._buf):
            raise BackendError(f"reply line longer than {len(self._buf)} bytes")
        self._end += self._recv_into(self._view[self._end :], deadline_s)

    def _recv_into(self, view: memoryview, deadline_s: float) -> int:
        self._settimeout(deadline_s)
        received = self._sock.recv_into(view)
        if received == 0:
            raise BackendError("server closed the connection")
        return received

    def _readline(self, deadline_s: float) -> bytearray:
        while True:
            eol = self._buf.find(b"\r\n", self._start, self._end)
            if eol >= 0:
                line = self._buf[self._start : eol]
                self._start = eol + 2
                return line
            self._fill(deadline_s)

    def _read_exact(self, dest: memoryview | ScatterDest | None, size: int, deadline_s: float) -> None:
        """Read ``size`` payload bytes plus CRLF into ``dest`` (or discard them when ``dest`` is None)."""
        done = 0
        if isinstance(dest, ScatterDest):
            self._read_scatter(dest, size, deadline_s)
            done = size
        elif dest is not None:
            done = min(size, self._end - self._start)
            dest[:done] = self._view[self._start : self._start + done]
            self._start += done
            while done < size:  # the rest goes straight from the socket into dest
                done += self._recv_into(dest[done:size], deadline_s)
        skip = size - done
        while skip:
            if self._start == self._end:
                self._fill(deadline_s)
            step = min(skip, self._end - self._start)
            self._start += step
            skip -= step
        while self._end - self._start < 2:
            self._fill(deadline_s)
        if self._buf[self._start] != 13 or self._buf[self._start + 1] != 10:
            raise BackendError("bulk reply not terminated by CRLF")
        self._start += 2

    def _read_scatter(self, dest: ScatterDest, size: int, deadline_s: float) -> None:
        """Read ``size`` payload bytes into the pieces of ``dest`` in order (the CRLF is left to the caller).

        Bytes already in the read buffer are copied; the rest is received straight into the pieces, as many per
        ``recvmsg_into`` as the socket holds, up to ``_SCATTER_RECV_BYTES``. Each copy and each receive runs inside the
        gate and never blocks; waiting for bytes (``poll`` until ``_SCATTER_RECV_BYTES`` or the rest of the reply are
        there, bounded by the deadline) happens outside it. The digest, if any, is updated
        from the pieces after each receive, outside the gate.
        """
        pieces, digest = dest.pieces, dest.digest
        idx = off = 0  # next byte goes to pieces[idx][off]
        left = size
        buffered = min(left, self._end - self._start)
        if buffered:
            with dest.gate:
                while buffered:
                    n = min(buffered, pieces[idx].nbytes - off)
                    pieces[idx][off:off + n] = self._view[self._start:self._start + n]
                    if digest is not None:
                        digest.update(self._view[self._start:self._start + n])
                    self._start += n
                    buffered -= n
                    left -= n
                    off += n
                    if off == pieces[idx].nbytes:
                        idx, off = idx + 1, 0
        if not left:
            return
        self._sock.settimeout(0.0)  # non-blocking receives; the next _settimeout re-arms the deadline
        self._sock_timeout_s = 0.0
        if self._tls:
            self._read_scatter_tls(dest, idx, off, left, deadline_s)
            return
        while left:
            iov = [pieces[idx][off:]]
            room = iov[0].nbytes
            end = idx + 1
            while room < left and end < len(pieces) and len(iov) < _IOV_MAX and room < _SCATTER_RECV_BYTES:
                iov.append(pieces[end])
                room += pieces[end].nbytes
                end += 1
            if room > left:  # never take the bytes of the next reply
                iov[-1] = iov[-1][:iov[-1].nbytes - (room - left)]
            with dest.gate:
                try:
                    received = self._sock.recvmsg_into(iov)[0]
                except BlockingIOError:
                    received = -1
            if received == 0:
                raise BackendError("server closed the connection")
            if received < 0:
                self._set_rcvlowat(min(room, left, _SCATTER_RECV_BYTES))
                self._wait_readable(deadline_s)
                continue
            left -= received
            while received:
                n = min(received, pieces[idx].nbytes - off)
                if digest is not None:  # (the bytes just landed: still in cache)
                    digest.update(pieces[idx][off:off + n])
                received -= n
                off += n
                if off == pieces[idx].nbytes:
                    idx, off = idx + 1, 0
        self._set_rcvlowat(1)  # replies' headers are read by waits for any byte (every failure closes the connection)

    def _read_scatter_tls(self, dest: ScatterDest, idx: int, off: int, left: int, deadline_s: float) -> None:
        """The TLS form of :meth:`_read_scatter`'s receive loop (the socket is non-blocking): one ``recv_into``
        per piece, inside the gate; waiting (outside it) only when the TLS layer holds no decrypted byte."""
        pieces, digest = dest.pieces, dest.digest
        while left:
            view = pieces[idx][off:off + min(pieces[idx].nbytes - off, left)]
            with dest.gate:
                try:
                    received = self._sock.recv_into(view)
                except ssl.SSLWantReadError:
                    received = -1
                except ssl.SSLWantWriteError:  # the TLS layer must send first (a key update): wait to write
                    received = -2
            if received == 0:
                raise BackendError("server closed the connection")
            if received < 0:
                self._wait_readable(deadline_s, select.POLLIN if received == -1 else select.POLLOUT)
                continue
            if digest is not None:
                digest.update(view[:received])
            left -= received
            off += received
            if off == pieces[idx].nbytes:
                idx, off = idx + 1, 0

    def _set_rcvlowat(self, size_bytes: int) -> None:
        if not self._use_rcvlowat:
            return
        if size_bytes != self._rcvlowat_bytes:
            self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, size_bytes)
            self._rcvlowat_bytes = size_bytes

    def _wait_readable(self, deadline_s: float, events: int = select.POLLIN) -> None:
        """Wait until the socket can be read (``events``: or written), or raise ``TimeoutError`` at the deadline.

        Over TLS, bytes already decrypted inside the ``SSLSocket`` are not on the socket, so ``poll`` would not see
        them: ``pending()`` is asked first."""
        if self._tls and events == select.POLLIN and self._sock.pending():
            return
        remaining_s = deadline_s - time.monotonic()
        if remaining_s <= 0:
            raise TimeoutError("deadline passed")
        if events != select.POLLIN:
            poller = select.poll()
            poller.register(self._sock, events)
            ready = poller.poll(math.ceil(remaining_s * 1000))
        else:
            ready = self._poller.poll(math.ceil(remaining_s * 1000))
        if not ready:
            raise TimeoutError("deadline passed")

    def _read_reply(self, dest: memoryview | ScatterDest | None, deadline_s: float, parse: bool) -> object:
        line = self._readline(deadline_s)
        kind, body = line[:1], line[1:]
        if kind == b"$":
            size = int(body)
            if size < 0:
                return None if parse else -1
            if parse:
                payload = memoryview(bytearray(size))
                self._read_exact(payload, size, deadline_s)
                return bytes(payload)
            if dest is not None and size > dest.nbytes:
                raise RespReplyTooLargeError(f"{self.server}: bulk reply of {size} bytes for a {dest.nbytes}-byte dest")
            self._read_exact(dest, size, deadline_s)
            return size
        if kind == b":":
            return int(body)
        if kind == b"+":
            return body.decode() if parse else 0
        if kind == b"-":
            return _ErrorReply(body.decode(errors="replace"))
        if kind == b"*":
            count = int(body)
            if count < 0:
                return None if parse else -1
            items = [self._read_reply(None, deadline_s, parse) for _ in range(count)]
            return [BackendError(i) if isinstance(i, _ErrorReply) else i for i in items] if parse else count
        raise BackendError(f"unexpected reply type {line[:16]!r}")


def _close_quietly(sock: socket.socket | None) -> None:
    if sock is not None:
        try:
            sock.close()
        except OSError:
            pass


class _ErrorReply(str):
    """The message of an error reply (``-ERR ...``), kept apart from simple strings."""


def _byte_view(buffer: bytes | bytearray | memoryview, *, writable: bool = False) -> memoryview:
    """A flat ``uint8`` view of a C-contiguous buffer (ValueError if it is not, or is read-only when ``writable``)."""
    view = memoryview(buffer)
    if not view.c_contiguous:
        raise ValueError("RESP buffers must be C-contiguous")
    if writable and view.readonly:
        raise ValueError("a RESP destination buffer must be writable")
    return view if view.ndim == 1 and view.format == "B" else view.cast("B")


def _encode(commands: Sequence[Sequence[Arg]]) -> list[memoryview]:
    """Encode commands as RESP arrays of bulk strings: small parts copied into headers, large args by reference."""
    pieces: list[memoryview] = []
    out = bytearray()
    for command in commands:
        out += b"*%d\r\n" % len(command)
        for arg in command:
            if isinstance(arg, int):
                arg = b"%d" % arg
            elif isinstance(arg, str):
                arg = arg.encode()
            view = _byte_view(arg)
            out += b"$%d\r\n" % view.nbytes
            if view.nbytes >= _INLINE_MAX_BYTES:
                pieces += (memoryview(out), view)
                out = bytearray(b"\r\n")
            else:
                out += view
                out += b"\r\n"
    pieces.append(memoryview(out))
    return pieces
