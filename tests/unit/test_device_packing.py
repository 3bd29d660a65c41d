"""The namespace names the attention backend and the KV-cache layout on GPU platforms, so that KV stored by one CUDA
attention backend, or one stride order, is a miss for another (``compat.kv_packing``); on CPU it is unchanged, so KV
stored before keeps hitting.

The device branch cannot run on this CPU build: the tests replace the platform probe at the compat boundary
(``compat._platform``: a platform that is not the CPU, device type ``cuda``) and, where a CUDA backend must be picked,
vLLM's selector there too (``compat._attention_backend``: on the CPU platform it answers ``CPU_ATTN`` whatever is
asked). The backend classes and the layout enum are vLLM's own.
"""

from __future__ import annotations

import dataclasses
import types

import pytest

from range_connector import compat
from range_connector.spec import resolve_deployment
from range_connector.testing.tiny_models import build_model

pytestmark = pytest.mark.timeout(180)

CONFIG = {"tiers": [{"type": "file", "directory": "/nonexistent-unused"}], "chunk_tokens": 256}
FAKE_CUDA = types.SimpleNamespace(is_cpu=lambda: False, device_type="cuda")


@pytest.fixture(scope="module")
def engine() -> tuple:
    vllm_config = compat.offline_vllm_config(str(build_model("gqa", "tiny")), block_size=128)
    return vllm_config, compat.offline_attention_group(vllm_config)


def _backend(name: str) -> type:
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    return AttentionBackendEnum[name].get_class()


def _namespace_on_cuda(monkeypatch: pytest.MonkeyPatch, engine: tuple, backend: str, layout: str | None) -> tuple:
    """``(namespace, packing)`` of the tiny model on a (faked) CUDA platform whose selector gives ``backend`` and
    whose engine resolved ``layout`` (``None``: not resolved, as without an engine)."""
    vllm_config, group = engine
    monkeypatch.setattr(compat, "_platform", lambda: FAKE_CUDA)
    monkeypatch.setattr(compat, "_attention_backend", lambda _vc, _g: _backend(backend))
    group = dataclasses.replace(group, kv_cache_layout=layout)
    *_, namespace, fields = resolve_deployment(vllm_config, group, dict(CONFIG), in_worker=False)
    return namespace, fields["packing"]


def test_two_cuda_attention_backends_do_not_share_stored_kv(monkeypatch: pytest.MonkeyPatch, engine: tuple) -> None:
    flash, flash_packing = _namespace_on_cuda(monkeypatch, engine, "FLASH_ATTN", "LBNHC")
    flex, flex_packing = _namespace_on_cuda(monkeypatch, engine, "FLEX_ATTENTION", "LBNHC")
    assert flash_packing == "cuda-auto-FLASH_ATTN-LBNHC-01324"
    assert flex_packing == "cuda-auto-FLEX_ATTENTION-LBNHC-01324"
    assert flash != flex


def test_two_kv_cache_stride_orders_do_not_share_stored_kv(monkeypatch: pytest.MonkeyPatch, engine: tuple) -> None:
    token_major, packing = _namespace_on_cuda(monkeypatch, engine, "FLASH_ATTN", "LBNHC")
    head_major, head_packing = _namespace_on_cuda(monkeypatch, engine, "FLASH_ATTN", "LBHNC")
    assert packing.endswith("LBNHC-01324") and head_packing.endswith("LBHNC-01234")
    assert token_major != head_major
    # the legacy names vLLM still takes for VLLM_KV_CACHE_LAYOUT are the same layouts
    assert _namespace_on_cuda(monkeypatch, engine, "FLASH_ATTN", "NHD")[0] == token_major


def test_the_same_backend_and_layout_give_the_same_namespace(monkeypatch: pytest.MonkeyPatch, engine: tuple) -> None:
    first = _namespace_on_cuda(monkeypatch, engine, "FLASH_ATTN", "LBNHC")
    vllm_config = compat.offline_vllm_config(str(build_model("gqa", "tiny")), block_size=128)  # (another engine)
    again = _namespace_on_cuda(monkeypatch, (vllm_config, compat.offline_attention_group(vllm_config)),
                               "FLASH_ATTN", "LBNHC")
    assert again == first


def test_without_an_engine_the_layout_is_the_one_vllm_would_pick(monkeypatch: pytest.MonkeyPatch,
                                                                 engine: tuple) -> None:
    monkeypatch.delenv("VLLM_KV_CACHE_LAYOUT", raising=False)
    # FlashAttention declares no layouts: vLLM's default preference, token-major LBNHC, first
    assert _namespace_on_cuda(monkeypatch, engine, "FLASH_ATTN", None)[1] == "cuda-auto-FLASH_ATTN-LBNHC-01324"
    # a backend that declares its layouts gets its first
    assert _namespace_on_cuda(monkeypatch, engine, "CPU_ATTN", None)[1] == "cuda-auto-CPU_ATTN-LBHNC-01234"
    monkeypatch.setenv("VLLM_KV_CACHE_LAYOUT", "HND")
    assert _namespace_on_cuda(monkeypatch, engine, "FLASH_ATTN", None)[1] == "cuda-auto-FLASH_ATTN-LBHNC-01234"


def test_the_cpu_namespace_is_unchanged(monkeypatch: pytest.MonkeyPatch, engine: tuple) -> None:
    """On CPU the packing is still ``cpu-<isa>`` alone (no backend, no layout): namespaces, and so the KV stored
    under them, stay those of earlier versions."""
    import torch
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    def no_selector(*_args: object) -> None:
        raise AssertionError("the CPU namespace must not depend on the attention selector")

    monkeypatch.setattr(compat, "_attention_backend", no_selector)
    vllm_config, group = engine
    isa = _get_attn_isa(torch.bfloat16, 128, 64, "auto")
    assert compat.kv_packing(vllm_config, group) == f"cpu-{isa}"
    assert compat.kv_packing(vllm_config, dataclasses.replace(group, kv_cache_layout="LBHNC")) == f"cpu-{isa}"
    assert compat.kv_packing(vllm_config, dataclasses.replace(group, is_mla=True)) == "cpu-mla"
