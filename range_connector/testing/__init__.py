"""Tooling shared by tests, benches and the demo (like ``zarr.testing``): the vLLM API-server launcher and client,
tiny local models (random weights, a locally trained tokenizer), and debug helpers that read a running worker.

Not used by the connector at run time. May import: ``errors``, ``kv``, ``config``, ``backends``, ``compat``,
``plugin``.
"""
