"""Bad input fails at start-up with a one-line message that names the value, and loses nothing."""

from __future__ import annotations

import json
import shutil

import pytest

from range_connector.config import RangeConfig
from range_connector.errors import ConfigError
from range_connector.launch import ServerProcess, check_model_dir
from range_connector.tiny_models import build_model


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
