"""Range's own counters on a real API server's ``/metrics`` agree with vLLM's, read the way the replay reads them.

One vLLM OpenAI API server (CPU, tiny GQA model, file tier, vLLM's own prefix cache off so every repeat is a Range
hit) serves three prompts, each sent twice; each measured send is read with the replay's own reader
(:func:`range_connector.bench.replay_metrics.snapshot_metrics` before,
:func:`~range_connector.bench.replay_metrics.settle_metrics` after: the counters must have arrived by the time the
engine's TTFT and prompt counters have):

1. a stored prompt loads whole: vLLM's external hit tokens == Range's loaded tokens (no failed ones), and the
   bytes loaded equal the tokens times the model's KV bytes per token (from its ``config.json``);
2. one stored chunk corrupted on disk: its tokens are counted failed, not loaded, and the earlier chunk loaded;
3. the tier slowed past ``load_deadline_s`` (the latency wrapper's control file): every promised token is failed.

In every case ``external hits == loaded + failed`` holds and the greedy output equals the first send's.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

pytest.importorskip("vllm")
pytest.importorskip("httpx")

import msgpack  # noqa: E402

from range_connector.backends.file.backend import FileBackend  # noqa: E402
from range_connector.backends.file.stripes import PAGE  # noqa: E402
from range_connector.backends.latency import write_control_file  # noqa: E402
from range_connector.bench.replay_metrics import EngineCounts, engine_counts, settle_metrics, snapshot_metrics  # noqa: E402
from range_connector.kv.namespace import prefix_hash_chain  # noqa: E402
from range_connector.kv.tickets import ticket_key  # noqa: E402
from range_connector.testing.client import CompletionResult, complete  # noqa: E402
from range_connector.testing.server_process import ServerProcess, connector_config  # noqa: E402
from tests.integration.harness import prompt_ids  # noqa: E402

pytestmark = pytest.mark.engine

BLOCK_SIZE = 128
CHUNK_TOKENS = 256
PROMPT_TOKENS = 600
HIT_TOKENS = 512  # two stored chunks; the last token is always computed
MAX_TOKENS = 12
LOAD_DEADLINE_S = 2.0
SLOW_TIER_DELAY_S = 4.0  # every tier round trip; a load needs at least one, so it misses the deadline
BACKEND_TIMEOUT_S = 10.0  # above the delay: lookups, leases and saves still succeed, slowly
SAVED_CHUNKS = "vllm:range_saved_chunks_total"
LOADED_BYTES = "vllm:range_loaded_bytes_total"
INTEGRITY_ERRORS = "vllm:range_load_integrity_errors_total"
DEADLINE_MISSES = "vllm:range_load_deadline_misses_total"


@dataclass
class Send:
    result: CompletionResult
    engine: EngineCounts
    raw: dict[str, float]  # deltas of every sample of the one engine


@dataclass
class Setup:
    server: ServerProcess
    model_dir: Path
    file_dir: Path
    control_file: Path


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Setup]:
    from range_connector.testing.tiny_models import build_model

    model_dir = build_model("gqa", "tiny")
    tmp = tmp_path_factory.mktemp("connector-metrics")
    control_file = tmp / "tier.json"
    write_control_file(control_file, delay_s=0.0)
    kv_config = connector_config({"backend": "file", "file_dir": str(tmp / "kv"), "chunk_tokens": CHUNK_TOKENS,
                                  "load_deadline_s": LOAD_DEADLINE_S, "backend_timeout_s": BACKEND_TIMEOUT_S,
                                  "tier_control_file": str(control_file)})
    server = ServerProcess(model_dir, work_dir=tmp / "vllm", block_size=BLOCK_SIZE, max_model_len=2048,
                           kv_transfer_config=kv_config, extra_args=["--no-enable-prefix-caching"])
    with server:
        server.wait_ready(timeout_s=300)
        # The flat one-tier shorthand of earlier versions still starts an engine, and says how to write it now.
        log = server.log_text()
        assert "deprecated one-tier shorthand" in log and '"testing": {"control_file"' in log
        yield Setup(server, model_dir, tmp / "kv", control_file)


def _send(server: ServerProcess, prompt: list[int]) -> Send:
    url = server.base_url
    before = snapshot_metrics([url])
    result = complete(url, prompt_token_ids=prompt, max_tokens=MAX_TOKENS, ignore_eos=True, timeout_s=180.0)
    after = settle_metrics([url], before, min_prompt_tokens=len(prompt), min_first_tokens=1)
    assert not after.errors, after.errors
    raw = {name: value - before.counters[url].get(name, 0.0) for name, value in after.counters[url].items()}
    return Send(result, engine_counts(before, after), raw)


def _kv_bytes_per_token(model_dir: Path) -> int:
    """Bytes of KV per token of a Llama-family model in bf16: layers x KV heads x head size x (K, V) x 2 bytes."""
    cfg = json.loads((model_dir / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    return cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * head_dim * 2 * 2


def _corrupt_chunk(setup: Setup, prompt: list[int], chunk_idx: int) -> None:
    """Flip one byte of a stored chunk (layer 0, its first block) in its stripe file on shard 0."""
    found = re.search(r"RangeConnector WORKER: .* namespace=([0-9a-f]+)", setup.server.log_text())
    assert found, "the worker's start-up line names the namespace"
    chain = prefix_hash_chain(bytes.fromhex(found.group(1)), b"", prompt, CHUNK_TOKENS)
    tier = FileBackend(setup.file_dir / "default" / "shard-0")  # (the deployment "default")
    try:
        [raw] = tier.get_tickets([ticket_key(chain[chunk_idx], 0)])
    finally:
        tier.close()
    assert raw is not None, f"chunk {chunk_idx} is not stored"
    # Ticket.encode: [version, stripe_id, block_offset, num_blocks, stripe_blocks, layers, planes, row_bytes, ...]
    ticket = msgpack.unpackb(raw)
    offset = PAGE + ticket[2] * ticket[7] + 7  # layer 0 starts after the header page; plane 0, the chunk's block 0
    with open(setup.file_dir / "default" / "shard-0" / "stripes" / ticket[1], "r+b") as f:
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ 0xFF]))


def _check(send: Send, *, loaded: int, failed: int) -> None:
    check = send.engine.connector_check
    assert check is not None, "the server exports no vllm:range_* counters"
    assert send.engine.external_hit_tokens == HIT_TOKENS
    assert (check["loaded_tokens"], check["failed_tokens"], check["aborted_tokens"]) == (loaded, failed, 0), check
    assert check["agrees"] and check["difference_tokens"] == 0, check
    assert send.engine.served_from_tier_share == pytest.approx(loaded / PROMPT_TOKENS)


@pytest.mark.timeout(420)
def test_loaded_tokens_on_metrics_equal_vllms_external_hits(setup: Setup) -> None:
    prompt = prompt_ids(setup.model_dir, PROMPT_TOKENS, 0)
    cold = _send(setup.server, prompt)
    assert cold.engine.external_hit_tokens == 0 and cold.engine.connector_check["loaded_tokens"] == 0
    assert cold.raw[SAVED_CHUNKS] == HIT_TOKENS // CHUNK_TOKENS
    hit = _send(setup.server, prompt)
    _check(hit, loaded=HIT_TOKENS, failed=0)
    assert hit.raw[LOADED_BYTES] == HIT_TOKENS * _kv_bytes_per_token(setup.model_dir)
    assert hit.engine.to_dict()["connector_check_per_engine"][setup.server.base_url]["agrees"]
    assert hit.result.token_ids == cold.result.token_ids and len(hit.result.token_ids) == MAX_TOKENS


@pytest.mark.timeout(420)
def test_corrupt_chunk_is_counted_failed_not_loaded(setup: Setup) -> None:
    prompt = prompt_ids(setup.model_dir, PROMPT_TOKENS, 20_000)
    cold = _send(setup.server, prompt)
    assert cold.engine.external_hit_tokens == 0
    _corrupt_chunk(setup, prompt, 1)
    hit = _send(setup.server, prompt)
    _check(hit, loaded=CHUNK_TOKENS, failed=HIT_TOKENS - CHUNK_TOKENS)  # chunk 0 loads, chunk 1 is recomputed
    assert hit.raw[INTEGRITY_ERRORS] == 1
    assert hit.result.token_ids == cold.result.token_ids


@pytest.mark.timeout(420)
def test_load_past_its_deadline_is_counted_failed(setup: Setup) -> None:
    prompt = prompt_ids(setup.model_dir, PROMPT_TOKENS, 40_000)
    cold = _send(setup.server, prompt)
    assert cold.engine.external_hit_tokens == 0
    write_control_file(setup.control_file, delay_s=SLOW_TIER_DELAY_S)
    try:
        time.sleep(0.5)  # the wrappers re-read the file at most every 100 ms
        slow = _send(setup.server, prompt)
    finally:
        write_control_file(setup.control_file, delay_s=0.0)
    _check(slow, loaded=0, failed=HIT_TOKENS)
    assert slow.raw[DEADLINE_MISSES] >= 1
    assert slow.result.token_ids == cold.result.token_ids
