"""A shard's server fails under a running engine: killed in the middle of a load or of a save, restarted empty on
its port, frozen (SIGSTOP) past the call's deadline, or refusing a value over its bulk limit. Each ends as failed
loads or lost saves (recompute, future misses), within the calls' deadlines, with the baseline restored.
"""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path

import pytest
import torch

from range_connector.backends.base import StripeWrite
from range_connector.config import RangeConfig, TierConfig
from range_connector.kv.metadata import (
    ChunkTransfer,
    RangeConnectorMetadata,
    RequestTransfer,
)
from range_connector.kv.namespace import ChunkHash
from range_connector.worker.facade import RangeWorker
from tests.faults.conftest import (
    Baseline,
    admin,
    assert_oracle,
    empty_server_on,
    num_clients,
    run_bounded,
    wait_until,
)
from tests.unit.scheduler_worker_harness import (
    Engine,
    FakeRequest,
    FlakyBackend,
    produce,
    prompt_tokens,
)

PROMPT = prompt_tokens(150, seed=77)


class WriteGate(FlakyBackend):
    """A FlakyBackend whose stripe writes wait for :attr:`go` (so a fault can strike while one is in flight)."""

    def __init__(self, inner, **kw) -> None:
        super().__init__(inner, **kw)
        self.entered = threading.Event()
        self.go = threading.Event()

    def write_stripe(self, write: StripeWrite) -> bool:
        self.entered.set()
        self.go.wait(10.0)
        return super().write_stripe(write)


def _kill(pid: int) -> None:
    os.kill(pid, signal.SIGKILL)
    def gone() -> bool:
        try:
            return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
        except OSError:
            return True

    assert wait_until(gone)


@pytest.mark.timeout(60)
def test_shard_killed_mid_load_then_restarted_empty(valkey_server_sets, backends_for, tmp_path) -> None:
    s = valkey_server_sets(1)
    [url] = s.urls
    base = Baseline([url])
    base.record()
    a, a_blocks = produce(backends_for([url]), PROMPT)
    flaky = [FlakyBackend(b, scatter=True) for b in backends_for([url])]
    b = Engine(flaky, seed=3, backend_retry_s=0.0)  # type: ignore[arg-type]
    ext = b.admit(FakeRequest("B-0", PROMPT))
    assert ext == 128
    flaky[0].hold_reads()
    step = threading.Thread(target=lambda: results.append(b.step(forward=False)))
    results: list = []
    step.start()
    assert wait_until(lambda: flaky[0].loads_in_flight > 0)
    _kill(s.pids[0])  # the server dies while the load's read is in flight
    flaky[0].release_reads()
    step.join(20.0)
    assert not step.is_alive()
    [res] = results

    assert res.invalid_block_ids == set(b.running["B-0"].block_ids[:8])  # nothing delivered, all recomputed
    assert assert_oracle([(a, a_blocks)], b, "B-0", ext, [res]) == 0
    assert b.worker.stats["load_backend_errors"] >= 1
    b.finish("B-0")

    with empty_server_on(url, tmp_path):  # back on its port, without its data
        assert run_bounded(lambda: b.sched.get_num_new_matched_tokens(FakeRequest("B-1", PROMPT), 0)) == (0, False)
        # a new save reaches the restarted server through the same backends, and then loads byte for byte
        c, c_blocks = produce(backends_for([url]), PROMPT, seed=12)
        ext = b.admit(FakeRequest("B-2", PROMPT))
        assert ext == 128
        res = b.step(forward=False)
        assert res.invalid_block_ids == set()
        assert assert_oracle([(c, c_blocks)], b, "B-2", ext, [res]) == 8
        b.finish("B-2")
        b.step(forward=False)
        Baseline([url]).check_live([b, c])
        for e in (a, b, c):
            e.close()
        backends_for.close_all()
        assert wait_until(lambda: num_clients(url) == 0)
    base.check_closed(urls=[])


@pytest.mark.timeout(60)
def test_shard_killed_mid_save_loses_the_save_only(valkey_server_sets, backends_for, tmp_path) -> None:
    s = valkey_server_sets(1)
    [url] = s.urls
    base = Baseline([url])
    base.record()
    gated = [WriteGate(b) for b in backends_for([url])]
    a = Engine(gated, seed=1)  # type: ignore[arg-type]
    assert a.admit(FakeRequest("A-0", PROMPT), None) == 0
    step = threading.Thread(target=lambda: a.step())
    step.start()
    assert gated[0].entered.wait(10.0)
    _kill(s.pids[0])  # the server dies as the stripe write goes out
    gated[0].go.set()
    step.join(20.0)
    assert not step.is_alive()
    assert a.worker.stats["save_errors"] >= 1 and a.worker.stats["saved_chunks"] == 0

    with empty_server_on(url, tmp_path):
        b = Engine(backends_for([url]), seed=2)  # type: ignore[arg-type]
        assert b.sched.get_num_new_matched_tokens(FakeRequest("B-0", PROMPT), 0) == (0, False)  # a miss, no error
        for e in (a, b):
            e.close()
        backends_for.close_all()
        assert wait_until(lambda: num_clients(url) == 0)
    base.check_closed(urls=[])


@pytest.mark.timeout(60)
@pytest.mark.parametrize("path", ["direct", "bank"])
def test_shard_frozen_past_the_deadline_fails_the_load_in_time(valkey_server_sets, backends_for, path: str) -> None:
    s = valkey_server_sets(1)
    [url] = s.urls
    base = Baseline([url])
    base.record()
    a, a_blocks = produce(backends_for([url]), PROMPT)
    flaky = [FlakyBackend(b, scatter=path == "direct") for b in backends_for([url], timeout_s=0.5)]
    # (the lease release at the end of the failed load meets the frozen server too: the lease then expires by
    # itself after lease_ttl_s, short here)
    b = Engine(flaky, seed=3, lease_ttl_s=1.0)  # type: ignore[arg-type]
    ext = b.admit(FakeRequest("B-0", PROMPT))
    assert ext == 128
    flaky[0].hold_reads()
    results: list = []
    step = threading.Thread(target=lambda: results.append(b.step(forward=False)))
    step.start()
    assert wait_until(lambda: flaky[0].loads_in_flight > 0)
    os.kill(s.pids[0], signal.SIGSTOP)
    try:
        flaky[0].release_reads()
        step.join(20.0)  # the read ends at its 0.5 s deadline; only a hang reaches this
        assert not step.is_alive()
    finally:
        os.kill(s.pids[0], signal.SIGCONT)
    [res] = results
    assert res.invalid_block_ids == set(b.running["B-0"].block_ids[:8])
    assert assert_oracle([(a, a_blocks)], b, "B-0", ext, [res]) == 0
    b.finish("B-0")
    b.step(forward=False)
    base.check_live([a, b], lease_expiry_s=5.0)
    a.close()
    b.close()
    backends_for.close_all()
    base.check_closed()


def _big_worker(backends, num_blocks: int = 4) -> tuple[RangeWorker, dict[str, torch.Tensor]]:
    """A worker whose one layer holds 1 MiB per block (2 MiB per chunk value): over a 1 MiB bulk limit."""
    # (save_mode "sync": what a save stored is checked when it returns)
    config = RangeConfig(tiers=(TierConfig("memory"),), chunk_tokens=32, save_mode="sync").resolve(16)
    kv = {"layer.0": torch.randn((num_blocks, 2, 16, 2 * 8192)).to(torch.bfloat16)}
    w = RangeWorker(config, 16, ("layer.0",), num_blocks, backends)
    w.register_kv_caches(kv)
    return w, kv


@pytest.mark.timeout(60)
def test_value_over_the_servers_bulk_limit_is_a_lost_save(valkey_server_sets, backends_for) -> None:
    s = valkey_server_sets(1)
    [url] = s.urls
    base = Baseline([url])
    base.record()
    backends = backends_for([url])  # reads the server's limit now (512 MiB) ...
    import contextlib
    with contextlib.closing(admin(url)) as c:
        c.config_set("proto-max-bulk-len", str(1 << 20))  # ... and the server lowers it under the running engine
        w, _kv = _big_worker(backends)
        save = RangeConnectorMetadata(saves=[RequestTransfer("r", (ChunkTransfer(0, ChunkHash(b"\x01" * 16), (0, 1),
                                                                                 (0, 1)),), 32)])
        run_bounded(lambda: w.save(save))  # never raises
        assert w.stats["save_errors"] == 1 and w.stats["saved_stripes"] == 0
        assert w.build_worker_meta() is None or not w.build_worker_meta().saved  # type: ignore[union-attr]
        c.config_set("proto-max-bulk-len", str(512 << 20))
        w.saver._down_until = [0.0]  # (the shard's retry pause after the error, not what is tested)
        run_bounded(lambda: w.save(save))  # the same backend recovered its connection
        assert w.stats["saved_stripes"] == 1
    w.close()
    backends_for.close_all()
    base.check_closed()
