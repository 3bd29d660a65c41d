"""The built wheel installs and registers the connector in a fresh environment, offline, next to an existing vLLM.

1. The wheel is built from a copy of the repository's files (what ``git ls-files`` lists, tracked or new and not
   ignored: what a clone has, plus uncommitted work) with ``pip wheel --no-deps --no-build-isolation --no-index``,
   so the build writes nothing into the working tree and needs no network.
2. A fresh virtual environment (``python -m venv --without-pip``) gets this environment's packages *without
   reinstalling them*: its site-packages is a view made of one symlink per entry of this environment's
   site-packages, except this project's own (``range_connector*``, ``__editable__*range_connector*``: the editable
   install would shadow or duplicate the wheel). pip comes through the view too.
3. ``python -m pip install --no-deps --no-index`` installs the wheel into it.
4. In a subprocess of the fresh environment, run outside the repository and without ``PYTHONPATH`` (so the
   repository's package cannot be imported by accident): ``range_connector`` comes from the fresh environment, the
   package data (``range_connector/patches/*.diff``) is there, the ``vllm.general_plugins`` entry point
   ``range_connector`` exists, and after vLLM's ``load_general_plugins()`` the factory knows ``RangeConnector``.
   ``range-connector --help`` runs from the fresh environment's ``bin``.

Slow (vLLM's import takes a while on 2 cores), hence marked ``engine`` although it starts no engine.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

pytest.importorskip("vllm")

pytestmark = [pytest.mark.engine, pytest.mark.timeout(900)]

ROOT = Path(__file__).resolve().parents[2]

CHECK = r"""
import glob, json, os, sys
from importlib.metadata import distribution, entry_points
import range_connector
pkg = os.path.dirname(range_connector.__file__)
eps = [ep for ep in entry_points(group="vllm.general_plugins") if ep.name == "range_connector"]
from vllm.plugins import load_general_plugins
load_general_plugins()
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
print(json.dumps({
    "prefix": sys.prefix,
    "package_dir": pkg,
    "diffs": sorted(os.path.basename(p) for p in glob.glob(os.path.join(pkg, "patches", "*.diff"))),
    "entry_points": [ep.value for ep in eps],
    "dist_files": str(distribution("range-connector").locate_file("")),
    "registered": "RangeConnector" in KVConnectorFactory._registry,
}))
"""


def _repo_files() -> list[str]:
    """Files of the repository as a clone has them, plus new ones git does not ignore."""
    out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                         capture_output=True, check=True)
    return [name for name in out.stdout.decode().split("\0") if name]


def _copy_repo(dst: Path) -> None:
    if not (ROOT / ".git").exists():
        pytest.skip("not a git checkout: the repository's file list is unknown")
    for name in _repo_files():
        src = ROOT / name
        if not src.exists() and not src.is_symlink():
            continue  # deleted in the working tree, not yet committed
        target = dst / name
        target.parent.mkdir(parents=True, exist_ok=True)
        if src.is_symlink():
            target.symlink_to(os.readlink(src))
        else:
            shutil.copy2(src, target)


def _is_own(entry: str) -> bool:
    lowered = entry.lower().replace("-", "_")
    return lowered.startswith("range_connector") or (lowered.startswith("__editable__")
                                                     and "range_connector" in lowered)


def _fresh_venv(venv: Path) -> Path:
    """A venv whose site-packages links every entry of this one's except this project's; returns its python."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip())
    ours = Path(sysconfig.get_paths()["purelib"])
    assert site != ours and site.is_dir()
    for entry in sorted(os.listdir(ours)):
        if _is_own(entry) or entry == "__pycache__" or (site / entry).exists():
            continue
        (site / entry).symlink_to(ours / entry)
    return python


def _clean_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    env["PIP_NO_INDEX"] = "1"
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    return env


def test_wheel_installs_into_a_fresh_environment_and_registers_the_connector(tmp_path: Path) -> None:
    src, dist, venv, outside = tmp_path / "src", tmp_path / "dist", tmp_path / "venv", tmp_path / "elsewhere"
    outside.mkdir()
    _copy_repo(src)
    env = _clean_env()
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
                            "-w", str(dist), str(src)], cwd=outside, env=env, capture_output=True, text=True,
                           timeout=300)
    assert build.returncode == 0, f"pip wheel failed:\n{build.stdout}\n{build.stderr}"
    [wheel] = sorted(dist.glob("range_connector-*.whl"))

    python = _fresh_venv(venv)
    probe = subprocess.run([str(python), "-c", "import range_connector"], cwd=outside, env=env,
                           capture_output=True, text=True)
    assert probe.returncode != 0, "the fresh environment sees a range_connector before the wheel is installed"

    install = subprocess.run([str(python), "-m", "pip", "install", "--no-deps", "--no-index", str(wheel)],
                             cwd=outside, env=env, capture_output=True, text=True, timeout=300)
    assert install.returncode == 0, f"pip install failed:\n{install.stdout}\n{install.stderr}"

    check = subprocess.run([str(python), "-c", CHECK], cwd=outside, env=env, capture_output=True, text=True,
                           timeout=600)
    assert check.returncode == 0, f"the installed wheel failed its check:\n{check.stderr[-4000:]}"
    facts = json.loads(check.stdout.strip().splitlines()[-1])
    venv = venv.resolve()
    assert Path(facts["prefix"]).resolve() == venv, facts["prefix"]
    assert Path(facts["package_dir"]).resolve().is_relative_to(venv), facts["package_dir"]
    assert not Path(facts["package_dir"]).is_relative_to(ROOT)
    assert "mla_direct_call_kv_hooks.diff" in facts["diffs"], facts
    assert facts["entry_points"] == ["range_connector.plugin:register"], facts
    assert Path(facts["dist_files"]).resolve().is_relative_to(venv), facts
    assert facts["registered"], "load_general_plugins() did not register RangeConnector"

    cli = venv / "bin" / "range-connector"
    assert cli.is_file()
    helped = subprocess.run([str(cli), "--help"], cwd=outside, env=env, capture_output=True, text=True, timeout=120)
    assert helped.returncode == 0, helped.stderr
    for command in ("valkey", "patch", "calibrate", "proxy"):
        assert command in helped.stdout
    head = "\n".join(cli.read_text().splitlines()[:3])  # a shebang, or pip's /bin/sh trampoline for long paths
    assert str(python) in head, f"the console script does not run the fresh environment's python: {head}"
