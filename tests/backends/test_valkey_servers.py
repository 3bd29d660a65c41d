"""Embedded Valkey servers: start, reuse across processes, status, stop, stale records, CLI; bounded and closed
(memory limit, password), same ports and password after a restart, nothing kept across it.

Every test uses its own runtime dir under ``tmp_path`` and stops its servers in the ``runtime_dir`` fixture's
teardown, killing by recorded pid as a last resort so no server outlives the test.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import valkey

from range_connector import cli
from range_connector.backends.valkey.servers import (
    RUNTIME_DIR_ENV,
    VALKEY_SERVER_BIN_ENV,
    default_runtime_dir,
    embedded_urls,
    ensure_servers,
    server_status,
    stop_servers,
    valkey_server_binary,
)
from range_connector.backends.valkey.urls import redact_url
from range_connector.config import RangeConfig
from range_connector.config.keys import DEFAULT_EMBEDDED_MAXMEMORY_BYTES
from range_connector.errors import ConfigError, ServerStartError

REPO_ROOT = Path(__file__).resolve().parents[2]

try:
    valkey_server_binary()
except ServerStartError as exc:  # pragma: no cover - depends on the environment
    pytest.skip(f"no valkey-server binary: {exc}", allow_module_level=True)


def _recorded_pids(runtime_dir: Path) -> list[int]:
    try:
        document = json.loads((runtime_dir / "servers.json").read_text())
    except (OSError, ValueError):
        return []
    return [int(entry["pid"]) for entry in document.get("servers", [])]


def _pid_running(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie."""
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[-1].split()[0] not in ("Z", "X")


@pytest.fixture
def runtime_dir(tmp_path: Path) -> Iterator[Path]:
    path = tmp_path / "runtime"
    seen_pids: set[int] = set()
    try:
        yield path
    finally:
        seen_pids.update(_recorded_pids(path))
        try:
            stop_servers(path, timeout_s=2.0)
        finally:
            for pid in seen_pids:
                if _pid_running(pid):
                    os.kill(pid, signal.SIGKILL)


def _run_python(code: str, env_extra: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    env.update(env_extra or {})
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=40,
        check=False,
    )


@pytest.mark.timeout(30)
def test_two_shards_answer_ping_on_different_ports(runtime_dir: Path) -> None:
    urls = ensure_servers(2, runtime_dir)

    assert len(urls) == 2
    password = (runtime_dir / "password").read_text().strip()
    assert all(url.startswith(f"valkey://:{password}@127.0.0.1:") for url in urls)
    assert len(set(urls)) == 2
    for url in urls:
        client = valkey.Valkey.from_url(url)
        try:
            assert client.ping() is True
            assert client.info("memory")["maxmemory"] == DEFAULT_EMBEDDED_MAXMEMORY_BYTES == 1 << 30
            assert client.config_get("maxmemory-policy") == {"maxmemory-policy": "noeviction"}
            assert client.config_get("save") == {"save": ""}
            assert client.config_get("appendonly") == {"appendonly": "no"}
            assert client.config_get("bind")["bind"] == "127.0.0.1"
        finally:
            client.close()


@pytest.mark.timeout(30)
def test_second_call_in_process_returns_same_servers(runtime_dir: Path) -> None:
    first_urls = ensure_servers(2, runtime_dir)
    first_pids = _recorded_pids(runtime_dir)

    assert ensure_servers(2, runtime_dir) == first_urls
    assert _recorded_pids(runtime_dir) == first_pids


@pytest.mark.timeout(60)
def test_servers_started_by_subprocess_outlive_it_and_keep_data(runtime_dir: Path) -> None:
    # A separate process starts the servers, writes a key and exits.
    result = _run_python(
        f"""
        import json, sys
        from pathlib import Path
        import valkey
        from range_connector.backends.valkey.servers import ensure_servers
        urls = ensure_servers(2, Path({str(runtime_dir)!r}))
        valkey.Valkey.from_url(urls[1]).set(b"kv:block:7", b"\\x00\\x01payload")
        print(json.dumps(urls))
        """
    )
    assert result.returncode == 0, result.stderr
    child_urls = json.loads(result.stdout)

    # This process finds the same servers, and a fresh client finds the key.
    assert ensure_servers(2, runtime_dir) == child_urls
    client = valkey.Valkey.from_url(child_urls[1])
    try:
        assert client.get(b"kv:block:7") == b"\x00\x01payload"
    finally:
        client.close()
    assert [status.num_keys for status in server_status(runtime_dir)] == [0, 1]


@pytest.mark.timeout(60)
def test_subprocess_call_returns_servers_started_here(runtime_dir: Path) -> None:
    urls = ensure_servers(2, runtime_dir)

    result = _run_python(
        f"""
        import json
        from pathlib import Path
        from range_connector.backends.valkey.servers import ensure_servers
        print(json.dumps(ensure_servers(2, Path({str(runtime_dir)!r}))))
        """
    )

    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == urls


@pytest.mark.timeout(60)
def test_concurrent_callers_end_up_with_the_same_servers(runtime_dir: Path) -> None:
    code = f"""
        import json
        from pathlib import Path
        from range_connector.backends.valkey.servers import ensure_servers
        print(json.dumps(ensure_servers(2, Path({str(runtime_dir)!r}))))
        """
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    processes = [
        subprocess.Popen(
            [sys.executable, "-c", textwrap.dedent(code)],
            cwd=REPO_ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(3)
    ]
    outputs = [process.communicate(timeout=40) for process in processes]

    assert [process.returncode for process in processes] == [0, 0, 0], [stderr for _, stderr in outputs]
    url_lists = [json.loads(stdout) for stdout, _ in outputs]
    assert url_lists[0] == url_lists[1] == url_lists[2]
    assert embedded_urls(runtime_dir) == url_lists[0]
    assert all(status.alive for status in server_status(runtime_dir))


@pytest.mark.timeout(30)
def test_status_reports_alive_servers_with_memory_and_keys(runtime_dir: Path) -> None:
    assert server_status(runtime_dir) == []
    urls = ensure_servers(2, runtime_dir)
    client = valkey.Valkey.from_url(urls[0])
    try:
        client.set(b"a", b"x" * 1024)
        client.set(b"b", b"y")
    finally:
        client.close()

    statuses = server_status(runtime_dir)

    assert [status.shard_idx for status in statuses] == [0, 1]
    assert [status.url for status in statuses] == [redact_url(url).replace("***@", "") for url in urls]
    assert [status.maxmemory_bytes for status in statuses] == [1 << 30] * 2
    assert all(status.password_protected for status in statuses)
    assert [status.port for status in statuses] == [int(url.rsplit(":", 1)[1]) for url in urls]
    assert all(status.alive for status in statuses)
    assert [status.num_keys for status in statuses] == [2, 0]
    assert all(status.used_memory_bytes is not None and status.used_memory_bytes > 0 for status in statuses)


@pytest.mark.timeout(30)
def test_stop_kills_the_servers_and_forgets_them(runtime_dir: Path) -> None:
    ensure_servers(2, runtime_dir)
    pids = _recorded_pids(runtime_dir)
    assert len(pids) == 2 and all(_pid_running(pid) for pid in pids)

    assert stop_servers(runtime_dir) == 2

    assert not any(_pid_running(pid) for pid in pids)
    assert server_status(runtime_dir) == []
    assert not (runtime_dir / "servers.json").exists()
    assert stop_servers(runtime_dir) == 0


@pytest.mark.timeout(30)
def test_stale_record_with_dead_pid_gets_new_servers(runtime_dir: Path) -> None:
    urls = ensure_servers(2, runtime_dir)
    pids = _recorded_pids(runtime_dir)
    # Kill shard 1 behind the record's back: its entry is now stale.
    os.kill(pids[1], signal.SIGKILL)
    while _pid_running(pids[1]):
        time.sleep(0.01)
    assert [status.alive for status in server_status(runtime_dir)] == [True, False]

    new_urls = ensure_servers(2, runtime_dir)

    new_pids = _recorded_pids(runtime_dir)
    assert new_urls[0] == urls[0] and new_pids[0] == pids[0]
    assert new_pids[1] != pids[1]
    assert new_urls[1] == urls[1]  # the same port (and password): an engine retrying the old URL finds it
    assert all(status.alive for status in server_status(runtime_dir))


@pytest.mark.timeout(30)
def test_hand_written_stale_record_is_replaced(runtime_dir: Path) -> None:
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    runtime_dir.mkdir(parents=True)
    stale_servers = [
        {
            "shard_idx": shard_idx,
            "pid": dead.pid,
            "port": 1,
            "url": "valkey://127.0.0.1:1",
            "data_dir": str(runtime_dir / f"shard-{shard_idx}-data"),
            "log_path": str(runtime_dir / f"shard-{shard_idx}.log"),
            "started_at_unix_s": 0.0,
        }
        for shard_idx in range(3)
    ]
    (runtime_dir / "servers.json").write_text(
        json.dumps({"format_version": 1, "num_shards": 3, "servers": stale_servers})
    )

    # A different shard count is fine when none of the recorded servers is alive.
    urls = ensure_servers(2, runtime_dir)

    assert len(urls) == 2 and "valkey://127.0.0.1:1" not in urls
    assert all(status.alive for status in server_status(runtime_dir))
    assert dead.pid not in _recorded_pids(runtime_dir)


@pytest.mark.timeout(30)
def test_different_shard_count_with_live_servers_is_refused(runtime_dir: Path) -> None:
    urls = ensure_servers(2, runtime_dir)

    with pytest.raises(ConfigError, match="num_shards: 3 requested"):
        ensure_servers(3, runtime_dir)

    assert embedded_urls(runtime_dir) == urls


@pytest.mark.timeout(30)
def test_binary_that_exits_raises_server_start_error_naming_the_log(
    runtime_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(VALKEY_SERVER_BIN_ENV, "/bin/false")

    with pytest.raises(ServerStartError, match=r"port \d+ exited with code 1; see .*shard-0\.log"):
        ensure_servers(2, runtime_dir)

    assert not (runtime_dir / "servers.json").exists()


@pytest.mark.timeout(30)
def test_bad_shard_count_is_a_config_error(runtime_dir: Path) -> None:
    with pytest.raises(ConfigError, match="num_shards"):
        ensure_servers(0, runtime_dir)


@pytest.mark.timeout(10)
def test_default_runtime_dir_honours_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv(RUNTIME_DIR_ENV, str(tmp_path / "rd"))
    assert default_runtime_dir() == tmp_path / "rd"
    monkeypatch.delenv(RUNTIME_DIR_ENV)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    assert default_runtime_dir() == tmp_path / f"range-connector-{os.getuid()}"


@pytest.mark.timeout(30)
def test_cli_start_status_stop(runtime_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["valkey", "status", "--runtime-dir", str(runtime_dir)]) == 0
    assert "no Valkey servers recorded" in capsys.readouterr().out

    assert cli.main(["valkey", "start", "--shards", "2", "--runtime-dir", str(runtime_dir)]) == 0
    out = capsys.readouterr().out
    password = (runtime_dir / "password").read_text().strip()
    assert password not in out
    assert "2 shards x 1 GiB maxmemory = 2 GiB" in out and "0.938 GiB per shard" in out
    urls = [status.url for status in server_status(runtime_dir)]
    assert all(f"{url.replace('//', '//***@')}  working dir" in out for url in urls)

    assert cli.main(["valkey", "status", "--runtime-dir", str(runtime_dir)]) == 0
    out = capsys.readouterr().out
    assert "ALIVE" in out and all(url in out for url in urls) and password not in out

    assert cli.main(["valkey", "stop", "--runtime-dir", str(runtime_dir)]) == 0
    assert "stopped 2" in capsys.readouterr().out


@pytest.mark.timeout(30)
def test_cli_start_prints_an_engine_flag_that_names_the_runtime_dir(tmp_path: Path,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    data_dir = tmp_path / "pcp-servers"
    try:
        # --data-dir is the deprecated name of --runtime-dir: it still works, with a warning.
        assert cli.main(["valkey", "start", "--shards", "2", "--maxmemory-bytes", str(64 << 20),
                         "--data-dir", str(data_dir)]) == 0
        captured = capsys.readouterr()
        assert "--data-dir is deprecated" in captured.err
        flag = next(line for line in captured.out.splitlines() if line.startswith("--kv-transfer-config "))
        config = json.loads(flag.split(" ", 1)[1].strip("'"))
        assert config["kv_connector"] == "RangeConnector"
        assert config["kv_connector_extra_config"] == {
            "num_shards": 2, "runtime_dir": str(data_dir.resolve()),
            "tiers": [{"type": "valkey", "embedded_maxmemory_bytes": 64 << 20}]}
        parsed = RangeConfig.from_extra_config(config["kv_connector_extra_config"])
        assert parsed.num_shards == 2 and parsed.tier.embedded and parsed.tier.budget_bytes == 48 << 20
        assert [s.maxmemory_bytes for s in server_status(data_dir)] == [64 << 20] * 2
        for shard_idx in range(2):
            assert (data_dir / f"shard-{shard_idx}-data").is_dir()
    finally:
        stop_servers(data_dir)


@pytest.mark.timeout(10)
@pytest.mark.parametrize(
    "argv",
    [
        [],
        ["bogus"],
        ["valkey"],
        ["valkey", "start"],
        ["valkey", "start", "--shards", "0"],
        ["valkey", "start", "--shards", "x"],
    ],
)
def test_cli_bad_input_exits_2_with_one_line(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and err.startswith("error: ")
