"""Valkey servers behind shaped links: each server in its own network namespace, reached over a veth pair whose two
egress directions are limited by a token bucket (``tc qdisc ... tbf``).

One :class:`ShapedServer` per shard, for ``bench/partition_shaped.py``:

* a network namespace ``rc-shaped-<pid>-<i>`` and a veth pair ``rc<pid>h<i>`` (host side) / ``rc<pid>n<i>``
  (namespace side; at most 11 characters, under IFNAMSIZ 15), addresses on a private /30
  (``10.231.<x>.1`` host, ``.2`` server, ``x = (pid % 32) * 8 + i``), loopback up inside;
* ``tbf rate <R>mbit burst <B>kb latency <L>ms`` on the namespace side (the server's replies: reads) and on the host
  side (the client's requests: writes);
* ``valkey-server`` (the binary :func:`~range_connector.backends.valkey.servers.valkey_server_binary` finds, started
  the way :mod:`~range_connector.backends.valkey.processes` starts it: the runtime dir's ``server.conf`` with the
  password first, persistence off, ``maxmemory`` with ``noeviction``) under ``ip netns exec``, bound to the
  namespace's address only. It is this process's child (not detached): :meth:`ShapedServer.close` stops it.

:func:`clean_stale` removes what a run that died left behind (namespaces and veths of pids no longer alive, and the
servers still inside them); :func:`probe_netns` says why shaped links cannot be made here (not root, no
CAP_NET_ADMIN, no ``ip``/``tc``). Everything runs ``ip`` and ``tc`` (iproute2) as subprocesses.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import valkey

from range_connector.backends.valkey.records import prepare_runtime_dir, runtime_password, write_server_config
from range_connector.backends.valkey.servers import valkey_server_binary

NS_PREFIX = "rc-shaped-"
SERVER_PORT = 6379
_STALE_NS = re.compile(r"^rc-shaped-(\d+)-(\d+)$")
_STALE_LINK = re.compile(r"^rc(\d+)[hn](\d+)$")
_CMD_TIMEOUT_S = 20.0


def run_cmd(*argv: str) -> str:
    """Run one iproute2 command; its stdout. Raises ``RuntimeError`` naming the command and its stderr."""
    try:
        proc = subprocess.run(list(argv), capture_output=True, text=True, timeout=_CMD_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise RuntimeError(f"{' '.join(argv)}: {exc}") from exc
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)}: exit {proc.returncode}: {proc.stderr.strip()[-500:]}")
    return proc.stdout


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def probe_netns() -> str | None:
    """Why namespaces, veths and tbf cannot be set up here (``None``: they can).

    Tries the real thing once: a namespace, a veth pair and a tbf qdisc, removed again.
    """
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"`{tool}` (iproute2) is not installed"
    if os.geteuid() != 0:
        return f"not root (euid {os.geteuid()}): ip netns and tc need CAP_NET_ADMIN"
    ns, host, peer = f"{NS_PREFIX}{os.getpid()}-99", f"rc{os.getpid()}h99", f"rc{os.getpid()}n99"
    try:
        run_cmd("ip", "netns", "add", ns)
        run_cmd("ip", "link", "add", host, "type", "veth", "peer", "name", peer)
        run_cmd("ip", "link", "set", peer, "netns", ns)
        run_cmd("tc", "qdisc", "add", "dev", host, "root", "tbf", "rate", "100mbit", "burst", "32kb",
                "latency", "50ms")
    except RuntimeError as exc:
        return f"cannot set up a shaped link (needs CAP_NET_ADMIN and CAP_SYS_ADMIN): {exc}"
    finally:
        with contextlib.suppress(RuntimeError):
            run_cmd("ip", "link", "del", host)
        with contextlib.suppress(RuntimeError):
            run_cmd("ip", "netns", "del", ns)
    return None


def clean_stale() -> list[str]:
    """Remove namespaces ``rc-shaped-<pid>-*`` and veths ``rc<pid>[hn]*`` whose pid is no longer alive, stopping
    the processes still inside those namespaces (servers of a run that died); what was removed."""
    removed: list[str] = []
    with contextlib.suppress(RuntimeError):
        for line in run_cmd("ip", "netns", "list").splitlines():
            name = line.split()[0] if line.split() else ""
            m = _STALE_NS.match(name)
            if not m or _pid_alive(int(m.group(1))):
                continue
            with contextlib.suppress(RuntimeError, ValueError):
                for pid in run_cmd("ip", "netns", "pids", name).split():
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(int(pid), signal.SIGKILL)
            with contextlib.suppress(RuntimeError):
                run_cmd("ip", "netns", "del", name)
                removed.append(name)
    with contextlib.suppress(RuntimeError):
        for line in run_cmd("ip", "-o", "link", "show").splitlines():
            parts = line.split(":")
            name = parts[1].strip().split("@")[0] if len(parts) > 1 else ""
            m = _STALE_LINK.match(name)
            if m and not _pid_alive(int(m.group(1))):
                with contextlib.suppress(RuntimeError):
                    run_cmd("ip", "link", "del", name)
                    removed.append(name)
    return removed


@dataclass
class ShapedServer:
    """One Valkey server in its own namespace behind a shaped veth pair.

    Attributes:
        idx: server index (0-based; one per shard).
        rate_mbit: tbf rate of each direction, megabits per second (10^6 bit/s).
        burst_kib: tbf bucket size, KiB.
        latency_ms: tbf queue limit, expressed as the longest wait in the queue, milliseconds.
        maxmemory_bytes: the server's memory limit, bytes.
        runtime_dir: directory for the password, ``server.conf``, the server's log and working dir.
    """

    idx: int
    rate_mbit: float
    burst_kib: int
    latency_ms: float
    maxmemory_bytes: int
    runtime_dir: Path
    ns: str = field(init=False)
    host_dev: str = field(init=False)
    ns_dev: str = field(init=False)
    host_addr: str = field(init=False)
    server_addr: str = field(init=False)
    url: str = field(init=False, default="")
    process: subprocess.Popen[bytes] | None = field(init=False, default=None)
    created: list[str] = field(init=False, default_factory=list)

    def __post_init__(self) -> None:
        pid = os.getpid()
        self.ns, self.host_dev, self.ns_dev = f"{NS_PREFIX}{pid}-{self.idx}", f"rc{pid}h{self.idx}", f"rc{pid}n{self.idx}"
        subnet = (pid % 32) * 8 + self.idx
        self.host_addr, self.server_addr = f"10.231.{subnet}.1", f"10.231.{subnet}.2"

    def tbf_args(self) -> list[str]:
        return ["tbf", "rate", f"{self.rate_mbit:g}mbit", "burst", f"{self.burst_kib}kb",
                "latency", f"{self.latency_ms:g}ms"]

    def start(self, start_timeout_s: float = 10.0) -> str:
        """Create the namespace, the veth pair and both shapers, start the server; its URL (with the password).

        Raises:
            RuntimeError: an ``ip``/``tc`` command failed, the /30 is already in use, or the server did not answer
                within ``start_timeout_s`` (the message names the log file).
        """
        if run_cmd("ip", "-4", "-o", "addr", "show", "to", f"{self.host_addr}/30").strip():
            raise RuntimeError(f"{self.host_addr}/30 is already in use on this host")
        run_cmd("ip", "netns", "add", self.ns)
        self.created.append("ns")
        run_cmd("ip", "link", "add", self.host_dev, "type", "veth", "peer", "name", self.ns_dev)
        self.created.append("veth")
        run_cmd("ip", "link", "set", self.ns_dev, "netns", self.ns)
        run_cmd("ip", "addr", "add", f"{self.host_addr}/30", "dev", self.host_dev)
        run_cmd("ip", "link", "set", self.host_dev, "up")
        run_cmd("ip", "-n", self.ns, "addr", "add", f"{self.server_addr}/30", "dev", self.ns_dev)
        run_cmd("ip", "-n", self.ns, "link", "set", self.ns_dev, "up")
        run_cmd("ip", "-n", self.ns, "link", "set", "lo", "up")
        run_cmd("tc", "qdisc", "add", "dev", self.host_dev, "root", *self.tbf_args())  # client -> server
        run_cmd("ip", "netns", "exec", self.ns, "tc", "qdisc", "add", "dev", self.ns_dev, "root",
                *self.tbf_args())  # server -> client
        prepare_runtime_dir(self.runtime_dir)
        password = runtime_password(self.runtime_dir)
        config_file = write_server_config(self.runtime_dir, password)
        data_dir = self.runtime_dir / f"shard-{self.idx}-data"
        data_dir.mkdir(mode=0o700, exist_ok=True)
        log_path = self.runtime_dir / f"shard-{self.idx}.log"
        command = ["ip", "netns", "exec", self.ns, str(valkey_server_binary()), str(config_file),  # conf first
                   "--port", str(SERVER_PORT), "--bind", self.server_addr, "--protected-mode", "yes",
                   "--save", "", "--appendonly", "no", "--maxmemory", str(self.maxmemory_bytes),
                   "--maxmemory-policy", "noeviction", "--daemonize", "no", "--logfile", "", "--dir", str(data_dir)]
        with open(log_path, "ab") as log_file:
            self.process = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=log_file,
                                            stderr=subprocess.STDOUT, cwd=str(data_dir), close_fds=True)
        deadline = time.monotonic() + start_timeout_s
        client = valkey.Valkey(host=self.server_addr, port=SERVER_PORT, password=password, socket_timeout=1.0,
                               socket_connect_timeout=1.0)
        try:
            while True:
                if self.process.poll() is not None:
                    raise RuntimeError(f"valkey-server in {self.ns} exited with {self.process.returncode}; "
                                       f"see {log_path}")
                with contextlib.suppress(valkey.exceptions.ConnectionError, valkey.exceptions.TimeoutError):
                    if client.ping():
                        break
                if time.monotonic() > deadline:
                    raise RuntimeError(f"valkey-server in {self.ns} did not answer within {start_timeout_s:g} s; "
                                       f"see {log_path}")
                time.sleep(0.05)
        finally:
            client.close()
        self.url = f"valkey://:{password}@{self.server_addr}:{SERVER_PORT}"
        return self.url

    def qdisc_sent_bytes(self) -> dict[str, int]:
        """Bytes each shaper has sent so far (``tc -s qdisc``; headers included): ``reads`` (namespace side, the
        server's replies) and ``writes`` (host side, the client's requests)."""
        def sent(*prefix: str) -> int:
            m = re.search(r"qdisc tbf .*?Sent (\d+) bytes", run_cmd(*prefix), re.S)
            return int(m.group(1)) if m else -1

        return {"reads": sent("ip", "netns", "exec", self.ns, "tc", "-s", "qdisc", "show", "dev", self.ns_dev),
                "writes": sent("tc", "-s", "qdisc", "show", "dev", self.host_dev)}

    def close(self) -> None:
        """Stop the server (SIGTERM, then SIGKILL after 5 s), delete the veth pair and the namespace; never
        raises."""
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(5.0)
            except subprocess.TimeoutExpired:
                self.process.kill()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self.process.wait(5.0)
        if "veth" in self.created:
            with contextlib.suppress(RuntimeError):
                run_cmd("ip", "link", "del", self.host_dev)  # takes its peer with it
        if "ns" in self.created:
            with contextlib.suppress(RuntimeError):
                run_cmd("ip", "netns", "del", self.ns)
        self.created.clear()
