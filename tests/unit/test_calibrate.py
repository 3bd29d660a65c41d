"""``range-connector calibrate`` without an engine: fits and the break-even table from given measurements, the
command on the real DRAM and file tiers (their stripes removed afterwards), and its bad-input errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from range_connector.cli import main
from range_connector.cli.calibrate import break_even_rows, build_calibration
from range_connector.cost.calibration_file import load_calibration, write_calibration
from range_connector.cost.model import PrefillRate, min_winning_prompt_tokens

pytestmark = pytest.mark.timeout(60)

MiB = 1 << 20
S = 131072.0  # bytes per token of the bench GQA model
TRUE_RATE, OVERHEAD_S = PrefillRate(1e-4, 0.0), 0.03  # 10k tokens/s: B* = 1.31 GB/s


def tier_points(bandwidth: float, t0_s: float) -> list[tuple[int, float]]:
    return [(n, t0_s + n / bandwidth) for n in (MiB, 4 * MiB, 16 * MiB, 64 * MiB)]


def test_table_from_given_measurements() -> None:
    prefill = [(n, OVERHEAD_S + TRUE_RATE.time_s(0, n)) for n in (128, 256, 512, 1024)]
    cal = build_calibration(prefill, {"fast": [tier_points(2e9, 0.001), tier_points(3e9, 0.002)],
                                      "slow": [tier_points(5e8, 0.01)]},
                            bytes_per_token=S, model="m", engine_t0_s=0.05)
    assert cal.prefill.tokens_per_s() == pytest.approx(1e4, rel=1e-6)
    assert cal.prefill_overhead_s == pytest.approx(OVERHEAD_S, rel=1e-6)
    assert cal.tiers["fast"][1].t0_s == pytest.approx(0.052, rel=1e-6)  # engine T0 added to the tier's
    header, rows = break_even_rows(cal, (1024, 65536))
    table = {row[0]: dict(zip(header, row)) for row in rows}
    fast, slow = table["fast"], table["slow"]
    # Two shards read in parallel, bounded by the slower one; T0 is the larger.
    assert (fast["SHARDS"], fast["B_GB/S"], fast["T0_MS"]) == ("2", "4.00", "52.00")
    assert fast["B*_GB/S"] == slow["B*_GB/S"] == "1.31"
    assert fast["SHORTEST_WIN_TOKENS"] == str(min_winning_prompt_tokens(0.052, 1e4, S, 4e9))
    assert slow["SHORTEST_WIN_TOKENS"] == "never"  # 0.5 GB/s < B*
    # 1,024 tokens recompute in 0.1024 s; loading them costs 0.052 + 1024·S/4e9 = 0.0856 s.
    assert fast["SAVE@1024"] == "+0.017s (+16%)"
    assert slow["SAVE@65536"].startswith("-")
    path = write_calibration(cal, Path(__import__("tempfile").mkdtemp()) / "cal.json")
    assert load_calibration(path) == cal


def test_table_needs_a_rate_and_bytes_per_token() -> None:
    with pytest.raises(ValueError, match="^calibration:"):
        break_even_rows(build_calibration([], {}, bytes_per_token=None, model=None))


def test_command_measures_dram_and_file_tiers_and_leaves_nothing_behind(tmp_path: Path, capsys,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    # The tiers' reads are real; the clock that times them advances by the bytes each read returned (1 GB/s), so
    # the fitted line does not depend on how busy the machine is.
    import range_connector.cli.calibrate as calibrate_mod
    from range_connector.backends.file.backend import FileBackend
    from range_connector.backends.memory import MemoryBackend

    fake_s = [0.0]
    for cls in (MemoryBackend, FileBackend):
        def read_ranges(self, reads, _orig=cls.read_ranges):
            fake_s[0] += 1e-4 + sum(r.length for r in reads) / 1e9
            return _orig(self, reads)
        monkeypatch.setattr(cls, "read_ranges", read_ranges)
    monkeypatch.setattr(calibrate_mod, "_clock", lambda: fake_s[0])
    out = tmp_path / "cal.json"
    extra = {"file_dir": str(tmp_path / "files"), "num_shards": 2}
    rc = main(["calibrate", "--skip-prefill", "--tokens-per-s", "5000", "--bytes-per-token", str(S),
               "--num-layers", "8", "--backends", "memory,file", "--extra-config", json.dumps(extra),
               "--read-mib", "1,4", "--read-repeats", "2", "--output", str(out)])
    printed = capsys.readouterr().out
    assert rc == 0, printed
    cal = load_calibration(out)
    assert len(cal.tiers["memory"]) == 1 and len(cal.tiers["file"]) == 2  # DRAM: one instance for every shard
    assert all(e.bandwidth_bytes_per_s > 1e7 for shards in cal.tiers.values() for e in shards)
    assert [len(p) for p in cal.tier_points["file"]] == [2, 2]
    assert cal.prefill.tokens_per_s() == pytest.approx(5000)
    lines = printed.splitlines()
    assert any(line.startswith("BACKEND") and "SAVE@16384" in line for line in lines)
    assert any(line.startswith("file ") for line in lines) and any(line.startswith("memory ") for line in lines)
    for shard in ("shard-0", "shard-1"):
        assert list((tmp_path / "files" / "default" / shard / "stripes").iterdir()) == []  # (deployment "default")


@pytest.mark.parametrize(
    ("argv", "key"),
    [
        (["--extra-config", "{bad"], "--extra-config"),
        (["--extra-config", "[1]"], "--extra-config"),
        (["--extra-config", '{"no_such_key": 1}'], "no_such_key"),
        (["--skip-prefill", "--num-layers", "4", "--backends", "tape"], "--backends"),
        (["--backends", ""], "--model"),
        (["--skip-prefill", "--backends", "memory"], "--num-layers"),
        (["--url", "http://127.0.0.1:9", "--backends", ""], "--vocab-size"),
        (["--model", "/no/such/model", "--backends", ""], "--model"),
        (["--skip-prefill", "--num-layers", "2", "--read-mib", "1", "--backends", "memory"], "--read-mib"),
    ],
)
def test_bad_input_is_one_line_naming_the_option(argv: list[str], key: str, tmp_path: Path, capsys) -> None:
    rc = main(["calibrate", "--output", str(tmp_path / "cal.json"), *argv])
    err = capsys.readouterr().err
    assert rc == 2
    assert err.startswith(f"error: {key}: ") and err.count("\n") == 1, err
    assert not (tmp_path / "cal.json").exists()


@pytest.mark.timeout(60)
def test_an_output_path_that_cannot_be_written_is_one_line_naming_the_option(tmp_path: Path, capsys) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    rc = main(["calibrate", "--skip-prefill", "--num-layers", "2", "--read-mib", "1,2", "--read-repeats", "1",
               "--backends", "memory", "--output", str(blocker / "cal.json")])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("error: --output: ") and err.count("\n") == 1, err


@pytest.mark.timeout(60)
def test_an_unusable_runtime_dir_for_valkey_start_is_one_line(tmp_path: Path, capsys) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    rc = main(["valkey", "start", "--shards", "1", "--runtime-dir", str(blocker / "rt")])
    err = capsys.readouterr().err  # (a bad argument, found before any server starts: exit 2)
    assert rc == 2 and err.startswith("error: --runtime-dir: ") and str(blocker) in err and err.count("\n") == 1, err


def test_each_tier_of_a_hierarchy_is_measured_alone_with_its_own_settings() -> None:
    """A hierarchy's calibration measures every tier type it lists (the command's default), each as a config of
    that tier only, with that tier's own table (its directory, its timeout)."""
    from range_connector.cli.calibrate import tier_config

    extra = {"tiers": [{"type": "memory", "capacity_bytes": 1 << 20},
                       {"type": "file", "directory": "/nvme/range", "timeout_s": 3.0}],
             "write_policy": "write-back", "num_shards": 2}
    memory, file = tier_config(extra, "memory"), tier_config(extra, "file")
    assert [t.type for t in memory.tiers] == ["memory"] and memory.tier.capacity_bytes == 0
    assert [t.type for t in file.tiers] == ["file"] and file.tier.directory == "/nvme/range"
    assert file.tier.timeout_s == 3.0 and file.num_shards == 2
