"""``range-connector calibrate --tiny --quick`` for real: a vLLM CPU engine started on the tiny GQA model and two
embedded Valkey servers (one per shard). The file must hold a fitted prefill rate and one line per shard, the table
must be printed, and the servers must hold the same keys as before (calibration stripes are dropped)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

pytest.importorskip("vllm")
valkey = pytest.importorskip("valkey")

from range_connector.backends.base import deployment_key_prefix  # noqa: E402
from range_connector.cli import main  # noqa: E402
from range_connector.config.keys import DEFAULT_DEPLOYMENT  # noqa: E402
from range_connector.cost.calibration_file import load_calibration  # noqa: E402

pytestmark = pytest.mark.engine


def _keys_and_used(url: str) -> tuple[set[bytes], int]:
    """The tier's keys other than its byte counter, and the counter (a missing counter is 0 bytes)."""
    client = valkey.Valkey.from_url(url, socket_timeout=5.0)
    try:
        prefix = deployment_key_prefix(DEFAULT_DEPLOYMENT)
        keys = set(client.scan_iter(match=f"{prefix}*", count=1000)) - {f"{prefix}used".encode()}
        return keys, int(client.get(f"{prefix}used") or 0)
    finally:
        client.close()


@pytest.mark.timeout(300)
def test_quick_calibration_of_the_tiny_model_and_embedded_valkey(valkey_servers, tmp_path: Path, capsys) -> None:
    before = [_keys_and_used(url) for url in valkey_servers.urls]
    out = tmp_path / "cal.json"
    start = time.monotonic()
    rc = main(["calibrate", "--tiny", "--quick", "--backends", "valkey", "--output", str(out),
               "--extra-config", json.dumps({"valkey_urls": list(valkey_servers.urls)})])
    elapsed_s = time.monotonic() - start
    printed = capsys.readouterr().out
    assert rc == 0, printed
    cal = load_calibration(out)
    assert [n for n, _ in cal.prefill_points] == [128, 256, 512, 1024]
    assert cal.prefill is not None and 10 < cal.prefill.tokens_per_s() < 1e7
    assert cal.prefill_points[-1][1] > cal.prefill_points[0][1]  # a longer prompt takes longer
    assert len(cal.tiers["valkey"]) == 2 and all(e.bandwidth_bytes_per_s > 1e7 for e in cal.tiers["valkey"])
    assert cal.bytes_per_token and cal.model.endswith(tuple("0123456789abcdef"))
    assert any(line.startswith("valkey ") for line in printed.splitlines()), printed
    assert [_keys_and_used(url) for url in valkey_servers.urls] == before
    print(printed)
    print(f"calibrate --tiny --quick took {elapsed_s:.1f} s; R = {cal.prefill.tokens_per_s():.0f} tokens/s")
