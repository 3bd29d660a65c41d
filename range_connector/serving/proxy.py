"""The proxy: an OpenAI-compatible HTTP front for prefill and decode engines, or for a fleet of ``kv_both`` engines.

**Fleet** (``engine_urls``): each request goes whole to one engine, chosen by the policy; with
:attr:`Policy.PREFIX_AWARE` the engine the proxy sent the longest prefix of the prompt to, so that its own prefix
cache serves it (:mod:`range_connector.serving.prefix_routing`); engines that share Range's tier load each other's
prefixes either way. ``GET /health`` answers 503 when no fleet engine is healthy.

**Disaggregated** (``prefill_urls`` and ``decode_urls``).

For each ``POST /v1/completions`` or ``POST /v1/chat/completions`` the proxy

1. sends the request to a prefill engine (``kv_role = kv_producer``) with ``max_tokens = 1`` (chat: also
   ``max_completion_tokens = 1``), ``stream = false``, no ``stream_options``/``min_tokens``, and
   ``{"do_remote_decode": true}`` merged into ``kv_transfer_params``;
2. reads the ``kv_transfer_params`` of the prefill response (vLLM's OpenAI server returns what the connector's
   ``request_finished`` returned: Range's names the namespace, chain head and token count);
3. sends the client's original request to a decode engine (``kv_role = kv_consumer``) with ``kv_transfer_params``
   set to exactly what prefill returned, and passes decode's answer back unchanged (server-sent events byte for
   byte when ``stream = true``).

Both calls carry one ``X-Request-Id`` and the client's ``Authorization`` header. Other endpoints: ``GET /health``
(200 while at least one prefill and one decode engine are healthy and, as far as the describe probes tell, some
healthy decode engine has the settings of some healthy prefill engine; else 503 with the reason),
``GET /v1/models`` (forwarded to a decode engine), ``GET /proxy/status`` (JSON: engines, health, in-flight and
error counts, outcome counts) and ``GET /proxy/traces`` (JSON: the timestamps of the last requests' prefill call,
decode call and first streamed bytes, :mod:`range_connector.serving.request_traces`).

**Settings contract (checked before decode).** A Range producer's ``kv_transfer_params`` carry
``{"range": {"settings": {...}}}``: a flat dict of every setting producer and consumer must share (model,
block_size, chunk_tokens, KV layout, num_shards, namespace fingerprint). The proxy learns each decode engine's
settings with a describe probe: ``POST /v1/completions`` with ``{"prompt": [0], "max_tokens": 1, "stream": false,
"kv_transfer_params": {"range_describe": true}}`` (plus the client's ``model``), whose response's
``kv_transfer_params`` carry ``{"range": {"settings": {...}}}`` too. It probes once per engine and again after the
engine was down. A decode engine whose settings differ from the producer's is never sent the request; when no
healthy decode engine matches, the client gets HTTP 409 naming each mismatched key with both values
(``error.mismatches = {key: {"prefill": v, "decode": v}}``), and the proxy logs it. An engine that returns no
``range`` settings (not a Range connector) is not checked; the proxy says so once per engine.

**Errors** (OpenAI-style JSON bodies ``{"error": {"message", "type", "param", "code"}}``): 503 when no healthy
engine of a kind exists; 502 when an engine fails (5xx, connection broken, unreadable answer); 504 when a phase
times out; an engine's 4xx is passed through unchanged. A stream that has already started ends with an SSE event
``data: {"error": {...}}`` and ``data: [DONE]``. An engine that refuses a connection is marked down and the
request goes to the next healthy engine of its kind; health checks (``GET /health``) bring it back.

**Timeouts.** ``prefill_timeout_s`` bounds the whole prefill call; ``decode_timeout_s`` bounds each silence of the
decode engine (until its answer starts, and between two streamed chunks), so long generations are not cut;
``connect_timeout_s`` bounds each connection attempt.

Example::

    range-connector proxy --prefill http://10.0.0.1:8100 --decode http://10.0.0.2:8200 --port 8000
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import logging
import signal
import uuid
from collections.abc import Mapping
from typing import Any

import aiohttp
from aiohttp import web

from range_connector.serving.engines import (
    Engine,
    EngineKind,
    EnginePool,
    EngineUnavailableError,
    Policy,
    mismatched_settings,
    settings_of,
)
from range_connector.serving.forwarding import Forwarder, Outcome, Reply, snippet
from range_connector.serving.prefix_routing import prompt_prefix_hashes
from range_connector.serving.proxy_config import DEFAULT_MAX_BODY_BYTES, ProxyConfig
from range_connector.serving.request_traces import HandoffTrace, TraceLog

__all__ = ["DEFAULT_MAX_BODY_BYTES", "Outcome", "Policy", "ProxyConfig", "ProxyServer", "serve_proxy"]

logger = logging.getLogger(__name__)

_KEEPALIVE_S = 3.0


def _prefill_body(body: Mapping[str, Any], is_chat: bool,
                  expect: Mapping[str, Any] | None = None) -> dict[str, Any]:
    prefill = {key: value for key, value in body.items() if key not in ("stream_options", "min_tokens")}
    prefill["max_tokens"] = 1
    if is_chat:
        prefill["max_completion_tokens"] = 1
    prefill["stream"] = False
    client_params = body.get("kv_transfer_params")
    prefill["kv_transfer_params"] = {**(client_params if isinstance(client_params, Mapping) else {}),
                                     "do_remote_decode": True}
    if expect:  # a decode engine's settings: the producer logs a mismatch too
        prefill["kv_transfer_params"]["range_expect"] = dict(expect)
    return prefill


class ProxyServer:
    """The proxy on an aiohttp server; runs on the event loop that calls :meth:`start`.

    Args:
        config: Engines, address, policy and timeouts.
    """

    def __init__(self, config: ProxyConfig) -> None:
        self.config = config
        self.pool = EnginePool(config.prefill_urls, config.decode_urls, config.policy, config.engine_urls,
                               config.prefix_imbalance_requests)
        self.outcomes: collections.Counter[Outcome] = collections.Counter()
        self._session: aiohttp.ClientSession | None = None
        self._forwarder: Forwarder | None = None
        self._runner: web.AppRunner | None = None
        self._health_task: asyncio.Task[None] | None = None
        self._said_no_params: set[str] = set()
        self.traces = TraceLog()
        self.port = config.port

    @property
    def _forward(self) -> Forwarder:
        if self._forwarder is None:
            raise RuntimeError("ProxyServer.start() was not called")
        return self._forwarder

    @property
    def base_url(self) -> str:
        """``http://host:port`` of the running proxy."""
        return f"http://{self.config.host}:{self.port}"

    async def start(self) -> None:
        """Check every engine's health once, start the periodic checks, and listen.

        Raises:
            OSError: The address cannot be bound.
        """
        # No connection cap: the engines' own queues bound the load. Idle connections are dropped before vLLM's
        # server drops them (VLLM_HTTP_TIMEOUT_KEEP_ALIVE, 5 s), so that a request never meets a closing connection.
        self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(
            limit=0, keepalive_timeout=_KEEPALIVE_S))
        self._forwarder = Forwarder(self._session, self.pool, self.outcomes, {
            EngineKind.PREFILL: self.config.prefill_timeout_s, EngineKind.DECODE: self.config.decode_timeout_s,
            EngineKind.ENGINE: self.config.decode_timeout_s})
        await self.pool.check_health(self._session, self.config.health_timeout_s)
        self._health_task = asyncio.create_task(self.pool.run_health_checks(
            self._session, self.config.health_interval_s, self.config.health_timeout_s))
        app = web.Application(client_max_size=self.config.max_body_bytes)
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_post("/v1/chat/completions", self._chat_completions)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/health", self._health)
        app.router.add_get("/proxy/status", self._status)
        app.router.add_get("/proxy/traces", self._traces)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.config.host, self.config.port)
        try:
            await site.start()
        except OSError:
            await self.stop()
            raise
        self.port = self._runner.addresses[0][1]
        engines = (f"fleet {list(self.config.engine_urls)}" if self.config.is_fleet else
                   f"prefill {list(self.config.prefill_urls)}, decode {list(self.config.decode_urls)}")
        logger.info("proxy listening on %s: %s, policy %s", self.base_url, engines, self.config.policy.value)

    async def stop(self) -> None:
        """Stop listening, stop the health checks, close the client session (in-flight requests are cut)."""
        if self._health_task is not None:
            self._health_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._health_task
        if self._runner is not None:
            await self._runner.cleanup()
        if self._session is not None:
            await self._session.close()

    # ---------------------------------------------------------------------------------------------------------
    # Handlers

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, "/v1/completions", is_chat=False)

    async def _chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, "/v1/chat/completions", is_chat=True)

    def _kinds(self) -> tuple[EngineKind, ...]:
        return (EngineKind.ENGINE,) if self.config.is_fleet else (EngineKind.PREFILL, EngineKind.DECODE)

    async def _health(self, request: web.Request) -> web.Response:
        missing = [kind.value for kind in self._kinds()
                   if not any(engine.healthy for engine in self.pool.engines[kind])]
        if missing:
            return Reply(Outcome.NO_ENGINE, 503, f"no healthy {' or '.join(missing)} engine").response()
        if not self.config.is_fleet and (mismatch := await self._no_decode_matches()) is not None:
            return Reply(Outcome.SETTINGS_MISMATCH, 503, mismatch).response()
        return web.json_response({"status": "ok"})

    async def _no_decode_matches(self) -> str | None:
        """Why no healthy decode engine can serve any healthy prefill engine, or ``None`` (one can, or unknown).

        Engines not yet described are probed (once per up-period, without the client's credentials); an engine
        that answers no Range settings, or whose probe fails, leaves the verdict unknown.
        """
        prefills = [engine for engine in self.pool.engines[EngineKind.PREFILL] if engine.healthy]
        decodes = [engine for engine in self.pool.engines[EngineKind.DECODE] if engine.healthy]
        await asyncio.gather(*(
            self.pool.describe(self._forward.session, engine, model=None, headers={},
                               timeout_s=self.config.health_timeout_s)
            for engine in prefills + decodes), return_exceptions=True)
        produced = [engine for engine in prefills if engine.settings]
        if not produced or not all(engine.settings for engine in decodes):
            return None
        for prefill in produced:
            for decode in decodes:
                if not mismatched_settings(prefill.settings, decode.settings):
                    return None
        mismatches = mismatched_settings(produced[0].settings, decodes[0].settings)
        return (f"no decode engine can serve the prefill engines: prefill engine {produced[0].url} and decode engine "
                f"{decodes[0].url} have different Range settings: {_describe_mismatches(mismatches)}")

    async def _status(self, request: web.Request) -> web.Response:
        return web.json_response({
            "policy": self.config.policy.value,
            "num_in_flight": sum(engine.num_in_flight for engine in self.pool.all_engines()),
            "outcomes": {outcome.value: self.outcomes[outcome] for outcome in Outcome},
            "engines": [engine.status() for engine in self.pool.all_engines()],
        })

    async def _traces(self, request: web.Request) -> web.Response:
        return web.json_response({"clock": "wall-clock seconds", "traces": self.traces.to_list()})

    async def _models(self, request: web.Request) -> web.Response:
        timeout = aiohttp.ClientTimeout(total=self.config.prefill_timeout_s, sock_connect=self.config.connect_timeout_s)
        try:
            kind = self._kinds()[-1]
            call = self._forward.call(kind, self.pool.ranked(kind), "GET", "/v1/models",
                                      None, self._headers(request, None), timeout)
            async with call as (_, response):
                data = await response.read()
                return web.Response(status=response.status, body=data,
                                    headers={"Content-Type": response.headers.get("Content-Type", "application/json")})
        except Reply as reply:
            return reply.response()

    # ---------------------------------------------------------------------------------------------------------
    # Prefill, then decode

    async def _generate(self, request: web.Request, path: str, *, is_chat: bool) -> web.StreamResponse:
        request_id = request.headers.get("X-Request-Id") or f"proxy-{uuid.uuid4().hex}"
        trace = self.traces.start(request_id)
        try:
            try:
                body = await request.json()
            except ValueError as exc:
                raise Reply(Outcome.BAD_REQUEST, 400, f"request body is not JSON: {exc}") from None
            if not isinstance(body, dict):
                raise Reply(Outcome.BAD_REQUEST, 400, "request body must be a JSON object")
            headers = self._headers(request, request_id)
            hashes = prompt_prefix_hashes(body) if self.config.policy is Policy.PREFIX_AWARE else []
            if self.config.is_fleet:
                return await self._decode(request, body, path, self.pool.ranked(EngineKind.ENGINE, hashes), headers,
                                          hashes, trace, EngineKind.ENGINE)
            if not any(engine.healthy for engine in self.pool.engines[EngineKind.DECODE]):
                raise Reply(Outcome.NO_ENGINE, 503, "no healthy decode engine")  # do not prefill in vain
            params, prefill_engine = await self._prefill(body, path, is_chat, headers, hashes, trace)
            candidates = await self._decode_candidates(params, prefill_engine, body.get("model"), headers, request_id,
                                                       hashes)
            decode_body = {**body, "kv_transfer_params": params} if params is not None else body
            return await self._decode(request, decode_body, path, candidates, headers, hashes, trace)
        except Reply as reply:
            self.outcomes[reply.outcome] += 1
            if reply.status >= 500 or reply.status == 409:
                logger.warning("request %s: HTTP %d: %s", request_id, reply.status, reply.message)
            trace.status = reply.status
            return reply.response()
        finally:
            trace.done_s = HandoffTrace.now()

    @staticmethod
    def _headers(request: web.Request, request_id: str | None) -> dict[str, str]:
        headers = {"Authorization": request.headers["Authorization"]} if "Authorization" in request.headers else {}
        if request_id is not None:
            headers["X-Request-Id"] = request_id
        return headers

    def _known_decode_settings(self) -> dict[str, Any] | None:
        """Range settings of the first healthy decode engine that has described itself, if any."""
        for engine in self.pool.engines[EngineKind.DECODE]:
            if engine.healthy and engine.settings:
                return engine.settings
        return None

    async def _prefill(self, body: dict[str, Any], path: str, is_chat: bool, headers: dict[str, str],
                       hashes: list[int], trace: HandoffTrace) -> tuple[dict[str, Any] | None, Engine]:
        timeout = aiohttp.ClientTimeout(total=self.config.prefill_timeout_s, sock_connect=self.config.connect_timeout_s)
        call = self._forward.call(EngineKind.PREFILL, self.pool.ranked(EngineKind.PREFILL, hashes), "POST", path,
                                  _prefill_body(body, is_chat, self._known_decode_settings()), headers, timeout)
        trace.prefill_sent_s = HandoffTrace.now()
        async with call as (engine, response):
            self.pool.record_sent(engine, hashes)
            data = await self._forward.read_answer(engine, response)
        trace.prefill_answered_s, trace.prefill_url = HandoffTrace.now(), engine.url
        try:
            doc = json.loads(data)
        except ValueError:
            engine.record_error("answer is not JSON")
            raise Reply(Outcome.ENGINE_FAILED, 502, f"prefill engine {engine.url} answered with a body that is not "
                        f"JSON: {snippet(data)}") from None
        params = doc.get("kv_transfer_params") if isinstance(doc, dict) else None
        if not isinstance(params, dict):
            if engine.url not in self._said_no_params:
                self._said_no_params.add(engine.url)
                logger.warning("prefill engine %s returned no kv_transfer_params (is it a kv_producer?); "
                               "decode engines will compute the whole prompt", engine.url)
            return None, engine
        return params, engine

    async def _decode_candidates(self, params: dict[str, Any] | None, prefill_engine: Engine, model: Any,
                                 headers: dict[str, str], request_id: str, hashes: list[int]) -> list[Engine]:
        candidates = self.pool.ranked(EngineKind.DECODE, hashes)
        producer = settings_of(params)
        if producer is None:
            if params is not None and not prefill_engine.said_no_settings:
                prefill_engine.said_no_settings = True
                logger.warning("prefill engine %s returned no Range settings (not a Range connector?); "
                               "prefill/decode compatibility is not checked", prefill_engine.url)
            return candidates
        probes = await asyncio.gather(*(
            self.pool.describe(self._forward.session, engine, model=model if isinstance(model, str) else None,
                               headers=headers, timeout_s=self.config.prefill_timeout_s)
            for engine in candidates), return_exceptions=True)
        compatible: list[Engine] = []
        refused: list[tuple[Engine, dict[str, dict[str, Any]]]] = []
        for engine, settings in zip(candidates, probes, strict=True):
            if isinstance(settings, EngineUnavailableError):
                continue
            if isinstance(settings, BaseException):
                raise settings
            mismatches = mismatched_settings(producer, settings) if settings is not None else {}
            if mismatches:
                refused.append((engine, mismatches))
            else:
                compatible.append(engine)
        for engine, mismatches in refused:
            logger.warning("request %s: decode engine %s does not match prefill engine %s: %s", request_id,
                           engine.url, prefill_engine.url, _describe_mismatches(mismatches))
        if not compatible and refused:
            engine, mismatches = refused[0]
            raise Reply(Outcome.SETTINGS_MISMATCH, 409,
                        f"prefill engine {prefill_engine.url} and decode engine {engine.url} have different Range "
                        f"settings: {_describe_mismatches(mismatches)}",
                        extra={"mismatches": mismatches, "prefill_url": prefill_engine.url,
                                "decode_url": engine.url})
        return compatible

    async def _decode(self, request: web.Request, body: dict[str, Any], path: str, candidates: list[Engine],
                      headers: dict[str, str], hashes: list[int], trace: HandoffTrace,
                      kind: EngineKind = EngineKind.DECODE) -> web.StreamResponse:
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=self.config.connect_timeout_s,
                                        sock_read=self.config.decode_timeout_s)
        call = self._forward.call(kind, candidates, "POST", path, body, headers, timeout)
        trace.decode_sent_s = HandoffTrace.now()
        async with call as (engine, response):
            trace.decode_headers_s, trace.decode_url, trace.status = HandoffTrace.now(), engine.url, response.status
            self.pool.record_sent(engine, hashes)
            if not body.get("stream") or response.status >= 400:
                data = await self._forward.read_answer(engine, response)
                trace.first_chunk_s = HandoffTrace.now()
                self.outcomes[Outcome.OK] += 1
                return web.Response(status=response.status, body=data,
                                    headers={"Content-Type": response.headers.get("Content-Type", "application/json")})
            out = web.StreamResponse(status=response.status, headers={
                "Content-Type": response.headers.get("Content-Type", "text/event-stream"), "Cache-Control": "no-cache"})
            await out.prepare(request)
            await self._forward.pass_stream(engine, response, out, trace)
            return out


def _describe_mismatches(mismatches: Mapping[str, Mapping[str, Any]]) -> str:
    return "; ".join(f"{key}: prefill {json.dumps(values['prefill'])}, decode {json.dumps(values['decode'])}"
                     for key, values in mismatches.items())


async def serve_proxy(config: ProxyConfig, stop_event: asyncio.Event | None = None) -> None:
    """Run the proxy until SIGINT/SIGTERM (or until ``stop_event`` is set), then stop it.

    Raises:
        OSError: The address cannot be bound.
    """
    stop_event = stop_event or asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop_event.set)
    server = ProxyServer(config)
    await server.start()
    print(f"proxy listening on {server.base_url}", flush=True)
    try:
        await stop_event.wait()
    finally:
        await server.stop()
