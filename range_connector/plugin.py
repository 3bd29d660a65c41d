"""vLLM general plugin: registers ``RangeConnector`` with vLLM's ``KVConnectorFactory``.

vLLM calls :func:`register` in every process it starts (API server, engine core, workers), possibly more than once;
registration is idempotent. On CPUs with AMX it also asks the kernel for AMX tile permission in the process (vLLM's
CPU attention uses AMX; without the permission a first request of 1-2 tokens can die with SIGILL), and on the CPU
platform it wraps vLLM's rotary-embedding op, which is wrong for the 3-D inputs of DeepSeek-V2 models
(:func:`range_connector.compat.apply_cpu_workarounds`).

Test switch: with ``RANGE_CONNECTOR_TEST_FORCE_MLA_DIRECT_CALL=1`` in the environment, every vLLM process makes its
platform report ``opaque_attention_op() == False`` (:func:`range_connector.compat.force_mla_direct_call`), so that
attention layers take the direct-call branch that the engine patch (``patches/README.md``) is about. Tests only.
"""

from __future__ import annotations

import os

CONNECTOR_NAME = "RangeConnector"
#: Environment variable of the test switch (value ``1``); see the module docstring.
FORCE_MLA_DIRECT_CALL_ENV = "RANGE_CONNECTOR_TEST_FORCE_MLA_DIRECT_CALL"


def register() -> None:
    """Register the connector (idempotent; safe in every vLLM process)."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    if CONNECTOR_NAME not in KVConnectorFactory._registry:
        KVConnectorFactory.register_connector(CONNECTOR_NAME, "range_connector.connector", "RangeConnector")
    _init_amx()
    from range_connector import compat
    from range_connector.errors import ConfigError

    compat.apply_cpu_workarounds()
    switch = os.environ.get(FORCE_MLA_DIRECT_CALL_ENV, "")
    if switch not in ("", "0", "1"):
        raise ConfigError(FORCE_MLA_DIRECT_CALL_ENV, f"{switch!r} is not 0 or 1")
    if switch == "1":
        compat.force_mla_direct_call()


def _init_amx() -> None:
    try:
        import torch

        if hasattr(torch.cpu, "_is_amx_tile_supported") and torch.cpu._is_amx_tile_supported():
            torch.cpu._init_amx()
    except (ImportError, AttributeError, RuntimeError):
        pass
