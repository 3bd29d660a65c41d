"""Tests of range_connector.testing.tiny_models: building, caching, sizes, tokenizer (no vLLM)."""

from __future__ import annotations

import json
import pathlib
import threading
import time

import pytest

from range_connector.testing import tiny_models
from range_connector.testing.tiny_models import MODEL_KINDS, MODELS, build_model, kv_bytes_per_token

# Expected architecture of each model: (architecture, layers, KV bytes per token in bf16).
EXPECTED = {
    ("gqa", "tiny"): ("LlamaForCausalLM", 4, 2 * 4 * 2 * 64 * 2),  # 2 KiB
    ("gqa", "bench"): ("LlamaForCausalLM", 32, 131072),  # 128 KiB, like an 8B Llama
    ("mla", "tiny"): ("DeepseekV2ForCausalLM", 4, 4 * 576 * 2),  # 4.5 KiB
    ("mla", "bench"): ("DeepseekV2ForCausalLM", 32, 36864),  # 36 KiB
    ("hybrid", "tiny"): ("GraniteMoeHybridForCausalLM", 4, 2 * 2 * 2 * 64 * 2),  # 1 KiB: 2 of 4 layers attention
}
ALL_MODELS = list(MODELS)


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    return tmp_path_factory.mktemp("tiny-models")


@pytest.fixture(scope="module")
def built(cache_dir: pathlib.Path) -> dict[tuple[str, str], tuple[pathlib.Path, float]]:
    """Build every model once for the module; value: (path, seconds the build took)."""
    out = {}
    for kind, size in ALL_MODELS:
        t0 = time.perf_counter()
        path = build_model(kind, size, cache_dir=cache_dir)
        out[(kind, size)] = (path, time.perf_counter() - t0)
    return out


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("kind", "size"), ALL_MODELS)
def test_builds_with_intended_sizes(built, kind: str, size: str) -> None:
    # (how fast a build is, is not asserted: a busy machine can make any bound fail; the timeout catches a hang)
    path, _ = built[(kind, size)]
    arch, layers, kv_bytes = EXPECTED[(kind, size)]
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert (path / name).is_file(), name
    assert kind in path.name and size in path.name and f"v{tiny_models.FORMAT_VERSION}" in path.name
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["architectures"] == [arch]
    assert cfg["num_hidden_layers"] == layers
    assert cfg["dtype"] == "bfloat16"
    assert cfg["vocab_size"] == 4096
    # the bench GQA model takes a 4,096-token prefix plus a suffix (bench/hit_ttft.py)
    assert cfg["max_position_embeddings"] == (8192 if (kind, size) == ("gqa", "bench") else 4096)
    if kind == "mla":
        assert (cfg["kv_lora_rank"], cfg["qk_rope_head_dim"]) == (512, 64)  # the 576-wide latent
        assert cfg["first_k_dense_replace"] == layers  # dense MLPs only
    elif kind == "hybrid":
        assert cfg["layer_types"] == ["linear_attention", "full_attention"] * 2  # Mamba2, attention, ...
        assert (cfg["num_attention_heads"], cfg["num_key_value_heads"]) == (4, 2)
        assert (cfg["num_local_experts"], cfg["shared_intermediate_size"]) == (0, 512)  # dense MLPs only
    elif size == "tiny":
        assert (cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]) == (4, 2, 64)
    else:
        assert (cfg["num_key_value_heads"], cfg["head_dim"]) == (8, 128)
    assert kv_bytes_per_token(path) == kv_bytes


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("kind", "size"), ALL_MODELS)
def test_second_call_reuses_cache(built, cache_dir: pathlib.Path, kind: str, size: str, monkeypatch) -> None:
    path, _ = built[(kind, size)]
    mtime = (path / "model.safetensors").stat().st_mtime_ns

    def no_build(*args, **kwargs):  # (what a cached call must not do, checked instead of how long it took)
        raise AssertionError("a cached model was built again")

    monkeypatch.setattr(tiny_models, "_write_model", no_build)
    again = build_model(kind, size, cache_dir=cache_dir)
    assert again == path
    assert (path / "model.safetensors").stat().st_mtime_ns == mtime


@pytest.mark.timeout(300)
def test_tokenizer_round_trips_and_has_special_tokens(built) -> None:
    from transformers import AutoTokenizer

    path, _ = built[("gqa", "tiny")]
    tok = AutoTokenizer.from_pretrained(path)
    cfg = json.loads((path / "config.json").read_text())
    assert len(tok) == 4096
    assert (tok.bos_token_id, tok.eos_token_id) == (cfg["bos_token_id"], cfg["eos_token_id"])
    for text in ["The quick brown fox jumps over the lazy dog.", "  tabs\tand naïve café 漢字 🙂\n", ""]:
        ids = tok(text)["input_ids"]
        assert ids[0] == tok.bos_token_id
        assert tok.decode(ids, skip_special_tokens=True) == text
    english = "The expression is evaluated and the result is assigned to the target list."
    assert len(tok(english)["input_ids"]) < len(english) / 3  # trained on English: real merges
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert "hi" in chat and chat.startswith(tok.bos_token)


@pytest.mark.timeout(300)
def test_models_share_one_tokenizer(built) -> None:
    files = {(built[m][0] / "tokenizer.json").read_bytes() for m in ALL_MODELS}
    assert len(files) == 1


@pytest.mark.timeout(300)
def test_build_is_deterministic(built, tmp_path: pathlib.Path) -> None:
    first, _ = built[("mla", "tiny")]
    second = build_model("mla", "tiny", cache_dir=tmp_path)
    assert second != first
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert (first / name).read_bytes() == (second / name).read_bytes(), name


@pytest.mark.timeout(300)
def test_concurrent_builds_share_one_result(tmp_path: pathlib.Path) -> None:
    results: list[pathlib.Path] = []
    errors: list[BaseException] = []

    def work() -> None:
        try:
            results.append(build_model("gqa", "tiny", cache_dir=tmp_path))
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=work) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert len(set(results)) == 1
    assert kv_bytes_per_token(results[0]) == EXPECTED[("gqa", "tiny")][2]
    assert not list(tmp_path.glob(".*.tmp-*")), "temporary build folders left behind"


@pytest.mark.timeout(300)
def test_incomplete_directory_is_rebuilt(tmp_path: pathlib.Path) -> None:
    final = tmp_path / tiny_models.model_dir_name("gqa", "tiny")
    final.mkdir()
    (final / "config.json").write_text("{}")
    path = build_model("gqa", "tiny", cache_dir=tmp_path)
    assert path == final
    assert kv_bytes_per_token(path) == EXPECTED[("gqa", "tiny")][2]


@pytest.mark.timeout(30)
@pytest.mark.parametrize(("kind", "size"), [("llama", "tiny"), ("gqa", "huge"), ("hybrid", "bench")])
def test_bad_kind_or_size_raises(tmp_path: pathlib.Path, kind: str, size: str) -> None:
    bad = kind if kind not in MODEL_KINDS else size
    with pytest.raises(ValueError, match=bad):
        build_model(kind, size, cache_dir=tmp_path)
    assert not list(tmp_path.iterdir())


@pytest.mark.timeout(30)
def test_kv_bytes_per_token_from_config(tmp_path: pathlib.Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(
        {"num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "hidden_size": 4096}
    ))
    assert kv_bytes_per_token(tmp_path) == 2 * 32 * 8 * 128 * 2  # Llama-3-8B: 128 KiB
    (tmp_path / "config.json").write_text(json.dumps(
        {"num_hidden_layers": 61, "num_attention_heads": 128, "kv_lora_rank": 512, "qk_rope_head_dim": 64}
    ))
    assert kv_bytes_per_token(tmp_path) == 61 * 576 * 2  # DeepSeek-V3
    with pytest.raises(FileNotFoundError):
        kv_bytes_per_token(tmp_path / "missing")


@pytest.mark.timeout(30)
def test_default_cache_dir_follows_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: pathlib.Path) -> None:
    monkeypatch.setenv("RANGE_CONNECTOR_CACHE_DIR", str(tmp_path))
    assert tiny_models.default_cache_dir() == tmp_path / "models"
    monkeypatch.delenv("RANGE_CONNECTOR_CACHE_DIR")
    assert tiny_models.default_cache_dir() == pathlib.Path.home() / ".cache" / "range-connector" / "models"


@pytest.mark.timeout(300)
def test_command_line_prints_the_path(built, cache_dir: pathlib.Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert tiny_models.main(["--kind", "mla", "--size", "tiny", "--cache-dir", str(cache_dir)]) == 0
    assert capsys.readouterr().out.strip() == str(built[("mla", "tiny")][0])


@pytest.mark.timeout(120)
def test_prompt_token_ids_are_english_of_the_asked_length() -> None:
    from transformers import AutoTokenizer

    path = build_model("gqa", "tiny")
    ids = tiny_models.prompt_token_ids(path, 1800)
    tok = AutoTokenizer.from_pretrained(path)
    assert len(ids) == 1800 and ids[0] == tok.bos_token_id
    assert tiny_models.prompt_token_ids(path, 300) == ids[:300]  # a prefix of the same text
    assert "the" in tok.decode(ids[:300], skip_special_tokens=True).split()
    with pytest.raises(ValueError, match="num_tokens"):
        tiny_models.prompt_token_ids(path, 10_000_000)
