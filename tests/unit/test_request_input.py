"""Client input (``kv_transfer_params``, cache salt, media ids, LoRA name) is parsed into a typed, bounded value:
anything else is dropped, counted by kind and logged once per kind, and never raises in the scheduler's hooks.

The fuzz runs the parser and the real scheduler half (engine-less harness, in-memory tier) on hostile shapes:
deep nesting, huge integers, NaN and infinities, booleans where integers belong, 10 MB strings.
"""

from __future__ import annotations

import logging
import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from range_connector.scheduler.request_input import (
    MAX_ANNOUNCED_TOKENS,
    MAX_SALT_CHARS,
    REJECTION_KINDS,
    REJECTION_STATS,
    Announcement,
    RequestInputs,
    parse_request_input,
)
from tests.unit.scheduler_worker_harness import (
    Engine,
    FakeRequest,
    prompt_tokens,
    shard_backends,
)

BIG_TEXT = "x" * 10_000_000  # 10 MB
SETTINGS = {"namespace": "ab" * 32, "block_size": 16}


def _ann(**range_part) -> dict:
    return {"range": {"version": 1, "settings": SETTINGS, **range_part}}


# ------------------------------------------------------------------------------------------------ the parser
def test_a_producer_announcement_parses_into_its_typed_value() -> None:
    parsed = parse_request_input(_ann(num_tokens=300, chain_head="ff" * 32))
    assert parsed.announcement == Announcement(300, SETTINGS, "ff" * 32)
    assert parsed.rejected == () and not parsed.wants_announcement
    asked = parse_request_input({"do_remote_decode": True, "range_expect": SETTINGS})
    assert asked.do_remote_decode and asked.wants_announcement and asked.expect == SETTINGS
    assert parse_request_input({"range_describe": True}).describe
    assert parse_request_input(None).rejected == () and parse_request_input({}).announcement is None


@pytest.mark.parametrize(("params", "kind"), [
    ("not a dict", "kv_transfer_params"),
    ([1, 2], "kv_transfer_params"),
    ({"do_remote_decode": 1}, "do_remote_decode"),
    ({"do_remote_decode": "false"}, "do_remote_decode"),
    ({"range_describe": [True]}, "range_describe"),
    ({"range": "x"}, "range"),
    (_ann(num_tokens="x"), "num_tokens"),
    (_ann(num_tokens=None), "num_tokens"),
    (_ann(num_tokens=math.inf), "num_tokens"),
    (_ann(num_tokens=math.nan), "num_tokens"),
    (_ann(num_tokens=True), "num_tokens"),
    (_ann(num_tokens=-1), "num_tokens"),
    (_ann(num_tokens=MAX_ANNOUNCED_TOKENS + 1), "num_tokens"),
    (_ann(num_tokens=10 ** 400), "num_tokens"),
    (_ann(num_tokens=12.0), "num_tokens"),
    ({"range": {"version": 2, "num_tokens": 5}}, "version"),
    ({"range": {"num_tokens": 5}}, "settings"),  # a producer always names its namespace
    ({"range": {"num_tokens": 5, "settings": {"block_size": 16}}}, "settings"),
    ({"range": {"version": True, "num_tokens": 5}}, "version"),
    ({"range": {"num_tokens": 5, "settings": "namespace"}}, "settings"),
    ({"range": {"num_tokens": 5, "settings": {"namespace": BIG_TEXT}}}, "settings"),
    ({"range": {"num_tokens": 5, "settings": {"nested": {"a": 1}}}}, "settings"),
    ({"range": {"num_tokens": 5, "settings": {"x": math.nan}}}, "settings"),
    ({"range": {"num_tokens": 5, "settings": {str(i): i for i in range(65)}}}, "settings"),
    (_ann(num_tokens=5, chain_head=7), "chain_head"),
    (_ann(num_tokens=5, chain_head=BIG_TEXT), "chain_head"),
    ({"do_remote_decode": True, "range_expect": ["namespace"]}, "range_expect"),
])
def test_each_malformed_part_is_dropped_and_named(params, kind: str) -> None:
    parsed = parse_request_input(params)
    assert parsed.rejected == (kind,)
    assert parsed.announcement is None
    assert parsed.salt == (None, None, ())  # an announcement part never costs the request its lookup


@pytest.mark.parametrize(("fields", "kind"), [
    ({"cache_salt": "s" * (MAX_SALT_CHARS + 1)}, "cache_salt"),
    ({"cache_salt": 5}, "cache_salt"),
    ({"lora_name": BIG_TEXT}, "lora_name"),
    ({"media_ids": ["a", 7]}, "media_ids"),
    ({"media_ids": ["m" * 2000]}, "media_ids"),
])
def test_a_salt_part_over_its_bound_makes_range_leave_the_request_alone(fields, kind: str) -> None:
    parsed = parse_request_input(None, **fields)
    assert parsed.rejected == (kind,) and parsed.salt is None
    ok = parse_request_input(None, cache_salt="tenant-a", media_ids=["img-1"], lora_name="adapter")
    assert ok.salt == ("adapter", "tenant-a", ("img-1",)) and ok.rejected == ()


json_leaf = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-(10 ** 30), max_value=10 ** 30),
    st.sampled_from([1 << 40, (1 << 40) + 1, 10 ** 300, -1, 0]),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=20),
    st.sampled_from(["x", BIG_TEXT, "ab" * 32]),
)
json_value = st.recursive(json_leaf, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)), max_leaves=30)
# an announcement that is well formed but for one or two fields (so that most examples reach the field checks)
range_part = st.fixed_dictionaries(
    {"num_tokens": st.one_of(json_leaf, st.integers(min_value=0, max_value=1 << 41)),
     "settings": st.one_of(st.just(SETTINGS), st.just(SETTINGS), json_value)},
    optional={"version": st.one_of(st.just(1), json_leaf),
              "chain_head": st.one_of(st.none(), st.just("ab" * 32), json_leaf), "extra": json_value})
hostile_params = st.one_of(
    json_value,
    st.fixed_dictionaries({}, optional={
        "do_remote_decode": st.one_of(st.booleans(), json_leaf), "range_describe": st.one_of(st.booleans(), json_leaf),
        "range_expect": st.one_of(st.just(SETTINGS), json_value), "range": st.one_of(range_part, range_part, json_value),
        "other": json_value}),
)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(params=hostile_params, salt=st.one_of(st.none(), json_leaf))
def test_fuzz_the_parser_never_raises_and_keeps_its_bounds(params, salt) -> None:
    parsed = parse_request_input(params, cache_salt=salt)
    assert set(parsed.rejected) <= set(REJECTION_KINDS)
    if parsed.announcement is not None:
        assert 0 <= parsed.announcement.num_tokens <= MAX_ANNOUNCED_TOKENS
        assert not isinstance(parsed.announcement.num_tokens, bool)
        assert all(not isinstance(v, (dict, list)) for v in parsed.announcement.settings.values())
    if parsed.salt is not None and parsed.salt[1] is not None:
        assert isinstance(parsed.salt[1], str) and len(parsed.salt[1]) <= MAX_SALT_CHARS


# ------------------------------------------------------------------------------------------------ the scheduler
@pytest.fixture(scope="module")
def engines():
    made = {role: Engine(shard_backends(1, 1), can_load=can_load, can_save=can_save, seed=301, remote_wait_s=600.0)
            for role, can_load, can_save in (("kv_both", True, True), ("kv_consumer", True, False),
                                             ("kv_producer", False, True))}
    yield made
    for e in made.values():
        e.close()


_counter = iter(range(10 ** 9))


@pytest.mark.timeout(300)
@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                  HealthCheck.function_scoped_fixture,
                                                                  HealthCheck.data_too_large])
@given(params=hostile_params, salt=st.one_of(st.none(), st.sampled_from(["s", BIG_TEXT])),
       role=st.sampled_from(["kv_both", "kv_consumer", "kv_producer"]))
def test_fuzz_the_scheduler_hooks_answer_without_raising_or_waiting(engines, params, salt, role: str) -> None:
    engine = engines[role]
    req = FakeRequest(f"fuzz-{next(_counter)}", prompt_tokens(70, seed=302), cache_salt=salt)
    req.kv_transfer_params = params  # type: ignore[attr-defined]
    ext, load_async = engine.sched.get_num_new_matched_tokens(req, 0)
    assert ext == 0 and load_async is False  # nothing is stored: no hit, and no wait (no announcement names our
    # namespace: the fuzz never has it)
    finished, answer = engine.sched.request_finished(req, [])
    assert finished is False
    assert answer is None or set(answer) == {"range"}
    assert len(engine.sched.inputs) == 0  # forgotten with the request


def test_rejections_are_counted_per_request_and_kind_and_logged_once(caplog) -> None:
    stats: dict[str, int] = {}
    inputs = RequestInputs(stats)
    with caplog.at_level(logging.WARNING, logger="vllm.range_connector.scheduler.request_input"):
        for i in range(3):
            req = FakeRequest(f"r{i}", [1, 2, 3])
            req.kv_transfer_params = _ann(num_tokens="x")  # type: ignore[attr-defined]
            inputs.get(req)
            inputs.get(req)  # asked again (vLLM asks every step): counted once
    assert stats[REJECTION_STATS["num_tokens"]] == 3
    assert sum(stats.values()) == 3
    warnings = [r for r in caplog.records if "num_tokens" in r.getMessage()]
    assert len(warnings) == 1 and "r0" in warnings[0].getMessage()


def test_a_rejected_salt_means_no_lookup_and_no_save_in_the_real_scheduler() -> None:
    engine = Engine(shard_backends(1, 1), seed=303)
    prompt = prompt_tokens(3 * engine.chunk_tokens + 5, seed=304)
    stored = FakeRequest("stored", prompt)
    engine.admit(stored)
    engine.step()
    engine.finish("stored")
    engine.step()
    again = FakeRequest("again", prompt)
    assert engine.sched.get_num_new_matched_tokens(again, 0)[0] > 0  # the prompt is stored: a plain request hits
    engine.sched.request_finished(again, [])
    salted = FakeRequest("salted", prompt, cache_salt="s" * (MAX_SALT_CHARS + 1))
    assert engine.sched.get_num_new_matched_tokens(salted, 0) == (0, False)
    assert engine.sched.stats[REJECTION_STATS["cache_salt"]] == 1
    engine.close()

