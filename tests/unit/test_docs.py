"""The user and developer docs stay true to the repository and the code (fast: no engine, no server).

Over ``README.md``, ``CONTRIBUTING.md`` and ``docs/*.md``:

* every relative link points to a file in the repository (and a ``#fragment`` to a heading of it), and every
  repository path named in code (``bench/replay.py``, ``worker/loads.py``, ``tests/backends/test_conformance_*.py``)
  exists;
* nothing points outside the repository (no ``../shared``, no ``DESIGN.md``, no absolute ``/work`` path);
* every ``--kv-transfer-config '<json>'`` shown parses as JSON, names ``RangeConnector`` and a vLLM role, and its
  ``kv_connector_extra_config`` goes through the real :meth:`RangeConfig.from_extra_config`; so do the JSON configs
  of ``--extra-config`` and ``--range-extra`` and the reference's ``json`` example;
* every ``range-connector`` command shown exists: a whole command line in a fenced block parses with the real
  parser (:func:`range_connector.cli.build_parser`), and a sub-command named in inline code is one of its choices;
* every ``vllm:range_*`` counter named is one that :mod:`range_connector.metrics` exports;
* the README is at most :data:`README_MAX_LINES` lines, and its CPU quick start is its only ``sh`` block, with the
  placeholders ``$MODEL_DIR`` and ``$PORT`` that ``tests/integration/test_readme_quickstart.py`` fills in.
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from range_connector.cli import build_parser
from range_connector.config import RangeConfig
from range_connector.histograms import GAUGES, HISTOGRAMS
from range_connector.metrics import (PROM_COUNTERS, PROM_GATE, PROM_HOOKS, PROM_REJECTED, PROM_SAVES_SKIPPED,
                                     PROM_TIER_COUNTERS)

pytestmark = pytest.mark.timeout(30)

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = (README, ROOT / "CONTRIBUTING.md", *sorted((ROOT / "docs").glob("*.md")))
README_MAX_LINES = 180
KV_ROLES = ("kv_both", "kv_producer", "kv_consumer")
#: text that points outside the repository (a user's clone has none of it)
FORBIDDEN = ("../shared", "DESIGN.md", "/work/")
#: where a path named in code may be rooted: the repository, or the package (``worker/loads.py``)
PATH_ROOTS = (ROOT, ROOT / "range_connector")


@dataclass(frozen=True)
class Block:
    """One fenced code block: its info string (``sh``, ``bash``, ``""``) and its text."""

    info: str
    text: str


def fenced_blocks(text: str) -> list[Block]:
    """The fenced code blocks of a Markdown text, in order."""
    blocks, info, lines = [], None, []
    for line in text.splitlines():
        if line.startswith("```"):
            if info is None:
                info, lines = line[3:].strip(), []
            else:
                blocks.append(Block(info, "\n".join(lines)))
                info = None
        elif info is not None:
            lines.append(line)
    assert info is None, "an unclosed fenced block"
    return blocks


def prose(text: str) -> str:
    """The text outside fenced blocks."""
    return re.sub(r"^```.*?^```[^\n]*$", "", text, flags=re.S | re.M)


def inline_code(text: str) -> list[str]:
    """Inline code spans outside fenced blocks (a span may wrap onto the next line)."""
    return [re.sub(r"\s+", " ", span) for span in re.findall(r"`([^`]+)`", prose(text))]


def joined_lines(block: str) -> list[str]:
    """Shell lines of a block with backslash continuations joined (quoted newlines stay inside their line)."""
    return block.replace("\\\n", " ").splitlines()


def doc_id(path: Path) -> str:
    return str(path.relative_to(ROOT))


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    return {slug(m) for m in re.findall(r"^#+\s+(.*)$", prose(path.read_text()), flags=re.M)}


# ------------------------------------------------------------------------------------------ links and paths
def links(path: Path) -> Iterator[str]:
    yield from re.findall(r"\[[^\]]*\]\(([^)\s]+)\)", prose(path.read_text()))


@pytest.mark.parametrize("doc", DOCS, ids=doc_id)
def test_relative_links_point_into_the_repository(doc: Path) -> None:
    for target in links(doc):
        if re.match(r"[a-z]+:", target):  # https:, mailto:
            continue
        file_part, _, fragment = target.partition("#")
        dest = (doc.parent / file_part).resolve() if file_part else doc
        assert dest.is_relative_to(ROOT), f"{doc_id(doc)}: link {target} leaves the repository"
        assert dest.exists(), f"{doc_id(doc)}: link {target}: no such file"
        if fragment and dest.suffix == ".md":
            assert fragment in anchors(dest), f"{doc_id(doc)}: link {target}: no heading with that anchor"


def named_paths(text: str) -> set[str]:
    """Repository paths named in code (fenced blocks and inline spans): ``dir/.../name.ext``."""
    code = "\n".join([b.text for b in fenced_blocks(text)] + inline_code(text))
    found = re.findall(r"(?<![\w./~<{$-])((?:[\w-]+/)+[\w*.-]*\.(?:py|md|diff|sh|toml))(?![\w<{])", code)
    return {p for p in found if not p.startswith("path/")}


@pytest.mark.parametrize("doc", DOCS, ids=doc_id)
def test_paths_named_in_code_exist(doc: Path) -> None:
    missing = sorted(p for p in named_paths(doc.read_text())
                     if not any(list(base.glob(p)) for base in (doc.parent, *PATH_ROOTS)))
    assert not missing, f"{doc_id(doc)} names paths that do not exist: {missing}"


@pytest.mark.parametrize("doc", DOCS, ids=doc_id)
def test_nothing_points_outside_the_repository(doc: Path) -> None:
    text = doc.read_text()
    for needle in FORBIDDEN:
        assert needle not in text, f"{doc_id(doc)} mentions {needle!r}, which a clone of the repository lacks"


# ------------------------------------------------------------------------------------------ configs shown
def _json_args(text: str, option: str) -> list[str]:
    code = "\n".join(line for b in fenced_blocks(text) for line in joined_lines(b.text)) + "\n" + \
        "\n".join(inline_code(text))
    return re.findall(re.escape(option) + r"\s+'([^']*)'", code)


def _check_extra(where: str, extra: object) -> None:
    assert isinstance(extra, dict), f"{where}: kv_connector_extra_config is not an object"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the flat shorthand of a dated benchmark command warns, as documented
        RangeConfig.from_extra_config(extra)  # raises ConfigError naming the key


def _check_transfer_config(where: str, config: dict) -> None:
    assert config.get("kv_connector") == "RangeConnector", f"{where}: kv_connector is {config.get('kv_connector')!r}"
    assert config.get("kv_role") in KV_ROLES, f"{where}: kv_role {config.get('kv_role')!r}"
    assert config.get("kv_load_failure_policy") == "recompute", f"{where}: the docs recommend recompute"
    assert "kv_connector_module_path" not in config, f"{where}: the entry point registers the connector"
    _check_extra(where, config.get("kv_connector_extra_config", {}))


def all_transfer_configs() -> list[tuple[str, str]]:
    return [(doc_id(doc), raw) for doc in DOCS for raw in _json_args(doc.read_text(), "--kv-transfer-config")]


def test_the_docs_show_transfer_configs() -> None:
    where = {w for w, _ in all_transfer_configs()}
    assert {"README.md", "docs/disaggregated.md"} <= where, where


@pytest.mark.parametrize(("where", "raw"), [pytest.param(w, raw, id=f"{w}-{i}")
                                            for i, (w, raw) in enumerate(all_transfer_configs())])
def test_every_transfer_config_is_valid(where: str, raw: str) -> None:
    try:
        config = json.loads(raw)
    except json.JSONDecodeError as exc:
        pytest.fail(f"{where}: --kv-transfer-config is not JSON ({exc}): {raw}")
    _check_transfer_config(where, config)


@pytest.mark.parametrize("doc", DOCS, ids=doc_id)
def test_every_extra_config_shown_is_valid(doc: Path) -> None:
    text = doc.read_text()
    for option in ("--extra-config", "--range-extra"):
        for raw in _json_args(text, option):
            _check_extra(f"{doc_id(doc)} {option}", json.loads(raw))
    for block in fenced_blocks(text):
        if block.info == "json" and "kv_connector" in block.text:
            _check_transfer_config(f"{doc_id(doc)} json block", json.loads(block.text))


# ------------------------------------------------------------------------------------------ commands shown
def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def command_lines(text: str) -> list[str]:
    """Whole ``range-connector ...`` command lines of the fenced blocks."""
    return [line.strip() for b in fenced_blocks(text) for line in joined_lines(b.text)
            if line.strip().startswith("range-connector ")]


@pytest.mark.parametrize("doc", DOCS, ids=doc_id)
def test_every_command_line_shown_parses(doc: Path) -> None:
    for line in command_lines(doc.read_text()):
        argv = shlex.split(line, comments=True)[1:]
        args = build_parser().parse_args(argv)  # raises on an unknown command or option, or a missing one
        assert callable(getattr(args, "handler", None)), f"{doc_id(doc)}: {line!r} names no command"


@pytest.mark.parametrize("doc", DOCS, ids=doc_id)
def test_every_subcommand_named_exists(doc: Path) -> None:
    text = doc.read_text()
    code = inline_code(text) + [line for b in fenced_blocks(text) for line in joined_lines(b.text)]
    for span in code:
        for words in re.findall(r"\brange-connector((?: [a-z][\w-]*)+)", span):
            parser: argparse.ArgumentParser = build_parser()
            for word in words.split():
                choices = _subcommands(parser)
                if not choices:
                    break  # a leaf command: what follows is its arguments (or prose)
                assert word in choices, f"{doc_id(doc)}: `range-connector ...{word}` is not a command ({span!r})"
                parser = choices[word]


def test_the_docs_show_the_commands() -> None:
    lines = [line for doc in DOCS for line in command_lines(doc.read_text())]
    assert any(line.startswith("range-connector proxy ") for line in lines)
    assert any(line.startswith("range-connector calibrate ") for line in lines)


# ------------------------------------------------------------------------------------------ metrics named
def test_every_metric_named_exists() -> None:
    exported = {name + "_total" for name, _help in (*PROM_COUNTERS.values(), *PROM_TIER_COUNTERS.values())} | {
        PROM_GATE[0] + "_total", PROM_REJECTED[0] + "_total", PROM_HOOKS[0] + "_total",
        PROM_SAVES_SKIPPED[0] + "_total"} | {
        h.name for h in HISTOGRAMS.values()} | {
        name for name, _help, _unit in GAUGES.values()}
    series = {h.name + suffix for h in HISTOGRAMS.values() for suffix in ("_bucket", "_count", "_sum")}
    for doc in DOCS:
        named = set(re.findall(r"vllm:range_\w+", doc.read_text()))
        assert named <= exported | series, \
            f"{doc_id(doc)} names metrics Range does not export: {sorted(named - exported - series)}"
    readme = set(re.findall(r"vllm:range_\w+", README.read_text()))
    assert readme == exported, f"the README leaves out {sorted(exported - readme)}"


# ------------------------------------------------------------------------------------------ the README itself
def test_readme_is_short() -> None:
    num_lines = len(README.read_text().splitlines())
    assert num_lines <= README_MAX_LINES, f"README.md has {num_lines} lines; move details to docs/"


def test_readme_cpu_quick_start_is_the_only_sh_block() -> None:
    [quick_start] = [b for b in fenced_blocks(README.read_text()) if b.info == "sh"]
    assert "$MODEL_DIR" in quick_start.text and "$PORT" in quick_start.text
    assert "vllm.entrypoints.openai.api_server" in quick_start.text
    assert len(_json_args(f"```sh\n{quick_start.text}\n```", "--kv-transfer-config")) == 1
