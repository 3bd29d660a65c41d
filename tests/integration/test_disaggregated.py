"""Disaggregated prefill on real vLLM CPU engines: a prefill engine (``kv_producer``) and a decode engine
(``kv_consumer``) sharing embedded Valkey, behind the ``range-connector proxy`` command, for the tiny GQA and MLA
models.

Per model: both engines start together (one core each), then the proxy. Reference outputs come from the decode
engine computing each prompt cold (a consumer never saves), after which vLLM's own prefix cache is emptied, so that
every hit counted on the decode engine's ``/metrics`` came from the tier.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

httpx = pytest.importorskip("httpx")

from range_connector.backends.latency import write_control_file  # noqa: E402
from range_connector.backends.valkey.servers import stop_servers  # noqa: E402
from range_connector.ops.checks import cpu_mla_block_size  # noqa: E402
from range_connector.serving.engines import mismatched_settings  # noqa: E402
from range_connector.testing.client import complete, reset_prefix_cache, scrape_metrics, wait_for_metric  # noqa: E402
from range_connector.testing.processes import free_port  # noqa: E402
from range_connector.testing.server_process import ServerProcess, connector_config  # noqa: E402
from range_connector.testing.tiny_models import build_model, prompt_token_ids  # noqa: E402

pytestmark = [pytest.mark.engine, pytest.mark.timeout(900)]

# vLLM-CPU forces 16 for MLA on its reference backend; its AMX backend (x86 with AMX) refuses 16 and defaults to 128
BLOCK_SIZES = {"gqa": 128, "mla": cpu_mla_block_size()}
CHUNK_TOKENS = 256
MAX_TOKENS = 12
REMOTE_WAIT_S = 2.0
HITS = "vllm:external_prefix_cache_hits_total"
PROMPT_TOKENS_TOTAL = "vllm:prompt_tokens_total"


class PD:
    def __init__(self, kind: str, model: Path, prefill: ServerProcess, decode: ServerProcess, proxy_url: str,
                 control_file: Path, prompts: list[list[int]]) -> None:
        self.kind, self.model, self.prefill, self.decode = kind, model, prefill, decode
        self.proxy_url, self.control_file, self.prompts = proxy_url, control_file, prompts


def _wait_http_ok(url: str, timeout_s: float) -> None:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        try:
            if httpx.get(url, timeout=2.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise AssertionError(f"{url} did not answer 200 within {timeout_s} s")


@pytest.fixture(scope="module", params=["gqa", "mla"])
def pd(request, tmp_path_factory) -> Iterator[PD]:
    kind = request.param
    tmp = tmp_path_factory.mktemp(f"pd-{kind}")
    model = build_model(kind, "tiny")
    runtime_dir, control_file = tmp / "runtime", tmp / "prefill-tier.json"
    write_control_file(control_file, frozen=False)
    common = {"runtime_dir": str(runtime_dir), "chunk_tokens": CHUNK_TOKENS}
    prefill = ServerProcess(model, work_dir=tmp / "prefill", block_size=BLOCK_SIZES[kind], max_model_len=2048,
                            omp_threads_bind="0", kv_transfer_config=connector_config(
                                {**common, "backend_timeout_s": 1.0, "tier_control_file": str(control_file)},
                                role="kv_producer"))
    decode = ServerProcess(model, work_dir=tmp / "decode", block_size=BLOCK_SIZES[kind], max_model_len=2048,
                           omp_threads_bind="1", extra_env={"VLLM_SERVER_DEV_MODE": "1"},
                           kv_transfer_config=connector_config({**common, "remote_wait_s": REMOTE_WAIT_S},
                                                               role="kv_consumer"))
    proxy_port = free_port()
    proxy = None
    try:
        with prefill, decode:
            prefill.wait_ready(timeout_s=400)
            decode.wait_ready(timeout_s=400)
            proxy = subprocess.Popen(
                [sys.executable, "-c", "import sys; from range_connector.cli import main; sys.exit(main())", "proxy",
                 "--prefill", prefill.base_url, "--decode", decode.base_url, "--port", str(proxy_port),
                 "--health-interval-s", "1"],
                stdout=open(tmp / "proxy.log", "w"), stderr=subprocess.STDOUT)
            proxy_url = f"http://127.0.0.1:{proxy_port}"
            _wait_http_ok(f"{proxy_url}/health", 60)
            prompts = [prompt_token_ids(model, n)[i * 7:] for i, n in enumerate((620, 700, 650))]
            yield PD(kind, model, prefill, decode, proxy_url, control_file, prompts)
    finally:
        if proxy is not None:
            proxy.terminate()
            proxy.wait(timeout=30)
        stop_servers(runtime_dir)


def _cold_on_decode(pd: PD, prompt: list[int]) -> list[int]:
    """The reference: the decode engine computes the prompt itself (it never saves), then forgets it."""
    res = complete(pd.decode.base_url, prompt_token_ids=prompt, max_tokens=MAX_TOKENS, ignore_eos=True)
    assert reset_prefix_cache(pd.decode.base_url)
    return list(res.token_ids or [])


def _through_proxy(pd: PD, prompt: list[int], *, stream: bool = False) -> tuple[list[int] | str, int, float]:
    """Send through the proxy (an OpenAI-compatible endpoint); return the tokens (the text when streamed), the
    decode engine's external hit tokens, and the seconds the request took."""
    before = scrape_metrics(pd.decode.base_url)
    t0 = time.monotonic()
    res = complete(pd.proxy_url, prompt_token_ids=prompt, max_tokens=MAX_TOKENS, ignore_eos=True, stream=stream,
                   timeout_s=120.0)
    out: list[int] | str = res.text if stream else list(res.token_ids or [])
    elapsed_s = time.monotonic() - t0
    after = wait_for_metric(pd.decode.base_url, PROMPT_TOKENS_TOTAL,
                            before.get(PROMPT_TOKENS_TOTAL, 0.0) + len(prompt))
    hits = round(after.get(HITS, 0.0) - before.get(HITS, 0.0))
    assert reset_prefix_cache(pd.decode.base_url)
    return out, hits, elapsed_s


def test_case_C22_decode_loads_everything_prefill_acknowledged(pd: PD) -> None:
    """The proxy forwards to decode the moment prefill answers: the decode engine finds every token but the last
    (vLLM computes at least one) already stored, so it neither misses nor waits, and its output is its own cold
    output."""
    prompt = pd.prompts[0]
    reference = _cold_on_decode(pd, prompt)
    tokens, hits, _ = _through_proxy(pd, prompt)
    assert hits == len(prompt) - 1
    if pd.kind == "gqa":  # MLA: vLLM-CPU's cached-context attention path drifts numerically (test_engine_roundtrip)
        assert tokens == reference


def test_streaming_through_the_proxy_loads_the_prompt(pd: PD) -> None:
    prompt = pd.prompts[1]
    reference = complete(pd.decode.base_url, prompt_token_ids=prompt, max_tokens=MAX_TOKENS, ignore_eos=True)
    assert reset_prefix_cache(pd.decode.base_url)
    text, hits, _ = _through_proxy(pd, prompt, stream=True)
    assert hits == len(prompt) - 1
    if pd.kind == "gqa":
        assert text == reference.text


def test_save_that_times_out_is_not_announced_and_decode_computes_at_once(pd: PD) -> None:
    """The prefill engine's tier freezes (its save times out after 1 s), so its workers report the prompt's chunks
    unstored and it announces 0 tokens (in the step the request finished in: vLLM hands the connector that step's
    worker report after ``request_finished``): the decode engine computes the prompt at once instead of waiting
    ``remote_wait_s`` for KV that never comes, and the answer is still right."""
    prompt = pd.prompts[2]
    reference = _cold_on_decode(pd, prompt)
    write_control_file(pd.control_file, frozen=True)
    try:
        time.sleep(0.3)  # the wrapper re-reads the control file at most every 100 ms
        tokens, hits, _ = _through_proxy(pd, prompt)
    finally:
        write_control_file(pd.control_file, frozen=False)
    assert hits == 0
    if pd.kind == "gqa":
        assert tokens == reference
    assert "were not reported stored by every saving rank" in pd.prefill.log_text()
    decode_log = pd.decode.log_text()
    assert "its producer stored none of the prompt" in decode_log
    assert "announced tokens arrived within" not in decode_log  # it never waited


def test_the_proxy_holds_each_decode_engines_own_settings_from_its_describe_probe(pd: PD) -> None:
    """The settings the proxy compares come from the engines themselves: the decode engine's describe answer (held in
    ``/proxy/status`` once the proxy has probed it) names its real block size (16 for MLA, 128 for GQA on this
    build) and equals what the prefill engine describes of itself. (What the proxy does with settings that differ, a
    409 naming the key and the mismatched engine passed over, is tested against stub engines in
    tests/unit/test_proxy.py; that real engines name a block size the other side does not share, in
    tests/integration/test_engine_tensor_parallel.py.)"""
    _through_proxy(pd, pd.prompts[2][:300])  # (the proxy probes a decode engine when it first needs its settings)
    status = httpx.get(f"{pd.proxy_url}/proxy/status", timeout=10).json()
    (decode,) = [engine for engine in status["engines"] if engine["kind"] == "decode"]
    assert decode["settings"] is not None, status
    assert decode["settings"]["block_size"] == BLOCK_SIZES[pd.kind]
    # a prefill request as the proxy sends it, straight to the prefill engine: its announcement names its settings
    answer = httpx.post(f"{pd.prefill.base_url}/v1/completions", timeout=120, json={
        "model": str(pd.model), "prompt": pd.prompts[1][:300], "max_tokens": 1,
        "kv_transfer_params": {"do_remote_decode": True}}).json()
    prefill_settings = answer["kv_transfer_params"]["range"]["settings"]
    assert prefill_settings["block_size"] == BLOCK_SIZES[pd.kind]
    assert mismatched_settings(prefill_settings, decode["settings"]) == {}


def test_decode_engine_killed_mid_replay_gives_clean_errors_and_the_proxy_stays_up(pd: PD) -> None:
    """Runs last (it kills the module's decode engine): a replay through the proxy while the decode engine dies.
    The requests it was serving or had not yet received end with clean errors in the report, the report says which
    engine could not be read, and the proxy keeps answering (503 on /health: no decode engine left)."""
    import threading

    from range_connector.bench.replay import ReplayRequest, run_replay

    requests = [ReplayRequest(i, 0.4 * i, tuple(pd.prompts[i % 3][: 300 + 10 * i]), 48) for i in range(12)]
    killer = threading.Timer(1.5, lambda: pd.decode.stop(timeout_s=0.5))
    killer.start()
    try:
        report = run_replay(pd.proxy_url, requests, metrics_urls=[pd.decode.base_url], label="decode-killed",
                            max_concurrency=4, request_timeout_s=120, progress=False, metrics_timeout_s=5)
    finally:
        killer.join()
    failed = [r for r in report.results if r.error is not None]
    done = [r for r in report.results if r.error is None]
    assert failed, "the decode engine died: some requests must have failed"
    assert all(len(r.error.splitlines()) == 1 and r.error.strip() for r in failed)
    assert report.summary["num_errors"] == len(failed) and sum(report.summary["errors"].values()) == len(failed)
    assert len(done) + len(failed) == len(requests)
    health = httpx.get(f"{pd.proxy_url}/health", timeout=10)
    assert health.status_code == 503  # up, and saying that no decode engine is healthy
    again = httpx.post(f"{pd.proxy_url}/v1/completions", json={"prompt": pd.prompts[0][:50], "max_tokens": 2},
                       timeout=30)
    assert again.status_code in (502, 503) and "error" in again.json()
