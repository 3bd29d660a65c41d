"""Inspection helpers that run inside a vLLM worker (through ``LLM.collective_rpc``).

They read the engine's own KV-cache tensors (``static_forward_context[layer].kv_cache``), not the connector's
views or checksums, so tests can compare what attention will read with what a run without the connector computed.
"""

from __future__ import annotations

from typing import Any

import torch
from blake3 import blake3

from range_connector import compat


def _layer_caches(worker: Any) -> list[tuple[str, torch.Tensor]]:
    runner = worker.model_runner
    ctx = runner.vllm_config.compilation_config.static_forward_context
    group = runner.kv_cache_config.kv_cache_groups[0]
    out = []
    for name in group.layer_names:
        kv = ctx[name].kv_cache
        if isinstance(kv, (list, tuple)):
            kv = kv[0]
        out.append((name, kv))
    return out


def _block_bytes_views(worker: Any) -> list[torch.Tensor]:
    num_blocks = worker.model_runner.kv_cache_config.num_blocks
    views = []
    for _name, kv in _layer_caches(worker):
        if kv.shape[0] == num_blocks:
            views.append(kv.reshape(num_blocks, -1).view(torch.uint8))
        else:  # [2, num_blocks, ...]
            views.append(torch.cat([kv[0].reshape(num_blocks, -1), kv[1].reshape(num_blocks, -1)], 1).view(torch.uint8))
    return views


def engine_block_digests(worker: Any, block_ids: list[int] | None = None) -> dict[int, str]:
    """BLAKE3 digest of each block across all attention layers, read from the engine's KV cache.

    Args:
        worker: the vLLM worker (``collective_rpc`` passes it).
        block_ids: blocks to digest; ``None`` digests every block that is not all zeros.

    Returns:
        ``{block_id: hex digest}``.
    """
    views = _block_bytes_views(worker)
    if block_ids is None:
        nonzero = torch.zeros(views[0].shape[0], dtype=torch.bool)
        for v in views:
            nonzero |= v.view(v.shape[0], -1).ne(0).any(dim=1)
        block_ids = [int(i) for i in torch.nonzero(nonzero).flatten().tolist()]
    out = {}
    for b in block_ids:
        h = blake3()
        for v in views:
            h.update(v[b].numpy().tobytes())
        out[int(b)] = h.hexdigest()
    return out


def engine_head_digests(worker: Any, block_ids: list[int] | None = None) -> dict[int, dict[int, str]]:
    """BLAKE3 digest of each KV head of each block across all attention layers, read from the engine's KV cache
    (CPU dense layout ``[num_blocks, num_kv_heads, block_size, 2 * head_size]``), keyed by the model's head index: a
    head's bytes do not depend on the tensor-parallel size, so engines of different sizes can be compared head by
    head.

    Args:
        worker: the vLLM worker (``collective_rpc`` passes it).
        block_ids: blocks to digest; ``None`` digests every block that is not all zeros.

    Returns:
        ``{block_id: {model head: hex digest}}``.

    Raises:
        ValueError: the KV cache is not the CPU dense layout.
    """
    caches = [kv for _name, kv in _layer_caches(worker)]
    num_blocks = worker.model_runner.kv_cache_config.num_blocks
    if any(kv.dim() != 4 or kv.shape[0] != num_blocks for kv in caches):
        raise ValueError(f"not the CPU dense KV layout: {[tuple(kv.shape) for kv in caches]}")
    local_heads = caches[0].shape[1]
    first_head = compat.tp_rank() * local_heads  # (vLLM's split without replication: H // T heads per rank)
    if block_ids is None:
        block_ids = list(engine_block_digests(worker))
    out: dict[int, dict[int, str]] = {}
    for b in block_ids:
        per_head = {}
        for k in range(local_heads):
            h = blake3()
            for kv in caches:
                h.update(kv[b, k].contiguous().view(torch.uint8).numpy().tobytes())
            per_head[first_head + k] = h.hexdigest()
        out[int(b)] = per_head
    return out


def connector_loaded_block_ids(worker: Any) -> list[int]:
    """Block ids the Range worker wrote since the last call (a batch can load over several steps)."""
    return compat.kv_connector_in_process()._worker.take_loaded_block_log()


def connector_last_loaded_tickets(worker: Any) -> list[tuple[int, str]]:
    """``(shard_idx, ticket key)`` of the chunks the Range worker read in its last loading step."""
    return [(s, k.decode()) for s, k in compat.kv_connector_in_process()._worker.last_loaded_tickets]


def connector_load_timelines(worker: Any) -> list[dict]:
    """Mode and per-layer timestamps (``time.monotonic()``: ready, delivered, waited for by attention) of the Range
    worker's recent load jobs, oldest first."""
    return list(compat.kv_connector_in_process()._worker.load_timelines)


def count_layer_hooks(worker: Any) -> None:
    """Count calls of the connector's per-layer hooks from now on (idempotent).

    Wraps ``wait_for_layer_load`` and ``save_kv_layer`` on this worker's connector instance, the objects that
    vLLM's attention code calls, so the counts show which hooks the forward actually reaches
    (:func:`layer_hook_counts`).
    """
    connector = compat.kv_connector_in_process()
    if hasattr(connector, "_range_debug_hook_counts"):
        return
    counts: dict[str, dict[str, int]] = {"wait_for_layer_load": {}, "save_kv_layer": {}}
    connector._range_debug_hook_counts = counts
    for hook in counts:
        original = getattr(connector, hook)

        def counted(layer_name: str, *args: Any, _hook: str = hook, _original: Any = original, **kwargs: Any) -> Any:
            counts[_hook][layer_name] = counts[_hook].get(layer_name, 0) + 1
            return _original(layer_name, *args, **kwargs)

        setattr(connector, hook, counted)


def layer_hook_counts(worker: Any) -> dict[str, dict[str, int]]:
    """``{hook: {layer_name: calls}}`` since :func:`count_layer_hooks` (empty dicts if it never ran)."""
    return getattr(compat.kv_connector_in_process(), "_range_debug_hook_counts", {"wait_for_layer_load": {},
                                                                         "save_kv_layer": {}})


def mla_branch_probe(worker: Any) -> dict[str, Any]:
    """What this worker's attention layers do: the compat probes and each layer's own ``use_direct_call``."""
    ctx = worker.model_runner.vllm_config.compilation_config.static_forward_context
    return {
        "direct_call_branch_taken": compat.mla_direct_call_branch_taken(),
        "patch_applied": compat.mla_patch_applied(),
        "layers": {name: {"type": type(layer).__name__, "use_direct_call": bool(getattr(layer, "use_direct_call",
                                                                                          False))}
                   for name, layer in ctx.items() if hasattr(layer, "use_direct_call")},
    }


def connector_worker_stats(worker: Any) -> dict[str, int]:
    """The Range worker's own counters (cumulative)."""
    return dict(compat.kv_connector_in_process()._worker.stats)
