"""A hybrid model (attention + Mamba2 layers) with Range on a real CPU engine is refused at start-up, by Range, with
the reason, before vLLM's own error (docs/architecture.md, "Models with recurrent state").

vLLM 0.32 turns its hybrid KV-cache manager off for a connector that is not ``SupportsHMA`` and would then fail
the model with "Failed to promote local KV cache specs to one unified type." (no word of the connector or why).
Range refuses it first, from ``get_required_kvcache_layout``. The unit tests of the check are
``tests/unit/test_hybrid_models.py``.
"""

from __future__ import annotations

import re

import pytest

from range_connector.testing.tiny_models import build_model
from tests.integration.harness import run_engine_expecting_failure

pytestmark = [pytest.mark.engine, pytest.mark.timeout(300)]

RANGE_REFUSAL = ("range_connector.errors.ConfigError: kv_connector: RangeConnector cannot serve "
                 "GraniteMoeHybridForCausalLM: it is a hybrid model (layer_types: 2 x linear_attention, "
                 "2 x full_attention), so its KV-cache groups hold attention KV and per-request recurrent state "
                 "(MambaSpec). Range stores attention KV blocks by token prefix and cannot restore the recurrent "
                 "state at a hit boundary, so a reused prefix would continue from the wrong state and give wrong "
                 "tokens (cf. LMCache#2845). Run this model without RangeConnector in --kv-transfer-config, or use "
                 "Range with a full-attention model.")
VLLM_HMA_OFF = "Turning off hybrid kv cache manager because `--kv-transfer-config` selects a KV connector"
VLLM_OWN_ERROR = "Failed to promote local KV cache specs to one unified type"


def test_a_hybrid_model_is_refused_by_range_at_start_up_with_the_reason(tmp_path):
    model = build_model("hybrid", "tiny")
    log = run_engine_expecting_failure(tmp_path, "hybrid", {
        "model": str(model), "max_model_len": 1024, "connector": {"tiers": [{"type": "memory"}]}, "steps": []},
        timeout_s=240)

    assert VLLM_HMA_OFF in log  # the situation: vLLM took the hybrid manager away because Range is not SupportsHMA
    assert RANGE_REFUSAL in log
    assert VLLM_OWN_ERROR not in log
    # (vLLM's prefixes: "(EngineCore pid=N) ERROR ... ] " in its own process layout, "[rank0]: " in one process)
    first_error = re.search(r"^(?:\(\w+ pid=\d+\) ERROR .*\] |\[rank\d+\]: )?([\w.]+(?:Error|Exception): .*)$", log,
                            re.MULTILINE)
    assert first_error is not None and first_error.group(1) == RANGE_REFUSAL
