"""Every ``range-connector`` sub-command checks all its arguments before it starts an engine or a server, measures
or writes anything: a bad one exits 2 with one line on stderr naming the option, and leaves no trace.

Each case is set up so that work started before the check would show: the prefill sweep of ``calibrate`` points at
a closed port (a sweep that ran first would end in a connection error, not in the option's name), runtime dirs and
output files that work would create are checked to be absent, and a ``--prompt-tokens`` case would otherwise start
an engine that vLLM then refuses. :func:`test_every_sub_command_has_a_bad_argument_case` keeps the table complete
as sub-commands are added.
"""

from __future__ import annotations

import argparse
import json
import socket
from pathlib import Path

import pytest

from range_connector.cli import build_parser, main
from range_connector.testing.tiny_models import build_model

pytestmark = pytest.mark.timeout(60)


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


#: ``(argv, the start of the error line after "error: ")``; ``{tmp}``, ``{blocker}`` (a regular file), ``{closed}``
#: (a port nothing listens on), ``{config}`` (a good doctor/cache config), ``{prompt}`` (a prompt file) and
#: ``{gqa}`` (the tiny model) are filled in
CASES: list[tuple[list[str], str]] = [
    # calibrate
    (["calibrate", "--url", "http://127.0.0.1:{closed}", "--vocab-size", "100", "--backends", "redis"],
     "--backends: 'redis' is not one of"),
    (["calibrate", "--url", "http://127.0.0.1:{closed}", "--vocab-size", "100", "--backends", "memory,memory",
      "--num-layers", "2"], "--backends: memory named more than once"),
    (["calibrate", "--url", "http://127.0.0.1:{closed}", "--vocab-size", "100", "--backends", "memory",
      "--num-layers", "2", "--output", "{blocker}/cal.json"], "--output: cannot create"),
    (["calibrate", "--url", "http://127.0.0.1:{closed}", "--vocab-size", "100", "--backends", "", "--output",
      "{tmp}"], "--output: "),
    (["calibrate", "--url", "ftp://127.0.0.1:{closed}", "--vocab-size", "100", "--backends", ""], "--url: "),
    (["calibrate", "--url", "http://127.0.0.1:99999", "--vocab-size", "100", "--backends", ""], "--url: "),
    (["calibrate", "--url", "127.0.0.1:{closed}", "--vocab-size", "100", "--backends", ""], "--url: "),
    (["calibrate", "--url", "http://127.0.0.1:{closed}", "--vocab-size", "100", "--backends", "",
      "--tokens-per-s", "5000"], "--tokens-per-s: "),
    (["calibrate", "--url", "http://127.0.0.1:{closed}", "--vocab-size", "100", "--backends", "",
      "--engine-t0-s", "-1"], "--engine-t0-s: "),
    (["calibrate", "--model", "{gqa}", "--backends", "", "--prompt-tokens", "8192"],
     "--prompt-tokens: 8192 tokens (+16) exceed the model's context of 4096 tokens"),
    (["calibrate", "--model", "{tmp}", "--backends", ""], "--model: "),
    (["calibrate", "--url", "http://127.0.0.1:{closed}", "--vocab-size", "100", "--prompt-tokens", "0"],
     "range-connector calibrate: argument --prompt-tokens: "),
    # valkey
    (["valkey", "start", "--shards", "1", "--runtime-dir", "{blocker}/rt"], "--runtime-dir: cannot create"),
    (["valkey", "start", "--shards", "1", "--runtime-dir", "{tmp}/rt", "--maxmemory-bytes", "1000"],
     "--maxmemory-bytes: 1000 is below the minimum"),
    (["valkey", "start", "--shards", "1", "--runtime-dir", "{tmp}/rt", "--start-timeout-s", "0"],
     "range-connector valkey start: argument --start-timeout-s: "),
    (["valkey", "status", "--runtime-dir", "{blocker}"], "--runtime-dir: "),
    (["valkey", "stop", "--data-dir", "{blocker}"], "--data-dir: "),
    # patch
    (["patch", "check", "--vllm-dir", "{tmp}/nowhere"], "--vllm-dir: "),
    (["patch", "apply", "--vllm-dir", "{tmp}/nowhere"], "--vllm-dir: "),
    (["patch", "revert", "--vllm-dir", "{tmp}/nowhere"], "--vllm-dir: "),
    # proxy
    (["proxy", "--prefill", "http://127.0.0.1:{closed}", "--decode", "http://127.0.0.1:{closed}", "--port",
      "70000"], "--port: 70000"),
    (["proxy", "--prefill", "http://127.0.0.1:{closed}", "--decode", "gopher://127.0.0.1:{closed}"], "--decode: "),
    # cache
    (["cache", "stats", "--config", "{config}", "--tier", "9"], "--tier: "),
    (["cache", "clear", "--config", "{config}", "--deployment", "a/b", "--yes"], "--deployment: "),
    (["cache", "lookup", "--config", "{config}", "--model", "{tmp}", "--prompt-file", "{prompt}"],
     "--model: "),
    # report
    (["report", "{tmp}/missing.json", "-o", "{tmp}/page.html"], "{tmp}/missing.json: cannot read it"),
    (["report", "{config}", "-o", "{blocker}/page.html"], "--output: "),
    (["report", "{config}", "-o", "{tmp}"], "--output: "),
    # doctor
    (["doctor", "--config", "{tmp}/missing.json"], "--config: "),
    (["doctor", "--config", "{config}", "--vllm-dir", "{tmp}/nowhere"], "--vllm-dir: "),
]


@pytest.fixture
def places(tmp_path: Path) -> dict[str, str]:
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    config = tmp_path / "range.json"
    config.write_text(json.dumps({"tiers": [{"type": "memory"}], "runtime_dir": str(tmp_path / "rt")}))
    prompt = tmp_path / "prompt.txt"
    prompt.write_text("a prompt")
    return {"tmp": str(tmp_path), "blocker": str(blocker), "closed": str(_closed_port()), "config": str(config),
            "prompt": str(prompt), "gqa": str(build_model("gqa", "tiny"))}


def _before(tmp_path: Path) -> set[str]:
    return {str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*")}


@pytest.mark.parametrize(("argv", "named"), CASES, ids=[" ".join(a[:2]) + f" [{i}]" for i, (a, _) in
                                                        enumerate(CASES)])
def test_a_bad_argument_is_one_line_naming_it_before_any_work(argv: list[str], named: str, places: dict[str, str],
                                                              tmp_path: Path, capsys) -> None:
    before = _before(tmp_path)
    rc = main([a.format(**places) for a in argv])
    out, err = capsys.readouterr()
    assert rc == 2, out + err
    assert err.startswith(f"error: {named.format(**places)}") and err.count("\n") == 1, err
    assert out == ""
    assert _before(tmp_path) == before  # (nothing created: no runtime dir, output, model copy or probe file)


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("option", "value"), [("--kv-cache-dtype", "fp9"), ("--dtype", "float7")])
def test_cache_lookup_names_a_dtype_vllm_does_not_know(option: str, value: str, places: dict[str, str],
                                                       capsys) -> None:
    """Checked against vLLM's own literals before the config is resolved (imports vLLM; no engine)."""
    rc = main(["cache", "lookup", "--config", places["config"], "--model", places["gqa"], "--prompt-file",
               places["prompt"], option, value])
    _, err = capsys.readouterr()
    mine = [line for line in err.splitlines() if line.startswith("error: ")]  # (vLLM logs to stderr too)
    assert rc == 2 and len(mine) == 1, err
    assert mine[0].startswith(f"error: {option}: {value!r} is not one of vLLM's: ") and "'auto'" not in mine[0]
    assert "auto, " in mine[0]


def _leaf_commands(parser: argparse.ArgumentParser, prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    actions = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not actions:
        return [prefix]
    return [leaf for name, sub in actions[0].choices.items() for leaf in _leaf_commands(sub, (*prefix, name))]


def test_every_sub_command_has_a_bad_argument_case() -> None:
    leaves = set(_leaf_commands(build_parser()))
    missing = {leaf for leaf in leaves if not any(tuple(argv[:len(leaf)]) == leaf for argv, _ in CASES)}
    assert not missing, f"sub-commands without a bad-argument case here: {sorted(missing)}"
