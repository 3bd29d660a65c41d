"""The scheduler half (vLLM's engine-core process, no tensors): lookup by prefix hash chain, admission through the
cost gate and probes, leases, the per-step load and save plan, the disaggregated hand-off, the DRAM tier's index.

Entry point: :class:`range_connector.scheduler.facade.RangeScheduler`. May import: ``errors``, ``kv``, ``config``,
``cost``, ``backends``, ``metrics``; never ``worker`` (the halves meet only through :mod:`range_connector.kv.metadata`)
and never vLLM (:mod:`range_connector.scheduler.engine_view` says what it reads of vLLM's objects).
"""
