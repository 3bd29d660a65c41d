"""Bad input fails at start-up with a one-line message that names the value, and loses nothing."""

from __future__ import annotations

import json
import shutil

import pytest

from range_connector.config import RangeConfig
from range_connector.errors import ConfigError
from range_connector.testing.server_process import ServerProcess, check_model_dir
from range_connector.testing.tiny_models import build_model


@pytest.mark.timeout(120)
def test_model_directory_without_a_tokenizer_is_refused_in_one_line(tmp_path) -> None:
    model = build_model("gqa", "tiny", cache_dir=tmp_path / "models")
    broken = tmp_path / "no-tokenizer"
    shutil.copytree(model, broken)
    for f in broken.iterdir():
        if f.name.startswith(("tokenizer", "vocab", "merges", "special_tokens", "chat_template")):
            f.unlink()
    with pytest.raises(ConfigError) as err:
        ServerProcess(broken, work_dir=tmp_path / "work")
    assert str(err.value).startswith("model: ") and str(broken) in str(err.value) and "\n" not in str(err.value)
    check_model_dir(str(model))  # the intact directory passes
    assert (model / "config.json").exists(), "the check changes nothing on disk"


@pytest.mark.timeout(10)
def test_missing_model_directory_is_refused(tmp_path) -> None:
    with pytest.raises(ConfigError, match="no such directory"):
        check_model_dir(str(tmp_path / "nowhere"))


@pytest.mark.timeout(10)
@pytest.mark.parametrize(("extra", "key"), [
    ({"chunk_tokens": 100}, "chunk_tokens"),
    ({"chunk_tokens": -256}, "chunk_tokens"),
    ({"memory_capacity_bytes": -1}, "memory_capacity_bytes"),
    ({"valkey_urls": ["valkey://127.0.0.1:notaport"]}, "valkey_urls"),
])
def test_bad_sizes_and_urls_name_the_key(extra: dict, key: str) -> None:
    with pytest.raises(ConfigError) as err:
        RangeConfig.from_extra_config(extra).resolve(128)
    assert str(err.value).startswith(f"{key}: ") and "\n" not in str(err.value), json.dumps(extra)


@pytest.mark.timeout(10)
def test_a_bandwidth_that_is_not_a_number_is_named_in_bytes_per_second() -> None:
    with pytest.raises(ConfigError, match=r"^tier_bandwidth_bytes_per_s: 'fast' is not a number of bytes per second$"):
        RangeConfig.from_extra_config({"tier_bandwidth_bytes_per_s": "fast"})


@pytest.mark.timeout(30)
@pytest.mark.parametrize(("extra", "key"), [
    ({"backend": "file", "file_dir": "<file>/x"}, "file_dir"),  # a path under a regular file
    ({"backend": "file", "runtime_dir": "<file>/x"}, "runtime_dir"),  # the file tier's default directory
    ({"runtime_dir": "<file>/x"}, "runtime_dir"),  # embedded Valkey servers
])
def test_a_directory_that_cannot_be_created_fails_at_start_up_naming_the_key(tmp_path, extra: dict, key: str) -> None:
    from range_connector.backends.factory import open_shard_backends

    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    extra = {k: v.replace("<file>", str(blocker)) for k, v in extra.items()}
    with pytest.raises(ConfigError) as err:
        open_shard_backends(RangeConfig.from_extra_config(extra).resolve(128))
    assert str(err.value).startswith(f"{key}: ") and "\n" not in str(err.value)
    assert blocker.read_text() == "not a directory"


@pytest.mark.timeout(30)
def test_something_other_than_valkey_at_a_valkey_url_fails_at_start_up_naming_the_key() -> None:
    import socket
    import threading

    from range_connector.backends.factory import open_shard_backends

    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]

    def answer_http() -> None:
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            with conn:
                conn.recv(1024)
                conn.sendall(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n")

    threading.Thread(target=answer_http, daemon=True).start()
    try:
        with pytest.raises(ConfigError) as err:
            open_shard_backends(RangeConfig.from_extra_config({"valkey_urls": [f"valkey://127.0.0.1:{port}"],
                                                               "backend_timeout_s": 5.0}).resolve(128))
        assert str(err.value).startswith("valkey_urls: ") and "not a Valkey server" in str(err.value)
    finally:
        server.close()
