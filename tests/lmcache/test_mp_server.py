"""docs/lmcache.md's MP server command, run: LMCache 0.5.6's multi-process server starts with the Range L2 adapter
connected to both shards of real Valkey servers, and stops on SIGTERM.

The command is read from the documentation (the bash block that runs ``lmcache.v1.multiprocess.server``); the test
replaces only what must be its own: the interpreter (``.venv-lmcache``), the servers and deployment inside
``adapter_params``, the ports (the server's and its Prometheus fallback's, which defaults to 9090) and the L1 size
(4 GiB -> 0.25 GiB). Skipped with the reason without ``.venv-lmcache``. No vLLM engine runs: serving a prompt through
LMCache's MP connector is the end-to-end test of issue 21, not this one.
"""

from __future__ import annotations

import json
import re
import shlex
import signal
import socket
import subprocess
import time
import uuid
from pathlib import Path

import pytest
import valkey

from tests.lmcache.lmcache_env import LMCACHE_PYTHON, REPO, lmcache_env, lmcache_unavailable_reason

DOCS = REPO / "docs" / "lmcache.md"
#: longest wait for the server to say it runs, and then to exit after SIGTERM, seconds (deadlines against a hang)
START_DEADLINE_S = 120.0
STOP_DEADLINE_S = 60.0
RUNNING_LINE = "LMCache cache server is running"


def documented_command() -> list[str]:
    """The MP server command of docs/lmcache.md as an argument list."""
    blocks = re.findall(r"```bash\n(.*?)```", DOCS.read_text(), re.S)
    [block] = [b for b in blocks if "lmcache.v1.multiprocess.server" in b]
    return shlex.split(block.replace("\\\n", " "))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_command(urls: list[str], deployment: str) -> list[str]:
    """:func:`documented_command` with the test's interpreter, servers, deployment, ports and L1 size."""
    argv = documented_command()
    assert argv[:3] == ["python", "-m", "lmcache.v1.multiprocess.server"], argv[:3]
    out = [str(LMCACHE_PYTHON), "-m", "lmcache.v1.multiprocess.server"]
    args = iter(argv[3:])
    for a in args:
        if a in ("--port", "--l1-size-gb", "--l2-adapter"):
            value = next(args)
            if a == "--port":
                value = str(free_port())
            elif a == "--l1-size-gb":
                value = "0.25"
            else:
                spec = json.loads(value)
                assert spec["module_path"] == "range_connector.lmcache.adapter", spec
                spec["adapter_params"].update(servers=urls, deployment=deployment)
                value = json.dumps(spec)
            out += [a, value]
        else:
            out.append(a)
    return out + ["--prometheus-port", str(free_port())]


def num_clients(urls: list[str]) -> list[int]:
    counts = []
    for u in urls:
        c = valkey.Valkey.from_url(u)
        try:
            counts.append(len(c.client_list()) - 1)  # (less this connection)
        finally:
            c.close()
    return counts


@pytest.mark.timeout(START_DEADLINE_S + STOP_DEADLINE_S + 60)
def test_the_documented_mp_server_runs_with_the_range_adapter(valkey_servers, tmp_path: Path) -> None:
    reason = lmcache_unavailable_reason()
    if reason:
        pytest.skip(reason)
    urls = list(valkey_servers.urls)
    before = num_clients(urls)
    log_path = tmp_path / "mp-server.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(server_command(urls, "mp" + uuid.uuid4().hex[:12]), stdout=log,
                                stderr=subprocess.STDOUT, env=lmcache_env(), cwd=str(tmp_path))
    try:
        deadline = time.monotonic() + START_DEADLINE_S
        while RUNNING_LINE not in log_path.read_text() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.5)
        text = log_path.read_text()
        assert proc.poll() is None and RUNNING_LINE in text, f"the server did not start: {text[-4000:]}"
        during = num_clients(urls)
        assert all(d > b for d, b in zip(during, before)), f"clients per shard before {before}, while running {during}"
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=STOP_DEADLINE_S)
        text = log_path.read_text()
        assert "Traceback" not in text, text[-4000:]
        assert rc in (0, -signal.SIGTERM), f"exit status {rc}: {text[-2000:]}"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
