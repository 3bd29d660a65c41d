"""How the disaggregated-prefill proxy talks to one engine: failover, timeouts, error replies, stream passthrough.

:class:`Forwarder` sends one call to the first of a list of candidate engines that accepts a connection (an engine
that refuses is marked down and the next one tried), turns what can go wrong into a :class:`Reply` (503 no engine,
502 engine failed, 504 timeout, the engine's own 4xx passed through), and copies a decode engine's event stream to
the client byte for byte, ending it with an SSE error event and ``[DONE]`` if decode fails in the middle.
:mod:`range_connector.serving.proxy` holds the front and the two-phase flow.
"""

from __future__ import annotations

import collections
import contextlib
import enum
import json
import logging
from collections.abc import AsyncIterator, Mapping
from typing import Any

import aiohttp
from aiohttp import web

from range_connector.serving.engines import Engine, EngineKind, EnginePool
from range_connector.serving.request_traces import HandoffTrace

__all__ = ["Forwarder", "Outcome", "Reply", "snippet"]

logger = logging.getLogger("range_connector.serving.proxy")  # one logger for the whole proxy

_ERROR_SNIPPET_CHARS = 200


class Outcome(str, enum.Enum):
    """How a client request ended (counted in ``/proxy/status``)."""

    OK = "ok"
    BAD_REQUEST = "bad_request_400"
    ENGINE_4XX = "engine_4xx"
    SETTINGS_MISMATCH = "settings_mismatch_409"
    ENGINE_FAILED = "engine_failed_502"
    NO_ENGINE = "no_engine_503"
    TIMEOUT = "timeout_504"
    CLIENT_GONE = "client_disconnected"


class Reply(Exception):
    """Ends a request early with an error answer: OpenAI-style JSON, or an engine's own 4xx body passed through."""

    def __init__(self, outcome: Outcome, status: int, message: str, *, extra: Mapping[str, Any] | None = None,
                 raw_body: bytes | None = None, content_type: str = "application/json") -> None:
        super().__init__(message)
        self.outcome, self.status, self.message = outcome, status, message
        self.extra, self.raw_body, self.content_type = dict(extra or {}), raw_body, content_type

    def error_doc(self) -> dict[str, Any]:
        """The OpenAI-style error body: ``{"error": {"message", "type", "param", "code", ...extra}}``."""
        error_type = {400: "BadRequestError", 409: "SettingsMismatchError", 502: "BadGatewayError",
                      503: "ServiceUnavailableError", 504: "GatewayTimeoutError"}.get(self.status, "ProxyError")
        return {"error": {"message": self.message, "type": error_type, "param": None, "code": self.status,
                          **self.extra}}

    def response(self) -> web.Response:
        """The HTTP answer: the engine's own body for a passed-through 4xx, else :meth:`error_doc` as JSON."""
        if self.raw_body is not None:
            return web.Response(status=self.status, body=self.raw_body, headers={"Content-Type": self.content_type})
        return web.json_response(self.error_doc(), status=self.status)


def snippet(data: bytes) -> str:
    """The start of an answer body as one line of text (for error messages)."""
    return " ".join(data.decode("utf-8", "replace").split())[:_ERROR_SNIPPET_CHARS]


class Forwarder:
    """Sends calls to engines on one client session and counts how client requests end.

    Args:
        session: The proxy's HTTP client session.
        pool: The engines (health is updated here when a connection fails).
        outcomes: Counter of request outcomes, shared with the front.
        limits_s: The timeout of each kind, seconds, for messages (prefill: whole call; decode: longest silence).
    """

    def __init__(self, session: aiohttp.ClientSession, pool: EnginePool, outcomes: collections.Counter[Outcome],
                 limits_s: Mapping[EngineKind, float]) -> None:
        self.session = session
        self.pool = pool
        self.outcomes = outcomes
        self._limits_s = dict(limits_s)

    async def pass_stream(self, engine: Engine, response: aiohttp.ClientResponse, out: web.StreamResponse,
                          trace: HandoffTrace | None = None) -> None:
        """Copy decode's event stream to the client unchanged; end it with an SSE error event if decode fails.
        ``trace.first_chunk_s`` is stamped when the first bytes are passed on."""
        tail = b"\n\n"
        failure: Reply | None = None
        while True:
            try:
                chunk = await response.content.readany()
            except TimeoutError:
                engine.record_error("stream stalled")
                failure = Reply(Outcome.TIMEOUT, 504, f"decode engine {engine.url} sent nothing for "
                                f"{self._limits_s[EngineKind.DECODE]} s in the middle of the stream")
                break
            except aiohttp.ClientError as exc:
                self.pool.mark_down(engine, f"stream broke: {type(exc).__name__}: {exc}")
                failure = Reply(Outcome.ENGINE_FAILED, 502, f"decode engine {engine.url} failed in the middle "
                                f"of the stream: {type(exc).__name__}: {exc}")
                break
            if not chunk:
                break
            if trace is not None and trace.first_chunk_s is None:
                trace.first_chunk_s = HandoffTrace.now()
            try:
                await out.write(chunk)
            except ConnectionError:  # the client went away: closing the response makes decode abort the request
                self.outcomes[Outcome.CLIENT_GONE] += 1
                response.close()
                return
            tail = (tail + chunk)[-2:]
        if failure is None:
            self.outcomes[Outcome.OK] += 1
        else:
            self.outcomes[failure.outcome] += 1
            logger.warning("%s", failure.message)
            separator = b"" if tail == b"\n\n" else b"\n\n"  # never glue the error to a half-sent event
            with contextlib.suppress(ConnectionError):
                await out.write(separator + b"data: " + json.dumps(failure.error_doc()).encode() + b"\n\n"
                                + b"data: [DONE]\n\n")
        with contextlib.suppress(ConnectionError):
            await out.write_eof()

    async def read_answer(self, engine: Engine, response: aiohttp.ClientResponse) -> bytes:
        """Read a whole answer; pass a 4xx through, turn a 5xx into 502."""
        data = await response.read()
        if 400 <= response.status < 500:
            raise Reply(Outcome.ENGINE_4XX, response.status, snippet(data), raw_body=data,
                        content_type=response.headers.get("Content-Type", "application/json"))
        if response.status >= 500:
            engine.record_error(f"HTTP {response.status}")
            raise Reply(Outcome.ENGINE_FAILED, 502, f"{engine.kind.value} engine {engine.url} answered HTTP "
                        f"{response.status}: {snippet(data)}")
        return data

    @contextlib.asynccontextmanager
    async def call(self, kind: EngineKind, candidates: list[Engine], method: str, path: str,
                   payload: dict[str, Any] | None, headers: dict[str, str],
                   timeout: aiohttp.ClientTimeout) -> AsyncIterator[tuple[Engine, aiohttp.ClientResponse]]:
        """Send to the first candidate that accepts a connection; yield it and its response (headers read).

        A refused or broken connection marks the engine down and tries the next candidate. Failures while the
        caller reads the answer become replies: a timeout 504, a broken connection 502.

        Raises:
            Reply: 503 when no candidate accepts, 504 on a timeout, 502 when the engine fails.
        """
        tried: list[str] = []
        for engine in candidates:
            if not engine.healthy:
                continue
            engine.num_in_flight += 1
            engine.num_requests += 1
            try:
                try:
                    response = await self.session.request(method, engine.url + path, json=payload, headers=headers,
                                                           timeout=timeout)
                except aiohttp.ConnectionTimeoutError as exc:
                    self.pool.mark_down(engine, f"connect timed out: {exc}")
                    tried.append(engine.url)
                    continue
                except TimeoutError:
                    engine.record_error("timed out")
                    raise self._timeout(engine) from None
                except aiohttp.ClientError as exc:
                    self.pool.mark_down(engine, f"{type(exc).__name__}: {exc}")
                    tried.append(engine.url)
                    continue
                async with response:
                    try:
                        yield engine, response
                    except TimeoutError:
                        engine.record_error("timed out")
                        raise self._timeout(engine) from None
                    except aiohttp.ClientError as exc:
                        self.pool.mark_down(engine, f"{type(exc).__name__}: {exc}")
                        raise Reply(Outcome.ENGINE_FAILED, 502, f"{kind.value} engine {engine.url} failed: "
                                    f"{type(exc).__name__}: {exc}") from None
                return
            finally:
                engine.num_in_flight -= 1
        detail = f" ({', '.join(tried)} could not be reached)" if tried else ""
        raise Reply(Outcome.NO_ENGINE, 503, f"no healthy {kind.value} engine{detail}")

    def _timeout(self, engine: Engine) -> Reply:
        limit_s = self._limits_s[engine.kind]
        return Reply(Outcome.TIMEOUT, 504, f"{engine.kind.value} engine {engine.url} did not answer within "
                     f"{limit_s} s")
