"""Requests to a running vLLM API server: one timed completion, its Prometheus metrics, a prefix-cache reset.

:func:`complete` sends one streamed (or not) ``/v1/completions`` request and measures time to first token
(:class:`CompletionResult`); :func:`scrape_metrics` reads vLLM's Prometheus ``/metrics``, summed over label sets, and
:func:`wait_for_metric` polls it until a counter arrives (vLLM publishes step stats asynchronously);
:func:`reset_prefix_cache` empties vLLM's own prefix cache (dev mode only). ``httpx`` (and ``prometheus_client``
for the metrics) are imported when called. The server is started by
:class:`range_connector.testing.server_process.ServerProcess`, or is any OpenAI-compatible vLLM server at a URL.
"""

from __future__ import annotations

import collections
import json
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = ["CompletionResult", "complete", "reset_prefix_cache", "scrape_metrics", "wait_for_metric"]


@dataclass
class CompletionResult:
    """One completion as seen by the client.

    Attributes:
        text: Generated text (all choices' text joined, normally one choice).
        token_ids: Generated token ids, when the server returned them (``return_token_ids``); else ``None``.
        token_texts: Text of each streamed chunk that carried output (one per token when streaming, one in all
            otherwise).
        ttft_s: Seconds from sending the request to the first streamed chunk with output (for ``stream=False``,
            the whole latency).
        latency_s: Seconds from sending the request to the end of the response.
        prompt_tokens: Prompt length in tokens reported in ``usage``; ``None`` if absent.
        completion_tokens: Generated tokens reported in ``usage``; ``None`` if absent.
        cached_tokens: ``usage.prompt_tokens_details.cached_tokens`` (only with
            ``--enable-prompt-tokens-details``); ``None`` if absent.
        finish_reason: ``"length"``, ``"stop"``, ... of the (last) choice.
        prompt_token_ids: Prompt token ids echoed by the server (``return_token_ids``); ``None`` if absent.
    """

    text: str
    token_ids: list[int] | None
    token_texts: list[str]
    ttft_s: float
    latency_s: float
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None
    finish_reason: str | None = None
    prompt_token_ids: list[int] | None = field(default=None, repr=False)


def complete(
    base_url: str,
    prompt_token_ids: Sequence[int] | None = None,
    prompt: str | None = None,
    max_tokens: int = 16,
    stream: bool = True,
    *,
    temperature: float = 0.0,
    ignore_eos: bool = False,
    model: str | None = None,
    timeout_s: float = 600.0,
    extra_body: Mapping[str, Any] | None = None,
) -> CompletionResult:
    """Send one ``/v1/completions`` request (greedy by default) and time it.

    Args:
        base_url: ``http://host:port`` of the server.
        prompt_token_ids: Prompt as token ids (preferred: no tokenizer round trip); exclusive with ``prompt``.
        prompt: Prompt as text.
        max_tokens: Tokens to generate.
        stream: Stream the answer (server-sent events) to measure time to first token.
        temperature: Sampling temperature; 0 is greedy.
        ignore_eos: Keep generating past the end-of-sequence token (a fixed number of tokens).
        model: ``model`` field; the server's only model when ``None``.
        timeout_s: Read timeout of the request in seconds.
        extra_body: More request fields (vLLM sampling extensions, ...).

    Returns:
        The generated text and token ids with client-side timings in seconds.

    Raises:
        ValueError: Neither or both of ``prompt_token_ids`` and ``prompt`` given.
        httpx.HTTPStatusError: The server answered with an error status (the body is in the message).
        httpx.HTTPError: Connection or protocol failure.
    """
    import httpx

    if (prompt_token_ids is None) == (prompt is None):
        raise ValueError("give exactly one of prompt_token_ids and prompt")
    body: dict[str, Any] = {
        "prompt": list(prompt_token_ids) if prompt_token_ids is not None else prompt,
        "max_tokens": max_tokens,
        "temperature": temperature,
        "stream": stream,
        "return_token_ids": True,
    }
    if ignore_eos:
        body["ignore_eos"] = True
    if model is not None:
        body["model"] = model
    if stream:
        body["stream_options"] = {"include_usage": True}
    body.update(extra_body or {})
    url = f"{base_url.rstrip('/')}/v1/completions"
    timeout = httpx.Timeout(timeout_s, connect=10.0)
    texts: list[str] = []
    token_ids: list[int] = []
    saw_token_ids = False
    usage: dict[str, Any] = {}
    finish_reason: str | None = None
    echoed_prompt_ids: list[int] | None = None
    ttft_s: float | None = None
    with httpx.Client(timeout=timeout) as client:
        t0 = time.perf_counter()
        if not stream:
            response = client.post(url, json=body)
            _raise_for_status(response)
            latency_s = time.perf_counter() - t0
            doc = response.json()
            for choice in doc.get("choices", []):
                texts.append(choice.get("text") or "")
                if choice.get("token_ids") is not None:
                    saw_token_ids = True
                    token_ids.extend(choice["token_ids"])
                if choice.get("prompt_token_ids") is not None:
                    echoed_prompt_ids = list(choice["prompt_token_ids"])
                finish_reason = choice.get("finish_reason") or finish_reason
            usage = doc.get("usage") or {}
            ttft_s = latency_s
        else:
            with client.stream("POST", url, json=body) as response:
                if response.status_code >= 400:
                    response.read()
                    _raise_for_status(response)
                for line in response.iter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[len("data:"):].strip()
                    if data == "[DONE]":
                        break
                    chunk = json.loads(data)
                    if chunk.get("usage"):
                        usage = chunk["usage"]
                    for choice in chunk.get("choices") or []:
                        text = choice.get("text") or ""
                        ids = choice.get("token_ids")
                        if choice.get("prompt_token_ids") is not None:
                            echoed_prompt_ids = list(choice["prompt_token_ids"])
                        if text or ids:
                            if ttft_s is None:
                                ttft_s = time.perf_counter() - t0
                            texts.append(text)
                        if ids is not None:
                            saw_token_ids = True
                            token_ids.extend(ids)
                        finish_reason = choice.get("finish_reason") or finish_reason
            latency_s = time.perf_counter() - t0
            if ttft_s is None:
                ttft_s = latency_s
    details = usage.get("prompt_tokens_details") or {}
    return CompletionResult(
        text="".join(texts),
        token_ids=token_ids if saw_token_ids else None,
        token_texts=texts,
        ttft_s=ttft_s,
        latency_s=latency_s,
        prompt_tokens=usage.get("prompt_tokens"),
        completion_tokens=usage.get("completion_tokens"),
        cached_tokens=details.get("cached_tokens"),
        finish_reason=finish_reason,
        prompt_token_ids=echoed_prompt_ids,
    )


def _raise_for_status(response: Any) -> None:
    import httpx

    if response.status_code >= 400:
        raise httpx.HTTPStatusError(
            f"{response.request.method} {response.request.url} -> {response.status_code}: {response.text[:2000]}",
            request=response.request,
            response=response,
        )


def scrape_metrics(base_url: str, timeout_s: float = 10.0) -> dict[str, float]:
    """Read vLLM's Prometheus ``/metrics`` and sum the samples of each sample name over all label sets.

    Args:
        base_url: ``http://host:port`` of the server.
        timeout_s: Request timeout in seconds.

    Returns:
        Sample name (e.g. ``"vllm:external_prefix_cache_hits_total"``, ``"vllm:prompt_tokens_total"``) -> sum of
        its values (counters in their own unit: tokens for the prefix-cache counters).

    Raises:
        httpx.HTTPError: The server could not be reached or answered with an error status.
    """
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    response = httpx.get(f"{base_url.rstrip('/')}/metrics", timeout=timeout_s)
    response.raise_for_status()
    totals: dict[str, float] = collections.defaultdict(float)
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            if sample.name.endswith("_created"):  # creation timestamps: summing them means nothing
                continue
            totals[sample.name] += float(sample.value)
    return dict(totals)


def wait_for_metric(
    base_url: str, name: str, at_least: float, *, timeout_s: float = 10.0, poll_interval_s: float = 0.2
) -> dict[str, float]:
    """Scrape ``/metrics`` until sample ``name`` reaches ``at_least`` (vLLM publishes step stats asynchronously).

    Args:
        base_url: ``http://host:port`` of the server.
        name: Sample name, e.g. ``"vllm:prompt_tokens_total"``.
        at_least: Value to wait for.
        timeout_s: Longest wait in seconds; the last scrape is returned when it passes.
        poll_interval_s: Pause between scrapes in seconds.

    Returns:
        The last scrape (see :func:`scrape_metrics`), whether or not ``name`` reached ``at_least``.
    """
    deadline_s = time.monotonic() + timeout_s
    while True:
        metrics = scrape_metrics(base_url)
        if metrics.get(name, 0.0) >= at_least or time.monotonic() > deadline_s:
            return metrics
        time.sleep(poll_interval_s)


def reset_prefix_cache(base_url: str, *, reset_external: bool = False, timeout_s: float = 30.0) -> bool:
    """Empty vLLM's own (local) prefix cache through ``POST /reset_prefix_cache``.

    The route exists only when the server runs with ``VLLM_SERVER_DEV_MODE=1``.

    Args:
        base_url: ``http://host:port`` of the server.
        reset_external: Also ask the KV connector to reset its cache (``?reset_external=true``).
        timeout_s: Request timeout in seconds.

    Returns:
        The server's ``success`` flag (``False`` while blocks are still held by running requests).

    Raises:
        httpx.HTTPStatusError: The route is missing (404: no dev mode) or failed.
    """
    import httpx

    response = httpx.post(
        f"{base_url.rstrip('/')}/reset_prefix_cache",
        params={"reset_external": "true" if reset_external else "false"},
        timeout=timeout_s,
    )
    response.raise_for_status()
    try:
        return bool(response.json().get("success", True))
    except ValueError:  # older servers answer 200 with an empty body
        return True
