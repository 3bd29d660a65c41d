"""The worker half (one per vLLM worker process, next to the KV tensors): load jobs, direct receive, transfer banks
(host, or device memory for GPUDirect reads: ``device_reads``), saves, background probes, and context parallelism (the ranks' agreement and exchange).

Entry point: :class:`range_connector.worker.facade.RangeWorker`; a load job sees only the
:class:`~range_connector.worker.context.LoadContext` built at ``register_kv_caches``. May import: ``errors``, ``kv``,
``config``, ``backends``, ``metrics`` (and torch); never ``scheduler`` and never vLLM, so the data path runs where
vLLM cannot be installed.
"""
