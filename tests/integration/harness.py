"""Helpers shared by the engine integration tests: real-text prompts and one-engine-per-subprocess runs."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

HARNESS = Path(__file__).with_name("engine_harness.py")
ENGINE_TIMEOUT_S = 420


def text_corpus() -> str:
    """English text from the Python standard library (no download)."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[k] for k in sorted(topics))


def prompt_ids(model_dir: Path, num_tokens: int, offset_chars: int = 0) -> list[int]:
    """``num_tokens`` token ids of real text, tokenized with the model's own tokenizer."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    text = text_corpus()[offset_chars:]
    ids = tok(text, add_special_tokens=False)["input_ids"]
    if len(ids) < num_tokens:
        raise ValueError(f"corpus too short for {num_tokens} tokens")
    return ids[:num_tokens]


def run_engine(tmp_dir: Path, name: str, spec: dict, *, env: dict | None = None) -> list[dict]:
    """Run one fresh engine process through ``spec['steps']``; return one result per step.

    Raises:
        AssertionError: the engine process failed (its log tail is in the message).
    """
    spec_path = tmp_dir / f"{name}.spec.json"
    out_path = tmp_dir / f"{name}.out.json"
    log_path = tmp_dir / f"{name}.log"
    spec_path.write_text(json.dumps(spec))
    full_env = dict(os.environ)
    full_env.setdefault("VLLM_CACHE_ROOT", str(tmp_dir / "vllm-cache"))
    full_env.setdefault("PYTHONHASHSEED", str(random.randint(1, 10**6)))
    full_env.update(env or {})
    with open(log_path, "w") as log:
        proc = subprocess.run([sys.executable, str(HARNESS), str(spec_path), str(out_path)], stdout=log,
                              stderr=subprocess.STDOUT, env=full_env, timeout=ENGINE_TIMEOUT_S)
    if proc.returncode != 0 or not out_path.exists():
        tail = "\n".join(log_path.read_text(errors="replace").splitlines()[-40:])
        raise AssertionError(f"engine run {name} failed (rc={proc.returncode}); log {log_path}:\n{tail}")
    return json.loads(out_path.read_text())["results"]


def run_engine_expecting_failure(tmp_dir: Path, name: str, spec: dict, *, env: dict | None = None,
                                 timeout_s: float = ENGINE_TIMEOUT_S) -> str:
    """Start one fresh engine process that must fail (a start-up refusal); return its whole log.

    Raises:
        AssertionError: the engine process succeeded (its log tail is in the message).
        subprocess.TimeoutExpired: it ran past ``timeout_s`` seconds.
    """
    spec_path = tmp_dir / f"{name}.spec.json"
    out_path = tmp_dir / f"{name}.out.json"
    log_path = tmp_dir / f"{name}.log"
    spec_path.write_text(json.dumps(spec))
    full_env = dict(os.environ)
    full_env.setdefault("VLLM_CACHE_ROOT", str(tmp_dir / "vllm-cache"))
    full_env.update(env or {})
    with open(log_path, "w") as log:
        proc = subprocess.run([sys.executable, str(HARNESS), str(spec_path), str(out_path)], stdout=log,
                              stderr=subprocess.STDOUT, env=full_env, timeout=timeout_s)
    text = log_path.read_text(errors="replace")
    if proc.returncode == 0:
        tail = "\n".join(text.splitlines()[-40:])
        raise AssertionError(f"engine run {name} was expected to fail but succeeded; log {log_path}:\n{tail}")
    return text
