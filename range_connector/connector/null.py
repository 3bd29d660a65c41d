"""A vLLM KV connector that does nothing: the baseline of what vLLM's own connector plumbing costs an engine.

With any ``--kv-transfer-config`` vLLM runs extra work every step whatever the connector does (the connector's
metadata built, bound and cleared, the worker's output and stats aggregated and sent to the front end). A replay of
``null`` next to ``none`` measures that; next to ``range`` it tells Range's own overhead from vLLM's
(``bench/replay.py --configs none,null,range``). It never loads or saves anything (every lookup is a miss).

Enable it with::

    --kv-transfer-config '{"kv_connector": "NullConnector", "kv_role": "kv_both",
        "kv_connector_module_path": "range_connector.connector.null"}'
"""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorMetadata

__all__ = ["NullConnector", "null_connector_config"]


class NullConnector(KVConnectorBase_V1):
    """Every hook returns at once: no lookup, no load, no save."""

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        return None

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        return None

    def wait_for_save(self) -> None:
        return None

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        return 0, False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        return None

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        return KVConnectorMetadata()


def null_connector_config() -> str:
    """``--kv-transfer-config`` JSON that enables :class:`NullConnector`."""
    import json

    return json.dumps({"kv_connector": "NullConnector", "kv_role": "kv_both",
                       "kv_connector_module_path": "range_connector.connector.null"}, separators=(",", ":"))
