"""The disaggregated-prefill proxy (``range-connector proxy``): sends a prompt to the prefill engine with
``max_tokens = 1``, then the request to the decode engine with the ``kv_transfer_params`` prefill returned.

Runs on any host: it imports no vLLM and nothing of the connector. May import: ``errors``.
"""
