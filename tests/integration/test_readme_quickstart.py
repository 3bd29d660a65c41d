"""The README's CPU quick start, run as written: its one ``sh`` block starts a vLLM API server with Range.

The block is taken from ``README.md`` verbatim and run with ``bash -c`` in a process group of its own, with the
README's placeholders set as environment variables (``MODEL_DIR``: the tiny GQA model, built by
:func:`range_connector.testing.tiny_models.build_model`; ``PORT``: a free port) and this interpreter's directory first
on ``PATH`` (the README's ``. .venv/bin/activate``). Once ``/health`` answers:

1. one prompt is sent twice (:func:`range_connector.testing.client.complete`): the first send finds nothing, the
   second gets its full chunks from the tier (``vllm:external_prefix_cache_hits_total``, with vLLM's own prefix
   cache off as the command says), and both greedy outputs are equal;
2. the README's ``curl`` block is run as written too: two equal answers, and its second request hit the tier.

Then SIGTERM goes to the group, and nothing of it may be left running.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

pytest.importorskip("vllm")
httpx = pytest.importorskip("httpx")

from range_connector.testing.client import complete, scrape_metrics, wait_for_metric  # noqa: E402
from range_connector.testing.processes import LOOPBACK_HOST, free_port, process_group_pids  # noqa: E402
from range_connector.testing.tiny_models import build_model, prompt_token_ids  # noqa: E402

pytestmark = [pytest.mark.engine, pytest.mark.timeout(600)]

README = Path(__file__).resolve().parents[2] / "README.md"
PROMPT_TOKENS = 600
CHUNK_TOKENS = 256  # the default, for the tiny model's block size 128
EXPECTED_HIT = 512  # two full chunks; the last token is always computed
MAX_TOKENS = 16
STARTUP_TIMEOUT_S = 300.0
STOP_GRACE_S = 30.0

HITS = "vllm:external_prefix_cache_hits_total"
LOADED = "vllm:range_loaded_tokens_total"
PROMPT_TOKENS_TOTAL = "vllm:prompt_tokens_total"


def readme_blocks() -> list[tuple[str, str]]:
    """``(info string, text)`` of every fenced block of the README."""
    return re.findall(r"^```([^\n]*)\n(.*?)^```", README.read_text(), flags=re.S | re.M)


def quick_start_block() -> str:
    [block] = [text for info, text in readme_blocks() if info.strip() == "sh"]
    assert "$MODEL_DIR" in block and "$PORT" in block, "the quick start lost its placeholders"
    return block


def curl_block() -> str:
    [block] = [text for _info, text in readme_blocks() if "curl" in text and "/v1/completions" in text]
    return block


@dataclass
class QuickStart:
    base_url: str
    env: dict[str, str]
    pgid: int
    log_path: Path
    model_dir: Path

    def log_tail(self, num_lines: int = 40) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-num_lines:])


def _wait_healthy(proc: subprocess.Popen, base_url: str, log_path: Path) -> None:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while True:
        if proc.poll() is not None:
            tail = "\n".join(log_path.read_text(errors="replace").splitlines()[-40:])
            pytest.fail(f"the README's quick start exited with code {proc.returncode}; log {log_path}:\n{tail}")
        try:
            if httpx.get(f"{base_url}/health", timeout=2.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            pytest.fail(f"the README's quick start was not healthy within {STARTUP_TIMEOUT_S:g} s; log {log_path}")
        time.sleep(0.5)


def _stop_group(proc: subprocess.Popen, pgid: int) -> None:
    """SIGTERM to the group, SIGKILL to what is left after the grace period."""
    for signum, grace_s in ((signal.SIGTERM, STOP_GRACE_S), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(pgid, signum)
        except ProcessLookupError:
            pass
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline:
            proc.poll()
            if proc.returncode is not None and not process_group_pids(pgid):
                return
            time.sleep(0.1)


@pytest.fixture(scope="module")
def quick_start(tmp_path_factory: pytest.TempPathFactory) -> Iterator[QuickStart]:
    model_dir = build_model("gqa", "tiny")
    work = tmp_path_factory.mktemp("readme-quickstart")
    port = free_port(LOOPBACK_HOST)
    env = dict(os.environ)
    env.update(MODEL_DIR=str(model_dir), PORT=str(port),
               PATH=f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}",
               VLLM_CACHE_ROOT=str(work / "vllm-cache"), TORCHINDUCTOR_CACHE_DIR=str(work / "inductor-cache"))
    log_path = work / "server.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(["bash", "-c", quick_start_block()], cwd=README.parent, env=env,
                                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
    pgid = proc.pid
    try:
        base_url = f"http://{LOOPBACK_HOST}:{port}"
        _wait_healthy(proc, base_url, log_path)
        yield QuickStart(base_url, env, pgid, log_path, model_dir)
    finally:
        _stop_group(proc, pgid)
    assert process_group_pids(pgid) == [], f"processes of the quick start outlived SIGTERM and SIGKILL: {pgid}"


def _counts(base_url: str) -> dict[str, float]:
    return scrape_metrics(base_url)


def test_the_quick_start_serves_a_repeated_prompt_from_the_tier(quick_start: QuickStart) -> None:
    url = quick_start.base_url
    prompt = prompt_token_ids(quick_start.model_dir, PROMPT_TOKENS)
    sends = []
    for _ in range(2):
        before = _counts(url)
        result = complete(url, prompt_token_ids=prompt, max_tokens=MAX_TOKENS, ignore_eos=True, timeout_s=180.0)
        after = wait_for_metric(url, PROMPT_TOKENS_TOTAL, before.get(PROMPT_TOKENS_TOTAL, 0.0) + len(prompt))
        sends.append((result, round(after.get(HITS, 0.0) - before.get(HITS, 0.0))))
    (first, first_hits), (second, second_hits) = sends
    assert first_hits == 0, "a fresh tier cannot hit"
    assert second_hits == EXPECTED_HIT, f"the repeat got {second_hits} external hit tokens, not {EXPECTED_HIT}"
    assert first.token_ids is not None and len(first.token_ids) == MAX_TOKENS
    assert second.token_ids == first.token_ids and second.text == first.text
    assert "RangeConnector" in quick_start.log_path.read_text(errors="replace")


def test_the_readme_curl_example_works(quick_start: QuickStart) -> None:
    url = quick_start.base_url
    before = _counts(url)
    proc = subprocess.run(["bash", "-c", curl_block()], cwd=README.parent, env=quick_start.env,
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, f"the README's curl block failed: {proc.stderr}\n{quick_start.log_tail()}"
    lines = [line for line in proc.stdout.splitlines() if line.strip()]
    answers = [json.loads(line) for line in lines if line.startswith("{")]
    assert len(answers) == 2, proc.stdout
    texts = [a["choices"][0]["text"] for a in answers]
    assert texts[0] == texts[1] and texts[0], texts
    prompt_tokens = sum(a["usage"]["prompt_tokens"] for a in answers)
    assert answers[0]["usage"]["prompt_tokens"] > CHUNK_TOKENS, "the README's prompt is too short to hit"
    after = wait_for_metric(url, PROMPT_TOKENS_TOTAL, before.get(PROMPT_TOKENS_TOTAL, 0.0) + prompt_tokens)
    assert after.get(HITS, 0.0) - before.get(HITS, 0.0) > 0, "the README's second request got no external hit"
    shown = [line for line in lines if line.startswith("vllm:")]
    assert any(line.startswith(HITS) for line in shown) and any(line.startswith(LOADED) for line in shown), shown
