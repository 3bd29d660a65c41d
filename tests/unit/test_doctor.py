"""``range-connector doctor`` without servers: the engine patch on a private copy of vLLM's file (fixture
``vllm_copy``), the cost gate's row, and arguments that are refused before any check runs (DRAM tier only)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from range_connector.cli import main
from range_connector.cli.patch import TARGET_RELPATH
from range_connector.plugin import FORCE_MLA_DIRECT_CALL_ENV
from range_connector.testing.tiny_models import build_model

pytestmark = pytest.mark.timeout(120)


def _config(tmp_path: Path, extra: dict | None = None) -> Path:
    path = tmp_path / "extra-config.json"
    path.write_text(json.dumps(extra or {"tiers": [{"type": "memory"}]}))
    return path


def _doctor(capsys, *args: str) -> tuple[int, dict[str, tuple[str, str]], str]:
    rc = main(["doctor", "--probe-mib", "1", *args])
    out, err = capsys.readouterr()
    rows = {}
    for line in out.splitlines()[1:]:
        name, status, detail = re.split(r"\s{2,}", line, maxsplit=2)
        rows[name] = (status, detail)
    return rc, rows, err


def test_an_unapplied_patch_that_the_model_needs_fails_and_applying_it_fixes_that(
        vllm_copy, tmp_path: Path, capsys, monkeypatch: pytest.MonkeyPatch) -> None:
    """The test switch makes attention take the direct-call branch (as on platforms without an opaque attention
    op); the doctor reads it from the environment, as every engine process would."""
    monkeypatch.setenv(FORCE_MLA_DIRECT_CALL_ENV, "1")
    mla = str(build_model("mla", "tiny"))
    args = ["--config", str(_config(tmp_path)), "--model", mla, "--vllm-dir", str(vllm_copy.vllm_dir)]
    rc, rows, err = _doctor(capsys, *args)
    target = vllm_copy.vllm_dir / TARGET_RELPATH
    assert rc == 1 and err.count("\n") == 1, err
    assert err == (f"error: engine patch: needed (MLA model, attention takes the direct-call branch) and not applied "
                   f"to {target}: run `range-connector patch apply` and restart the engines\n")
    assert rows["vllm"][0] == "ok"

    assert main(["patch", "apply", "--vllm-dir", str(vllm_copy.vllm_dir)]) == 0
    capsys.readouterr()
    rc, rows, err = _doctor(capsys, *args)
    assert rc == 0 and rows["engine patch"] == ("ok", f"needed for MLA models here, applied ({target})"), err


def test_the_patch_is_not_needed_for_a_dense_model_or_where_attention_is_one_op(
        vllm_copy, tmp_path: Path, capsys, monkeypatch: pytest.MonkeyPatch) -> None:
    gqa = str(build_model("gqa", "tiny"))
    base = ["--config", str(_config(tmp_path)), "--vllm-dir", str(vllm_copy.vllm_dir)]
    monkeypatch.setenv(FORCE_MLA_DIRECT_CALL_ENV, "1")
    rc, rows, _ = _doctor(capsys, *base, "--model", gqa)
    assert rc == 0 and rows["engine patch"] == ("ok", "not needed (the model is not MLA); not applied")
    rc, rows, _ = _doctor(capsys, *base)
    assert rc == 0 and rows["engine patch"][0] == "warn" and "give --model to decide" in rows["engine patch"][1]
    monkeypatch.delenv(FORCE_MLA_DIRECT_CALL_ENV)
    rc, rows, _ = _doctor(capsys, *base, "--model", str(build_model("mla", "tiny")))
    assert rc == 0 and rows["engine patch"][1].startswith("not needed (this platform registers attention as one")


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
])
def test_bad_arguments_exit_2_in_one_line_before_any_check(make, key: str, tmp_path: Path, capsys) -> None:
    rc = main(["doctor", *make(tmp_path)])
    out, err = capsys.readouterr()
    assert (rc, out) == (2, ""), err
    assert err.startswith(f"error: {key if key != 'doctor' else 'range-connector doctor'}: ") and err.count("\n") == 1


def test_a_bad_key_in_the_config_is_a_failed_row(tmp_path: Path, capsys) -> None:
    rc, rows, err = _doctor(capsys, "--config", str(_config(tmp_path, {"tiers": [{"type": "tape"}]})))
    assert rc == 1 and rows["config"][0] == "fail" and err.startswith("error: config: tiers[0].type: "), err


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path
