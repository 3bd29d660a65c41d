"""Conformance of ``range_connector.lmcache.adapter.RangeL2Adapter`` to LMCache 0.5.6's ``L2AdapterInterface``.

The adapter subclasses LMCache's interface, so it runs only in LMCache's environment (``.venv-lmcache``, built by
``bash bench/setup_lmcache_env.sh``; never the main ``.venv``: LMCache downgrades numpy). This module starts
``tests/lmcache/l2_adapter_checks.py`` once with ``.venv-lmcache/bin/python`` against the session's real Valkey
servers (two shards) and a scratch directory (file tier), and reports each of its checks as a test of its own.
Without ``.venv-lmcache`` every test is skipped with the reason (CI has no LMCache environment).

What the checks prove (details in their docstrings there): a store / lookup-and-lock / load / unlock round trip
over two shards is bit-exact and leaves no lease; each call's round trips per shard are the same for 8 and 256
objects (a store task is one round trip per shard); the three event fds are distinct, signalled on completion,
and each result is returned once; a missing, a corrupted (on the server, with a mutation showing the checksum is
what catches it) and a wrongly sized object are 0 bits while the others load; lock counts and lease release;
Range's budget evicts unleased stripes, never a locked one, and ``get_usage`` reports Range's bytes; the file tier;
two controller threads at once; docs/lmcache.md's ``--l2-adapter`` JSON through LMCache's own parser and factory;
no vLLM imported.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tests.lmcache.lmcache_env import LMCACHE_PYTHON, REPO, lmcache_env, lmcache_unavailable_reason

CHILD = Path(__file__).with_name("l2_adapter_checks.py")
#: the checks of :data:`CHILD`, by name (the child reports exactly these)
CHECKS = ("a_task_that_raises_fails_its_keys_and_is_counted", "budget_evicts_unleased_stripes", "event_fds",
          "file_tier", "lmcache_loads_the_plugin_from_the_docs",
          "lock_counts_and_leases", "no_vllm", "partial_failure_bitmaps", "round_trips_follow_shards_not_objects",
          "store_lookup_load_unlock", "two_threads_at_once", "usage_by_cache_salt")
#: the child's whole run, seconds (a deadline against a hang; the checks take a few seconds)
CHILD_TIMEOUT_S = 240


@pytest.fixture(scope="module")
def check_results(valkey_servers, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    reason = lmcache_unavailable_reason()
    if reason:
        pytest.skip(reason)
    scratch = tmp_path_factory.mktemp("lmcache-l2")
    r = subprocess.run([str(LMCACHE_PYTHON), str(CHILD), "--urls", ",".join(valkey_servers.urls), "--scratch",
                        str(scratch), "--docs", str(REPO / "docs" / "lmcache.md")],
                       capture_output=True, text=True, timeout=CHILD_TIMEOUT_S, env=lmcache_env(), cwd=str(scratch))
    assert r.returncode == 0 and r.stdout.strip(), f"checks exited {r.returncode}: {r.stderr[-4000:]}"
    results = json.loads(r.stdout.strip().splitlines()[-1])
    assert sorted(results) == sorted(CHECKS), f"the child ran {sorted(results)}"
    return results


@pytest.mark.timeout(CHILD_TIMEOUT_S + 60)
@pytest.mark.parametrize("check", CHECKS)
def test_range_l2_adapter_conforms(check_results: dict[str, str], check: str) -> None:
    assert check_results[check] == "ok", check_results[check]
