"""Traces: Mooncake JSONL and Azure CSV parsing, bad input, prompts rebuilt from hash ids, scaling, slicing, capping,
the synthetic generator, and the real public traces when ``../shared/data/traces`` is present."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from range_connector.bench.synthetic_trace import synthetic_trace
from range_connector.bench.trace_prompts import PromptBuilder
from range_connector.bench.trace_transforms import (
    cap_lengths,
    prepare_trace,
    sample_conversations,
    scale_time,
    scale_tokens,
    slice_trace,
)
from range_connector.bench.traces import (
    MOONCAKE_BLOCK_TOKENS,
    Trace,
    TraceRequest,
    best_prefix_hit_share,
    read_azure,
    read_mooncake,
    read_trace,
    write_mooncake,
)
from range_connector.errors import TraceError

pytestmark = pytest.mark.timeout(60)

SHARED_TRACES = Path(__file__).resolve().parents[3] / "shared" / "data" / "traces"
VOCAB = list(range(3, 4096))  # the tiny models' normal vocabulary (0-2 are special)

MOONCAKE_SAMPLE = [
    {"timestamp": 0, "input_length": 1100, "output_length": 50, "hash_ids": [0, 1, 2]},
    {"timestamp": 250, "input_length": 1600, "output_length": 20, "hash_ids": [0, 1, 3, 4]},
    {"timestamp": 1000, "input_length": 300, "output_length": 7, "hash_ids": [5]},
    {"timestamp": 1500, "input_length": 700, "output_length": 9, "hash_ids": [0, 6]},
]
AZURE_SAMPLE = """TIMESTAMP,ContextTokens,GeneratedTokens
2023-11-16 18:15:46.6805900,374,44
2023-11-16 18:15:50.9951690,1396,109
2023-11-16 18:15:51.2224670,879,55
"""


def _write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture
def mooncake_file(tmp_path: Path) -> Path:
    return _write_jsonl(tmp_path / "sample.jsonl", MOONCAKE_SAMPLE)


def test_mooncake_fields(mooncake_file: Path) -> None:
    trace = read_trace(mooncake_file)
    assert trace.format == "mooncake" and trace.block_tokens == MOONCAKE_BLOCK_TOKENS
    assert [r.arrival_s for r in trace.requests] == [0.0, 0.25, 1.0, 1.5]  # ms -> s
    assert [r.input_tokens for r in trace.requests] == [1100, 1600, 300, 700]
    assert [r.output_tokens for r in trace.requests] == [50, 20, 7, 9]
    assert trace.requests[1].hash_ids == (0, 1, 3, 4)


def test_azure_fields(tmp_path: Path) -> None:
    path = tmp_path / "azure.csv"
    path.write_text(AZURE_SAMPLE)
    trace = read_trace(path)
    assert trace.format == "azure"
    assert [r.input_tokens for r in trace.requests] == [374, 1396, 879]
    assert [r.output_tokens for r in trace.requests] == [44, 109, 55]
    assert trace.requests[0].arrival_s == 0.0
    assert trace.requests[1].arrival_s == pytest.approx(50.995169 - 46.680590, abs=1e-6)
    assert [len(r.hash_ids) for r in trace.requests] == [1, 3, 2]
    all_ids = [h for r in trace.requests for h in r.hash_ids]
    assert len(all_ids) == len(set(all_ids)), "Azure requests carry no prefix information: no shared ids"
    assert best_prefix_hit_share(trace) == 0.0


@pytest.mark.parametrize(("line", "field"), [
    ('{"timestamp": 0, "input_length": -5, "output_length": 1, "hash_ids": []}', "input_length"),
    ('{"timestamp": 0, "input_length": 10, "output_length": 0, "hash_ids": [1]}', "output_length"),
    ('{"timestamp": -1, "input_length": 10, "output_length": 1, "hash_ids": [1]}', "timestamp"),
    ('{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": "x"}', "hash_ids"),
    ('{"timestamp": 0, "input_length": 1000, "output_length": 1, "hash_ids": [1]}', "hash_ids"),
    ('{"timestamp": 0, "input_length": 10, "output_length": 1}', "hash_ids"),
    ('{"timestamp": 0, "input_length": 10.5, "output_length": 1, "hash_ids": [1]}', "input_length"),
    ('{"timestamp": 0, "input_length": 10, ', "not valid JSON"),
    ('[1, 2]', "not a JSON object"),
])
def test_mooncake_bad_line_names_field_and_line(tmp_path: Path, line: str, field: str) -> None:
    good = json.dumps(MOONCAKE_SAMPLE[0])
    path = tmp_path / "bad.jsonl"
    path.write_text(f"{good}\n{good}\n{line}\n")
    with pytest.raises(TraceError) as err:
        read_mooncake(path)
    message = str(err.value)
    assert message.startswith("bad.jsonl:3: ") and field in message and "\n" not in message


def test_mooncake_time_going_backwards_is_refused(tmp_path: Path) -> None:
    path = _write_jsonl(tmp_path / "t.jsonl", [MOONCAKE_SAMPLE[1], MOONCAKE_SAMPLE[0]])
    with pytest.raises(TraceError, match=r"^t\.jsonl:2: timestamp: "):
        read_mooncake(path)


@pytest.mark.parametrize(("row", "field"), [
    ("2023-11-16 18:15:52.0,abc,3", "ContextTokens"),
    ("2023-11-16 18:15:52.0,10,0", "GeneratedTokens"),
    ("yesterday,10,3", "TIMESTAMP"),
    ("2023-11-16 18:15:40.0,10,3", "TIMESTAMP"),  # earlier than the previous row
])
def test_azure_bad_row_names_field_and_line(tmp_path: Path, row: str, field: str) -> None:
    path = tmp_path / "bad.csv"
    path.write_text(AZURE_SAMPLE + row + "\n")
    with pytest.raises(TraceError) as err:
        read_azure(path)
    assert str(err.value).startswith(f"bad.csv:5: {field}: ") and "\n" not in str(err.value)


def test_azure_missing_column_and_unknown_suffix(tmp_path: Path) -> None:
    path = tmp_path / "cols.csv"
    path.write_text("TIMESTAMP,ContextTokens\n2023-11-16 18:15:46.68,10\n")
    with pytest.raises(TraceError, match=r"^cols\.csv:1: GeneratedTokens: column missing"):
        read_azure(path)
    with pytest.raises(TraceError, match="unknown trace format '.txt'"):
        read_trace(tmp_path / "trace.txt")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(TraceError, match="no requests"):
        read_mooncake(empty)


def test_shared_hash_ids_give_shared_token_prefixes(mooncake_file: Path) -> None:
    trace = read_mooncake(mooncake_file)
    prompts = PromptBuilder(VOCAB, seed=7).prompts(trace)
    assert [len(p) for p in prompts] == [r.input_tokens for r in trace.requests]
    block = MOONCAKE_BLOCK_TOKENS
    # Requests 0 and 1 share hash ids 0, 1: exactly two blocks of tokens.
    assert prompts[0][:2 * block] == prompts[1][:2 * block]
    assert prompts[0][2 * block:2 * block + 16] != prompts[1][2 * block:2 * block + 16]
    # Request 3 shares only block 0 with them; request 2 shares nothing.
    assert prompts[3][:block] == prompts[0][:block] and prompts[3][block:block + 16] != prompts[0][block:block + 16]
    assert prompts[2][:16] != prompts[0][:16]
    assert all(3 <= t < 4096 for p in prompts for t in p), "token ids stay in the normal vocabulary"
    # Deterministic across builders (processes), different under another seed.
    assert PromptBuilder(VOCAB, seed=7).prompts(trace) == prompts
    assert PromptBuilder(VOCAB, seed=8).prompts(trace)[0][:64] != prompts[0][:64]


def test_slice_rebases_time_and_is_recorded(mooncake_file: Path) -> None:
    trace = slice_trace(read_mooncake(mooncake_file), start=1, count=2)
    assert [r.input_tokens for r in trace.requests] == [1600, 300]
    assert [r.arrival_s for r in trace.requests] == [0.0, 0.75]
    assert "slice: requests 1..2 of 4" in trace.transforms[-1]
    with pytest.raises(TraceError, match="slice: start 9 is past"):
        slice_trace(trace, start=9)
    with pytest.raises(TraceError, match="count 0"):
        slice_trace(trace, count=0)


def test_time_and_token_scaling(mooncake_file: Path) -> None:
    base = read_mooncake(mooncake_file)
    fast = scale_time(base, 0.5)
    assert [r.arrival_s for r in fast.requests] == [0.0, 0.125, 0.5, 0.75]
    small = scale_tokens(base, 1 / 32)
    assert small.block_tokens == 16
    assert [r.input_tokens for r in small.requests] == [34, 50, 9, 22]  # round(n / 32), within the hash blocks
    assert [r.output_tokens for r in small.requests] == [2, 1, 1, 1]  # at least one token
    assert [r.hash_ids for r in small.requests] == [r.hash_ids for r in base.requests]
    assert "hash block 512 -> 16 tokens" in small.transforms[-1]
    prompts = PromptBuilder(VOCAB).prompts(small)
    assert prompts[0][:32] == prompts[1][:32] and prompts[0][32:34] != prompts[1][32:34]
    kept = scale_tokens(base, 1 / 32, scale_output=False)
    assert [r.output_tokens for r in kept.requests] == [50, 20, 7, 9]
    for bad in (0.0, -1.0, float("nan"), 1 / 1024):
        with pytest.raises(TraceError, match="token_scale"):
            scale_tokens(base, bad)
    with pytest.raises(TraceError, match="time_scale"):
        scale_time(base, 0.0)


def test_cap_to_max_model_len_keeps_the_prefix(mooncake_file: Path) -> None:
    base = read_mooncake(mooncake_file)
    capped = cap_lengths(base, 1024)
    assert [(r.input_tokens, r.output_tokens) for r in capped.requests] == [(974, 50), (1004, 20), (300, 7), (700, 9)]
    assert capped.requests[1].hash_ids == (0, 1)
    assert "2 of 4 requests shortened" in capped.transforms[-1]
    assert all(r.input_tokens + r.output_tokens <= 1024 for r in capped.requests)
    p_base, p_cap = PromptBuilder(VOCAB).prompts(base), PromptBuilder(VOCAB).prompts(capped)
    assert p_cap[1] == p_base[1][:1004]
    assert cap_lengths(base, 40).requests[0].output_tokens == 20  # output at most half of max_model_len


@given(factor=st.floats(min_value=1 / 512, max_value=4.0), seed=st.integers(0, 5))
@settings(max_examples=40, deadline=None)
def test_token_scaling_keeps_every_hash_block(factor: float, seed: int) -> None:
    trace = synthetic_trace(12, seed=seed)
    scaled = scale_tokens(trace, factor)
    for r in scaled.requests:
        assert (len(r.hash_ids) - 1) * scaled.block_tokens < r.input_tokens <= len(r.hash_ids) * scaled.block_tokens
        assert r.output_tokens >= 1


def test_synthetic_trace_is_deterministic_and_shares_prefixes(tmp_path: Path) -> None:
    trace = synthetic_trace(60, seed=3)
    assert synthetic_trace(60, seed=3) == trace and synthetic_trace(60, seed=4) != trace
    reqs = trace.requests
    assert all(b.arrival_s > a.arrival_s for a, b in zip(reqs, reqs[1:])), "Poisson arrivals are increasing"
    gaps = [b.arrival_s - a.arrival_s for a, b in zip(reqs, reqs[1:])]
    assert 0.4 < sum(gaps) / len(gaps) < 2.5  # rate 1/s
    firsts = {r.hash_ids[0] for r in reqs}
    assert len(firsts) <= 3, "every prompt starts with one of the 3 system prompts"
    extends = sum(any(p.hash_ids == r.hash_ids[:len(p.hash_ids)] or
                      (len(p.hash_ids) > 1 and p.hash_ids[:-1] == r.hash_ids[:len(p.hash_ids) - 1]
                       and p.input_tokens < r.input_tokens) for p in reqs[:i]) for i, r in enumerate(reqs))
    assert extends >= 20, "later turns extend earlier ones"
    assert 0.4 < best_prefix_hit_share(trace) < 0.95
    for r in reqs:
        assert len(r.hash_ids) == math.ceil(r.input_tokens / MOONCAKE_BLOCK_TOKENS)
    path = tmp_path / "synthetic.jsonl"
    write_mooncake(trace, path)
    again = read_mooncake(path)
    assert [(r.input_tokens, r.output_tokens, r.hash_ids) for r in again.requests] == \
           [(r.input_tokens, r.output_tokens, r.hash_ids) for r in reqs]
    assert [round(r.arrival_s, 3) for r in again.requests] == [round(r.arrival_s, 3) for r in reqs]
    with pytest.raises(TraceError, match="request_rate_per_s"):
        synthetic_trace(5, request_rate_per_s=0)
    with pytest.raises(TraceError, match="output_tokens"):
        synthetic_trace(5, output_tokens=(10, 5))


def test_prepare_trace_order_and_prompt_errors(mooncake_file: Path) -> None:
    trace = prepare_trace(read_mooncake(mooncake_file), start=1, count=3, time_scale=2.0, token_scale=0.25,
                          max_model_len=300)
    assert [t.split(":")[0].split(" ")[0] for t in trace.transforms] == ["slice", "time", "tokens", "capped"]
    assert [r.arrival_s for r in trace.requests] == [0.0, 1.5, 2.5]
    assert trace.block_tokens == 128 and all(r.input_tokens + r.output_tokens <= 300 for r in trace.requests)
    with pytest.raises(TraceError, match="vocab_token_ids: empty"):
        PromptBuilder([])
    short = TraceRequest(0.0, 100, 1, (1,))
    with pytest.raises(TraceError, match="hash_ids: 1 blocks of 16 tokens cannot hold input_length 100"):
        PromptBuilder(VOCAB).prompt(short, 16)


def _shared(name: str) -> Path:
    path = SHARED_TRACES / name
    if not path.is_file():
        pytest.skip(f"{path} not present (the shared data folder is not beside this checkout)")
    return path


def test_real_mooncake_conversation_trace() -> None:
    trace = read_trace(_shared("mooncake_conversation_trace.jsonl"))
    assert len(trace.requests) == 12031  # README of the shared folder and the Mooncake README
    info = trace.describe()
    assert info["input_tokens"] / len(trace.requests) == pytest.approx(12035, rel=0.001)  # Mooncake's README
    assert info["output_tokens"] / len(trace.requests) == pytest.approx(343, rel=0.01)
    assert 3500 < info["duration_s"] < 3600  # "about 1 hour"
    assert info["best_prefix_hit_share"] == pytest.approx(0.37, abs=0.01)  # shared README: "about 37%"
    demo = prepare_trace(trace, count=100, token_scale=1 / 32, time_scale=0.1, max_model_len=4096)
    prompts = PromptBuilder(VOCAB).prompts(demo)
    assert [len(p) for p in prompts] == [r.input_tokens for r in demo.requests]
    assert prompts[0][:16] == prompts[1][:16], "the first requests share hash id 0"


def test_real_azure_conversation_trace() -> None:
    trace = read_trace(_shared("AzureLLMInferenceTrace_conv_2023.csv"))
    assert len(trace.requests) == 19366  # README of the shared folder
    assert trace.requests[1].input_tokens == 396 and trace.requests[1].output_tokens == 109
    assert 3400 < trace.describe()["duration_s"] < 3600


def test_describe_is_json_ready(mooncake_file: Path) -> None:
    info = prepare_trace(read_mooncake(mooncake_file), count=2).describe()
    assert json.loads(json.dumps(info))["num_requests"] == 2
    assert info["input_tokens"] == 2700 and info["output_tokens"] == 70
    assert isinstance(Trace((), 512, "x", "mooncake").describe()["best_prefix_hit_share"], float)


def test_sample_conversations_keeps_whole_conversations(tmp_path: Path) -> None:
    rows = [  # two conversations (keys (0, 1) and (0, 7)) interleaved with single requests
        {"timestamp": 0, "input_length": 1100, "output_length": 5, "hash_ids": [0, 1, 2]},
        {"timestamp": 10, "input_length": 1000, "output_length": 5, "hash_ids": [3, 4]},
        {"timestamp": 20, "input_length": 1100, "output_length": 5, "hash_ids": [0, 7, 8]},
        {"timestamp": 30, "input_length": 1600, "output_length": 5, "hash_ids": [0, 1, 2, 9]},
        {"timestamp": 40, "input_length": 900, "output_length": 5, "hash_ids": [5, 6]},
        {"timestamp": 50, "input_length": 1600, "output_length": 5, "hash_ids": [0, 7, 8, 10]},
        {"timestamp": 60, "input_length": 2100, "output_length": 5, "hash_ids": [0, 1, 2, 9, 11]},
    ]
    trace = read_mooncake(_write_jsonl(tmp_path / "conv.jsonl", rows))
    sampled = sample_conversations(trace, 10, seed=0)
    assert [r.hash_ids[:2] for r in sampled.requests] == [(0, 1), (0, 7), (0, 1), (0, 7), (0, 1)]
    assert sampled.requests[0].arrival_s == 0.0 and sampled.requests[-1].arrival_s == pytest.approx(0.06)
    assert "5 requests of 2 conversations" in sampled.transforms[-1]
    one = sample_conversations(trace, 2, seed=0)
    assert len(one.requests) == 2 and len({r.hash_ids[:2] for r in one.requests}) == 1  # one whole conversation
    assert sample_conversations(trace, 2, seed=0) == one  # seeded
    assert best_prefix_hit_share(sampled) > best_prefix_hit_share(slice_trace(trace, 0, 5))
    with pytest.raises(TraceError, match="no two requests"):
        sample_conversations(slice_trace(trace, 1, 1), 5)
    via_prepare = prepare_trace(trace, count=10, conversations=True, seed=0)
    assert via_prepare.requests == sampled.requests


def test_real_mooncake_conversation_sample_shares_prefixes() -> None:
    trace = read_trace(_shared("mooncake_conversation_trace.jsonl"))
    contiguous = prepare_trace(trace, count=100, token_scale=1 / 32)
    sampled = prepare_trace(trace, count=100, token_scale=1 / 32, conversations=True, seed=0)
    assert len(sampled.requests) == 100
    assert best_prefix_hit_share(contiguous) < 0.05 < 0.3 < best_prefix_hit_share(sampled)
