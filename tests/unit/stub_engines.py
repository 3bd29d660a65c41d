"""Stub OpenAI engines for the proxy tests: just enough of vLLM's HTTP answers, served by aiohttp on loopback.

A :class:`StubEngine` answers ``/v1/completions`` and ``/v1/chat/completions`` (streaming and not) the way vLLM's
OpenAI server with a KV connector does: a request carrying ``kv_transfer_params.do_remote_decode`` is a prefill and
gets ``kv_transfer_params`` back (Range's ``{"range": {"settings": ...}}`` plus a chain head); a request carrying
``kv_transfer_params.range_describe`` is the describe probe and gets the settings back; anything else is a decode,
answered with ``num_chunks`` tokens. :class:`StubBehaviour` turns on the faults (unhealthy, slow, dying mid-stream,
an error status). Every generation request's body is recorded, and every byte a stream sent.

:class:`LoopThread` runs one asyncio loop in a thread, so that synchronous tests can drive the proxy and the stubs
over real HTTP (pytest-asyncio is not installed here); :class:`Stack` is a running proxy with its stubs and a client.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
from collections.abc import Callable, Coroutine, Iterator
from dataclasses import dataclass, field
from typing import Any, TypeVar

import httpx
from aiohttp import web
from multidict import CIMultiDict

from range_connector.serving.proxy import ProxyConfig, ProxyServer

T = TypeVar("T")

RANGE_SETTINGS = {"model": "tiny-gqa", "block_size": 16, "chunk_tokens": 256, "kv_layout": "gqa:2x4x64:bf16",
                  "num_shards": 2, "namespace": "ns-1f2e"}


@dataclass
class StubBehaviour:
    """What the stub does; tests change it between requests (read by the handlers at each request).

    Attributes:
        settings: Range settings returned to prefill and describe requests; ``None``: no ``range`` part at all.
        num_chunks: Output tokens of a decode (one SSE event each when streaming).
        chunk_delay_s: Pause before each streamed event after the first, seconds.
        answer_delay_s: Pause before answering a generation request at all, seconds.

    A pause ends early once the test sets its delay back to 0, so a test can make a stub far slower than any timeout
    it checks (only a hang would let the stub win) and still not wait the pause out.
        die_after_chunks: Streaming decode: cut the connection after this many events.
        die_mid_event: With ``die_after_chunks``: send the first bytes of the next event before cutting.
        status: HTTP status of generation answers (an error body when not 200).
        healthy: Whether ``GET /health`` answers 200 (else 503).
    """

    settings: dict[str, Any] | None = field(default_factory=lambda: dict(RANGE_SETTINGS))
    num_chunks: int = 3
    chunk_delay_s: float = 0.0
    answer_delay_s: float = 0.0
    die_after_chunks: int | None = None
    die_mid_event: bool = False
    status: int = 200
    healthy: bool = True


class StubEngine:
    """One stub engine on ``127.0.0.1`` (a free port). Start and stop it on the :class:`LoopThread`'s loop."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.behaviour = StubBehaviour()
        self.requests: list[tuple[str, dict[str, Any]]] = []  # (path, body) of generation requests
        self.headers: list[CIMultiDict[str]] = []  # headers of generation requests (case-insensitive)
        self.probes: list[dict[str, Any]] = []  # bodies of describe probes
        self.streamed: list[bytes] = []  # every byte each streamed decode sent
        self.url = ""
        self._runner: web.AppRunner | None = None

    async def start(self) -> None:
        app = web.Application()
        app.router.add_post("/v1/completions", self._generate)
        app.router.add_post("/v1/chat/completions", self._generate)
        app.router.add_get("/health", self._health)
        app.router.add_get("/v1/models", self._models)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{self._runner.addresses[0][1]}"

    async def stop(self) -> None:
        """Close the listening socket and every connection: afterwards connections are refused."""
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    def paths(self) -> list[str]:
        return [path for path, _ in self.requests]

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(status=200 if self.behaviour.healthy else 503)

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "tiny-gqa", "object": "model",
                                                                "owned_by": self.name}]})

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        params = body.get("kv_transfer_params") or {}
        behaviour = self.behaviour
        is_chat = request.path.endswith("/chat/completions")
        if params.get("range_describe"):
            self.probes.append(body)
            return web.json_response(self._answer(is_chat, ["x"], self._range_params({})))
        self.requests.append((request.path, body))
        self.headers.append(request.headers.copy())
        if behaviour.answer_delay_s:
            await self._pause("answer_delay_s")
        if behaviour.status != 200:
            return web.json_response({"error": {"message": f"{self.name} says no", "type": "BadRequestError",
                                                "param": None, "code": behaviour.status}}, status=behaviour.status)
        if params.get("do_remote_decode"):
            produced = self._range_params({"chain_head": f"head-{self.name}", "num_tokens": 42})
            return web.json_response(self._answer(is_chat, ["p"], produced))
        tokens = [f"{self.name}-t{idx} " for idx in range(behaviour.num_chunks)]
        if not body.get("stream"):
            return web.json_response(self._answer(is_chat, tokens, None))
        return await self._stream(request, is_chat, tokens)

    async def _pause(self, name: str) -> None:
        """Sleep ``behaviour.<name>`` seconds, or until the test sets it to 0."""
        loop = asyncio.get_running_loop()
        end = loop.time() + getattr(self.behaviour, name)
        while getattr(self.behaviour, name) and loop.time() < end:
            await asyncio.sleep(min(0.01, max(0.0, end - loop.time())))

    def _range_params(self, extra: dict[str, Any]) -> dict[str, Any]:
        if self.behaviour.settings is None:
            return dict(extra)
        return {**extra, "range": {"settings": dict(self.behaviour.settings)}}

    def _answer(self, is_chat: bool, tokens: list[str], params: dict[str, Any] | None) -> dict[str, Any]:
        text = "".join(tokens)
        choice = ({"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "length"}
                  if is_chat else {"index": 0, "text": text, "finish_reason": "length"})
        return {"id": f"cmpl-{self.name}", "object": "chat.completion" if is_chat else "text_completion",
                "model": "tiny-gqa", "choices": [choice], "usage": {"completion_tokens": len(tokens)},
                "kv_transfer_params": params}

    async def _stream(self, request: web.Request, is_chat: bool, tokens: list[str]) -> web.StreamResponse:
        behaviour = self.behaviour
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8"})
        await out.prepare(request)
        sent = bytearray()
        self.streamed.append(b"")
        for idx, token in enumerate(tokens):
            if idx and behaviour.chunk_delay_s:
                await self._pause("chunk_delay_s")
            choice = {"index": 0, "delta": {"content": token}} if is_chat else {"index": 0, "text": token}
            event = f"data: {json.dumps({'id': f'cmpl-{self.name}', 'choices': [choice]})}\n\n".encode()
            if behaviour.die_after_chunks is not None and idx == behaviour.die_after_chunks:
                if behaviour.die_mid_event:
                    await out.write(event[:7])
                    self.streamed[-1] = bytes(sent + event[:7])
                request.transport.close()  # cut the connection in the middle of the chunked body
                return out
            # Write each event in two pieces split mid-event: the proxy must not re-frame anything.
            for piece in (event[:7], event[7:]):
                await out.write(piece)
                sent += piece
                self.streamed[-1] = bytes(sent)
        for piece in (b"data: [DONE]\n\n",):
            await out.write(piece)
            sent += piece
        self.streamed[-1] = bytes(sent)
        await out.write_eof()
        return out


class LoopThread:
    """An asyncio event loop running in a daemon thread; :meth:`run` executes a coroutine there and waits."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="proxy-test-loop", daemon=True)

    def __enter__(self) -> LoopThread:
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=5.0)
        self.loop.close()

    def run(self, coro: Coroutine[Any, Any, T], timeout_s: float = 10.0) -> T:
        """Run ``coro`` on the loop; raise ``TimeoutError`` after ``timeout_s`` seconds."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout=timeout_s)


@dataclass
class Stack:
    """A running proxy with its stub engines, and a client."""

    loop: LoopThread
    proxy: ProxyServer
    prefills: list[StubEngine]
    decodes: list[StubEngine]
    client: httpx.Client

    def url(self, path: str) -> str:
        return self.proxy.base_url + path

    def post(self, path: str, body: dict[str, Any]) -> httpx.Response:
        return self.client.post(self.url(path), json=body)

    def stream(self, path: str, body: dict[str, Any]) -> tuple[httpx.Response, bytes]:
        with self.client.stream("POST", self.url(path), json=body) as response:
            return response, b"".join(response.iter_raw())

    def status(self) -> dict[str, Any]:
        return self.client.get(self.url("/proxy/status")).json()

    def engine_status(self, url: str) -> dict[str, Any]:
        return next(engine for engine in self.status()["engines"] if engine["url"] == url)

    def wait_health(self, stub: StubEngine, healthy: bool, timeout_s: float = 5.0) -> None:
        deadline = time.monotonic() + timeout_s
        while self.engine_status(stub.url)["healthy"] is not healthy:
            assert time.monotonic() < deadline, f"{stub.name} not marked healthy={healthy} in {timeout_s} s"
            time.sleep(0.02)


def sse_events(raw: bytes) -> list[str]:
    """The ``data:`` payloads of a server-sent event stream, in order."""
    return [event.removeprefix("data: ") for event in raw.decode().split("\n\n") if event]


@contextlib.contextmanager
def running_stacks() -> Iterator[Callable[..., Stack]]:
    """Yield ``start(prefills, decodes, fleet=False, **config)``: starts the stubs and a proxy on a free port in
    front of them (a fleet: ``decodes`` are its engines), returns the :class:`Stack`; all are stopped on exit.
    ``health_interval_s`` defaults to 0.1 s."""
    with LoopThread() as loop:
        stacks: list[Stack] = []

        def start(prefills: list[StubEngine], decodes: list[StubEngine], fleet: bool = False,
                  **config: Any) -> Stack:
            for stub in prefills + decodes:
                loop.run(stub.start())
            config.setdefault("health_interval_s", 0.1)
            decode_urls = tuple(stub.url for stub in decodes)
            urls = {"engine_urls": decode_urls} if fleet else {
                "prefill_urls": tuple(stub.url for stub in prefills), "decode_urls": decode_urls}
            proxy = ProxyServer(ProxyConfig(**urls, port=0, **config))
            loop.run(proxy.start())
            stack = Stack(loop, proxy, prefills, decodes, httpx.Client(timeout=20.0))
            stacks.append(stack)
            return stack

        try:
            yield start
        finally:
            for stack in stacks:
                stack.client.close()
                loop.run(stack.proxy.stop())
                for stub in stack.prefills + stack.decodes:
                    loop.run(stub.stop())
