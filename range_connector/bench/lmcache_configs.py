"""The replay's LMCache configurations: vLLM's ``LMCacheMPConnector`` against LMCache 0.5.6's MP server.

* ``lmcache``: the MP server with a 1 GiB L1 and no L2 (every hit from its CPU memory).
* ``lmcache-resp``: a small L1 (``l1_size_gb``) in front of LMCache's own ``resp`` L2 adapter on one Valkey server.
* ``lmcache-range``: the same L1 in front of the Range L2 adapter (``range_connector.lmcache``, docs/lmcache.md) on
  the same kind of server (one shard).

With an L1 smaller than the trace's working set most hits must come from L2; :func:`valkey_counters` read before
and after a replay tell how many bytes the Valkey server sent (what L2 served). The server is started by the replay
(``bench/replay.py``), open (no password) on loopback, one per configuration run.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from range_connector.testing.lmcache_server import LMCacheServer, range_l2_adapter, resp_l2_adapter

__all__ = ["L2_CONFIGS", "LMCACHE_CONFIGS", "l2_adapters", "lmcache_server", "valkey_counters", "valkey_delta"]

LMCACHE_CONFIGS = ("lmcache", "lmcache-resp", "lmcache-range")
#: the configurations with an L2 adapter on a Valkey server
L2_CONFIGS = ("lmcache-resp", "lmcache-range")
#: L1 of ``lmcache`` (no L2), GiB
FULL_L1_GB = 1.0
#: Range's deployment of the replay's objects
REPLAY_DEPLOYMENT = "replay"


def l2_adapters(config: str, valkey_url: str | None) -> list[dict[str, Any]]:
    """LMCache's ``--l2-adapter`` mappings of ``config``: none for ``lmcache``; LMCache's ``resp`` adapter or the
    Range adapter on ``valkey_url`` (``valkey://host:port``, no password) for the others.

    Raises:
        ValueError: ``config`` is not one of :data:`LMCACHE_CONFIGS`, or an L2 configuration without a URL.
    """
    if config not in LMCACHE_CONFIGS:
        raise ValueError(f"{config!r} is not an LMCache configuration ({', '.join(LMCACHE_CONFIGS)})")
    if config == "lmcache":
        return []
    if not valkey_url:
        raise ValueError(f"{config}: needs a Valkey server URL")
    if config == "lmcache-resp":
        hostport = valkey_url.split("://", 1)[-1].rsplit("@", 1)[-1]
        host, port = hostport.rsplit(":", 1)
        return [resp_l2_adapter(host, int(port))]
    return [range_l2_adapter([valkey_url], deployment=REPLAY_DEPLOYMENT)]


def lmcache_server(config: str, venv: Path, run_dir: Path, valkey_url: str | None,
                   l1_size_gb: float) -> LMCacheServer:
    """The MP server of ``config`` (not started): L1 of :data:`FULL_L1_GB` for ``lmcache``, ``l1_size_gb`` for the
    L2 configurations; its log is ``run_dir/lmcache-server.log``.

    Raises:
        ValueError: as :func:`l2_adapters`.
        RuntimeError: ``venv`` has no ``bin/python``.
    """
    adapters = l2_adapters(config, valkey_url)
    return LMCacheServer(venv, run_dir / "lmcache-server.log", l1_size_gb=l1_size_gb if adapters else FULL_L1_GB,
                         l2_adapters=adapters)


def valkey_counters(url: str) -> dict[str, int]:
    """A Valkey server's counters: ``sent_bytes`` (``total_net_output_bytes``), ``received_bytes`` and the calls of
    each command (``INFO commandstats``, lower-case names)."""
    import valkey

    client = valkey.Valkey.from_url(url, socket_timeout=10.0)
    try:
        stats = client.info("stats")
        commands = client.info("commandstats")
    finally:
        client.close()
    out = {"sent_bytes": int(stats["total_net_output_bytes"]), "received_bytes": int(stats["total_net_input_bytes"])}
    out.update({name.removeprefix("cmdstat_"): int(s["calls"]) for name, s in commands.items()})
    return out


def valkey_delta(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    """``after - before`` per counter (the ``INFO`` commands themselves included), zero ones left out."""
    return {k: v - before.get(k, 0) for k, v in after.items() if v - before.get(k, 0)}
