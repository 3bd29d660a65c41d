"""End to end through vLLM's OpenAI API server: the connector, enabled through the ``vllm.general_plugins`` entry
point (no ``kv_connector_module_path``), saves a prompt's KV to embedded Valkey and loads it once vLLM's own prefix
cache is reset; hostile ``kv_transfer_params`` are answered and counted; ``reset_external`` clears this
deployment's tier entries only. (A start-up failure naming the key: ``test_engine_bad_config.py``.)

One server start serves every test (about 35-60 s on 2 cores).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

pytest.importorskip("vllm")
httpx = pytest.importorskip("httpx")

from range_connector.backends.valkey.servers import server_status, stop_servers  # noqa: E402
from range_connector.testing.client import (  # noqa: E402
    CompletionResult,
    complete,
    reset_prefix_cache,
    scrape_metrics,
    wait_for_metric,
)
from range_connector.testing.processes import process_group_pids  # noqa: E402
from range_connector.testing.server_process import ServerProcess, connector_config  # noqa: E402

pytestmark = pytest.mark.engine

BLOCK_SIZE = 128
CHUNK_TOKENS = 256
PROMPT_TOKENS = 600
MAX_TOKENS = 16
STARTUP_TIMEOUT_S = 300.0

HITS = "vllm:external_prefix_cache_hits_total"
QUERIES = "vllm:external_prefix_cache_queries_total"
LOCAL_HITS = "vllm:prefix_cache_hits_total"
PROMPT_TOKENS_TOTAL = "vllm:prompt_tokens_total"


def expected_hit_tokens(num_prompt_tokens: int, chunk_tokens: int, block_size: int) -> int:
    """Tokens the connector can load for a prompt stored in full chunks: stored chunks capped at len-1, whole
    blocks."""
    stored = (num_prompt_tokens // chunk_tokens) * chunk_tokens
    return min(stored, num_prompt_tokens - 1) // block_size * block_size


@dataclass
class Send:
    result: CompletionResult
    hits: int
    queries: int
    local_hits: int


@pytest.fixture(scope="module")
def model_dir() -> Path:
    from range_connector.testing.tiny_models import build_model

    return build_model("gqa", "tiny")


@pytest.fixture(scope="module")
def prompt(model_dir: Path) -> list[int]:
    from range_connector.testing.tiny_models import prompt_token_ids

    return prompt_token_ids(model_dir, PROMPT_TOKENS)


@pytest.fixture(scope="module")
def runtime_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """Runtime dir of the embedded Valkey servers that the connector starts itself; stopped afterwards."""
    path = tmp_path_factory.mktemp("valkey-runtime")
    try:
        yield path
    finally:
        stop_servers(path)


@pytest.fixture(scope="module")
def server(model_dir: Path, runtime_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    kv_config = connector_config({"runtime_dir": str(runtime_dir), "chunk_tokens": CHUNK_TOKENS,
                                  "tiers": [{"type": "valkey", "timeout_s": 5.0}]})  # the tree spelling
    assert "kv_connector_module_path" not in kv_config  # the entry point must register the connector
    proc = ServerProcess(
        model_dir,
        work_dir=tmp_path_factory.mktemp("vllm"),
        block_size=BLOCK_SIZE,
        max_model_len=2048,
        kv_transfer_config=kv_config,
        extra_env={"VLLM_SERVER_DEV_MODE": "1"},  # registers POST /reset_prefix_cache
    )
    with proc:
        proc.wait_ready(timeout_s=STARTUP_TIMEOUT_S)
        assert "deprecated one-tier shorthand" not in proc.log_text()  # (the flat shorthand warns; the tree does not)
        yield proc
    assert process_group_pids(proc.pid) == [], "engine processes outlived stop()"


def _send(server: ServerProcess, prompt: list[int]) -> Send:
    before = scrape_metrics(server.base_url)
    result = complete(server.base_url, prompt_token_ids=prompt, max_tokens=MAX_TOKENS, ignore_eos=True)
    after = wait_for_metric(server.base_url, PROMPT_TOKENS_TOTAL, before.get(PROMPT_TOKENS_TOTAL, 0.0) + len(prompt))
    return Send(
        result=result,
        hits=round(after.get(HITS, 0.0) - before.get(HITS, 0.0)),
        queries=round(after.get(QUERIES, 0.0) - before.get(QUERIES, 0.0)),
        local_hits=round(after.get(LOCAL_HITS, 0.0) - before.get(LOCAL_HITS, 0.0)),
    )


@pytest.fixture(scope="module")
def sends(server: ServerProcess, prompt: list[int]) -> tuple[Send, Send]:
    """The prompt sent to a fresh store, then again after vLLM's own prefix cache was emptied."""
    first = _send(server, prompt)
    assert reset_prefix_cache(server.base_url), "POST /reset_prefix_cache reported failure"
    second = _send(server, prompt)
    return first, second


def test_expected_hit_formula() -> None:
    assert expected_hit_tokens(600, 256, 128) == 512
    assert expected_hit_tokens(512, 256, 128) == 384  # the last token is always computed
    assert expected_hit_tokens(200, 256, 128) == 0


@pytest.mark.timeout(600)
def test_hit_after_local_cache_reset(server: ServerProcess, prompt: list[int], sends: tuple[Send, Send],
                                     runtime_dir: Path) -> None:
    first, second = sends
    expected = expected_hit_tokens(len(prompt), CHUNK_TOKENS, BLOCK_SIZE)
    assert expected >= 512 and expected % BLOCK_SIZE == 0

    assert first.result.prompt_tokens == len(prompt) == PROMPT_TOKENS
    assert first.queries == len(prompt)
    assert first.hits == 0, "a fresh store cannot hit"

    assert second.local_hits == 0, "vLLM's own prefix cache was not reset: the hit would not prove anything"
    assert second.queries == len(prompt)
    assert second.hits == expected, f"external hit {second.hits} != expected {expected}"

    # The connector started the embedded server in our runtime dir and stored the prompt's full chunks there.
    statuses = server_status(runtime_dir)
    assert len(statuses) == 1 and statuses[0].alive
    assert statuses[0].num_keys is not None and statuses[0].num_keys >= len(prompt) // CHUNK_TOKENS


@pytest.mark.timeout(600)
def test_greedy_output_identical(sends: tuple[Send, Send]) -> None:
    first, second = sends
    assert first.result.token_ids is not None and len(first.result.token_ids) == MAX_TOKENS
    assert second.result.token_ids == first.result.token_ids
    assert second.result.text == first.result.text


@pytest.mark.timeout(600)
def test_connector_registered_by_entry_point(server: ServerProcess, sends: tuple[Send, Send]) -> None:
    log = server.log_text()
    assert "Creating v1 connector with name: RangeConnector" in log
    assert "RangeConnector SCHEDULER" in log and "RangeConnector WORKER" in log
    # The command line carries no module path: the name was resolved through the plugin's registration.
    kv_arg = server.command()[server.command().index("--kv-transfer-config") + 1]
    assert json.loads(kv_arg)["kv_connector"] == "RangeConnector"
    assert "kv_connector_module_path" not in json.loads(kv_arg)


# ------------------------------------------------------------------------------------------------ hostile clients
REJECTED = "vllm:range_rejected_request_inputs_total"
NAMESPACE_ONLY = {"namespace": "00" * 32}
#: (kind counted, kv_transfer_params): what any client of the default kv_both server can send (kind None: vLLM's own
#: validation refuses it with a 400 before Range sees it)
HOSTILE_PARAMS: list[tuple[str | None, object]] = [
    ("num_tokens", {"range": {"version": 1, "settings": NAMESPACE_ONLY, "num_tokens": "x"}}),
    ("num_tokens", {"range": {"settings": NAMESPACE_ONLY, "num_tokens": None}}),
    ("num_tokens", {"range": {"settings": NAMESPACE_ONLY, "num_tokens": float("inf")}}),  # JSON Infinity
    ("num_tokens", {"range": {"settings": NAMESPACE_ONLY, "num_tokens": True}}),
    ("num_tokens", {"range": {"settings": NAMESPACE_ONLY, "num_tokens": 1 << 62}}),  # over Range's bound
    (None, {"range": {"settings": NAMESPACE_ONLY, "num_tokens": 10 ** 200}}),  # vLLM itself answers 400
    ("settings", {"range": {"num_tokens": 5, "settings": ["namespace"]}}),
    ("settings", {"range": {"num_tokens": 5, "settings": {"namespace": "x" * 10_000_000}}}),  # a 10 MB string
    ("settings", {"range": {"num_tokens": 5, "settings": {"namespace": "0", "deep": [[[[[[[[[[1]]]]]]]]]]}}}),
    ("range", {"range": [1, 2, 3]}),
    ("do_remote_decode", {"do_remote_decode": "yes"}),
    ("range_expect", {"do_remote_decode": True, "range_expect": "everything"}),
]


def _rejected_by_kind(base_url: str) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{base_url}/metrics", timeout=10.0).text
    return {s.labels["kind"]: s.value for f in text_string_to_metric_families(text) for s in f.samples
            if s.name == REJECTED}


@pytest.mark.timeout(600)
def test_hostile_kv_transfer_params_leave_the_engine_serving(server: ServerProcess, prompt: list[int],
                                                             sends: tuple[Send, Send]) -> None:
    # Each malformed shape goes to /v1/completions as any client could send it: the engine answers every one (the
    # request is served without Range's part), keeps serving, and counts each on /metrics by kind.
    before = _rejected_by_kind(server.base_url)
    expected: dict[str, int] = {}
    for i, (kind, params) in enumerate(HOSTILE_PARAMS):
        body = {"prompt": prompt[: 40 + i], "max_tokens": 2, "temperature": 0.0, "kv_transfer_params": params}
        response = httpx.post(f"{server.base_url}/v1/completions", content=json.dumps(body),  # (Infinity allowed)
                              headers={"Content-Type": "application/json"}, timeout=120.0)
        if kind is None:
            assert response.status_code == 400, f"{response.status_code} {response.text[:300]}"
            continue
        assert response.status_code == 200, f"{kind}: {response.status_code} {response.text[:300]}"
        assert len(response.json()["choices"][0]["text"]) >= 0
        expected[kind] = expected.get(kind, 0) + 1
    assert httpx.get(f"{server.base_url}/health", timeout=10.0).status_code == 200
    # still serving: the stored prompt is still a hit after all that
    assert reset_prefix_cache(server.base_url)
    after_hostile = _send(server, prompt)
    assert after_hostile.hits == sends[1].hits > 0
    assert after_hostile.result.token_ids == sends[0].result.token_ids
    after = wait_for_metric(server.base_url, REJECTED, sum(before.values()) + sum(expected.values()))
    by_kind = _rejected_by_kind(server.base_url)
    for kind, count in expected.items():
        assert by_kind[kind] - before.get(kind, 0.0) == count, (kind, by_kind)
    assert after[REJECTED] == sum(before.values()) + sum(expected.values())
    log = server.log_text()
    assert "EngineDeadError" not in log and "Traceback" not in log
    assert log.count("further requests with this kind of input are only counted") == len(expected)


# ------------------------------------------------------------------------------------------------ reset_external
@pytest.mark.timeout(600)
def test_reset_external_clears_this_deployments_tier_entries_only(server: ServerProcess, prompt: list[int],
                                                                  sends: tuple[Send, Send], runtime_dir: Path,
                                                                  tmp_path: Path) -> None:
    # Defined last: it empties the tier the other tests read. vLLM's /reset_prefix_cache?reset_external=true (dev
    # mode) reaches the connector's reset_cache: this deployment's entries go from every tier, another deployment's
    # on the same server stay, and the prompt is a miss on this engine and on a fresh one.
    from range_connector.backends.valkey.client import ValkeyBackend
    from range_connector.backends.valkey.servers import embedded_urls
    from range_connector.testing.embedded import embedded_client
    from range_connector.testing.tiny_models import build_model
    from tests.backends.conformance import make_stripe
    from tests.integration.harness import run_engine

    other = ValkeyBackend(embedded_urls(runtime_dir)[0], deployment="another", capacity_bytes=1 << 20)
    stripe = make_stripe(3)
    assert other.write_stripe(stripe.write)
    client = embedded_client(runtime_dir)
    ours_before = list(client.scan_iter(match="rc3:default:*", count=1000))
    others_before = sorted(client.scan_iter(match="rc3:another:*", count=1000))
    assert len(ours_before) > 2 and others_before, "nothing stored to clear"
    assert sends[1].hits > 0  # the tier served the prompt before the reset

    assert reset_prefix_cache(server.base_url, reset_external=True), "reset_prefix_cache reported failure"

    assert list(client.scan_iter(match="rc3:default:*", count=1000)) == [b"rc3:default:epoch"]  # (the fence)
    assert int(client.get(b"rc3:default:used") or 0) == 0
    assert sorted(client.scan_iter(match="rc3:another:*", count=1000)) == others_before
    assert other.get_tickets(stripe.keys) == stripe.encoded and other.used_bytes() == stripe.nbytes
    # a fresh engine of the same deployment (a consumer: it saves nothing) misses
    fresh = run_engine(tmp_path, "fresh-after-reset", {
        "model": str(build_model("gqa", "tiny")), "role": "kv_consumer",
        "connector": {"runtime_dir": str(runtime_dir), "chunk_tokens": CHUNK_TOKENS, "remote_wait_s": 0.0},
        "steps": [{"op": "generate", "prompts": [prompt], "max_tokens": MAX_TOKENS}]})
    assert fresh[0]["external_hits"] == 0 and fresh[0]["external_queries"] == len(prompt)
    # and so does this engine
    after = _send(server, prompt)
    assert after.hits == 0 and after.local_hits == 0 and after.queries == len(prompt)
    other.close()
    client.close()
