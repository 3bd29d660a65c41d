"""vLLM general plugin: registers ``RangeConnector`` with vLLM's ``KVConnectorFactory``.

vLLM calls :func:`register` in every process it starts (API server, engine core, workers), possibly more than once;
registration is idempotent. On CPUs with AMX it also asks the kernel for AMX tile permission in the process (vLLM's
CPU attention uses AMX; without the permission a first request of 1-2 tokens can die with SIGILL), and on the CPU
platform it wraps vLLM's rotary-embedding op, which is wrong for the 3-D inputs of DeepSeek-V2 models
(:func:`range_connector.compat.apply_cpu_workarounds`).
"""

from __future__ import annotations

CONNECTOR_NAME = "RangeConnector"


def register() -> None:
    """Register the connector (idempotent; safe in every vLLM process)."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    if CONNECTOR_NAME not in KVConnectorFactory._registry:
        KVConnectorFactory.register_connector(CONNECTOR_NAME, "range_connector.connector", "RangeConnector")
    _init_amx()
    from range_connector.compat import apply_cpu_workarounds

    apply_cpu_workarounds()


def _init_amx() -> None:
    try:
        import torch

        if hasattr(torch.cpu, "_is_amx_tile_supported") and torch.cpu._is_amx_tile_supported():
            torch.cpu._init_amx()
    except (ImportError, AttributeError, RuntimeError):
        pass
