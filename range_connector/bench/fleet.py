"""Two ``kv_both`` engines behind ``range-connector proxy``: round robin or prefix-aware, without or with Range.

:func:`run_fleet` runs one configuration: it starts two vLLM engines (``kv_both``; core 0 and core 1, started in
parallel, vLLM's own prefix cache on, as users run them), ``range-connector proxy --engine A --engine B --policy P``
in front of them, replays a trace through the proxy at its arrival times, and stops everything. The configurations
(:data:`CONFIGS`) are ``<policy>-<connector>``:

* ``rr-none``: round robin, no connector;
* ``prefix-none``: prefix-aware routing, no connector (what users run today);
* ``rr-range``: round robin, both engines with Range on the same Valkey shards (:data:`NUM_SHARDS`, embedded);
* ``prefix-range``: prefix-aware routing and Range.

With vLLM's prefix cache on, a tier hit in a fleet is a prefix the engine's own cache no longer (or never) held:
computed by the other engine, or by itself and evicted since. :func:`per_engine_lines` reports each engine's
shares, so that the split shows.

Used by ``bench/fleet.py`` (any of the four, one table) and by the demo (``prefix-none`` against ``prefix-range``).
Engine settings (block size, chunk size, model length) are the demo's
(:mod:`range_connector.bench.stack`).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from range_connector.bench import stack
from range_connector.testing.client import complete
from range_connector.testing.server_process import connector_config

if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence

    from range_connector.bench.replay import ReplayReport, ReplayRequest
    from range_connector.bench.traces import Trace

__all__ = ["CONFIGS", "NUM_ENGINES", "NUM_SHARDS", "POLICIES", "per_engine_lines", "run_fleet", "split_config"]

CONFIGS = ("rr-none", "prefix-none", "rr-range", "prefix-range")
#: the configuration's policy part -> the proxy's ``--policy``
POLICIES = {"rr": "round_robin", "prefix": "prefix_aware"}
NUM_ENGINES = 2
NUM_SHARDS = stack.NUM_SHARDS


def split_config(config: str) -> tuple[str, str]:
    """``(proxy policy, connector)`` of a configuration, e.g. ``"prefix-range"`` -> ``("prefix_aware", "range")``.

    Raises:
        ValueError: ``config`` is not one of :data:`CONFIGS` (the message lists them).
    """
    if config not in CONFIGS:
        raise ValueError(f"unknown fleet configuration {config!r} (known: {', '.join(CONFIGS)})")
    policy, connector = config.split("-")
    return POLICIES[policy], connector


def run_fleet(config: str, model_dir: Path, run_dir: Path, requests: list[ReplayRequest], trace: Trace,
              prime: list[int], *, kv_cache_gib: int = 1,
              range_extra: Mapping[str, Any] | None = None) -> ReplayReport:
    """Valkey (for ``*-range``), two engines, the fleet proxy; replay through the proxy; stop all.

    Each engine gets the priming prompt directly (one-off first-request costs on both engines, whichever the proxy
    would route it to), then the proxy gets it once more before the replay.

    Args:
        config: One of :data:`CONFIGS`.
        model_dir: The model both engines serve.
        run_dir: Work folder; this configuration's engines, proxy and Valkey live in ``run_dir/<config>``.
        requests: The replay's requests (:func:`range_connector.bench.replay.build_requests`).
        trace: The trace they came from (its description goes into the report).
        prime: Token ids of the priming prompt (shares no block with the trace's).
        kv_cache_gib: Each engine's KV cache, GiB.
        range_extra: Keys merged into Range's ``kv_connector_extra_config`` (``*-range`` only).

    Returns:
        The :class:`range_connector.bench.replay.ReplayReport` labelled ``config``; its engine rows sum both engines
        (a fleet counts each prompt once, on the engine that served it), ``options`` adds the proxy's
        ``/proxy/status``, the engines' commands, the logs and (``*-range``) what each Valkey shard holds.

    Raises:
        ValueError: Unknown ``config``.
        DemoError, ServerError: A process did not start (the message names its log).
    """
    import httpx

    from range_connector.backends.valkey.servers import ensure_servers, server_status, stop_servers
    from range_connector.backends.valkey.urls import redact_url

    policy, connector = split_config(config)
    run_dir = run_dir / config
    valkey_dir = run_dir / "valkey"
    with stack.Cleanup() as cleanup:
        kv_config = None
        if connector == "range":
            cleanup.callback(lambda: stack.log(f"{config}: stopped {stop_servers(valkey_dir)} Valkey server(s)"))
            urls = ensure_servers(NUM_SHARDS, valkey_dir)
            stack.log(f"{config}: Valkey: {NUM_SHARDS} shards at {', '.join(map(redact_url, urls))}")
            kv_config = connector_config({"chunk_tokens": stack.CHUNK_TOKENS, "num_shards": NUM_SHARDS,
                                          "runtime_dir": str(valkey_dir), "tiers": [{"type": "valkey"}],
                                          **(range_extra or {})})
        engines = [stack.engine_server(model_dir, run_dir, f"engine{idx}", str(idx), kv_cache_gib, kv_config)
                   for idx in range(NUM_ENGINES)]
        cleanup.callback(lambda: stack.log(f"{config}: stopped the proxy and both engines"))
        for server in engines:  # all start before any is waited for: the starts overlap
            cleanup.enter_context(server)
            stack.log(f"{config}: engine starting on {server.base_url} (core {server.omp_threads_bind}, "
                      f"log {server.log_path})")
        for server in engines:
            stack.log(f"{config}: engine on {server.base_url} ready after "
                      f"{server.wait_ready(timeout_s=stack.STARTUP_TIMEOUT_S):.0f} s")
        for server in engines:
            complete(server.base_url, prompt_token_ids=prime, max_tokens=2, timeout_s=stack.REQUEST_TIMEOUT_S)
        engine_args = [arg for server in engines for arg in ("--engine", server.base_url)]
        proxy = cleanup.enter_context(stack.ProxyProcess([*engine_args, "--policy", policy], run_dir / "proxy.log"))
        proxy.wait_ready(stack.PROXY_TIMEOUT_S)
        stack.log(f"{config}: proxy --policy {policy} ready on {proxy.url} (log {proxy.log_path})")
        report = stack.replay_primed(proxy.url, requests, trace, config, [server.base_url for server in engines], prime)
        status = httpx.get(f"{proxy.url}/proxy/status", timeout=5.0).json()
        report.options.update(
            proxy_status=status, engines={server.base_url: server.command() for server in engines},
            logs={"proxy": str(proxy.log_path), **{server.base_url: str(server.log_path) for server in engines}})
        if connector == "range":
            report.options["valkey"] = [{"shard": s.shard_idx, "used_memory_bytes": s.used_memory_bytes,
                                         "num_keys": s.num_keys} for s in server_status(valkey_dir)]
        stack.log(f"{config}: done; stopping the proxy, the engines" + (" and Valkey" if connector == "range" else ""))
    return report


def per_engine_lines(reports: Sequence[ReplayReport]) -> list[str]:
    """One line per report and engine: its prompt tokens, and the shares from its own prefix cache and from the tier.

    Args:
        reports: Fleet reports (:func:`run_fleet`); a report without engine counts gives no line.

    Returns:
        Lines like ``"  prefix-range  http://127.0.0.1:8001: 16376 prompt tokens, 72.6% from its own prefix cache,
        3.0% loaded from the shared tier"`` (shares of that engine's prompt tokens; ``-`` when it had none).
    """
    lines = []
    for report in reports:
        if report.engine is None:
            continue
        for url, counts in sorted(report.engine.per_engine.items()):
            prompt_tokens = counts.get("prompt_tokens") or 0
            local_tokens = counts.get("local_hit_tokens") or 0
            external_tokens = counts.get("external_hit_tokens") or 0

            def share(num_tokens: float, prompt_tokens: float = prompt_tokens) -> str:
                return f"{100 * num_tokens / prompt_tokens:.1f}%" if prompt_tokens else "-"

            lines.append(f"  {report.label:13s} {url}: {prompt_tokens:.0f} prompt tokens, {share(local_tokens)} from "
                         f"its own prefix cache, {share(external_tokens)} loaded from the shared tier")
    return lines
