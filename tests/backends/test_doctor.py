"""``range-connector doctor`` against real tiers: Valkey servers from the fixtures of ``tests/conftest.py`` (the
session's, a dedicated one that may be reconfigured, the password-protected one of ``tests/backends/conftest.py``),
real files, and a full tmpfs where one can be mounted.

Each failure the doctor must name is a test of its own: the exit status is 1 and stderr has one line naming the
check and the cause. Latency and bandwidth are reported, never compared with a threshold.
"""

from __future__ import annotations

import json
import socket
import uuid
from pathlib import Path

import pytest
import valkey

from range_connector.backends.base import StripeWrite, deployment_key_prefix
from range_connector.backends.valkey.client import ValkeyBackend
from range_connector.cli import main
from range_connector.kv.namespace import ChunkHash
from range_connector.kv.tickets import Ticket, head_keys
from range_connector.ops.doctor import model_view_from_config_json
from range_connector.testing.tiny_models import build_model
from tests.filesystems import fill_up

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def gqa_model() -> str:
    return str(build_model("gqa", "tiny"))


def _deployment() -> str:
    return f"doctortest-{uuid.uuid4().hex[:12]}"


def _write_config(tmp_path: Path, extra: dict) -> Path:
    path = tmp_path / "extra-config.json"
    path.write_text(json.dumps(extra))
    return path


def _doctor(capsys: pytest.CaptureFixture[str], config: Path, *args: str) -> tuple[int, str, str]:
    """Run the command; ``err`` is its own message (vLLM's log lines, also on stderr, are left out), at most one
    line."""
    rc = main(["doctor", "--config", str(config), "--probe-mib", "1", *args])
    out, err = capsys.readouterr()
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(errors) <= 1, err
    return rc, out, "".join(f"{line}\n" for line in errors)


def _rows(out: str) -> dict[str, tuple[str, str]]:
    """``{check: (status, detail)}`` of the printed table (columns are separated by two or more spaces)."""
    import re

    rows = {}
    for line in out.splitlines()[1:]:
        name, status, detail = re.split(r"\s{2,}", line, maxsplit=2)
        rows[name] = (status, detail)
    return rows


def _seed_one_chunk(url: str, deployment: str, model: str) -> None:
    """Store one chunk of ``model``'s layout (one shard, default chunk of 256 tokens) under ``deployment``, as an
    engine's save would: one stripe, its tickets under every head's key."""
    view = model_view_from_config_json(model)
    num_blocks = 256 // view.block_size
    heads = view.num_kv_heads
    row_bytes = view.head_block_bytes * heads // 2  # (two planes)
    ticket = Ticket("seedstripe", 0, num_blocks, num_blocks, view.num_layers, 2, row_bytes, (0,) * view.num_layers,
                    head_start=0, num_heads=heads)
    keys = head_keys(ChunkHash(bytes(16)), 0, range(heads))
    backend = ValkeyBackend(url, deployment=deployment)
    try:
        values = [bytes(ticket.layer_bytes)] * view.num_layers
        assert backend.write_stripe(StripeWrite("seedstripe", values, [(k, ticket.encode()) for k in keys]))
    finally:
        backend.close()


def _clear(url: str, deployment: str) -> None:
    backend = ValkeyBackend(url, deployment=deployment)
    try:
        backend.clear()
    finally:
        backend.close()


def _probe_keys(url: str) -> list[bytes]:
    client = valkey.Valkey.from_url(url, socket_timeout=5.0)
    try:
        return list(client.scan_iter(match="rc3:doctor-*"))
    finally:
        client.close()


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_good_config_exits_0_and_the_probes_leave_nothing_behind(valkey_servers, gqa_model: str, tmp_path: Path,
                                                                   capsys) -> None:
    url, deployment = valkey_servers.urls[0], _deployment()
    files = tmp_path / "files"
    extra = {"deployment": deployment, "tiers": [
        {"type": "memory"}, {"type": "valkey", "servers": [url], "capacity_bytes": 64 << 20},
        {"type": "file", "directory": str(files)}]}
    _seed_one_chunk(url, deployment, gqa_model)
    try:
        rc, out, err = _doctor(capsys, _write_config(tmp_path, extra), "--model", gqa_model)
        rows = _rows(out)
        assert rc == 0 and err == "", out + err
        assert {"vllm", "engine patch", "config", "model", "tiers[0] memory", "tiers[1] shard 0",
                "tiers[1] shard 0 limits", "tiers[2] file", f"stored data ({deployment})", "cost gate"} <= set(rows)
        assert all(status in ("ok", "warn") for status, _ in rows.values())
        assert rows[f"stored data ({deployment})"] == ("ok", "tiers[1] valkey: 2 ticket keys, 2 fit this model's "
                                                             "KV layout; tiers[2] file: 0 ticket keys, 0 fit this "
                                                             "model's KV layout")
        assert "latency" in rows["tiers[1] shard 0"][1] and "GB/s" in rows["tiers[1] shard 0"][1]
        assert "O_DIRECT" in rows["tiers[2] file"][1]
        # what the GPUDirect start-up probe would find (here: no kvikio or no CUDA device, so POSIX)
        assert "GPUDirect reads: off (" in rows["tiers[2] file"][1]

        rc, out, _ = _doctor(capsys, _write_config(tmp_path, extra), "--model", gqa_model, "--json")
        report = json.loads(out)
        assert rc == 0 and report["usable"] is True
        probe = next(c for c in report["checks"] if c["name"] == "tiers[1] shard 0")
        assert probe["data"]["read_bytes_per_s"] > 0 and probe["data"]["latency_s"] >= 0
    finally:
        _clear(url, deployment)
    assert _probe_keys(url) == []
    assert not files.exists()  # (the probe made the directory, and removed it again)


def test_an_unreachable_shard_is_named(valkey_servers, tmp_path: Path, capsys) -> None:
    dead = f"valkey://127.0.0.1:{_closed_port()}"
    extra = {"num_shards": 2, "tiers": [{"type": "valkey", "servers": [valkey_servers.urls[0], dead]}]}
    rc, out, err = _doctor(capsys, _write_config(tmp_path, extra))
    assert rc == 1, err
    assert err.startswith(f"error: tiers[0] shard 1: tiers[0].servers: {dead}: Valkey server does not answer"), err
    assert _rows(out)["tiers[0] shard 0"][0] == "ok"


def test_a_wrong_password_is_named(auth_valkey_url: str, tmp_path: Path, capsys, monkeypatch) -> None:
    host_port = auth_valkey_url.rsplit("@", 1)[1]
    monkeypatch.setenv("DOCTOR_TEST_PASSWORD", "not-the-password")
    extra = {"tiers": [{"type": "valkey", "servers": [f"valkey://{host_port}"],
                        "security": {"password_env": "DOCTOR_TEST_PASSWORD"}}]}
    rc, _, err = _doctor(capsys, _write_config(tmp_path, extra))
    assert rc == 1, err
    assert err.startswith(f"error: tiers[0] shard 0: tiers[0].servers: valkey://{host_port}: the server refused the "
                          "credentials"), err
    assert "not-the-password" not in err

    monkeypatch.setenv("DOCTOR_TEST_PASSWORD", auth_valkey_url.split(":")[2].split("@")[0])  # the right one
    rc, out, err = _doctor(capsys, _write_config(tmp_path, extra))
    assert _rows(out)["tiers[0] shard 0"][0] == "ok", out + err


def test_a_bulk_limit_below_one_block_row_is_named(dedicated_valkey, tmp_path: Path, capsys) -> None:
    """Valkey's smallest ``proto-max-bulk-len`` is 1 MiB: a model whose block row is 2 MiB (32 KV heads of 128,
    block 128, bf16, K and V) cannot store a single block in a value."""
    url = dedicated_valkey.urls[0]
    admin = valkey.Valkey.from_url(url, socket_timeout=5.0)
    try:
        admin.config_set("proto-max-bulk-len", 1 << 20)
    finally:
        admin.close()
    model = tmp_path / "wide-model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "num_hidden_layers": 2, "hidden_size": 4096,
        "num_attention_heads": 32, "num_key_value_heads": 32, "head_dim": 128, "torch_dtype": "bfloat16"}))
    extra = {"tiers": [{"type": "valkey", "servers": [url]}]}
    rc, _, err = _doctor(capsys, _write_config(tmp_path, extra), "--model", str(model), "--block-size", "128")
    assert rc == 1, err
    assert err.startswith(f"error: tiers[0] shard 0 limits: {url}: proto-max-bulk-len 1048576 bytes is below one "
                          "block row (2097152 bytes + 1024 of the command): no stripe fits; raise it to at least "
                          "2098176"), err


def test_a_namespace_without_stored_data_is_named(valkey_servers, gqa_model: str, tmp_path: Path, capsys) -> None:
    url, deployment = valkey_servers.urls[0], _deployment()
    extra = {"deployment": deployment, "tiers": [{"type": "valkey", "servers": [url], "capacity_bytes": 64 << 20}]}
    rc, _, err = _doctor(capsys, _write_config(tmp_path, extra), "--model", gqa_model)
    assert rc == 1, err
    assert err.startswith(f"error: stored data ({deployment}): no stored data for this model under deployment "
                          f"'{deployment}': tiers[0] valkey: 0 ticket keys"), err


def test_data_of_another_model_does_not_count(valkey_servers, gqa_model: str, tmp_path: Path, capsys) -> None:
    url, deployment = valkey_servers.urls[0], _deployment()
    _seed_one_chunk(url, deployment, gqa_model)
    try:
        extra = {"deployment": deployment, "tiers": [{"type": "valkey", "servers": [url],
                                                      "capacity_bytes": 64 << 20}]}
        rc, _, err = _doctor(capsys, _write_config(tmp_path, extra), "--model", str(build_model("mla", "tiny")))
        assert rc == 1 and "tiers[0] valkey: 2 ticket keys, 0 fit this model's KV layout" in err, err
    finally:
        _clear(url, deployment)


def test_a_file_tier_on_a_full_tmpfs_is_named(small_tmpfs: Path, tmp_path: Path, capsys) -> None:
    fill_up(small_tmpfs / "filler")
    extra = {"tiers": [{"type": "file", "directory": str(small_tmpfs / "files")}]}
    rc, _, err = _doctor(capsys, _write_config(tmp_path, extra))
    assert rc == 1, err
    assert err.startswith(f"error: tiers[0] file: tiers[0].directory: the file system under {small_tmpfs} is full "
                          "("), err


def test_config_get_refused_by_the_acl_is_a_warning(dedicated_valkey, tmp_path: Path, capsys, monkeypatch) -> None:
    url = dedicated_valkey.urls[0]
    admin = valkey.Valkey.from_url(url, socket_timeout=5.0)
    try:
        admin.execute_command("ACL", "SETUSER", "doctor", "on", ">doctor-pw", "~*", "+@all", "-config")
    finally:
        admin.close()
    monkeypatch.setenv("DOCTOR_TEST_PASSWORD", "doctor-pw")
    extra = {"tiers": [{"type": "valkey", "servers": [url], "capacity_bytes": 64 << 20,
                        "security": {"username": "doctor", "password_env": "DOCTOR_TEST_PASSWORD"}}]}
    rc, out, err = _doctor(capsys, _write_config(tmp_path, extra))
    rows = _rows(out)
    assert rows["tiers[0] shard 0"][0] == "ok", out + err
    assert rows["tiers[0] shard 0 limits"][0] == "warn"
    assert rows["tiers[0] shard 0 limits"][1].startswith(f"{url}: CONFIG GET refused (ACL or a managed server)")
    assert rc == 0, out + err  # (no model: the stored-data row only warns)
    assert _probe_keys(url) == []


def test_the_deployment_prefix_of_the_probe_is_its_own() -> None:
    """The probe's keys are under ``rc3:doctor-<random>:``: never the config's deployment."""
    from range_connector.ops.doctor_tiers import _probe_deployment

    a, b = _probe_deployment(), _probe_deployment()
    assert a != b and deployment_key_prefix(a).startswith("rc3:doctor-")
