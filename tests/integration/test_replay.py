"""A short trace replay against one real vLLM CPU engine with Range: the report's numbers agree with independent
counts.

The engine runs with vLLM's own prefix cache off, so every prefix hit must come from Range; requests go one at a
time (``max_concurrency`` 1), so each request's hit is known in advance from the trace: the longest run of full
chunks its prompt shares with an earlier prompt (Range saves every prompt's full chunks), cut to leave one token
and rounded down to whole blocks. Checked:

* the report's external hit tokens equal the growth of ``vllm:external_prefix_cache_hits_total`` read by the test
  itself, less the warm-up requests, and both equal the hits expected from the trace (which are not zero); each
  request's ``usage.prompt_tokens_details.cached_tokens`` equals its own expected hit;
* every request succeeded with a positive TTFT no larger than its end-to-end latency; the engine's TTFT histogram
  counted exactly the measured requests, and its mean is below the client's by less than the request overhead;
* Range's own counters (``vllm:range_*``) say every admitted hit was loaded and verified: ``external hits == loaded
  + failed`` with nothing failed, and the share served from the tier is the verified count over prompt tokens;
* the report's prompt tokens equal the measured prompts' lengths; the JSON and both PNGs are written; the table
  shows the check and the engine's histogram percentiles next to the client's.

The same engine then serves ``bench/replay.py --endpoint`` (the script as a user runs it, as a subprocess): its exit
status, table, JSON and PNGs. (Its own engine start is the shared ``ServerProcess``; a second engine for it alone
cost 80 s of ``make test``.)
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("vllm")
pytest.importorskip("httpx")

from range_connector.backends.valkey.servers import stop_servers  # noqa: E402
from range_connector.bench.replay import ReplayRequest, build_requests, run_replay  # noqa: E402
from range_connector.bench.replay_report import comparison_rows, format_comparison, write_json, write_plots  # noqa: E402
from range_connector.bench.synthetic_trace import synthetic_trace  # noqa: E402
from range_connector.bench.trace_prompts import PromptBuilder, normal_vocab_token_ids  # noqa: E402
from range_connector.bench.trace_transforms import prepare_trace  # noqa: E402
from range_connector.testing.client import scrape_metrics  # noqa: E402
from range_connector.testing.server_process import ServerProcess, connector_config  # noqa: E402

pytestmark = pytest.mark.engine

REPO = Path(__file__).resolve().parents[2]

BLOCK_SIZE = 128
CHUNK_TOKENS = 256
MAX_MODEL_LEN = 2048
NUM_REQUESTS = 8
WARMUP = 2
HITS = "vllm:external_prefix_cache_hits_total"
# Client TTFT also holds the HTTP round trip and the API server's request handling; on the 2-core machine a few
# hundred ms at most. A wrong pairing of client and engine figures would be off by whole prefills or requests.
MAX_CLIENT_OVERHEAD_S = 1.0


def expected_hits(prompts: list[tuple[int, ...]]) -> list[int]:
    """Per prompt: tokens Range can load when the prompts before it were each saved in full chunks."""
    out = []
    for i, prompt in enumerate(prompts):
        stored = 0
        for earlier in prompts[:i]:
            n = 0
            while (n + 1) * CHUNK_TOKENS <= min(len(earlier), len(prompt)) and \
                    earlier[n * CHUNK_TOKENS:(n + 1) * CHUNK_TOKENS] == prompt[n * CHUNK_TOKENS:(n + 1) * CHUNK_TOKENS]:
                n += 1
            stored = max(stored, n)
        out.append(min(stored * CHUNK_TOKENS, len(prompt) - 1) // BLOCK_SIZE * BLOCK_SIZE)
    return out


@pytest.fixture(scope="module")
def model_dir() -> Path:
    from range_connector.testing.tiny_models import build_model

    return build_model("gqa", "tiny")


@pytest.fixture(scope="module")
def requests(model_dir: Path) -> list[ReplayRequest]:
    # Synthetic conversations scaled 1/4 (hash block 128 tokens): prompts of a few hundred to 2,000 tokens, later
    # turns extending earlier ones; arrivals compressed 20x.
    trace = prepare_trace(synthetic_trace(NUM_REQUESTS, seed=11), token_scale=0.25, time_scale=0.05,
                          max_model_len=MAX_MODEL_LEN)
    built = build_requests(trace, PromptBuilder(normal_vocab_token_ids(model_dir), seed=11))
    return [ReplayRequest(r.index, r.arrival_s, r.prompt_token_ids, min(r.max_tokens, 8)) for r in built]


@pytest.fixture(scope="module")
def server(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    runtime_dir = tmp_path_factory.mktemp("valkey-runtime")
    kv_config = connector_config({"runtime_dir": str(runtime_dir), "chunk_tokens": CHUNK_TOKENS})
    proc = ServerProcess(model_dir, work_dir=tmp_path_factory.mktemp("vllm"), block_size=BLOCK_SIZE,
                         max_model_len=MAX_MODEL_LEN, kv_transfer_config=kv_config,
                         extra_args=["--no-enable-prefix-caching", "--enable-prompt-tokens-details"])
    try:
        with proc:
            proc.wait_ready(timeout_s=300)
            yield proc
    finally:
        stop_servers(runtime_dir)


@pytest.mark.timeout(420)
def test_replay_report_agrees_with_metrics_and_trace(server: ServerProcess, requests: list[ReplayRequest],
                                                      tmp_path: Path) -> None:
    prompts = [r.prompt_token_ids for r in requests]
    expected = expected_hits(prompts)
    expected_measured = sum(expected[WARMUP:])
    assert expected_measured >= 2 * CHUNK_TOKENS, f"the trace slice must share prefixes to test anything: {expected}"

    before = scrape_metrics(server.base_url)
    report = run_replay(server.base_url, requests, metrics_urls=[server.base_url], warmup=WARMUP, label="range",
                        max_concurrency=1, request_timeout_s=120.0, progress=False)
    after = scrape_metrics(server.base_url)
    independent_hits = round(after.get(HITS, 0.0) - before.get(HITS, 0.0))

    assert report.summary["num_ok"] == NUM_REQUESTS - WARMUP, [r.error for r in report.results]
    assert len(report.warmup_results) == WARMUP and all(r.error is None for r in report.warmup_results)
    engine = report.engine
    assert engine is not None
    # Hits: report == /metrics delta (less warm-up) == trace expectation.
    assert independent_hits == sum(expected), (independent_hits, expected)
    assert engine.external_hit_tokens == independent_hits - sum(expected[:WARMUP]) == expected_measured
    assert round(engine.totals["local_hit_tokens"]) == 0  # local prefix cache off
    measured_prompt_tokens = sum(len(p) for p in prompts[WARMUP:])
    assert engine.prompt_tokens == measured_prompt_tokens == report.summary["prompt_tokens"]
    assert engine.external_hit_share == pytest.approx(expected_measured / measured_prompt_tokens)
    assert engine.prompt_by_source.get("external_kv_transfer") == pytest.approx(expected_measured)
    # Range's own count on /metrics: every admitted hit was loaded and verified, none failed.
    check = engine.connector_check
    assert check is not None and check["agrees"], check
    assert (check["loaded_tokens"], check["failed_tokens"]) == (expected_measured, 0)
    assert engine.served_from_tier_share == pytest.approx(expected_measured / measured_prompt_tokens)

    # Per request, the server's usage agrees with the trace (only connector hits: the local cache is off).
    assert [r.cached_tokens for r in report.results] == expected[WARMUP:]
    assert report.summary["cached_tokens"] == expected_measured

    # TTFT: positive, within E2E, and consistent with the engine's own histogram.
    for r in report.results:
        assert r.ttft_s is not None and 0 < r.ttft_s <= r.e2e_s
        assert r.output_tokens == requests[r.index].max_tokens  # ignore_eos: exactly max_tokens
    assert engine.engine_ttft_s["count"] == NUM_REQUESTS - WARMUP
    client_mean = report.summary["ttft_s"]["mean"]
    engine_mean = engine.engine_ttft_s["mean"]
    assert 0 < engine_mean <= client_mean + 1e-3, (engine_mean, client_mean)
    assert client_mean - engine_mean < MAX_CLIENT_OVERHEAD_S
    assert engine.engine_ttft_s["p99"] is not None and engine.engine_ttft_s["p99"] > 0

    out = write_json(tmp_path / "replay.json", [report], baseline="none")
    doc = json.loads(out.read_text())
    assert doc["reports"][0]["engine"]["totals"]["external_hit_tokens"] == expected_measured
    assert len(doc["reports"][0]["results"]) == NUM_REQUESTS - WARMUP
    for png in write_plots(tmp_path / "replay", [report]):
        assert png.stat().st_size > 1000
    table = format_comparison([report])
    rows = {row[0].strip(): row[1:] for row in comparison_rows([report])}
    assert rows["external hit tokens (vLLM, admitted)"] == [str(expected_measured)]
    assert rows["loaded and verified (Range)"] == [str(expected_measured)]
    assert rows["hits == loaded + failed"] == ["yes"]
    assert rows["engine's histogram p50 (s)"] == [f"{engine.engine_ttft_s['p50']:.3f}"]
    assert doc["reports"][0]["engine"]["connector_check"]["agrees"] is True
    print(table)
    print(f"expected hits per request: {expected}")


@pytest.mark.timeout(300)
def test_replay_script_against_the_running_engine(server: ServerProcess, tmp_path: Path) -> None:
    num_requests, warmup = 6, 1
    out = tmp_path / "replay.json"
    proc = subprocess.run(
        [sys.executable, str(REPO / "bench" / "replay.py"), "--endpoint", server.base_url, "--metrics-url",
         server.base_url, "--synthetic-requests", str(num_requests), "--warmup", str(warmup), "--time-scale", "0.1",
         "--max-model-len", str(MAX_MODEL_LEN), "--seed", "5", "--no-progress", "--out", str(out)],
        capture_output=True, text=True, timeout=280, cwd=str(REPO),
    )
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    assert "external hit tokens (vLLM, admitted)" in proc.stdout and "transform: tokens x 0.0625" in proc.stdout
    hits_row = next(line for line in proc.stdout.splitlines() if line.strip().startswith("hits == loaded + failed"))
    assert hits_row.split()[-1] == "yes"  # vLLM's external hits agree with what Range loaded and verified
    doc = json.loads(out.read_text())
    (report,) = doc["reports"]
    assert report["label"] == "endpoint" and report["summary"]["num_ok"] == num_requests - warmup
    assert len(report["results"]) == num_requests - warmup and len(report["warmup_results"]) == warmup
    engine = report["engine"]
    assert engine["totals"]["prompt_tokens"] == report["summary"]["prompt_tokens"]
    assert engine["totals"]["external_hit_tokens"] == report["summary"]["cached_tokens"]
    assert doc["trace"]["format"] == "synthetic" and doc["machine"]["cpus"] >= 1
    for suffix in ("-ttft-cdf.png", "-ttft-over-time.png"):
        png = tmp_path / f"replay{suffix}"
        assert png.stat().st_size > 1000, png
