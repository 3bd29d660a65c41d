"""``range-connector cache stats|clear`` against real Valkey servers (two shards, recorded in a runtime dir as embedded
servers are) and a real file tier, with two deployments: what each holds, clearing one leaves the other intact, the
confirmation, and bad arguments refused (exit 2, one line naming the argument) before any server is asked."""

from __future__ import annotations

import io
import json
import sys
from pathlib import Path

import pytest

from range_connector.backends.file.backend import FileBackend
from range_connector.backends.valkey.client import ValkeyBackend
from range_connector.cli import main
from range_connector.config.keys import embedded_budget_bytes
from tests.backends.conformance import make_stripe

pytestmark = pytest.mark.timeout(120)

#: stripes each deployment saves per shard (so their counts tell them apart)
STRIPES = {"alpha": 1, "beta": 2}


@pytest.fixture
def stores(tmp_path: Path, valkey_server_sets) -> dict:
    """Two tiers (embedded-style Valkey with two shards, then files), both deployments saved on every shard; the
    config (written to ``config.json``) names deployment ``alpha``."""
    servers = valkey_server_sets(2)
    files = tmp_path / "files"
    config = {"tiers": [{"type": "valkey"}, {"type": "file", "directory": str(files)}], "num_shards": 2,
              "runtime_dir": str(servers.runtime_dir), "deployment": "alpha"}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    saved: dict = {}
    for deployment, count in STRIPES.items():
        for s, url in enumerate(servers.urls):
            for backend in (ValkeyBackend(url, deployment=deployment), FileBackend(files / deployment / f"shard-{s}")):
                for i in range(count):
                    stripe = make_stripe(100 * s + i)
                    assert backend.write_stripe(stripe.write)
                    saved.setdefault((deployment, s, type(backend).__name__), []).append(stripe)
                backend.close()
    return {"config": path, "servers": servers, "files": files, "saved": saved}


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def _stats(capsys, config: Path) -> dict[tuple[int, str, int], dict]:
    rc, out, err = _run(capsys, "cache", "stats", "--config", str(config), "--json")
    assert rc == 0, err
    return {(r["tier_idx"], r["deployment"], r["shard_idx"]): r for r in json.loads(out)["rows"]}


def test_stats_shows_each_deployment_on_each_shard_of_each_tier(capsys, stores):
    rows = _stats(capsys, stores["config"])
    assert set(rows) == {(t, d, s) for t in (0, 1) for d in STRIPES for s in (0, 1)}
    for (tier_idx, deployment, shard_idx), row in rows.items():
        stripes = stores["saved"][(deployment, shard_idx, "ValkeyBackend" if tier_idx == 0 else "FileBackend")]
        assert row["tier_type"] == ("valkey", "file")[tier_idx]
        assert (row["num_stripes"], row["num_tickets"]) == (len(stripes), 2 * len(stripes))
        assert row["used_bytes"] == sum(s.write.nbytes for s in stripes)
        assert row["oldest_use_unix_s"] <= row["newest_use_unix_s"]
    # the budget is the config's, for its own deployment: embedded servers' default, and none on the file tier
    assert rows[(0, "alpha", 0)]["budget_bytes"] == embedded_budget_bytes(1 << 30)
    assert rows[(1, "alpha", 1)]["budget_bytes"] == 0
    assert rows[(0, "beta", 0)]["budget_bytes"] is None
    rc, out, _ = _run(capsys, "cache", "stats", "--config", str(stores["config"]), "--deployment", "beta",
                      "--tier", "file")
    assert rc == 0
    lines = out.splitlines()
    assert lines[0].split()[:4] == ["TIER", "TYPE", "SHARD", "DEPLOYMENT"] and len(lines) == 3
    assert all(line.split()[1:4:2] == ["file", "beta"] for line in lines[1:])


def test_clearing_one_deployment_leaves_the_other_intact(capsys, stores):
    rc, out, err = _run(capsys, "cache", "clear", "--config", str(stores["config"]), "--deployment", "beta", "--yes")
    assert rc == 0, err
    assert out.count(" yes ") == 4  # two tiers x two shards
    rows = _stats(capsys, stores["config"])
    for key, row in rows.items():
        if key[1] == "beta":
            assert (row["num_tickets"], row["num_stripes"], row["used_bytes"]) == (0, 0, 0), key
        else:
            assert row["num_stripes"] == STRIPES["alpha"], key
    for s, url in enumerate(stores["servers"].urls):  # alpha's entries still read back
        for backend in (ValkeyBackend(url, deployment="alpha"), FileBackend(stores["files"] / "alpha" / f"shard-{s}")):
            (stripe,) = stores["saved"][("alpha", s, type(backend).__name__)]
            assert backend.get_tickets(stripe.keys) == stripe.encoded
            backend.close()


def test_clear_of_one_tier_by_type_and_the_configs_deployment_by_default(capsys, stores):
    rc, _, err = _run(capsys, "cache", "clear", "--config", str(stores["config"]), "--tier", "file", "--yes")
    assert rc == 0, err
    rows = _stats(capsys, stores["config"])
    assert rows[(1, "alpha", 0)]["num_stripes"] == 0 and rows[(1, "alpha", 1)]["num_stripes"] == 0
    assert rows[(0, "alpha", 0)]["num_stripes"] == 1 and rows[(1, "beta", 0)]["num_stripes"] == 2


def test_clear_refuses_without_yes_when_stdin_is_not_a_terminal(capsys, monkeypatch, stores):
    monkeypatch.setattr(sys, "stdin", io.StringIO("y\n"))  # (piped input: not a terminal)
    rc, _, err = _run(capsys, "cache", "clear", "--config", str(stores["config"]))
    assert rc == 2 and err.count("\n") == 1 and err.startswith("error: --yes: ")
    assert _stats(capsys, stores["config"])[(0, "alpha", 0)]["num_stripes"] == 1


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.mark.parametrize("answer", ["n", "y"])
def test_clear_asks_on_a_terminal(capsys, monkeypatch, stores, answer):
    monkeypatch.setattr(sys, "stdin", _Terminal(answer + "\n"))
    rc, out, err = _run(capsys, "cache", "clear", "--config", str(stores["config"]), "--tier", "0")
    assert rc == 0, err
    assert "alpha: 4 tickets, 2 stripes" in out and "Clear deployment 'alpha' on tier(s) 0 (valkey)" in out
    left = _stats(capsys, stores["config"])[(0, "alpha", 0)]["num_stripes"]
    assert left == (1 if answer == "n" else 0)


@pytest.mark.parametrize("argv, named", [
    (["cache", "stats", "--config", "{missing}"], "--config"),
    (["cache", "stats", "--config", "{bad_json}"], "--config"),
    (["cache", "stats", "--config", "{unknown_key}"], "--config: chunk_size"),
    (["cache", "stats", "--config", "{good}", "--tier", "7"], "--tier"),
    (["cache", "stats", "--config", "{good}", "--tier", "memory"], "--tier"),
    (["cache", "clear", "--config", "{good}", "--deployment", "no spaces", "--yes"], "--deployment"),
    (["cache", "stats", "--bogus"], "unrecognized arguments: --bogus"),
    (["cache", "lookup", "--config", "{good}", "--prompt-file", "{prompt}"], "--model"),
    (["cache", "lookup", "--config", "{good}", "--model", "{missing}", "--prompt-file", "{prompt}"], "--model"),
    (["cache", "lookup", "--config", "{good}", "--model", "{tmp}", "--prompt-file", "{missing}"], "--prompt-file"),
    (["cache", "lookup", "--config", "{good}", "--model", "{tmp}", "--prompt-file", "{prompt}",
      "--prompt-is-token-ids"], "--prompt-file"),
    (["cache", "lookup", "--config", "{good}", "--model", "{tmp}", "--prompt-file", "{prompt}",
      "--block-size", "0"], "--block-size"),
])
def test_bad_arguments_exit_2_with_one_line_naming_them(capsys, tmp_path, argv, named):
    """The runtime dir records no servers: had a command gone on to the tiers, it would fail otherwise."""
    files = {"missing": tmp_path / "missing.json", "bad_json": tmp_path / "bad.json", "good": tmp_path / "good.json",
             "unknown_key": tmp_path / "unknown.json", "prompt": tmp_path / "prompt.txt", "tmp": tmp_path}
    files["bad_json"].write_text("{not json")
    files["good"].write_text(json.dumps({"runtime_dir": str(tmp_path / "rt")}))
    files["unknown_key"].write_text(json.dumps({"chunk_size": 256}))
    files["prompt"].write_text("some words, not token ids")
    rc, out, err = _run(capsys, *[a.format(**{k: str(v) for k, v in files.items()}) for a in argv])
    assert rc == 2, err
    assert err.count("\n") == 1 and named in err, err
    assert not (tmp_path / "rt").exists()  # (nothing was started or created)


def test_a_shard_count_that_differs_from_the_running_servers_says_which_setting_to_change(capsys, stores, tmp_path):
    """Two embedded servers run and the config says one shard: the fix is the config's num_shards, not another
    ``valkey start`` (which would refuse, since two servers already run there)."""
    config = json.loads(stores["config"].read_text())
    del config["num_shards"]
    path = tmp_path / "one-shard.json"
    path.write_text(json.dumps(config))
    rc, out, err = _run(capsys, "cache", "stats", "--config", str(path))
    assert rc != 0 and out == ""
    assert 'records 2 embedded Valkey server(s), the config has 1 shard(s)' in err
    assert 'set "num_shards": 2 in the config' in err and "valkey start" not in err, err
