"""The package's imports follow the dependency table in ``docs/architecture.md``.

Every ``import`` of every module under ``range_connector/`` is read from its syntax tree (module level, inside
functions, under ``TYPE_CHECKING``: all of them), mapped to the package it lands in, and checked against the table:
an arrow the table does not list fails, a vLLM import outside the packages the table marks fails, and so does any
circle between modules. The checker itself is tested on a small tree that breaks each rule once, so a checker that
finds nothing cannot pass.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = "range_connector"
TABLE_DOC = ROOT / "docs" / "architecture.md"


@dataclass(frozen=True)
class Rules:
    """``allowed[p]``: the packages ``p`` may import; ``vllm``: the packages that may import vLLM."""

    allowed: dict[str, frozenset[str]]
    vllm: frozenset[str]


def parse_table(text: str) -> Rules:
    """Rows ``| `pkg` | `a`, `b` (or —) | yes/no | ... |`` under the heading "Allowed dependencies"."""
    section = text.split("## Allowed dependencies", 1)[1].split("\n## ", 1)[0]
    allowed: dict[str, frozenset[str]] = {}
    vllm: set[str] = set()
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 3 or not cells[0].startswith("`"):
            continue
        name = cells[0].strip("`")
        allowed[name] = frozenset(re.findall(r"`([\w.]+)`", cells[1]))
        if cells[2].lower().startswith("yes"):
            vllm.add(name)
    return Rules(allowed, frozenset(vllm))


def module_files(src_root: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every ``.py`` below ``src_root / PACKAGE``."""
    out = {}
    for path in sorted((src_root / PACKAGE).rglob("*.py")):
        parts = path.relative_to(src_root).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def imports_of(module: str, path: Path, modules: dict[str, Path]) -> Iterator[tuple[str, int]]:
    """``(imported module, line)`` for every import statement anywhere in the file."""
    is_pkg = path.name == "__init__.py"
    here = module.split(".") if is_pkg else module.split(".")[:-1]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = ".".join(here[:len(here) - node.level + 1] + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            for alias in node.names:  # ``from pkg import submodule`` imports the submodule
                sub = f"{base}.{alias.name}"
                yield (sub if sub in modules else base), node.lineno


def package_of(module: str) -> str:
    """``range_connector.kv.tickets`` -> ``kv``; ``range_connector.errors`` -> ``errors``; the root ->
    ``range_connector``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else PACKAGE


def violations(src_root: Path, rules: Rules) -> list[str]:
    """Every broken rule, one line each (empty: the tree follows the table)."""
    modules = module_files(src_root)
    found: list[str] = []
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for module, path in modules.items():
        src_pkg = package_of(module)
        if src_pkg not in rules.allowed:
            found.append(f"{module}: package {src_pkg!r} is not in the table")
            continue
        for target, line in imports_of(module, path, modules):
            where = f"{path.relative_to(src_root)}:{line}"
            root = target.split(".")[0]
            if root == "vllm" and src_pkg not in rules.vllm:
                found.append(f"{where}: {module} imports {target} (only {sorted(rules.vllm)} may import vLLM)")
            if root != PACKAGE:
                continue
            if target in modules:
                graph[module].add(target)
            dst_pkg = package_of(target)
            if dst_pkg != src_pkg and dst_pkg not in rules.allowed[src_pkg]:
                found.append(f"{where}: {src_pkg} -> {dst_pkg} ({module} imports {target}) is not in the table")
    found += [f"import circle: {' -> '.join(c)}" for c in circles(graph)]
    return found


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle through each strongly connected group of modules that has more than one (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1 or v in graph.get(v, ()):
                groups.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return groups


def table_circles(rules: Rules) -> list[list[str]]:
    return circles({p: set(deps) for p, deps in rules.allowed.items()})


@pytest.mark.timeout(30)
def test_the_package_follows_the_dependency_table() -> None:
    rules = parse_table(TABLE_DOC.read_text())
    assert rules.allowed, "docs/architecture.md has no dependency table"
    problems = violations(ROOT, rules)
    assert not problems, "\n".join(problems)


@pytest.mark.timeout(10)
def test_the_table_points_one_way_and_keeps_scheduler_and_worker_apart() -> None:
    rules = parse_table(TABLE_DOC.read_text())
    assert not table_circles(rules)
    assert "worker" not in rules.allowed["scheduler"] and "scheduler" not in rules.allowed["worker"]
    assert rules.vllm == {"compat", "connector", "spec", "plugin"}
    for pkg, deps in rules.allowed.items():
        unknown = deps - rules.allowed.keys()
        assert not unknown, f"{pkg} names a package that is not in the table: {unknown}"


@pytest.mark.timeout(10)
@pytest.mark.parametrize("case", ["arrow", "vllm", "circle", "type_checking", "in_function", "from_package"])
def test_the_checker_finds_each_kind_of_broken_rule(tmp_path: Path, case: str) -> None:
    rules = parse_table("## Allowed dependencies\n| `kv` | — | no |\n| `worker` | `kv` | no |\n"
                        "| `compat` | — | yes |\n")
    pkg = tmp_path / PACKAGE
    for sub in ("kv", "worker"):
        (pkg / sub).mkdir(parents=True)
        (pkg / sub / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "compat.py").write_text("import vllm\n")
    (pkg / "worker" / "loads.py").write_text("from range_connector.kv import tickets\n")
    (pkg / "kv" / "tickets.py").write_text("")
    (pkg / "kv" / "layout.py").write_text("")
    assert violations(tmp_path, rules) == [f"{PACKAGE}: package 'range_connector' is not in the table"]
    (pkg / "__init__.py").unlink()
    assert violations(tmp_path, rules) == []
    bad = {
        "arrow": "from range_connector.worker import loads\n",
        "vllm": "import vllm.config\n",
        "circle": "from range_connector.kv import layout\n",
        "type_checking": ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                          "    from range_connector.worker.loads import X\n"),
        "in_function": "def f():\n    from vllm import LLM\n",
        "from_package": "from range_connector import worker\n",
    }[case]
    target = pkg / "kv" / ("layout.py" if case != "circle" else "tickets.py")
    target.write_text(bad)
    if case == "circle":
        (pkg / "kv" / "layout.py").write_text("from range_connector.kv.tickets import T\n")
    problems = violations(tmp_path, rules)
    assert len(problems) == 1, problems
    expected = {"arrow": "kv -> worker", "vllm": "may import vLLM", "circle": "import circle",
                "type_checking": "kv -> worker", "in_function": "may import vLLM", "from_package": "kv -> worker"}
    assert expected[case] in problems[0]
