"""The options of ``range-connector calibrate`` (:class:`CalibrateOptions`) and their checks, all made before
anything is measured, started or written (:func:`check_options`): the measurement itself is
:mod:`range_connector.cli.calibrate`, which runs the checks first.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from range_connector.config import TIER_TYPES, RangeConfig
from range_connector.config.keys import FLAT_TIER_KEYS
from range_connector.errors import ConfigError

__all__ = [
    "FULL_PROMPT_TOKENS", "FULL_READ_BYTES", "MAX_MODEL_LEN_MARGIN_TOKENS", "QUICK_PROMPT_TOKENS", "QUICK_READ_BYTES",
    "TABLE_PROMPT_TOKENS", "CalibrateOptions", "MiB", "ModelFacts", "check_options", "model_facts", "tier_config",
]

MiB = 1 << 20
QUICK_PROMPT_TOKENS = (128, 256, 512, 1024)
FULL_PROMPT_TOKENS = (256, 512, 1024, 2048, 4096)
QUICK_READ_BYTES = (1 * MiB, 4 * MiB, 16 * MiB)
FULL_READ_BYTES = (1 * MiB, 4 * MiB, 16 * MiB, 64 * MiB, 256 * MiB)
TABLE_PROMPT_TOKENS = (1024, 4096, 16384, 65536)
#: the engine started for the sweep has a context this much longer than the longest prompt
MAX_MODEL_LEN_MARGIN_TOKENS = 16


@dataclass(frozen=True, slots=True)
class ModelFacts:
    """What calibration needs from a model's ``config.json``.

    Attributes:
        bytes_per_token: ``s``, bf16 KV bytes of one token, all layers.
        num_layers: attention layers.
        vocab_size: token ids are drawn below this.
        max_model_len_tokens: the longest ``--max-model-len`` vLLM accepts for it, tokens (``None``: not known
            here: no ``max_position_embeddings``, a RoPE scaling that stretches it, or
            ``VLLM_ALLOW_LONG_MAX_MODEL_LEN`` set).
    """

    bytes_per_token: int
    num_layers: int
    vocab_size: int
    max_model_len_tokens: int | None = None


def model_facts(model_dir: str | Path) -> ModelFacts:
    """Read :class:`ModelFacts` from a model directory.

    Raises:
        ConfigError: no readable ``config.json`` or missing fields (key ``model``).
    """
    from range_connector.testing.tiny_models import kv_bytes_per_token

    try:
        cfg = json.loads((Path(model_dir) / "config.json").read_text())
        return ModelFacts(kv_bytes_per_token(model_dir), int(cfg["num_hidden_layers"]), int(cfg["vocab_size"]),
                          _max_model_len_tokens(cfg))
    except (OSError, ValueError, KeyError) as exc:
        raise ConfigError("model", f"{model_dir}: cannot read the KV size from config.json ({exc!r})") from None


def _max_model_len_tokens(cfg: dict[str, Any]) -> int | None:
    """vLLM's limit on ``--max-model-len`` (``vllm/config/model.py``: a user's length above the derived one is
    refused unless ``model_max_length`` allows it or ``VLLM_ALLOW_LONG_MAX_MODEL_LEN`` is set), in the plain case
    only: ``max_position_embeddings`` without a RoPE scaling; else ``None`` (not checked here)."""
    if os.environ.get("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "0").strip().lower() in ("1", "true"):
        return None
    rope = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
    if not isinstance(rope, dict) or rope.get("rope_type", rope.get("type", "default")) != "default" or (
            "factor" in rope):
        return None
    limit = cfg.get("max_position_embeddings")
    if not isinstance(limit, int) or limit <= 0:
        return None
    longer = cfg.get("model_max_length")
    return max(limit, longer) if isinstance(longer, int) else limit


def tier_config(extra: dict[str, Any], tier_type: str) -> RangeConfig:
    """The user's ``--extra-config`` as a config of one tier of ``tier_type`` (each measured tier type gets its own):
    in a hierarchy the tier of that type alone, else the one tier with its type set; the address of another type
    (valkey servers, a file directory) is dropped, and there is no byte budget (a budget would make room for our own
    stripes by evicting the tier's real ones).

    Raises:
        ConfigError: ``tier_type`` is not a tier type (names ``--backends``), or the config is bad (names the key).
    """
    if tier_type not in TIER_TYPES:
        raise ConfigError("--backends", f"{tier_type!r} is not one of {', '.join(TIER_TYPES)}")
    own = {"valkey": "servers", "file": "directory", "memory": None}
    drop = {key for other, key in own.items() if other != tier_type and key}
    extra = dict(extra)
    if "tiers" in extra or not any(k in FLAT_TIER_KEYS for k in extra):
        tables = [dict(t) if isinstance(t, dict) else {} for t in extra.get("tiers") or [{}]]
        # (a hierarchy: the tier of this type, measured alone; a config of one tier: that tier, retyped)
        table = next((t for t in tables if t.get("type", "valkey") == tier_type), tables[0])
        extra["tiers"] = [{**{k: v for k, v in table.items() if k not in drop}, "type": tier_type}]
        extra.pop("write_policy", None)
    else:
        flat_drop = {flat for flat, target in FLAT_TIER_KEYS.items() if target in drop}
        extra = {k: v for k, v in extra.items() if k not in flat_drop}
        extra["backend"] = tier_type
    return RangeConfig.from_extra_config(extra).with_tier(capacity_bytes=0)


@dataclass(frozen=True, slots=True)
class CalibrateOptions:
    """Inputs of :func:`run_calibration` (the command's options)."""

    output: Path
    model: str | None = None
    url: str | None = None
    backends: tuple[str, ...] = ()
    extra_config: dict = dataclasses.field(default_factory=dict)
    prompt_tokens: tuple[int, ...] = FULL_PROMPT_TOKENS
    prefill_repeats: int = 5
    read_bytes: tuple[int, ...] = FULL_READ_BYTES
    read_repeats: int = 5
    skip_prefill: bool = False
    tokens_per_s: float | None = None
    bytes_per_token: float | None = None
    num_layers: int | None = None
    vocab_size: int | None = None
    engine_t0_s: float = 0.0
    start_timeout_s: float = 300.0
    table_tokens: tuple[int, ...] = TABLE_PROMPT_TOKENS
    #: leave running the embedded Valkey servers this run started (by default it stops them again)
    keep_servers: bool = False


def check_options(opts: CalibrateOptions) -> tuple[ModelFacts | None, dict[str, RangeConfig]]:
    """Check every option before anything is measured, started or written (the command runs this first).

    Returns:
        ``(facts, configs)``: the model's facts (``None`` without ``--model``) and, per backend to measure, its
        one-tier config (:func:`tier_config`).

    Raises:
        ConfigError: naming the option: ``--output`` cannot be written, ``--url`` is not an ``http(s)://host[:port]``
            URL, ``--backends`` names an unknown type or one twice, ``--model`` is unreadable, an option the
            others make necessary is missing (``--model``, ``--vocab-size``, ``--num-layers``), ``--read-mib``
            has fewer than two sizes, ``--tokens-per-s`` without ``--skip-prefill``, ``--engine-t0-s`` below 0,
            ``--prompt-tokens`` longer than the model's context; or a bad ``--extra-config`` (names the key).
    """
    from urllib.parse import urlsplit

    from range_connector.cli.common import check_output_file  # (a sibling module of the command line)

    check_output_file(opts.output, "--output")
    if opts.url is not None:
        parts = urlsplit(opts.url)
        try:
            parts.port  # (raises for a port that is not a number in 0-65535)
        except ValueError:
            parts = parts._replace(scheme="")
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ConfigError("--url", f"{opts.url!r} is not http(s)://host[:port] (the vLLM API server's base URL)")
    if not opts.skip_prefill and not (opts.url or opts.model):
        raise ConfigError("--model", "give --model (or --tiny) to start an engine, --url for a running one, or "
                                     "--skip-prefill")
    if opts.tokens_per_s is not None and not opts.skip_prefill:
        raise ConfigError("--tokens-per-s", "is recorded only with --skip-prefill (otherwise the sweep measures R)")
    if opts.engine_t0_s < 0:
        raise ConfigError("--engine-t0-s", f"{opts.engine_t0_s} must be >= 0")
    twice = sorted({b for b in opts.backends if opts.backends.count(b) > 1})
    if twice:
        raise ConfigError("--backends", f"{', '.join(twice)} named more than once")
    for name in opts.backends:
        if name not in TIER_TYPES:
            raise ConfigError("--backends", f"{name!r} is not one of {', '.join(TIER_TYPES)}")
    try:
        facts = model_facts(opts.model) if opts.model else None
    except ConfigError as exc:
        raise ConfigError("--model", str(exc)[len(exc.key) + 2:]) from None
    if facts is not None and facts.max_model_len_tokens is not None and not opts.skip_prefill and not opts.url:
        # (the engine started for the sweep gets --max-model-len = the longest prompt + the margin)
        longest = max(opts.prompt_tokens)
        if longest + MAX_MODEL_LEN_MARGIN_TOKENS > facts.max_model_len_tokens:
            raise ConfigError("--prompt-tokens", f"{longest} tokens (+{MAX_MODEL_LEN_MARGIN_TOKENS}) exceed the "
                                                 f"model's context of {facts.max_model_len_tokens} tokens, which vLLM "
                                                 "refuses: give shorter --prompt-tokens (or --quick)")
    if not opts.skip_prefill and (opts.vocab_size or (facts.vocab_size if facts else None)) is None:
        raise ConfigError("--vocab-size", "needed to measure a server without --model")
    if opts.backends and (opts.num_layers or (facts.num_layers if facts else None)) is None:
        raise ConfigError("--num-layers", "needed to measure tiers without --model")
    if opts.backends and len(set(opts.read_bytes)) < 2:
        raise ConfigError("--read-mib", "give at least two different sizes: B and T0 are fitted as a line through "
                                        "the read times")
    return facts, {name: tier_config(opts.extra_config, name) for name in opts.backends}
