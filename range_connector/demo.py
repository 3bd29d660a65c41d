"""Demo: a prompt's KV cache survives a vLLM restart through the Range connector.

Run ``python -m range_connector.demo``. It

1. builds the tiny GQA model (``tiny_models.build_model("gqa", "tiny")``, cached after the first build);
2. starts one embedded Valkey server in ``./.cache/range-connector/demo/valkey`` (the demo folder is recreated on
   every run; servers left there by an earlier run are stopped first);
3. starts vLLM's OpenAI API server with the connector pointed at that server and sends a ~1,800-token prompt of
   English text (Python's own reference documentation, ``pydoc_data.topics``) as token ids: a miss, and the
   connector saves the prompt's KV;
4. stops the server and starts a fresh one (vLLM's own prefix cache is empty) and sends the same prompt: the
   connector loads the saved KV instead of recomputing it;
5. prints, per send, prompt tokens, hit tokens (growth of ``vllm:external_prefix_cache_hits_total``), time to first
   token and whether the greedy output matched the first send.

Everything it started (vLLM servers, Valkey) is stopped on exit, on errors and on Ctrl-C. Exit status: 0 on
success, 1 when the second send had no hit, 2 when the outputs differ, 3 on other errors.
Takes about 1.5-2 minutes on a 2-core machine (two vLLM start-ups of ~35 s each).
"""

from __future__ import annotations

import argparse
import shutil
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from types import FrameType

from range_connector.launch import ServerProcess, complete, connector_config, scrape_metrics, wait_for_metric

DEMO_DIR = Path(".cache") / "range-connector" / "demo"
HITS = "vllm:external_prefix_cache_hits_total"
PROMPT_TOKENS = "vllm:prompt_tokens_total"

_T0 = time.monotonic()


def _log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')} +{time.monotonic() - _T0:6.1f}s] {message}", flush=True)


@dataclass
class SendResult:
    """What one send of the demo prompt measured.

    Attributes:
        prompt_tokens: Prompt length in tokens.
        hit_tokens: Tokens the connector loaded (growth of ``vllm:external_prefix_cache_hits_total``).
        ttft_s: Time to first token in seconds, as seen by the client.
        latency_s: Whole request in seconds.
        token_ids: Generated token ids (greedy).
    """

    prompt_tokens: int
    hit_tokens: int
    ttft_s: float
    latency_s: float
    token_ids: list[int]


def prompt_token_ids(model_dir: Path, num_tokens: int) -> list[int]:
    """Tokenize English text from ``pydoc_data.topics`` with the model's tokenizer.

    Args:
        model_dir: Model directory holding the tokenizer.
        num_tokens: Prompt length in tokens (BOS included).

    Returns:
        ``num_tokens`` token ids starting with the tokenizer's BOS.
    """
    from pydoc_data.topics import topics
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    text = "\n\n".join(topics[key] for key in sorted(topics))
    num_chars = num_tokens * 4  # ~3-4 characters per token: grow the slice until it is long enough
    while True:
        ids = tokenizer(text[:num_chars])["input_ids"]
        if len(ids) >= num_tokens or num_chars >= len(text):
            break
        num_chars *= 2
    if len(ids) < num_tokens:
        raise ValueError(f"pydoc_data.topics holds only {len(ids)} tokens, fewer than {num_tokens}")
    return list(ids[:num_tokens])


def _warm_up_ids(prompt: list[int]) -> list[int]:
    """A short prompt sharing no chunk with ``prompt`` (the first request after start-up pays one-off costs)."""
    return prompt[:1] + list(reversed(prompt[1:64]))


def send_once(model_dir: Path, work_dir: Path, kv_config: str, prompt: list[int], label: str,
              max_tokens: int) -> SendResult:
    """Start a fresh vLLM server, warm it up, send ``prompt`` once, measure, and stop the server.

    Args:
        model_dir: Model directory.
        work_dir: Folder for the server's log and caches.
        kv_config: ``--kv-transfer-config`` JSON.
        prompt: Prompt token ids.
        label: Name of this send in progress lines.
        max_tokens: Tokens to generate.

    Returns:
        The measurements of the send.
    """
    server = ServerProcess(model_dir, work_dir=work_dir, kv_transfer_config=kv_config, max_model_len=4096,
                           log_path=work_dir / f"vllm-{label.replace(' ', '-')}.log")
    with server:
        _log(f"{label}: starting vLLM server on port {server.port} (log {server.log_path})")
        startup_s = server.wait_ready(timeout_s=300)
        _log(f"{label}: server ready after {startup_s:.1f} s")
        complete(server.base_url, prompt_token_ids=_warm_up_ids(prompt), max_tokens=2)
        before = scrape_metrics(server.base_url)
        _log(f"{label}: sending the {len(prompt)}-token prompt")
        result = complete(server.base_url, prompt_token_ids=prompt, max_tokens=max_tokens, ignore_eos=True)
        after = wait_for_metric(server.base_url, PROMPT_TOKENS, before.get(PROMPT_TOKENS, 0.0) + len(prompt))
        hit = int(after.get(HITS, 0.0) - before.get(HITS, 0.0))
        _log(f"{label}: TTFT {result.ttft_s:.3f} s, {hit} hit tokens, {len(result.token_ids or [])} tokens out")
        _log(f"{label}: stopping the server")
    _log(f"{label}: server stopped (exit code {server.returncode})")
    return SendResult(
        prompt_tokens=result.prompt_tokens or len(prompt),
        hit_tokens=hit,
        ttft_s=result.ttft_s,
        latency_s=result.latency_s,
        token_ids=list(result.token_ids or []),
    )


def format_table(results: list[SendResult]) -> str:
    """Render the per-send table (plain text, aligned columns)."""
    header = ("send", "prompt tokens", "hit tokens", "TTFT (s)", "latency (s)", "output identical to send 1")
    rows = [header]
    for i, r in enumerate(results):
        same = "(reference)" if i == 0 else ("yes" if r.token_ids == results[0].token_ids else "NO")
        rows.append((str(i + 1), str(r.prompt_tokens), str(r.hit_tokens), f"{r.ttft_s:.3f}", f"{r.latency_s:.3f}",
                     same))
    widths = [max(len(row[c]) for row in rows) for c in range(len(header))]
    lines = ["  ".join(cell.rjust(w) if c < 5 else cell for c, (cell, w) in enumerate(zip(row, widths)))
             for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _raise_keyboard_interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: list[str] | None = None) -> int:
    """Run the demo (see the module docstring).

    Args:
        argv: Command-line arguments without the program name; defaults to ``sys.argv[1:]``.

    Returns:
        Exit status: 0 success, 1 no hit on the second send, 2 outputs differ, 3 error, 130 interrupted.
    """
    parser = argparse.ArgumentParser(description="Range connector demo: KV reuse across a vLLM restart.")
    parser.add_argument("--prompt-tokens", type=int, default=1800, help="prompt length in tokens (default 1800)")
    parser.add_argument("--max-tokens", type=int, default=32, help="tokens generated per send (default 32)")
    parser.add_argument("--demo-dir", type=Path, default=DEMO_DIR, help=f"work folder, recreated (default {DEMO_DIR})")
    args = parser.parse_args(argv)

    from range_connector.tiny_models import build_model
    from range_connector.valkey_servers import ensure_servers, stop_servers

    demo_dir: Path = args.demo_dir.resolve()
    valkey_dir = demo_dir / "valkey"
    previous_sigterm = signal.signal(signal.SIGTERM, _raise_keyboard_interrupt)
    try:
        if valkey_dir.is_dir():
            stopped = stop_servers(valkey_dir)
            if stopped:
                _log(f"stopped {stopped} Valkey server(s) left by an earlier demo run")
        shutil.rmtree(demo_dir, ignore_errors=True)
        demo_dir.mkdir(parents=True)
        _log("building (or finding) the tiny GQA model")
        model_dir = build_model("gqa", "tiny")
        _log(f"model: {model_dir}")
        prompt = prompt_token_ids(model_dir, args.prompt_tokens)
        _log(f"prompt: {len(prompt)} tokens of pydoc_data.topics text")
        urls = ensure_servers(1, valkey_dir)
        _log(f"embedded Valkey: {urls[0]} (runtime dir {valkey_dir})")
        kv_config = connector_config({"valkey_urls": urls})
        results = []
        for i in range(2):
            results.append(send_once(model_dir, demo_dir / "vllm", kv_config, prompt, f"send {i + 1}",
                                     args.max_tokens))
        print()
        print(format_table(results))
        print()
        if results[1].hit_tokens <= 0:
            _log("FAIL: the second send had no external prefix-cache hit")
            return 1
        if results[1].token_ids != results[0].token_ids:
            _log("FAIL: the second send's greedy output differs from the first")
            return 2
        _log(f"OK: {results[1].hit_tokens} of {results[1].prompt_tokens} prompt tokens loaded from Valkey after the "
             f"restart; TTFT {results[0].ttft_s:.3f} s -> {results[1].ttft_s:.3f} s; identical output")
        return 0
    except KeyboardInterrupt:
        _log("interrupted")
        return 130
    except Exception as exc:  # noqa: BLE001 - report, clean up, exit non-zero
        _log(f"ERROR: {type(exc).__name__}: {exc}")
        return 3
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # cleanup below must not be interrupted by a second TERM
        try:
            if valkey_dir.is_dir():
                stopped = stop_servers(valkey_dir)
                _log(f"stopped {stopped} Valkey server(s)")
        finally:
            signal.signal(signal.SIGTERM, previous_sigterm)


if __name__ == "__main__":
    sys.exit(main())
