"""Replay a request trace against an OpenAI-compatible endpoint at the trace's own timing, and measure it.

Each request is sent to ``/v1/completions`` at its (scaled) arrival time with its prompt as token ids, streaming,
``ignore_eos`` and ``max_tokens`` = its output length, greedy. Per request the client records time to first token
(TTFT: from sending to the first streamed chunk carrying output), time per output token (TPOT: the rest of the
request over the remaining tokens), end-to-end latency (E2E) and, on failure, the reason; a failed request never
stops the run. At most ``max_concurrency`` requests are in flight; a request that has to wait for a slot is sent
late, and the delay is recorded (``dispatch_delay_s``).

:func:`run_replay` adds the engines' view: it reads ``/metrics`` of every engine before and after the measured
requests (:mod:`range_connector.bench.replay_metrics`) so that the report shows prompt tokens, local and external
(connector) prefix-cache hits and the engine's own TTFT histogram for exactly those requests. The first ``warmup``
requests are replayed first (at their own timing) and left out of every statistic.

Example::

    trace = prepare_trace(synthetic_trace(40), token_scale=1 / 32, time_scale=0.25)
    requests = build_requests(trace, PromptBuilder(normal_vocab_token_ids(model_dir)))
    report = run_replay(server.base_url, requests, warmup=4, label="range")
    print(report.summary["ttft_s"]["p99"], report.engine.external_hit_share)
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from range_connector.bench.handoff import fetch_traces, handoff_report
from range_connector.bench.replay_metrics import EngineCounts, engine_counts, settle_metrics, snapshot_metrics
from range_connector.bench.trace_prompts import PromptBuilder
from range_connector.bench.traces import Trace

__all__ = [
    "ReplayReport",
    "ReplayRequest",
    "RequestResult",
    "build_requests",
    "replay_requests",
    "run_replay",
    "summarize",
]

PERCENTILES = (50, 90, 99)
_CONNECT_TIMEOUT_S = 10.0


@dataclass(frozen=True, slots=True)
class ReplayRequest:
    """One request ready to send.

    Attributes:
        index: Position in the trace (after slicing).
        arrival_s: Send time in seconds from the start of its phase.
        prompt_token_ids: ``[num_prompt_tokens]`` token ids.
        max_tokens: Tokens to generate (the trace's output length).
    """

    index: int
    arrival_s: float
    prompt_token_ids: tuple[int, ...]
    max_tokens: int


@dataclass(slots=True)
class RequestResult:
    """What the client saw of one request. Times in seconds; ``None`` where it did not happen.

    Attributes:
        index: :attr:`ReplayRequest.index`.
        arrival_s: Scheduled send time from the start of the phase.
        sent_s: Actual send time from the start of the phase.
        dispatch_delay_s: ``sent_s - arrival_s`` (waiting for a concurrency slot, or a late event loop).
        ttft_s: Send to first streamed output.
        tpot_s: ``(e2e_s - ttft_s) / (output_tokens - 1)``; ``None`` with fewer than 2 output tokens.
        e2e_s: Send to the end of the response (also set for failures: time until the failure).
        prompt_tokens: Prompt length sent.
        output_tokens: Output tokens received (token ids when the server returns them, else ``usage``).
        cached_tokens: Prompt tokens the server reports as cached (``usage.prompt_tokens_details.cached_tokens``:
            vLLM's local prefix cache plus connector hits; only with ``--enable-prompt-tokens-details``).
        finish_reason: The server's ``finish_reason``.
        output_digest: Hex digest (blake2b, 8 bytes) of the generated token ids when the server returned them
            (vLLM's ``return_token_ids``), to compare outputs across configurations; else ``None``.
        output_token_ids: The generated token ids (empty when the server did not return them), to tell where two
            configurations' outputs part.
        error: ``None`` on success, else a one-line reason (HTTP status and body, timeout, connection error).
        request_id: The ``X-Request-Id`` it was sent with (a proxy's ``/proxy/traces`` names it).
        sent_wall_s: Wall-clock send time (``time.time()``), to join with a proxy's traces on the same host.
    """

    index: int
    arrival_s: float
    sent_s: float | None = None
    dispatch_delay_s: float | None = None
    ttft_s: float | None = None
    tpot_s: float | None = None
    e2e_s: float | None = None
    prompt_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int | None = None
    finish_reason: str | None = None
    output_digest: str | None = None
    output_token_ids: list[int] = field(default_factory=list)
    error: str | None = None
    request_id: str | None = None
    sent_wall_s: float | None = None


@dataclass
class ReplayReport:
    """Result of :func:`run_replay` for one configuration.

    Attributes:
        label: Name of the configuration (``"none"``, ``"range"``, ...).
        trace: :meth:`Trace.describe` of the replayed trace, when known.
        options: Replay options (concurrency, warm-up count, endpoint).
        summary: :func:`summarize` of the measured (non-warm-up) results.
        engine: Deltas of the engines' ``/metrics`` over the measured requests; ``None`` without metrics URLs.
        results: Per measured request.
        warmup_results: Per warm-up request (not in any statistic).
        handoff: When ``base_url`` is a Range proxy: each measured request's time split between the client, the
            proxy, the prefill call and the decode call, and its percentiles
            (:func:`range_connector.bench.handoff.handoff_report`); else ``None``.
    """

    label: str
    trace: dict[str, Any] | None
    options: dict[str, Any]
    summary: dict[str, Any]
    engine: EngineCounts | None
    results: list[RequestResult] = field(default_factory=list)
    warmup_results: list[RequestResult] = field(default_factory=list)
    handoff: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return {
            "label": self.label,
            "trace": self.trace,
            "options": self.options,
            "summary": self.summary,
            "engine": None if self.engine is None else self.engine.to_dict(),
            "results": [asdict(r) for r in self.results],
            "warmup_results": [asdict(r) for r in self.warmup_results],
            "handoff": self.handoff,
        }


def build_requests(trace: Trace, builder: PromptBuilder) -> list[ReplayRequest]:
    """Turn every request of ``trace`` into a :class:`ReplayRequest` (prompts from ``builder``)."""
    return [ReplayRequest(i, r.arrival_s, tuple(builder.prompt(r, trace.block_tokens)), r.output_tokens)
            for i, r in enumerate(trace.requests)]


# ------------------------------------------------------------------------------------------------------ client
def _one_line(text: str, limit: int = 300) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[:limit] + "..."


async def _send(client: Any, url: str, body: dict[str, Any], result: RequestResult, t_sent: float,
                timeout_s: float, headers: Mapping[str, str] | None = None) -> None:
    """Stream one completion into ``result`` (never raises for request failures)."""
    import httpx

    counts = {"chunks": 0, "usage": 0}
    token_ids: list[int] = []

    async def stream() -> None:
        async with client.stream("POST", url, json=body, headers=headers) as response:
            if response.status_code >= 400:
                text = (await response.aread()).decode("utf-8", errors="replace")
                result.error = _one_line(f"HTTP {response.status_code}: {text}")
                return
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[len("data:"):].strip()
                if data == "[DONE]":
                    return
                chunk = json.loads(data)
                if chunk.get("error"):
                    result.error = _one_line(f"stream error: {json.dumps(chunk['error'])}")
                    return
                if chunk.get("usage"):
                    counts["usage"] = int(chunk["usage"].get("completion_tokens") or 0)
                    details = chunk["usage"].get("prompt_tokens_details") or {}
                    if details.get("cached_tokens") is not None:
                        result.cached_tokens = int(details["cached_tokens"])
                for choice in chunk.get("choices") or []:
                    ids = choice.get("token_ids") or []
                    if choice.get("text") or ids:
                        if result.ttft_s is None:
                            result.ttft_s = time.perf_counter() - t_sent
                        counts["chunks"] += 1
                        token_ids.extend(ids)
                    result.finish_reason = choice.get("finish_reason") or result.finish_reason

    try:
        await asyncio.wait_for(stream(), timeout_s)
    except asyncio.TimeoutError:
        result.error = f"timeout: no complete answer within {timeout_s:g} s"
    except httpx.HTTPError as exc:
        result.error = _one_line(f"{type(exc).__name__}: {exc}")
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        result.error = _one_line(f"bad response: {type(exc).__name__}: {exc}")
    finally:
        result.e2e_s = time.perf_counter() - t_sent
    result.output_tokens = len(token_ids) or counts["usage"] or counts["chunks"]
    if token_ids:
        digest = hashlib.blake2b(np.asarray(token_ids, dtype=np.int64).tobytes(), digest_size=8)
        result.output_digest = digest.hexdigest()
        result.output_token_ids = [int(t) for t in token_ids]
    if result.error is None and result.ttft_s is None:
        result.error = "no output: the stream ended without a token"
    if result.error is None and result.ttft_s is not None and result.output_tokens >= 2:
        result.tpot_s = (result.e2e_s - result.ttft_s) / (result.output_tokens - 1)


async def replay_requests(base_url: str, requests: Sequence[ReplayRequest], *, max_concurrency: int = 64,
                          request_timeout_s: float = 600.0, model: str | None = None, progress: bool = True,
                          description: str = "replay", extra_body: Mapping[str, Any] | None = None,
                          ) -> list[RequestResult]:
    """Send ``requests`` at their arrival times (from now) and collect what the client saw.

    Args:
        base_url: ``http://host:port`` of any OpenAI-compatible server (a vLLM engine or a proxy).
        requests: In any order; each is sent at ``arrival_s`` seconds after the call.
        max_concurrency: Most requests in flight; later ones wait for a slot (recorded as dispatch delay).
        request_timeout_s: Longest a request may take in seconds (connect, queue, prefill and all tokens); past it
            the request is recorded as a timeout.
        model: ``model`` field; ``None`` asks ``GET /v1/models`` for the first model (omitted if that fails).
        progress: Show a tqdm progress bar of finished requests.
        description: Label of the progress bar.
        extra_body: More fields for every request body.

    Returns:
        One :class:`RequestResult` per request, in the order of ``requests``.

    Raises:
        ValueError: ``max_concurrency`` < 1 or ``request_timeout_s`` <= 0.
    """
    import httpx
    from tqdm.auto import tqdm

    if max_concurrency < 1:
        raise ValueError(f"max_concurrency: {max_concurrency} must be >= 1")
    if not request_timeout_s > 0:
        raise ValueError(f"request_timeout_s: {request_timeout_s} must be > 0")
    url = f"{base_url.rstrip('/')}/v1/completions"
    limits = httpx.Limits(max_connections=max_concurrency, max_keepalive_connections=max_concurrency)
    timeout = httpx.Timeout(request_timeout_s, connect=_CONNECT_TIMEOUT_S)
    results = [RequestResult(r.index, r.arrival_s, prompt_tokens=len(r.prompt_token_ids)) for r in requests]
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
        if model is None:
            model = await _first_model(client, base_url)
        slots = asyncio.Semaphore(max_concurrency)
        bar = tqdm(total=len(requests), desc=description, unit="req", disable=not progress, leave=False)
        t0 = time.perf_counter()
        run_tag = f"{description.replace(' ', '-')[:32]}-{int(time.time() * 1000) % 10**8}"

        async def one(request: ReplayRequest, result: RequestResult) -> None:
            await asyncio.sleep(max(0.0, t0 + request.arrival_s - time.perf_counter()))
            async with slots:
                result.request_id = f"replay-{run_tag}-{request.index}"
                result.sent_wall_s, t_sent = time.time(), time.perf_counter()
                result.sent_s = t_sent - t0
                result.dispatch_delay_s = result.sent_s - request.arrival_s
                body: dict[str, Any] = {
                    "prompt": list(request.prompt_token_ids), "max_tokens": request.max_tokens,
                    "temperature": 0.0, "ignore_eos": True, "stream": True,
                    "stream_options": {"include_usage": True}, "return_token_ids": True,
                    **({"model": model} if model else {}), **(extra_body or {}),
                }
                await _send(client, url, body, result, t_sent, request_timeout_s,
                            headers={"X-Request-Id": result.request_id})
            bar.update(1)
            if result.error is not None:
                bar.set_postfix_str(f"errors: {sum(r.error is not None for r in results)}")

        try:
            await asyncio.gather(*(one(r, res) for r, res in zip(requests, results)))
        finally:
            bar.close()
    return results


async def _first_model(client: Any, base_url: str) -> str | None:
    try:
        response = await client.get(f"{base_url.rstrip('/')}/v1/models", timeout=_CONNECT_TIMEOUT_S)
        data = response.json().get("data") or []
        return str(data[0]["id"]) if response.status_code == 200 and data else None
    except Exception:  # noqa: BLE001 - any failure: send without a model field
        return None


# ----------------------------------------------------------------------------------------------------- summary
def _stats(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"mean": None, **{f"p{p}": None for p in PERCENTILES}}
    arr = np.asarray(values, dtype=np.float64)
    return {"mean": float(arr.mean()), **{f"p{p}": float(np.percentile(arr, p)) for p in PERCENTILES}}


def summarize(results: Sequence[RequestResult]) -> dict[str, Any]:
    """Percentiles (p50, p90, p99; linear interpolation, ``numpy.percentile``) and means of TTFT, TPOT, E2E and
    dispatch delay in seconds over successful requests; counts; throughput over the measured span (first send to
    last end): requests/s, output tokens/s and prompt + output tokens/s.

    Returns:
        ``{"num_requests", "num_ok", "num_errors", "errors": {reason: count}, "span_s", "ttft_s": {...},
        "tpot_s", "e2e_s", "dispatch_delay_s", "request_throughput_per_s", "output_tokens_per_s",
        "total_tokens_per_s", "prompt_tokens", "output_tokens"}``.
    """
    ok = [r for r in results if r.error is None]
    sent = [r for r in results if r.sent_s is not None]
    span_s = (max(r.sent_s + (r.e2e_s or 0.0) for r in sent) - min(r.sent_s for r in sent)) if sent else 0.0
    errors: dict[str, int] = {}
    for r in results:
        if r.error is not None:
            reason = r.error.split(":", 1)[0]
            errors[reason] = errors.get(reason, 0) + 1
    num_prompt = sum(r.prompt_tokens for r in ok)
    num_output = sum(r.output_tokens for r in ok)
    cached = [r.cached_tokens for r in ok if r.cached_tokens is not None]
    rate = (lambda n: n / span_s if span_s > 0 else None)  # noqa: E731
    return {
        "num_requests": len(results),
        "num_ok": len(ok),
        "num_errors": len(results) - len(ok),
        "errors": errors,
        "span_s": span_s,
        "ttft_s": _stats([r.ttft_s for r in ok if r.ttft_s is not None]),
        "tpot_s": _stats([r.tpot_s for r in ok if r.tpot_s is not None]),
        "e2e_s": _stats([r.e2e_s for r in ok if r.e2e_s is not None]),
        "dispatch_delay_s": _stats([r.dispatch_delay_s for r in ok if r.dispatch_delay_s is not None]),
        "prompt_tokens": num_prompt,
        "output_tokens": num_output,
        "cached_tokens": sum(cached) if cached else None,
        "request_throughput_per_s": rate(len(ok)),
        "output_tokens_per_s": rate(num_output),
        "total_tokens_per_s": rate(num_prompt + num_output),
    }


def run_replay(base_url: str, requests: Sequence[ReplayRequest], *, metrics_urls: Sequence[str] | None = None,
               warmup: int = 0, label: str = "replay", trace: Trace | None = None, max_concurrency: int = 64,
               request_timeout_s: float = 600.0, model: str | None = None, progress: bool = True,
               metrics_timeout_s: float = 30.0) -> ReplayReport:
    """Replay ``requests``: the first ``warmup`` of them as a warm-up phase, then the rest, measured.

    Both phases keep the trace's timing (the measured phase starts at its first request's arrival). Between them,
    and after the measured phase, ``/metrics`` of every URL in ``metrics_urls`` is read; the after-reading waits
    (up to ``metrics_timeout_s``) until the engines have published the prompt tokens and first tokens of the
    measured requests (vLLM logs its statistics asynchronously).

    Args:
        base_url: Endpoint to send to.
        requests: The trace's requests in order (see :func:`build_requests`).
        metrics_urls: Engines whose ``/metrics`` to read (``[base_url]`` for a single vLLM server); ``None`` or
            empty: no engine figures.
        warmup: Leading requests excluded from the statistics.
        label: Configuration name in the report.
        trace: The trace, for the report's description.
        max_concurrency, request_timeout_s, model, progress: As in :func:`replay_requests`.
        metrics_timeout_s: Longest wait in seconds for the engines' counters to catch up.

    Returns:
        The report.

    Raises:
        ValueError: ``warmup`` negative or not smaller than ``len(requests)``. Neither failed requests nor
            unreadable ``/metrics`` raise: they are in the report (``error`` per request,
            ``engine.extra["unreadable_engines"]``).
    """
    if not 0 <= warmup < len(requests):
        raise ValueError(f"warmup: {warmup} must be >= 0 and < the {len(requests)} requests")
    kwargs = dict(max_concurrency=max_concurrency, request_timeout_s=request_timeout_s, model=model,
                  progress=progress)
    warm: list[RequestResult] = []
    if warmup:
        warm = asyncio.run(replay_requests(base_url, requests[:warmup], description=f"{label} warm-up", **kwargs))
    measured = list(requests[warmup:])
    t_first = measured[0].arrival_s
    measured = [ReplayRequest(r.index, r.arrival_s - t_first, r.prompt_token_ids, r.max_tokens) for r in measured]
    urls = list(metrics_urls or [])
    before = snapshot_metrics(urls) if urls else None
    results = asyncio.run(replay_requests(base_url, measured, description=label, **kwargs))
    engine = None
    if before is not None:
        started = [r for r in results if r.ttft_s is not None]
        after = settle_metrics(urls, before, min_prompt_tokens=sum(r.prompt_tokens for r in started),
                               min_first_tokens=len(started), timeout_s=metrics_timeout_s)
        engine = engine_counts(before, after)
    options = {"base_url": base_url, "metrics_urls": urls, "warmup": warmup, "max_concurrency": max_concurrency,
               "request_timeout_s": request_timeout_s, "model": model}
    return ReplayReport(label, None if trace is None else trace.describe(), options, summarize(results), engine,
                        results, warm, handoff_report(results, fetch_traces(base_url)))
