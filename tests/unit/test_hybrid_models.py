"""Models with recurrent state (hybrid attention + Mamba-type layers, attention-free SSMs) are refused at start-up by
name and reason: :func:`range_connector.compat.refuse_recurrent_state`, reached from the connector's
``get_required_kvcache_layout`` (vLLM's first call into Range with the config), and the constructor's
``compat.attention_group`` on vLLM's real KV-cache dataclasses. The refusal on a real CPU engine is
``tests/integration/test_engine_hybrid.py``.

The model configs here are fakes at the vLLM boundary: a real ``ModelConfig`` inspects the architecture in a
subprocess (about a minute on this machine), and ``refuse_recurrent_state`` reads only the attributes given.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
    SlidingWindowSpec,
)

from range_connector import compat
from range_connector.connector import RangeConnector
from range_connector.errors import ConfigError

pytestmark = pytest.mark.timeout(60)

GRANITE_4_LAYERS = ["linear_attention", "full_attention", "linear_attention", "full_attention"]


def _vllm_config(architecture: str, *, is_hybrid: bool = False, is_attention_free: bool = False,
                 has_inner_state: bool = False, layer_types: list[str] | None = None) -> SimpleNamespace:
    hf = SimpleNamespace(layer_types=layer_types) if layer_types is not None else SimpleNamespace()
    model_config = SimpleNamespace(architecture=architecture, is_hybrid=is_hybrid, is_attention_free=is_attention_free,
                                   has_inner_state=has_inner_state, hf_text_config=hf)
    return SimpleNamespace(model_config=model_config)


def _assert_says_why(message: str) -> None:
    assert message.startswith("kv_connector: RangeConnector cannot serve ")
    for words in ("MambaSpec", "by token prefix", "cannot restore the recurrent state at a hit boundary",
                  "wrong tokens", "LMCache#2845", "without RangeConnector in --kv-transfer-config",
                  "full-attention model"):
        assert words in message, words


def test_a_hybrid_model_is_refused_by_name_with_its_layer_kinds_and_the_reason() -> None:
    config = _vllm_config("GraniteMoeHybridForCausalLM", is_hybrid=True, has_inner_state=True,
                          layer_types=GRANITE_4_LAYERS)

    with pytest.raises(ConfigError) as caught:
        compat.refuse_recurrent_state(config)

    message = str(caught.value)
    assert caught.value.key == "kv_connector"
    assert "GraniteMoeHybridForCausalLM: it is a hybrid model" in message
    assert "(layer_types: 2 x linear_attention, 2 x full_attention)" in message
    assert "attention KV and per-request recurrent state (MambaSpec)" in message
    _assert_says_why(message)


def test_a_hybrid_model_without_layer_types_is_refused_too() -> None:
    config = _vllm_config("JambaForCausalLM", is_hybrid=True, has_inner_state=True)

    with pytest.raises(ConfigError, match=r"cannot serve JambaForCausalLM: it is a hybrid model, so its KV-cache"):
        compat.refuse_recurrent_state(config)


def test_an_attention_free_state_space_model_is_refused() -> None:
    config = _vllm_config("Mamba2ForCausalLM", is_attention_free=True, has_inner_state=True)

    with pytest.raises(ConfigError) as caught:
        compat.refuse_recurrent_state(config)

    assert "Mamba2ForCausalLM: it is a state-space model" in str(caught.value)
    assert "recurrent state only (MambaSpec)" in str(caught.value)
    _assert_says_why(str(caught.value))


@pytest.mark.parametrize("config", [
    _vllm_config("LlamaForCausalLM"),
    # granite-4.0-micro: a hybrid architecture whose layers are all attention (vLLM's is_hybrid is then False)
    _vllm_config("GraniteMoeHybridForCausalLM", has_inner_state=True, layer_types=["full_attention"] * 4),
    # sliding-window layers: with the hybrid manager off, vLLM allocates them as full attention (one group)
    _vllm_config("Gemma3ForCausalLM", layer_types=["sliding_attention", "full_attention"]),
    SimpleNamespace(model_config=None),
], ids=["dense", "hybrid-architecture-all-attention", "sliding-window", "no-model-config"])
def test_models_without_recurrent_state_pass(config: SimpleNamespace) -> None:
    compat.refuse_recurrent_state(config)


def test_the_connector_refuses_in_the_first_hook_that_sees_the_config() -> None:
    hybrid = _vllm_config("GraniteMoeHybridForCausalLM", is_hybrid=True, has_inner_state=True,
                          layer_types=GRANITE_4_LAYERS)

    with pytest.raises(ConfigError, match="cannot serve GraniteMoeHybridForCausalLM"):
        RangeConnector.get_required_kvcache_layout(hybrid)
    assert RangeConnector.get_required_kvcache_layout(_vllm_config("LlamaForCausalLM")) is None


def _attention(block_size: int = 256) -> FullAttentionSpec:
    return FullAttentionSpec(block_size=block_size, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)


def _kv_cache_config(*groups: KVCacheGroupSpec) -> KVCacheConfig:
    return KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=list(groups))


def test_the_constructor_check_explains_a_recurrent_state_group() -> None:
    # What vLLM's hybrid manager makes of the tiny hybrid model: one attention group and one Mamba2 state group.
    mamba = MambaSpec(block_size=256, shapes=((3, 640), (8, 64, 64)), dtypes=(torch.bfloat16, torch.float32))
    config = _kv_cache_config(KVCacheGroupSpec(["model.layers.1.self_attn.attn", "model.layers.3.self_attn.attn"],
                                               _attention()),
                              KVCacheGroupSpec(["model.layers.0.mamba", "model.layers.2.mamba"], mamba))

    with pytest.raises(ConfigError) as caught:
        compat.attention_group(config)

    assert "KV-cache groups are ['FullAttentionSpec', 'MambaSpec']" in str(caught.value)
    _assert_says_why(str(caught.value))


def test_the_constructor_check_keeps_its_message_for_several_attention_groups() -> None:
    window = SlidingWindowSpec(block_size=256, num_kv_heads=2, head_size=64, dtype=torch.bfloat16, sliding_window=512)
    config = _kv_cache_config(KVCacheGroupSpec(["a"], _attention()), KVCacheGroupSpec(["b"], window))

    with pytest.raises(ConfigError, match=r"one full-attention KV-cache group, got \['FullAttentionSpec', "
                                          r"'SlidingWindowSpec'\]"):
        compat.attention_group(config)


def test_one_full_attention_group_is_served() -> None:
    group = compat.attention_group(_kv_cache_config(KVCacheGroupSpec(["l0", "l1"], _attention(128))))

    assert (group.layer_names, group.block_size, group.is_mla) == (("l0", "l1"), 128, False)
