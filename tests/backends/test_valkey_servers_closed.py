"""Embedded Valkey servers are bounded and closed: a memory limit, a password kept in the runtime dir (never on a
command line, never printed), the same ports and password after a stop/start or a crash, nothing kept across a
restart (persistence is off), format-1 records replaced, ``valkey status`` failing on a dead server, Range's budget
just under the limit, and ``calibrate`` stopping the servers it started.

Every test uses its own runtime dir under ``tmp_path``; teardown stops its servers, killing by recorded pid as a
last resort.
"""

from __future__ import annotations

import json
import logging
import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest
import valkey

from range_connector import cli
from range_connector.backends.factory import resolve_valkey_tier
from range_connector.backends.valkey.servers import (
    embedded_urls,
    ensure_servers,
    server_status,
    start_embedded,
    stop_servers,
    valkey_server_binary,
)
from range_connector.cli.calibrate import CalibrateOptions, run_calibration
from range_connector.cli.common import EXIT_SERVER_DEAD
from range_connector.config import RangeConfig
from range_connector.errors import ConfigError, ServerStartError
from range_connector.testing.embedded import embedded_client

try:
    valkey_server_binary()
except ServerStartError as exc:  # pragma: no cover - depends on the environment
    pytest.skip(f"no valkey-server binary: {exc}", allow_module_level=True)

MiB = 1 << 20


def _recorded_pids(runtime_dir: Path) -> list[int]:
    try:
        return [int(e["pid"]) for e in json.loads((runtime_dir / "servers.json").read_text())["servers"]]
    except (OSError, ValueError, KeyError):
        return []


def _running(pid: int) -> bool:
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[-1].split()[0] not in ("Z", "X")
    except OSError:
        return False


def _kill(pid: int) -> None:
    os.kill(pid, signal.SIGKILL)
    while _running(pid):
        pass


@pytest.fixture
def runtime_dir(tmp_path: Path) -> Iterator[Path]:
    path = tmp_path / "runtime"
    seen: set[int] = set()
    try:
        yield path
    finally:
        seen.update(_recorded_pids(path))
        try:
            stop_servers(path, timeout_s=2.0)
        finally:
            for pid in seen:
                if _running(pid):
                    os.kill(pid, signal.SIGKILL)


def _port(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


@pytest.mark.timeout(30)
def test_servers_report_their_memory_limit_and_refuse_clients_without_the_password(runtime_dir: Path) -> None:
    servers = start_embedded(2, runtime_dir, maxmemory_bytes=64 * MiB)

    assert servers.maxmemory_bytes == 64 * MiB and servers.total_maxmemory_bytes == 128 * MiB
    assert servers.started_shard_idxs == (0, 1) and servers.password_protected
    for url in servers.urls:
        with valkey.Valkey(host="127.0.0.1", port=_port(url), socket_timeout=2.0) as anonymous, \
                pytest.raises(valkey.exceptions.AuthenticationError):
            anonymous.get(b"rc2:used")
        with valkey.Valkey(host="127.0.0.1", port=_port(url), password="not-it", socket_timeout=2.0) as wrong, \
                pytest.raises(valkey.exceptions.AuthenticationError):
            wrong.ping()
        with valkey.Valkey.from_url(url, socket_timeout=2.0) as client:
            assert client.info("memory")["maxmemory"] == 64 * MiB
            assert client.config_get("maxmemory-policy")["maxmemory-policy"] == "noeviction"
    # A second call starts nothing, and reports the same limit.
    assert start_embedded(2, runtime_dir).started_shard_idxs == ()


@pytest.mark.timeout(30)
def test_password_lives_in_private_files_never_on_a_command_line(runtime_dir: Path) -> None:
    urls = ensure_servers(1, runtime_dir)
    password = (runtime_dir / "password").read_text().strip()

    assert len(password) >= 40 and urls == [f"valkey://:{password}@127.0.0.1:{_port(urls[0])}"]
    assert (runtime_dir.stat().st_mode & 0o777) == 0o700
    assert ((runtime_dir / "password").stat().st_mode & 0o777) == 0o600
    assert ((runtime_dir / "server.conf").stat().st_mode & 0o777) == 0o600
    assert f"requirepass {password}" in (runtime_dir / "server.conf").read_text()
    (pid,) = _recorded_pids(runtime_dir)
    assert password.encode() not in Path(f"/proc/{pid}/cmdline").read_bytes()
    assert password not in (runtime_dir / "servers.json").read_text()
    with embedded_client(runtime_dir, 0) as client:  # the testing helper authenticates
        assert client.ping() is True


@pytest.mark.timeout(30)
def test_loose_runtime_dir_is_made_private(runtime_dir: Path) -> None:
    runtime_dir.mkdir(mode=0o755)
    os.chmod(runtime_dir, 0o755)

    ensure_servers(1, runtime_dir)

    assert (runtime_dir.stat().st_mode & 0o777) == 0o700


@pytest.mark.timeout(30)
def test_stop_then_start_same_ports_same_password_and_an_empty_tier(runtime_dir: Path) -> None:
    urls = ensure_servers(2, runtime_dir)
    with embedded_client(runtime_dir, 1) as client:
        client.set(b"rc2:kept?", b"x")
    assert stop_servers(runtime_dir) == 2

    assert ensure_servers(2, runtime_dir) == urls  # same ports, same password: a running engine reconnects

    with embedded_client(runtime_dir, 1) as client:
        assert client.get(b"rc2:kept?") is None  # persistence is off: a restarted server starts empty
    assert [s.num_keys for s in server_status(runtime_dir)] == [0, 0]


@pytest.mark.timeout(30)
def test_taken_port_gives_another_one(runtime_dir: Path) -> None:
    (url,) = ensure_servers(1, runtime_dir)
    stop_servers(runtime_dir)
    import socket

    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", _port(url)))
        squatter.listen()
        (new_url,) = ensure_servers(1, runtime_dir)
    assert _port(new_url) != _port(url)
    with valkey.Valkey.from_url(new_url, socket_timeout=2.0) as client:
        assert client.ping() is True


@pytest.mark.timeout(30)
def test_format_1_record_of_an_open_unbounded_server_is_replaced_on_its_port(runtime_dir: Path) -> None:
    (open_url,) = ensure_servers(1, runtime_dir, require_password=False)
    with valkey.Valkey.from_url(open_url) as client:
        client.config_set("maxmemory", 0)  # as an older version started it
    # Rewrite the record as an older version wrote it (no maxmemory_bytes, no password_protected).
    document = json.loads((runtime_dir / "servers.json").read_text())
    document["format_version"] = 1
    for entry in document["servers"]:
        del entry["maxmemory_bytes"], entry["password_protected"]
    (runtime_dir / "servers.json").write_text(json.dumps(document))
    (runtime_dir / "ports.json").unlink()
    (old_pid,) = _recorded_pids(runtime_dir)

    (url,) = ensure_servers(1, runtime_dir)

    assert not _running(old_pid)
    assert _port(url) == _port(open_url) and url != open_url
    (status,) = server_status(runtime_dir)
    assert status.alive and status.password_protected and status.maxmemory_bytes == 1 << 30
    assert json.loads((runtime_dir / "servers.json").read_text())["format_version"] == 2


@pytest.mark.timeout(30)
def test_running_servers_with_other_settings_are_refused(runtime_dir: Path) -> None:
    urls = ensure_servers(1, runtime_dir, maxmemory_bytes=64 * MiB)

    with pytest.raises(ConfigError, match=r"^embedded_maxmemory_bytes: 134217728 requested.*\[67108864\]"):
        ensure_servers(1, runtime_dir, maxmemory_bytes=128 * MiB)
    with pytest.raises(ConfigError, match="^require_password: servers without a password requested"):
        ensure_servers(1, runtime_dir, require_password=False)
    with pytest.raises(ConfigError, match="^embedded_maxmemory_bytes: .* below the minimum"):
        ensure_servers(1, runtime_dir, maxmemory_bytes=MiB)
    assert ensure_servers(1, runtime_dir) == urls  # no limit asked: the running one is used


@pytest.mark.timeout(30)
def test_cli_status_exits_4_when_a_server_is_dead(runtime_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ensure_servers(2, runtime_dir)
    assert cli.main(["valkey", "status", "--runtime-dir", str(runtime_dir)]) == 0
    capsys.readouterr()
    _kill(_recorded_pids(runtime_dir)[1])

    assert cli.main(["valkey", "status", "--runtime-dir", str(runtime_dir)]) == EXIT_SERVER_DEAD == 4

    captured = capsys.readouterr()
    assert "dead: shard(s) [1]" in captured.err
    assert [line.split()[4] for line in captured.out.splitlines()[2:]] == ["yes", "no"]


@pytest.mark.timeout(30)
def test_engine_budget_defaults_to_just_under_the_running_limit_and_is_logged(
        runtime_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    ensure_servers(2, runtime_dir, maxmemory_bytes=256 * MiB)  # started by hand with another limit
    config = RangeConfig.from_extra_config({"num_shards": 2, "runtime_dir": str(runtime_dir),
                                            "tiers": [{"type": "valkey"}]})

    with caplog.at_level(logging.INFO, logger="vllm.range_connector.backends.factory"):
        urls, budget_bytes = resolve_valkey_tier(config)

    assert urls == embedded_urls(runtime_dir)
    assert budget_bytes == 240 * MiB  # 256 MiB less max(1/16, 16 MiB)
    assert "2 shards x 0.25 GiB maxmemory = 0.5 GiB; Range budget 0.234 GiB per shard" in caplog.text
    password = (runtime_dir / "password").read_text().strip()
    assert password not in caplog.text
    too_big = config.with_tier(capacity_bytes=512 * MiB)
    with pytest.raises(ConfigError, match=r"^tiers\[0\]\.capacity_bytes: .*tiers\[0\]\.embedded_maxmemory_bytes = "
                                          "268435456"):
        resolve_valkey_tier(too_big)


def _calibrate_tier_only(runtime_dir: Path, tmp_path: Path, *, keep: bool) -> None:
    run_calibration(CalibrateOptions(
        output=tmp_path / "cal.json", backends=("valkey",), skip_prefill=True, tokens_per_s=1000.0,
        bytes_per_token=1024.0, num_layers=2, read_bytes=(MiB // 16, 8 * MiB), read_repeats=2, keep_servers=keep,
        extra_config={"runtime_dir": str(runtime_dir), "tiers": [{"type": "valkey", "embedded_maxmemory_bytes":
                                                                   64 * MiB}]}), report=lambda line: None)


@pytest.mark.timeout(60)
def test_calibrate_stops_the_servers_it_started_unless_told_to_keep_them(runtime_dir: Path, tmp_path: Path) -> None:
    _calibrate_tier_only(runtime_dir, tmp_path, keep=False)
    assert server_status(runtime_dir) == [] and (tmp_path / "cal.json").is_file()

    _calibrate_tier_only(runtime_dir, tmp_path, keep=True)
    (kept,) = server_status(runtime_dir)
    assert kept.alive

    _calibrate_tier_only(runtime_dir, tmp_path, keep=False)  # already running: someone else's, left alone
    assert [(s.pid, s.port, s.alive) for s in server_status(runtime_dir)] == [(kept.pid, kept.port, True)]
