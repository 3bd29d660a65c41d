"""Operators' tools that work without an engine: the namespace and prefix hash chain a given model and config
produce (:mod:`~range_connector.ops.offline_spec`), the cache's contents per tier, shard and deployment and their
removal (:mod:`~range_connector.ops.cache_inventory`), and the hit a prompt would get
(:mod:`~range_connector.ops.cache_lookup`); one HTML page from result files of the benchmarks, the replay and the
demo (:mod:`~range_connector.ops.report`, with :mod:`~range_connector.ops.report_kinds` and
:mod:`~range_connector.ops.report_html`). The command line
(:mod:`range_connector.cli`) and ``range-connector doctor`` build on them.

Nothing here starts an engine, starts embedded Valkey servers or opens a network port: embedded servers are found in
their runtime directory's record, and a tier that is not running is reported as such.
"""
