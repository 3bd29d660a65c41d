"""``range-connector doctor`` without servers: the engine patch on a private copy of vLLM's file (fixture
``vllm_copy``), the cost gate's row, and arguments that are refused before any check runs (DRAM tier only)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from range_connector.cli import main
from range_connector.cli.patch import TARGET_RELPATH
from range_connector.plugin import FORCE_MLA_DIRECT_CALL_ENV
from range_connector.testing.tiny_models import build_model

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.timeout(120)


def _config(tmp_path: Path, extra: dict | None = None) -> Path:
    path = tmp_path / "extra-config.json"
    path.write_text(json.dumps(extra or {"tiers": [{"type": "memory"}]}))
    return path


def _doctor(capsys, *args: str) -> tuple[int, dict[str, tuple[str, str]], str]:
    """Run the command: ``(exit status, {check: (status, detail)}, its own error line)``; vLLM's log lines, also
    on stderr, are left out."""
    rc = main(["doctor", "--probe-mib", "1", *args])
    out, err = capsys.readouterr()
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(errors) <= 1, err
    err = "".join(f"{line}\n" for line in errors)
    rows = {}
    for line in out.splitlines()[1:]:
        name, status, detail = re.split(r"\s{2,}", line, maxsplit=2)
        rows[name] = (status, detail)
    return rc, rows, err


_SWITCHED = """
import contextlib, io, json, sys
from range_connector.cli import main
out = []
for argv in json.loads(sys.argv[1]):
    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        rc = main(argv)
    out.append([rc, json.loads(stdout.getvalue()) if "--json" in argv else None,
                [line for line in stderr.getvalue().splitlines() if line.startswith("error: ")]])
print("DOCTOR" + json.dumps(out))
"""


def _doctor_with_the_switch(runs: list[list[str]]) -> list[tuple[int, dict[str, tuple[str, str]], list[str]]]:
    """Run the command once per argument list in a fresh process with the test switch of
    :mod:`range_connector.plugin` set: attention takes the direct-call branch, as on platforms without an opaque
    attention op. (Not in this process: vLLM loads the plugin while the doctor resolves the model's config, and the
    switch changes the platform for the rest of the process.)"""
    env = {**os.environ, FORCE_MLA_DIRECT_CALL_ENV: "1", "PYTHONPATH": os.pathsep.join(
        [str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])}
    argv = [["doctor", "--probe-mib", "1", "--json", *args] for args in runs]
    proc = subprocess.run([sys.executable, "-c", _SWITCHED, json.dumps(argv)], capture_output=True, text=True,
                          env=env, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (line,) = [line for line in proc.stdout.splitlines() if line.startswith("DOCTOR")]
    return [(rc, {c["name"]: (c["status"], c["detail"]) for c in report["checks"]}, errors)
            for rc, report, errors in json.loads(line[len("DOCTOR"):])]


@pytest.mark.timeout(300)
def test_an_unapplied_patch_that_the_model_needs_fails_and_is_not_needed_for_a_dense_model(
        vllm_copy, tmp_path: Path) -> None:
    base = ["--config", str(_config(tmp_path)), "--vllm-dir", str(vllm_copy.vllm_dir)]
    mla, gqa = str(build_model("mla", "tiny")), str(build_model("gqa", "tiny"))
    target = vllm_copy.vllm_dir / TARGET_RELPATH
    unpatched, dense, no_model = _doctor_with_the_switch([[*base, "--model", mla], [*base, "--model", gqa], base])
    assert unpatched[0] == 1 and unpatched[2] == [
        f"error: engine patch: needed (MLA model, attention takes the direct-call branch) and not applied to {target}: "
        "run `range-connector patch apply` and restart the engines"]
    assert unpatched[1]["vllm"][0] == "ok"
    assert dense[0] == 0 and dense[1]["engine patch"] == ("ok", "not needed (the model is not MLA); not applied")
    assert no_model[0] == 0 and no_model[1]["engine patch"][0] == "warn"
    assert "give --model to decide" in no_model[1]["engine patch"][1]

    assert main(["patch", "apply", "--vllm-dir", str(vllm_copy.vllm_dir)]) == 0
    (patched,) = _doctor_with_the_switch([[*base, "--model", mla]])
    assert patched[0] == 0 and patched[1]["engine patch"] == ("ok", f"needed for MLA models here, applied ({target})")


def test_without_the_switch_the_cpu_platform_needs_no_patch(vllm_copy, tmp_path: Path, capsys) -> None:
    rc, rows, err = _doctor(capsys, "--config", str(_config(tmp_path)), "--vllm-dir", str(vllm_copy.vllm_dir),
                            "--model", str(build_model("mla", "tiny")))
    assert rc == 0, err
    assert rows["engine patch"][1].startswith("not needed (this platform registers attention as one")


def test_the_gate_row_uses_the_calibration_and_warns_about_a_tier_that_never_pays_off(tmp_path: Path,
                                                                                       capsys) -> None:
    from range_connector.cost.calibration_file import Calibration, write_calibration
    from range_connector.cost.model import PrefillRate, TierEstimate

    # Prefill at 1M tokens/s against a DRAM tier of 1 MB/s: no hit pays off at any length.
    cal = write_calibration(Calibration(PrefillRate.constant(1e6), 0.0, {"memory": (TierEstimate(1e6, 0.01),)}),
                            tmp_path / "cal.json")
    config = _config(tmp_path, {"tiers": [{"type": "memory"}], "calibration_file": str(cal)})
    rc, rows, _ = _doctor(capsys, "--config", str(config), "--model", str(build_model("gqa", "tiny")),
                          "--prompt-tokens", "512,4096")
    assert rc == 0
    assert rows["cost gate"] == ("warn", f"tiers[0] memory: 512 refuse, 4096 refuse (calibration {cal}); tiers[0] "
                                         "never pays off")
    rc, rows, _ = _doctor(capsys, "--config", str(_config(tmp_path)), "--model", str(build_model("gqa", "tiny")),
                          "--prompt-tokens", "512,4096")
    assert rows["cost gate"] == ("ok", "tiers[0] memory: 512 take, 4096 take (defaults (no calibration_file))")


@pytest.mark.parametrize(("make", "key"), [
    (lambda d: ["--config", str(d / "missing.json")], "--config"),
    (lambda d: ["--config", str(_write(d / "bad.json", "{not json"))], "--config"),
    (lambda d: ["--config", str(_write(d / "list.json", "[1]"))], "--config"),
    (lambda d: ["--config", str(_config(d)), "--model", str(d)], "--model"),
    (lambda d: ["--config", str(_config(d)), "--tensor-parallel-size", "0"], "doctor"),
    (lambda d: ["--config", str(_config(d)), "--model", str(build_model("gqa", "tiny")),
                "--tensor-parallel-size", "3"], "--tensor-parallel-size"),
    (lambda d: ["--config", str(_config(d)), "--vllm-dir", str(d / "nowhere")], "--vllm-dir"),
    (lambda d: ["--config", str(_config(d)), "--prompt-tokens", "512,x"], "doctor"),  # (argparse: "argument --prompt-tokens: ...")
    (lambda d: ["--config", str(_config(d)), "--probe-mib", "0"], "doctor"),
])
def test_bad_arguments_exit_2_in_one_line_before_any_check(make, key: str, tmp_path: Path, capsys) -> None:
    rc = main(["doctor", *make(tmp_path)])
    out, err = capsys.readouterr()
    assert (rc, out) == (2, ""), err
    assert err.startswith(f"error: {key if key != 'doctor' else 'range-connector doctor'}: "), err
    assert err.count("\n") == 1, err


def test_a_bad_key_in_the_config_is_a_failed_row(tmp_path: Path, capsys) -> None:
    rc, rows, err = _doctor(capsys, "--config", str(_config(tmp_path, {"tiers": [{"type": "tape"}]})))
    assert rc == 1 and rows["config"][0] == "fail" and err.startswith("error: config: tiers[0].type: "), err


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


@pytest.mark.timeout(300)
def test_the_namespace_row_is_the_one_the_offline_spec_computes_and_json_is_alone_on_stdout(tmp_path: Path) -> None:
    """The doctor's namespace is :func:`~range_connector.ops.offline_spec.offline_namespace`'s, whose value equals
    the namespace a real engine reports (``tests/integration/test_cache_admin_engine.py`` starts one and compares):
    this test together with that one shows the doctor's namespace is the engine's. The model row takes the engine's
    geometry (vLLM's block size for the model, its page bytes).

    Run as the installed command would be, in a fresh process: vLLM logs INFO lines to stdout from its first
    import on, and with ``--json`` stdout must be the JSON object alone (the log lines go to stderr).
    """
    from range_connector.ops.offline_spec import offline_namespace

    model = str(build_model("gqa", "tiny"))
    extra = {"tiers": [{"type": "memory"}], "num_shards": 1, "namespace_salt": "doctor"}
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])}
    proc = subprocess.run([sys.executable, "-m", "range_connector.cli", "doctor", "--probe-mib", "1", "--json",
                           "--config", str(_config(tmp_path, extra)), "--model", model], capture_output=True,
                          text=True, env=env, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout)  # (nothing else on stdout)
    rows = {c["name"]: c for c in report["checks"]}
    spec = offline_namespace(model, extra)
    assert rows["namespace"]["status"] == "ok" and rows["namespace"]["data"]["namespace"] == spec.namespace_hex
    assert rows["namespace"]["detail"].startswith(f"{spec.namespace_hex} (packing ")
    assert rows["namespace"]["data"]["fields"]["packing"] == spec.fields["packing"]
    assert f"block {spec.block_size} tokens" in rows["model"]["detail"]
    assert f"= {spec.group.page_size_bytes} bytes" in rows["model"]["detail"]
    assert "INFO" in proc.stderr  # (vLLM did log: to stderr)
