"""The disaggregated-prefill proxy, driven over real HTTP against stub engines (``tests/unit/stub_engines.py``).

Real vLLM engines behind the proxy are the integration tests' job; here the engines are aiohttp stubs that answer
like vLLM's OpenAI server with a KV connector, so that faults (refused connections, a stream cut in the middle, a
stall, an error status, mismatched Range settings) can be produced on demand.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from range_connector.cli import main
from range_connector.serving.proxy import Policy
from range_connector.testing.processes import free_port
from tests.unit.stub_engines import RANGE_SETTINGS, Stack, StubEngine, running_stacks, sse_events

pytestmark = pytest.mark.timeout(60)

REPO_ROOT = Path(__file__).resolve().parents[2]
COMPLETION = {"model": "tiny-gqa", "prompt": [11, 12, 13, 14], "max_tokens": 7, "min_tokens": 2, "temperature": 0.0}
CHAT = {"model": "tiny-gqa", "messages": [{"role": "user", "content": "Say something."}],
        "max_completion_tokens": 5, "temperature": 0.0}


@pytest.fixture
def make_stack() -> Iterator[Callable[..., Stack]]:
    """Build a proxy on a free port with ``num_prefill`` and ``num_decode`` stub engines; stop all at teardown."""
    with running_stacks() as start:
        yield lambda num_prefill=1, num_decode=1, **config: start(
            [StubEngine(f"p{idx}") for idx in range(num_prefill)],
            [StubEngine(f"d{idx}") for idx in range(num_decode)], **config)


# ------------------------------------------------------------------------------------------------------------------
# The two phases


def test_prefill_gets_one_token_and_the_marker_then_decode_gets_the_returned_params(make_stack) -> None:
    stack = make_stack()
    response = stack.client.post(stack.url("/v1/completions"), json=COMPLETION,
                                 headers={"Authorization": "Bearer k-1"})
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["text"] == "d0-t0 d0-t1 d0-t2 "
    [prefill_headers], [decode_headers] = stack.prefills[0].headers, stack.decodes[0].headers
    assert prefill_headers["Authorization"] == decode_headers["Authorization"] == "Bearer k-1"
    assert prefill_headers["X-Request-Id"] == decode_headers["X-Request-Id"], "one request id for both phases"

    [(prefill_path, prefill_body)] = stack.prefills[0].requests
    assert prefill_path == "/v1/completions"
    # The decode engine's settings, once the proxy knows them, go along so that the producer can name a mismatch.
    params = prefill_body.pop("kv_transfer_params")
    assert params.pop("range_expect", RANGE_SETTINGS) == RANGE_SETTINGS
    assert params == {"do_remote_decode": True}
    assert prefill_body == {**{k: v for k, v in COMPLETION.items() if k != "min_tokens"}, "max_tokens": 1,
                            "stream": False}
    [(decode_path, decode_body)] = stack.decodes[0].requests
    returned = {"chain_head": "head-p0", "num_tokens": 42, "range": {"settings": RANGE_SETTINGS}}
    assert decode_path == "/v1/completions"
    assert decode_body == {**COMPLETION, "kv_transfer_params": returned}, "decode gets the original request"
    [probe] = stack.decodes[0].probes
    assert probe["kv_transfer_params"] == {"range_describe": True} and probe["model"] == "tiny-gqa"
    assert probe["max_tokens"] == 1 and probe["stream"] is False


def test_streaming_passes_decode_events_through_byte_for_byte(make_stack) -> None:
    stack = make_stack()
    body = {**COMPLETION, "stream": True, "stream_options": {"include_usage": True}}
    response, raw = stack.stream("/v1/completions", body)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    assert raw == stack.decodes[0].streamed[0]
    assert sse_events(raw)[-1] == "[DONE]" and len(sse_events(raw)) == 4
    [(_, prefill_body)] = stack.prefills[0].requests
    assert prefill_body["stream"] is False and "stream_options" not in prefill_body
    assert stack.decodes[0].requests[0][1]["stream_options"] == {"include_usage": True}


def test_chat_completions_streaming_and_not(make_stack) -> None:
    stack = make_stack()
    response = stack.post("/v1/chat/completions", CHAT)
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["message"]["content"] == "d0-t0 d0-t1 d0-t2 "
    stream_response, raw = stack.stream("/v1/chat/completions", {**CHAT, "stream": True})
    assert stream_response.status_code == 200 and raw == stack.decodes[0].streamed[0]

    assert stack.prefills[0].paths() == ["/v1/chat/completions"] * 2
    assert stack.decodes[0].paths() == ["/v1/chat/completions"] * 2
    for _, prefill_body in stack.prefills[0].requests:
        assert prefill_body["max_tokens"] == 1 and prefill_body["max_completion_tokens"] == 1
        assert prefill_body["stream"] is False and prefill_body["messages"] == CHAT["messages"]
        assert {k: v for k, v in prefill_body["kv_transfer_params"].items() if k != "range_expect"} == {
            "do_remote_decode": True}
    for (_, decode_body), stream in zip(stack.decodes[0].requests, (False, True), strict=True):
        assert decode_body["max_completion_tokens"] == 5 and "max_tokens" not in decode_body
        assert decode_body.get("stream", False) is stream
        assert decode_body["kv_transfer_params"]["chain_head"] == "head-p0"


# ------------------------------------------------------------------------------------------------------------------
# Choice of engine


def test_round_robin_alternates_the_engines_of_each_kind(make_stack) -> None:
    stack = make_stack(num_prefill=2, num_decode=2, policy=Policy.ROUND_ROBIN)
    prefill_order, decode_order = [], []
    for _ in range(4):
        before = [len(stub.requests) for stub in stack.prefills + stack.decodes]
        assert stack.post("/v1/completions", COMPLETION).status_code == 200
        stubs = stack.prefills + stack.decodes
        grown = [stub.name for stub, count in zip(stubs, before, strict=True) if len(stub.requests) > count]
        prefill_order.append(grown[0])
        decode_order.append(grown[1])
    assert prefill_order in (["p0", "p1", "p0", "p1"], ["p1", "p0", "p1", "p0"])
    assert decode_order in (["d0", "d1", "d0", "d1"], ["d1", "d0", "d1", "d0"])


def test_least_loaded_sends_to_the_engine_with_fewest_in_flight(make_stack) -> None:
    stack = make_stack(num_decode=2, policy=Policy.LEAST_LOADED)
    for stub in stack.decodes:
        stub.behaviour.num_chunks, stub.behaviour.chunk_delay_s = 4, 0.3
    with stack.client.stream("POST", stack.url("/v1/completions"), json={**COMPLETION, "stream": True}) as held:
        assert held.status_code == 200  # decode has answered: the held stream is in flight on one decode engine
        [busy] = [stub for stub in stack.decodes if stub.requests]
        [idle] = [stub for stub in stack.decodes if stub is not busy]
        assert stack.engine_status(busy.url)["num_in_flight"] == 1
        for _ in range(2):  # round robin would send one of these to the busy engine
            assert stack.post("/v1/completions", COMPLETION).status_code == 200
        assert len(busy.requests) == 1 and len(idle.requests) == 2
        assert sse_events(b"".join(held.iter_raw()))[-1] == "[DONE]"
    assert stack.status()["num_in_flight"] == 0


# ------------------------------------------------------------------------------------------------------------------
# Engines down, dying, slow, failing


def test_a_refused_connection_fails_over_to_the_other_engine(make_stack) -> None:
    stack = make_stack(num_prefill=2, num_decode=2, health_interval_s=60.0)  # only the request can notice
    stack.loop.run(stack.prefills[0].stop())
    stack.loop.run(stack.decodes[0].stop())
    for _ in range(3):
        response = stack.post("/v1/completions", COMPLETION)
        assert response.status_code == 200, response.text
    assert len(stack.prefills[1].requests) == 3 and len(stack.decodes[1].requests) == 3
    for stub in (stack.prefills[0], stack.decodes[0]):
        engine = stack.engine_status(stub.url)
        assert engine["healthy"] is False and "ClientConnectorError" in engine["last_error"]


def test_no_healthy_engine_of_a_kind_answers_503_with_an_openai_error(make_stack) -> None:
    stack = make_stack()
    stack.decodes[0].behaviour.healthy = False
    stack.wait_health(stack.decodes[0], healthy=False)
    response = stack.post("/v1/completions", COMPLETION)
    assert response.status_code == 503
    error = response.json()["error"]
    assert error["code"] == 503 and error["type"] == "ServiceUnavailableError" and "decode" in error["message"]
    assert stack.prefills[0].requests == [], "no prefill is spent when no decode engine can take the request"
    health = stack.client.get(stack.url("/health"))
    assert health.status_code == 503 and "decode" in health.json()["error"]["message"]

    stack.loop.run(stack.prefills[0].stop())
    stack.decodes[0].behaviour.healthy = True
    stack.wait_health(stack.decodes[0], healthy=True)
    stack.wait_health(stack.prefills[0], healthy=False)
    response = stack.post("/v1/chat/completions", CHAT)
    assert response.status_code == 503 and "prefill" in response.json()["error"]["message"]
    assert stack.status()["outcomes"]["no_engine_503"] == 2


def test_health_checks_mark_an_engine_down_and_up_again(make_stack) -> None:
    stack = make_stack(num_decode=2)
    stack.decodes[0].behaviour.healthy = False
    stack.wait_health(stack.decodes[0], healthy=False)
    for _ in range(3):
        assert stack.post("/v1/completions", COMPLETION).status_code == 200
    assert len(stack.decodes[0].requests) == 0 and len(stack.decodes[1].requests) == 3
    assert "HTTP 503" in stack.engine_status(stack.decodes[0].url)["last_error"]
    stack.decodes[0].behaviour.healthy = True
    stack.wait_health(stack.decodes[0], healthy=True)
    for _ in range(2):
        assert stack.post("/v1/completions", COMPLETION).status_code == 200
    assert len(stack.decodes[0].requests) == 1 and len(stack.decodes[1].requests) == 4


@pytest.mark.parametrize("mid_event", [False, True], ids=["between-events", "mid-event"])
def test_an_engine_dying_mid_stream_ends_the_stream_cleanly_and_the_proxy_serves_on(make_stack, mid_event) -> None:
    stack = make_stack(num_decode=2, health_interval_s=60.0)
    for stub in stack.decodes:
        stub.behaviour.die_after_chunks, stub.behaviour.die_mid_event = 1, mid_event
    response, raw = stack.stream("/v1/completions", {**COMPLETION, "stream": True})
    [dead] = [stub for stub in stack.decodes if stub.requests]
    events = sse_events(raw)
    assert response.status_code == 200
    assert raw.startswith(dead.streamed[0]), "what decode sent before dying reaches the client unchanged"
    assert json.loads(events[0])["choices"][0]["text"] == f"{dead.name}-t0 "
    if mid_event:  # the half-sent event stays a separate (broken) event: the error event is not glued to it
        assert events.pop(1) == "{"
    error = json.loads(events[1])["error"]
    assert error["code"] == 502 and dead.url in error["message"] and events[2:] == ["[DONE]"]

    for stub in stack.decodes:
        stub.behaviour.die_after_chunks = None
    response, raw = stack.stream("/v1/completions", {**COMPLETION, "stream": True})
    [alive] = [stub for stub in stack.decodes if stub is not dead]
    assert response.status_code == 200 and raw == alive.streamed[0]
    status = stack.status()
    assert status["outcomes"]["engine_failed_502"] == 1 and status["outcomes"]["ok"] == 1
    assert stack.engine_status(dead.url)["healthy"] is False and status["num_in_flight"] == 0


def test_a_client_leaving_mid_stream_frees_the_decode_call(make_stack) -> None:
    stack = make_stack()
    stack.decodes[0].behaviour.num_chunks, stack.decodes[0].behaviour.chunk_delay_s = 20, 0.1
    with stack.client.stream("POST", stack.url("/v1/completions"), json={**COMPLETION, "stream": True}) as response:
        assert next(response.iter_raw()).startswith(b"data: ")
    deadline = time.monotonic() + 30.0  # (only a hang takes that long)
    while stack.status()["outcomes"]["client_disconnected"] != 1:
        assert time.monotonic() < deadline, "the proxy did not notice the client leaving"
        time.sleep(0.05)
    status = stack.status()
    assert status["num_in_flight"] == 0 and status["outcomes"]["ok"] == 0
    assert stack.engine_status(stack.decodes[0].url)["healthy"] is True, "a client leaving is not the engine's fault"
    assert stack.post("/v1/completions", COMPLETION).status_code == 200


def test_a_slow_prefill_answers_504_and_the_proxy_serves_on(make_stack) -> None:
    # The prefill would answer after 15 s (far past the 0.3 s timeout, within the client's 20 s): a 504 can only be
    # the proxy's own timeout, which the error names.
    stack = make_stack(prefill_timeout_s=0.3)
    stack.prefills[0].behaviour.answer_delay_s = 15.0
    response = stack.post("/v1/completions", COMPLETION)
    assert response.status_code == 504
    error = response.json()["error"]
    assert error["type"] == "GatewayTimeoutError" and "prefill" in error["message"] and "0.3 s" in error["message"]
    assert stack.decodes[0].requests == []
    stack.prefills[0].behaviour.answer_delay_s = 0.0
    assert stack.post("/v1/completions", COMPLETION).status_code == 200
    assert stack.status()["outcomes"]["timeout_504"] == 1


def test_a_decode_stalling_mid_stream_ends_the_stream_with_a_504_event(make_stack) -> None:
    stack = make_stack(decode_timeout_s=0.3)
    stack.decodes[0].behaviour.chunk_delay_s = 15.0  # (far past the timeout: only the proxy's timeout can end it)
    response, raw = stack.stream("/v1/completions", {**COMPLETION, "stream": True})
    events = sse_events(raw)
    assert response.status_code == 200 and json.loads(events[0])["choices"][0]["text"] == "d0-t0 "
    assert json.loads(events[1])["error"]["code"] == 504 and events[2:] == ["[DONE]"]
    stack.decodes[0].behaviour.chunk_delay_s = 0.0
    assert stack.post("/v1/completions", COMPLETION).status_code == 200


@pytest.mark.parametrize("kind", ["prefill", "decode"])
def test_an_engine_4xx_is_passed_through_unchanged(make_stack, kind: str) -> None:
    stack = make_stack()
    stub = stack.prefills[0] if kind == "prefill" else stack.decodes[0]
    stub.behaviour.status = 400
    response = stack.post("/v1/completions", COMPLETION)
    assert response.status_code == 400
    assert response.json() == {"error": {"message": f"{stub.name} says no", "type": "BadRequestError",
                                         "param": None, "code": 400}}
    assert stack.status()["outcomes"]["engine_4xx"] == 1


def test_an_engine_5xx_answers_502_naming_the_engine(make_stack) -> None:
    stack = make_stack()
    stack.decodes[0].behaviour.status = 500
    response = stack.post("/v1/completions", {**COMPLETION, "stream": True})
    assert response.status_code == 502
    error = response.json()["error"]
    assert error["type"] == "BadGatewayError" and stack.decodes[0].url in error["message"] and "500" in error["message"]


def test_a_body_that_is_not_json_answers_400(make_stack) -> None:
    stack = make_stack()
    response = stack.client.post(stack.url("/v1/completions"), content=b"{not json")
    assert response.status_code == 400 and response.json()["error"]["type"] == "BadRequestError"
    assert stack.prefills[0].requests == []


def test_a_body_over_max_body_bytes_answers_413_and_reaches_no_engine(make_stack) -> None:
    stack = make_stack(max_body_bytes=4096)
    big = {**COMPLETION, "prompt": "x" * 8192}
    response = stack.client.post(stack.url("/v1/completions"), json=big)
    assert response.status_code == 413
    assert stack.prefills[0].requests == [] and stack.decodes[0].requests == []
    # a body under the cap still goes through
    assert stack.client.post(stack.url("/v1/completions"), json=COMPLETION).status_code == 200


@pytest.mark.parametrize("body", [[1, 2], "text", 7, None])
def test_a_json_body_that_is_not_an_object_answers_400(make_stack, body) -> None:
    stack = make_stack()
    response = stack.client.post(stack.url("/v1/completions"), json=body)
    assert response.status_code == 400 and stack.prefills[0].requests == []


# ------------------------------------------------------------------------------------------------------------------
# Range settings


def test_settings_mismatch_answers_409_naming_the_key(make_stack, caplog) -> None:
    stack = make_stack()
    stack.decodes[0].behaviour.settings = {**RANGE_SETTINGS, "block_size": 32}
    with caplog.at_level(logging.WARNING, logger="range_connector.serving.proxy"):
        response = stack.post("/v1/completions", COMPLETION)
    assert response.status_code == 409
    error = response.json()["error"]
    assert error["type"] == "SettingsMismatchError"
    assert error["mismatches"] == {"block_size": {"prefill": 16, "decode": 32}}
    assert "block_size: prefill 16, decode 32" in error["message"]
    assert stack.decodes[0].requests == [], "a mismatched decode engine never gets the request"
    assert any("block_size: prefill 16, decode 32" in record.getMessage() for record in caplog.records)


def test_a_kv_dtype_mismatch_answers_409_naming_the_dtype(make_stack) -> None:
    stack = make_stack()
    stack.prefills[0].behaviour.settings = {**RANGE_SETTINGS, "kv_spec.dtype": "torch.bfloat16"}
    stack.decodes[0].behaviour.settings = {**RANGE_SETTINGS, "kv_spec.dtype": "torch.float8_e4m3fn"}
    response = stack.post("/v1/completions", COMPLETION)
    assert response.status_code == 409
    assert response.json()["error"]["mismatches"] == {
        "kv_spec.dtype": {"prefill": "torch.bfloat16", "decode": "torch.float8_e4m3fn"}}
    assert stack.decodes[0].requests == []


def test_a_mismatched_decode_engine_is_passed_over_for_a_matching_one(make_stack) -> None:
    stack = make_stack(num_decode=2)
    stack.decodes[0].behaviour.settings = {**RANGE_SETTINGS, "num_shards": 4, "namespace": "other"}
    for _ in range(3):
        assert stack.post("/v1/completions", COMPLETION).status_code == 200
    assert stack.decodes[0].requests == [] and len(stack.decodes[1].requests) == 3
    assert len(stack.decodes[0].probes) == 1, "settings are probed once per engine, not per request"


@pytest.mark.parametrize("without", ["prefill", "decode"])
def test_engines_without_range_settings_are_not_checked_and_it_is_said_once(make_stack, caplog, without) -> None:
    stack = make_stack()
    stub = stack.prefills[0] if without == "prefill" else stack.decodes[0]
    stub.behaviour.settings = None
    with caplog.at_level(logging.WARNING, logger="range_connector"):
        for _ in range(2):
            assert stack.post("/v1/completions", COMPLETION).status_code == 200
    said = [record for record in caplog.records if "no Range settings" in record.getMessage()]
    assert len(said) == 1 and stub.url in said[0].getMessage()
    assert len(stack.decodes[0].requests) == 2
    assert len(stack.decodes[0].probes) == (0 if without == "prefill" else 1)


# ------------------------------------------------------------------------------------------------------------------
# Other endpoints and the command line


def test_models_is_forwarded_and_status_reports_every_engine(make_stack) -> None:
    stack = make_stack(num_prefill=1, num_decode=2)
    models = stack.client.get(stack.url("/v1/models"))
    assert models.status_code == 200 and models.json()["data"][0]["owned_by"] in ("d0", "d1")
    assert stack.client.get(stack.url("/health")).json() == {"status": "ok"}
    assert stack.post("/v1/completions", COMPLETION).status_code == 200
    status = stack.status()
    assert status["policy"] == "round_robin" and status["outcomes"]["ok"] == 1
    assert [(engine["kind"], engine["healthy"]) for engine in status["engines"]] == [
        ("prefill", True), ("decode", True), ("decode", True)]
    assert sum(engine["num_requests"] for engine in status["engines"] if engine["kind"] == "decode") == 2


@pytest.mark.parametrize(("argv", "needle"), [
    (["proxy", "--decode", "http://127.0.0.1:9"], "--prefill"),
    (["proxy", "--prefill", "ftp://127.0.0.1:9", "--decode", "http://127.0.0.1:9"], "--prefill: 'ftp://"),
    (["proxy", "--prefill", "http://a:1", "--prefill", "http://a:1", "--decode", "http://b:1"], "--prefill: "),
    (["proxy", "--prefill", "http://a:1", "--decode", "http://b:1", "--policy", "fastest"], "--policy"),
    (["proxy", "--prefill", "http://a:1", "--decode", "http://b:1", "--timeout-s", "0"], "--timeout-s"),
    (["proxy", "--prefill", "http://a:1", "--decode", "http://b:1", "--port", "70000"], "--port: 70000"),
    (["proxy", "--prefill", "http://a:1", "--decode", "http://b:1", "--max-body-bytes", "10"], "--max-body-bytes"),
])
def test_bad_proxy_arguments_exit_2_with_one_line(capsys, argv: list[str], needle: str) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and needle in err, err


def test_a_port_in_use_exits_1_with_one_line(capsys) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        argv = ["proxy", "--prefill", "http://127.0.0.1:9", "--decode", "http://127.0.0.1:9", "--port", str(port),
                "--log-level", "error", "--health-interval-s", "60"]
        assert main(argv) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"error: cannot listen on 127.0.0.1:{port}: "), err


def test_the_proxy_command_serves_until_sigterm(make_stack) -> None:
    stack = make_stack()
    port = free_port()
    command = [sys.executable, "-m", "range_connector.cli", "proxy", "--prefill", stack.prefills[0].url,
               "--decode", stack.decodes[0].url, "--port", str(port), "--policy", "least_loaded"]
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env) as process:
        try:
            line = process.stdout.readline()  # the proxy prints its address once it listens
            assert line.strip() == f"proxy listening on http://127.0.0.1:{port}", process.stderr.read()
            response = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=COMPLETION, timeout=10.0)
            assert response.status_code == 200 and len(stack.decodes[0].requests) == 1
            process.send_signal(signal.SIGTERM)
            assert process.wait(timeout=10.0) == 0
        finally:
            if process.poll() is None:
                process.kill()
                process.wait(timeout=5.0)
