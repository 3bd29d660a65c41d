"""Trace replay and the demo: traces (Mooncake and Azure formats), the synthetic trace, the replay client, the
engines' metrics around a replay, the side-by-side report, and ``python -m range_connector.bench.demo``
(``make demo``). Used by the scripts in ``bench/`` and by ``make demo``; not by the connector.

May import: ``errors``, ``kv``, ``config``, ``backends``, ``serving``, ``testing``.
"""
