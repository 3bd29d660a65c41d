"""The proxy in front of a fleet of ``kv_both`` engines, prefix-aware routing, and ``/health`` on mismatched settings.

Over real HTTP against the stub engines of ``tests/unit/stub_engines.py`` (a fleet engine is a stub that gets
plain requests, which it answers as a decode). Real engines sharing a tier behind the proxy are the fleet replay's
job (``bench/replay.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from range_connector.cli import main
from range_connector.serving.prefix_routing import TOKENS_PER_BLOCK, PrefixRecord, prompt_prefix_hashes
from range_connector.serving.proxy import Policy
from tests.unit.stub_engines import RANGE_SETTINGS, Stack, StubEngine, running_stacks, sse_events

pytestmark = pytest.mark.timeout(60)

SYSTEM = list(range(1000, 1000 + 4 * TOKENS_PER_BLOCK))  # a shared system prompt of 4 blocks


def _body(prompt: Any, **extra: Any) -> dict[str, Any]:
    return {"model": "tiny-gqa", "prompt": prompt, "max_tokens": 3, **extra}


@pytest.fixture
def make_fleet() -> Iterator[Callable[..., Stack]]:
    """A proxy on a free port in front of ``num_engines`` stub engines (fleet mode); all stopped at teardown."""
    with running_stacks() as start:
        yield lambda num_engines=2, **config: start([], [StubEngine(f"e{idx}") for idx in range(num_engines)],
                                                    fleet=True, **config)


def _served_by(stack: Stack, body: dict[str, Any]) -> str:
    before = [len(stub.requests) for stub in stack.decodes]
    response = stack.post("/v1/completions", body)
    assert response.status_code == 200, response.text
    [name] = [stub.name for stub, count in zip(stack.decodes, before, strict=True) if len(stub.requests) > count]
    return name


# ------------------------------------------------------------------------------------------------------------------
# Prefix hashes and the record


def test_prompts_share_the_hashes_of_exactly_their_common_leading_blocks() -> None:
    a = prompt_prefix_hashes(_body(SYSTEM + [1] * 20))
    b = prompt_prefix_hashes(_body(SYSTEM + [2] * 20))
    assert len(a) == len(b) == 6 and a[:4] == b[:4] and a[4] != b[4]
    assert prompt_prefix_hashes(_body(SYSTEM, model="other"))[0] != a[0], "another model never matches"
    assert prompt_prefix_hashes(_body(SYSTEM, cache_salt="tenant-b"))[0] != a[0], "another tenant never matches"
    text = prompt_prefix_hashes(_body("x" * 200))
    assert text[:3] == prompt_prefix_hashes(_body("x" * 192 + "y"))[:3] and len(text) == 4
    assert prompt_prefix_hashes(_body(["x" * 200, "z"])) == text, "a batch routes on its first prompt"
    system = {"role": "system", "content": "s" * 300}
    chat = {"model": "tiny-gqa", "messages": [system, {"role": "user", "content": "q"}]}
    other = {"model": "tiny-gqa", "messages": [system, {"role": "user", "content": "r"}]}
    chat_hashes, other_hashes = prompt_prefix_hashes(chat), prompt_prefix_hashes(other)
    assert chat_hashes[:4] == other_hashes[:4] and chat_hashes[-1] != other_hashes[-1]


@settings(max_examples=200, deadline=None)
@given(st.dictionaries(st.sampled_from(["prompt", "messages", "model", "cache_salt", "x"]),
                       st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=40),
                                    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=5),
                                                                                                inner, max_size=3),
                                    max_leaves=30)))
def test_any_request_body_gives_hashes_or_none_and_never_raises(body: dict[str, Any]) -> None:
    hashes = prompt_prefix_hashes(body)
    assert isinstance(hashes, list) and all(isinstance(value, int) and 0 <= value < 2**64 for value in hashes)


def test_the_record_is_bounded_and_keeps_leading_blocks_longest() -> None:
    record = PrefixRecord(max_blocks=8)
    first = prompt_prefix_hashes(_body(SYSTEM + [5] * 32))  # 6 blocks
    record.add(first)
    assert record.matched_blocks(first) == 6
    record.add(prompt_prefix_hashes(_body(list(range(5000, 5000 + 4 * TOKENS_PER_BLOCK)))))  # 4 more: 2 go out
    assert len(record) == 8
    assert record.matched_blocks(first) == 4, "the first prompt's last blocks went out first, its leading ones stay"
    with pytest.raises(ValueError, match="max_blocks"):
        PrefixRecord(max_blocks=0)


# ------------------------------------------------------------------------------------------------------------------
# A fleet behind the proxy


def test_a_fleet_request_goes_whole_to_one_engine_round_robin(make_fleet) -> None:
    stack = make_fleet(policy=Policy.ROUND_ROBIN)
    order = [_served_by(stack, _body(SYSTEM)) for _ in range(4)]
    assert order in (["e0", "e1", "e0", "e1"], ["e1", "e0", "e1", "e0"])
    for stub in stack.decodes:
        for _, body in stub.requests:
            assert body == _body(SYSTEM), "no prefill hop, no kv_transfer_params: the body is the client's"
    response, raw = stack.stream("/v1/completions", {**_body(SYSTEM), "stream": True})
    assert response.status_code == 200 and sse_events(raw)[-1] == "[DONE]"
    assert stack.client.get(stack.url("/health")).status_code == 200


def test_prefix_aware_sends_a_prompt_to_the_engine_that_has_its_prefix(make_fleet) -> None:
    stack = make_fleet(num_engines=3, policy=Policy.PREFIX_AWARE)
    first = _served_by(stack, _body(SYSTEM + [7] * 10))
    for turn in range(4):  # the same system prompt, other questions: round robin would spread these
        assert _served_by(stack, _body(SYSTEM + [8 + turn] * 10)) == first
    unseen = [list(range(9000 + 100 * idx, 9000 + 100 * idx + 40)) for idx in range(2)]
    other = [_served_by(stack, _body(prompt)) for prompt in unseen]
    assert other[0] != other[1], "prompts nobody has seen are spread (least loaded, ties round robin)"
    assert _served_by(stack, _body(unseen[1] + [1, 2, 3])) == other[1]
    routed = {engine["url"]: engine["num_prefix_routed"] for engine in stack.status()["engines"]}
    assert routed[next(stub.url for stub in stack.decodes if stub.name == first)] >= 4
    assert sum(routed.values()) == 5, "4 follow-ups of the system prompt and 1 of an unseen prompt; 3 had no prefix"


def test_prefix_aware_balances_when_the_engine_with_the_prefix_is_too_busy(make_fleet) -> None:
    stack = make_fleet(policy=Policy.PREFIX_AWARE, prefix_imbalance_requests=0)
    first = _served_by(stack, _body(SYSTEM))
    busy = next(stub for stub in stack.decodes if stub.name == first)
    busy.behaviour.num_chunks, busy.behaviour.chunk_delay_s = 4, 0.3
    with stack.client.stream("POST", stack.url("/v1/completions"), json={**_body(SYSTEM), "stream": True}) as held:
        assert held.status_code == 200 and stack.engine_status(busy.url)["num_in_flight"] == 1
        assert _served_by(stack, _body(SYSTEM + [3] * 16)) != first, "one in flight above the idle engine: moved"
        assert sse_events(b"".join(held.iter_raw()))[-1] == "[DONE]"
    assert _served_by(stack, _body(SYSTEM + [4] * 16)) in ("e0", "e1")  # both have the prefix now


def test_a_fleet_with_no_healthy_engine_answers_503(make_fleet) -> None:
    stack = make_fleet(num_engines=1)
    stack.decodes[0].behaviour.healthy = False
    stack.wait_health(stack.decodes[0], healthy=False)
    assert stack.post("/v1/completions", _body(SYSTEM)).status_code == 503
    health = stack.client.get(stack.url("/health"))
    assert health.status_code == 503 and "engine" in health.json()["error"]["message"]


# ------------------------------------------------------------------------------------------------------------------
# /health when no decode engine can serve the prefill engines


@pytest.fixture
def make_pd() -> Iterator[Callable[..., Stack]]:
    """A proxy in front of one prefill stub with ``prefill_settings`` and one decode stub per ``decode_settings``."""
    def stub(name: str, settings: dict[str, Any] | None) -> StubEngine:
        engine = StubEngine(name)
        engine.behaviour.settings = settings
        return engine

    with running_stacks() as start:
        yield lambda prefill_settings, decode_settings: start(
            [stub("p0", prefill_settings)], [stub(f"d{idx}", value) for idx, value in enumerate(decode_settings)])


def test_health_is_503_naming_the_key_when_no_decode_engine_matches_the_prefill_engines(make_pd) -> None:
    stack = make_pd(RANGE_SETTINGS, [{**RANGE_SETTINGS, "chunk_tokens": 512}])
    health = stack.client.get(stack.url("/health"))
    assert health.status_code == 503, health.text
    message = health.json()["error"]["message"]
    assert "no decode engine can serve the prefill engines" in message and "chunk_tokens: prefill 256, decode 512" \
        in message
    assert stack.post("/v1/completions", _body(SYSTEM)).status_code == 409, "what /health foretold"


@pytest.mark.parametrize("decode_settings", [
    [RANGE_SETTINGS],
    [{**RANGE_SETTINGS, "chunk_tokens": 512}, RANGE_SETTINGS],
    [None],  # not a Range connector: not checked
], ids=["match", "one-of-two-matches", "no-range-settings"])
def test_health_is_200_when_some_decode_engine_matches_or_cannot_be_checked(make_pd, decode_settings) -> None:
    stack = make_pd(RANGE_SETTINGS, decode_settings)
    assert stack.client.get(stack.url("/health")).status_code == 200
    assert all(len(stub.probes) == 1 for stub in stack.prefills + stack.decodes), "probed once per up-period"
    assert stack.client.get(stack.url("/health")).status_code == 200
    assert all(len(stub.probes) == 1 for stub in stack.prefills + stack.decodes)


# ------------------------------------------------------------------------------------------------------------------
# The command line


@pytest.mark.parametrize(("argv", "needle"), [
    (["proxy", "--engine", "http://a:1", "--prefill", "http://b:1", "--decode", "http://c:1"], "--engine: "),
    (["proxy", "--engine", "http://a:1", "--engine", "http://a:1"], "--engine: an engine URL is given twice"),
    (["proxy", "--engine", "gopher://a:1"], "--engine: 'gopher://"),
    (["proxy", "--engine", "http://a:1", "--prefix-imbalance-requests", "-1"], "--prefix-imbalance-requests"),
    (["proxy"], "--prefill: give at least one engine URL"),
])
def test_bad_fleet_arguments_exit_2_with_one_line(capsys, argv: list[str], needle: str) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and needle in err, err
