"""``range-connector proxy``: the proxy in front of prefill and decode engines, or of a fleet of ``kv_both`` ones.

The proxy itself is :mod:`range_connector.serving.proxy` (it needs ``aiohttp``, imported when the handler runs: a
missing one exits ``EXIT_FAILURE`` with the pip line); this module is the command's parser and handler. A bad
option exits ``EXIT_BAD_INPUT`` naming the command-line option; a port it cannot listen on exits ``EXIT_FAILURE``.
"""

from __future__ import annotations

import argparse
import sys

from range_connector.cli.common import EXIT_BAD_INPUT, EXIT_FAILURE, EXIT_OK, Parser, positive_float
from range_connector.errors import ConfigError

__all__ = ["add_commands"]


def add_commands(subparsers: argparse._SubParsersAction[Parser]) -> None:
    """Register ``proxy``."""
    proxy = subparsers.add_parser(
        "proxy",
        help="proxy in front of engines: disaggregated (each request goes to a prefill engine with max_tokens=1, "
        "then to a decode engine with the returned kv_transfer_params) or a fleet of kv_both engines (--engine)",
    )
    proxy.add_argument("--prefill", action="append", default=[], metavar="URL",
                       help="base URL of a prefill engine (kv_producer), e.g. http://10.0.0.1:8100; repeatable")
    proxy.add_argument("--decode", action="append", default=[], metavar="URL",
                       help="base URL of a decode engine (kv_consumer); repeatable")
    proxy.add_argument("--engine", action="append", default=[], metavar="URL",
                       help="base URL of a fleet engine (kv_both; instead of --prefill/--decode): each request goes "
                       "whole to one of them; repeatable")
    proxy.add_argument("--host", default="127.0.0.1", help="interface to listen on (default: 127.0.0.1)")
    proxy.add_argument("--port", type=int, default=8000, help="port to listen on (default: 8000)")
    proxy.add_argument("--policy", choices=["round_robin", "least_loaded", "prefix_aware"], default="round_robin",
                       help="how a request picks among healthy engines of a kind (least_loaded: fewest in flight; "
                       "prefix_aware: the engine it sent the longest prefix of the prompt to, else least loaded)")
    proxy.add_argument("--prefix-imbalance-requests", type=int, default=4, metavar="N",
                       help="prefix_aware: most requests in flight an engine with the prefix may have above the least "
                       "loaded one and still be chosen (default: 4)")
    proxy.add_argument("--timeout-s", type=positive_float, default=300.0,
                       help="default of --prefill-timeout-s and --decode-timeout-s (default: 300)")
    proxy.add_argument("--prefill-timeout-s", type=positive_float, default=None,
                       help="deadline of the whole prefill call, seconds")
    proxy.add_argument("--decode-timeout-s", type=positive_float, default=None,
                       help="longest silence of a decode engine (before its answer, between streamed chunks), seconds")
    proxy.add_argument("--connect-timeout-s", type=positive_float, default=5.0,
                       help="deadline of one connection attempt, seconds (default: 5)")
    proxy.add_argument("--health-interval-s", type=positive_float, default=5.0,
                       help="seconds between health checks of every engine (default: 5)")
    proxy.add_argument("--max-body-bytes", type=int, default=None, metavar="N",
                       help="largest client request body in bytes; larger ones get 413 (default: 67108864)")
    proxy.add_argument("--log-level", choices=["debug", "info", "warning", "error"], default="info")
    proxy.set_defaults(handler=_proxy)


def _proxy(args: argparse.Namespace) -> int:
    import asyncio
    import logging

    try:
        from range_connector.serving.proxy import Policy, ProxyConfig, serve_proxy
    except ImportError as exc:
        print(f"error: the proxy needs aiohttp ({exc}): pip install 'range-connector[proxy]'", file=sys.stderr)
        return EXIT_FAILURE

    try:
        config = ProxyConfig(
            prefill_urls=tuple(args.prefill),
            decode_urls=tuple(args.decode),
            engine_urls=tuple(args.engine),
            prefix_imbalance_requests=args.prefix_imbalance_requests,
            host=args.host,
            port=args.port,
            policy=Policy(args.policy),
            prefill_timeout_s=args.prefill_timeout_s or args.timeout_s,
            decode_timeout_s=args.decode_timeout_s or args.timeout_s,
            connect_timeout_s=args.connect_timeout_s,
            health_interval_s=args.health_interval_s,
            **({"max_body_bytes": args.max_body_bytes} if args.max_body_bytes is not None else {}),
        )
    except ConfigError as exc:  # name the command-line option, not the config field
        option = "--" + exc.key.removesuffix("_urls").replace("_", "-")
        print(f"error: {option}: {str(exc)[len(exc.key) + 2:]}", file=sys.stderr)
        return EXIT_BAD_INPUT
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        asyncio.run(serve_proxy(config))
    except OSError as exc:
        print(f"error: cannot listen on {args.host}:{args.port}: {exc}", file=sys.stderr)
        return EXIT_FAILURE
    return EXIT_OK
