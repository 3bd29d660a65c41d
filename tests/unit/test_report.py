"""``range-connector report``: one self-contained HTML page whose every inline plot is a real, drawn image.

The result files are made by the producers' own code, small: a replay JSON from a real
:func:`~range_connector.bench.replay.run_replay` of a tiny synthetic trace against two stub OpenAI engines
(``tests/unit/stub_engines.py``), written by :func:`~range_connector.bench.replay_report.write_json` with the
``extra`` fields of :func:`~range_connector.bench.run_info.run_extra`, as ``bench/replay.py`` and the demo write
them; a granularity and a partition JSON whose rows have the fields the
scripts' rows have, with ``analysis`` from the scripts' own ``analyse`` and the run context from
``bench/bench_common.py`` (``machine_info``, ``versions``, ``git_state``), assembled as their ``main`` does.

Every ``<img>`` of the page must be a ``data:image/png;base64`` URI that decodes (PIL) to an image with drawn pixels:
enough pixels off the background colour, and coloured ones (the data series; axes, labels and grid are grey). The
check is shown to reject a blank PNG and a plot with axes but no data.
"""

from __future__ import annotations

import base64
import io
import json
import sys
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("matplotlib", reason="the report draws with matplotlib (the bench extra)")
from PIL import Image  # noqa: E402  (a matplotlib dependency)

from range_connector.bench.replay import build_requests, run_replay  # noqa: E402
from range_connector.bench.replay_report import write_json  # noqa: E402
from range_connector.bench.run_info import run_extra  # noqa: E402
from range_connector.bench.synthetic_trace import synthetic_trace  # noqa: E402
from range_connector.bench.trace_prompts import PromptBuilder  # noqa: E402
from range_connector.bench.trace_transforms import prepare_trace  # noqa: E402
from range_connector.cli import main as cli_main  # noqa: E402
from range_connector.ops.report import load_result, write_report  # noqa: E402
from tests.unit.stub_engines import LoopThread, StubEngine  # noqa: E402

pytestmark = pytest.mark.timeout(90)

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "bench"
MIB = 1 << 20


# ---------------------------------------------------------------------------------------------------- the check
class _Images(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.srcs: list[str] = []
        self.tags: set[str] = set()

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.add(tag)
        if tag == "img":
            self.srcs.append(dict(attrs).get("src") or "")


def inline_pngs(page: str) -> list[bytes]:
    """The decoded bytes of every ``<img>``; fails on an image that is not an inline PNG."""
    parser = _Images()
    parser.feed(page)
    prefix = "data:image/png;base64,"
    assert all(src.startswith(prefix) for src in parser.srcs), [src[:40] for src in parser.srcs]
    assert not parser.tags & {"script", "link", "iframe", "object"}, parser.tags
    return [base64.b64decode(src[len(prefix):], validate=True) for src in parser.srcs]


def assert_drawn(png: bytes) -> None:
    """``png`` decodes to an image of at least 200 x 150 pixels, at least 1% of them differ from its background (its
    most common colour), and at least 200 are coloured (channels more than 60 apart: a data series, not the black
    and grey of axes, text and grid)."""
    image = Image.open(io.BytesIO(png))
    image.load()
    pixels = np.asarray(image.convert("RGB")).astype(np.int16)
    height, width, _ = pixels.shape
    assert width >= 200 and height >= 150, (width, height)
    flat = pixels.reshape(-1, 3)
    colours, counts = np.unique(flat, axis=0, return_counts=True)
    background = colours[counts.argmax()]
    off_background = int(np.any(flat != background, axis=1).sum())
    assert off_background >= 0.01 * len(flat), f"only {off_background} of {len(flat)} pixels drawn"
    coloured = int(((flat.max(axis=1) - flat.min(axis=1)) > 60).sum())
    assert coloured >= 200, f"only {coloured} coloured pixels: no data series drawn"


def _png(fig: Any) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    return buf.getvalue()


def test_the_check_rejects_a_blank_image_and_a_plot_without_data() -> None:
    from matplotlib.figure import Figure

    blank = io.BytesIO()
    Image.new("RGB", (700, 450), "white").save(blank, format="PNG")
    with pytest.raises(AssertionError, match="pixels drawn"):
        assert_drawn(blank.getvalue())
    empty = Figure(figsize=(7, 4.5))
    ax = empty.subplots()
    ax.set_xlabel("time to first token (s)")
    ax.set_title("no data")
    ax.grid(True)
    with pytest.raises(AssertionError, match="no data series"):
        assert_drawn(_png(empty))
    drawn = Figure(figsize=(7, 4.5))
    drawn.subplots().plot([0, 1, 2], [0, 2, 1], linewidth=2)
    assert_drawn(_png(drawn))
    with pytest.raises(AssertionError):
        inline_pngs('<img src="https://example.com/plot.png">')


# ---------------------------------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def bench_modules() -> Any:
    """``bench/bench_common.py``, ``bench/granularity_report.py`` and ``bench/partition.py``, imported as the scripts
    import each other (``bench/`` on ``sys.path``)."""
    sys.path.insert(0, str(BENCH))
    try:
        import bench_common
        import granularity_report
        import partition
    finally:
        sys.path.remove(str(BENCH))
    return bench_common, granularity_report, partition


@pytest.fixture(scope="module")
def run_context(bench_modules: Any) -> dict[str, Any]:
    common = bench_modules[0]
    return {"machine": common.machine_info(), "versions": common.versions(), "git": common.git_state()}


def replay_json(path: Path) -> Path:
    """A real replay of 6 synthetic requests against two stub engines (``none`` and ``range``), as JSON."""
    trace = prepare_trace(synthetic_trace(6, seed=0), token_scale=1 / 64, time_scale=0.05)
    requests = build_requests(trace, PromptBuilder(np.arange(100, 5000), seed=0))
    reports = []
    with LoopThread() as loop:
        for label, delay_s in (("none", 0.03), ("range", 0.01)):
            engine = StubEngine(label)
            engine.behaviour.answer_delay_s, engine.behaviour.chunk_delay_s = delay_s, 0.002
            loop.run(engine.start())
            try:
                reports.append(run_replay(engine.url, requests, label=label, trace=trace, progress=False))
            finally:
                loop.run(engine.stop())
    assert all(r.summary["num_ok"] == len(requests) for r in reports), [r.summary["errors"] for r in reports]
    extra = run_extra([sys.executable, "bench/replay.py", "--configs", "none,range"], model="stub",
                      trace=trace.describe(), loadavg_start=[0.5, 0.4, 0.3])  # as bench/replay.py calls it
    return write_json(path, reports, extra=extra)


def granularity_json(path: Path, bench_modules: Any, context: dict[str, Any]) -> Path:
    """``bench/granularity.py``'s document for two chunk sizes and three paths (16 MiB, the smoke run's sizes)."""
    chunks, payload_tokens, payload_bytes = [32, 128], 128, 16 * MIB
    rows = []
    for idx, path_name in enumerate(("range_memory", "range_valkey", "resident")):
        for c in chunks:
            restore_s = 0.01 * (idx + 1) * (1.1 if c == 32 else 1.0)
            rows.append({"path": path_name, "family": "range" if path_name.startswith("range_") else "resident",
                         "chunk_tokens": c, "num_objects": payload_tokens // c * 32, "payload_bytes": payload_bytes,
                         "status": "ok", "repeats_done": 2, "restore_s_all": [restore_s, restore_s * 1.02],
                         "restore_s_median": restore_s, "restore_s_min": restore_s, "byte_exact": True,
                         "first_layer_s_median": restore_s / 8, "lookup_s_median": 0.001})
    doc = {"format_version": 1, "tool": "bench/granularity.py",
           "command": f"{sys.executable} bench/granularity.py --smoke", "started": "20261203-101500", "wall_s": 12.5,
           **context, "git_at_end": context["git"],
           "config": {"payload_bytes": payload_bytes, "payload_tokens": payload_tokens, "chunk_tokens": chunks,
                      "repeats": 2, "warmup": 1, "smoke": True, "backends": ["memory", "valkey"]},
           "notes": ["LMCache/plain/resident_shim rows skipped (--smoke)"], "rows": rows,
           "analysis": bench_modules[1].analyse(rows, chunks, payload_tokens), "plot": None}
    path.write_text(json.dumps(doc, indent=1))
    return path


def partition_json(path: Path, bench_modules: Any, context: dict[str, Any]) -> Path:
    """``bench/partition.py``'s document: S = 1, 2, 4 partitioned and 2, 4 shared, both paths (16 MiB)."""
    partition = bench_modules[2]
    payload_bytes = 16 * MIB
    rows = []
    for s in partition.SHARD_COUNTS:
        for placement in ("partitioned", "shared") if s > 1 else ("partitioned",):
            for path_name in partition.PATHS:
                servers = s if placement == "partitioned" else 1
                restore_s = 0.02 / (s if placement == "partitioned" else 1.2)
                rows.append({"case": f"S{s}-{placement}", "path": path_name, "num_shards": s,
                             "placement": placement, "num_servers": servers, "status": "ok",
                             "restore_s_median": restore_s, "gib_per_s": payload_bytes / (1 << 30) / restore_s,
                             "byte_exact": True, "client_cpu_s_median": 0.01,
                             "server_bytes_median": [payload_bytes / servers] * servers,
                             "server_cpu_s_median": [0.005] * servers, "multi_server_fraction_median": 0.5})
    doc = {"format_version": partition.FORMAT_VERSION, "tool": "bench/partition.py",
           "command": f"{sys.executable} bench/partition.py --smoke", "started": "20261203-101600", "wall_s": 30.0,
           **context, "config": {"payload_bytes": payload_bytes, "shard_counts": list(partition.SHARD_COUNTS),
                                 "repeats": 2, "smoke": True}, "errors": {}, "rows": rows,
           "analysis": partition.analyse(rows, payload_bytes, 100.0), "plot": None}
    path.write_text(json.dumps(doc, indent=1))
    return path


# ---------------------------------------------------------------------------------------------------- the tests
def test_report_of_replay_granularity_and_partition(tmp_path: Path, bench_modules: Any,
                                                    run_context: dict[str, Any]) -> None:
    files = [replay_json(tmp_path / "replay.json"),
             granularity_json(tmp_path / "granularity.json", bench_modules, run_context),
             partition_json(tmp_path / "partition.json", bench_modules, run_context)]
    assert [load_result(f).kind for f in files] == ["replay", "granularity", "partition"]
    out, num_plots = write_report(files, tmp_path / "page.html")
    page = out.read_text()
    pngs = inline_pngs(page)
    assert len(pngs) == num_plots == 4  # TTFT CDF and over time; restore against N; bandwidth per case
    for png in pngs:
        assert_drawn(png)
    for text in ("TTFT p50 (s)", "range/none", "restore time against object count", "S4-shared",
                 run_context["machine"]["cpu_model"], run_context["git"]["head"], "bench/partition.py --smoke"):
        assert text in page, text
    assert page.count(run_context["git"]["head"]) == 3 and "not recorded" not in page  # every file has its commit


def test_the_command_writes_the_page_and_names_a_bad_file(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                          bench_modules: Any, run_context: dict[str, Any]) -> None:
    good = granularity_json(tmp_path / "granularity.json", bench_modules, run_context)
    out = tmp_path / "page.html"
    assert cli_main(["report", str(good), "-o", str(out)]) == 0
    assert "1 plot(s)" in capsys.readouterr().out and len(inline_pngs(out.read_text())) == 1
    bad = {"not-json.json": "{\"rows\": [", "list.json": "[1, 2]", "unknown.json": json.dumps({"hello": 1}),
           "bad-reports.json": json.dumps({"reports": [{"summary": {}}]}),
           "bad-rows.json": json.dumps({"tool": "bench/partition.py", "config": {}, "rows": [{"status": "ok"}]})}
    for name, text in bad.items():
        (tmp_path / name).write_text(text)
        target = tmp_path / f"{name}.html"
        assert cli_main(["report", str(good), str(tmp_path / name), "-o", str(target)]) == 2, name
        err = capsys.readouterr().err
        assert err.startswith(f"error: {tmp_path / name}: ") and err.count("\n") == 1, err
        assert "Traceback" not in err and not target.exists(), name
    assert cli_main(["report", str(tmp_path / "missing.json"), "-o", str(tmp_path / "m.html")]) == 2
    assert "missing.json: cannot read it" in capsys.readouterr().err
    assert cli_main(["report", str(good), "-o", str(tmp_path / "no-such-dir" / "page.html")]) == 2
    assert "--output" in capsys.readouterr().err


def test_another_benchmark_gets_its_run_config_and_rows_without_a_plot(tmp_path: Path,
                                                                       run_context: dict[str, Any]) -> None:
    """``bench/threshold.py``, ``bench/soak.py`` and ``bench/partition_shaped.py`` write ``command``, ``machine``,
    ``versions``, ``git``, ``config`` and ``rows`` (bench_common's fields) and get no plot of the report's."""
    doc = {"format_version": 1, "command": "bench/threshold.py --smoke", **run_context,
           "config": {"lengths": [256, 1024], "runs": 1},
           "rows": [{"length_tokens": 256, "speed_factor": 0.5, "decision": "load", "ttft_s": 0.12},
                    {"length_tokens": 1024, "speed_factor": 0.5, "decision": "recompute", "ttft_s": 0.31}],
           "summary": {"regret_s": 0.01}}
    path = tmp_path / "threshold.json"
    path.write_text(json.dumps(doc))
    assert load_result(path).kind == "benchmark"
    out, num_plots = write_report([path], tmp_path / "page.html")
    page = out.read_text()
    assert num_plots == 0 and inline_pngs(page) == []
    for text in ("speed_factor", "recompute", "regret_s", run_context["git"]["head"], "bench/threshold.py --smoke"):
        assert text in page, text
