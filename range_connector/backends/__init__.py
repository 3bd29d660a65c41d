"""Storage tiers behind one interface (:class:`range_connector.backends.base.Backend`): the in-process DRAM tier
(``memory``), stripe files (``file/``), Valkey servers (``valkey/``: client, RESP reader, embedded servers), a
latency-injecting wrapper for slow-tier tests and benches (``latency``), and the factory that opens one backend per
shard from the config (``factory``).

Every tier passes the same conformance suite (``tests/backends/test_conformance_*.py``). May import: ``errors``, ``kv``,
``config``.
"""
