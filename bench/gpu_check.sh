#!/usr/bin/env bash
# The prepared device check: Range's data path on one CUDA device, without vLLM, in at most about 5 minutes.
#
#   bench/gpu_check.sh          on the lent GPU machine (torch with CUDA, no vLLM, no network)
#   bench/gpu_check.sh --cpu    the same steps on CPU at smoke size (here; tests/bench/test_gpu_check_smoke.py)
#
# Steps (each under a time limit; a failing step does not stop the others):
#   0. wheels: installs what bench/fetch_gpu_wheels.sh put in .whl/gpu (cp312, for the GPU machine) into
#      .whl/site, with pip --no-index (nothing is downloaded); skipped when the folder is absent or with --cpu
#   1. tests: the `gpu` tests (tests/gpu) and their CPU twins (tests/unit/test_device_seam.py, test_pcp_device.py,
#      test_device_reads.py),
#      JUnit XML in tests.xml; on CPU the gpu tests skip with their reason
#   2. data path: tests/unit/data_path_child.py with vLLM made unimportable, into CUDA KV tensors in FlashAttention's
#      layout (CPU layout with --cpu): data_path.json
#   3. sweep: bench/gpu_sweep.py (GiB/s per tier against the pinned H2D and D2D limits, first-layer time, flatness
#      over N, a corruption check that must fail, the I/O path the file tier's loads ran: GDS, kvikio's
#      compatibility mode or POSIX, with the start-up GPUDirect probe's verdict): sweep.json
# Then bench/gpu_check_report.py merges them into gpu_check.json (schema: that module's docstring), prints a summary,
# and its exit status is this script's. Everything goes under $OUT when set (the device machine's result folder),
# else bench/results/gpu_check; the whole output is also in gpu_check.log there.
# Environment: PYTHON (default python3).
set -uo pipefail

MODE=cuda
if [[ "${1:-}" == "--cpu" ]]; then MODE=cpu; elif [[ -n "${1:-}" ]]; then echo "usage: $0 [--cpu]" >&2; exit 2; fi
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
OUT_DIR=${OUT:-$ROOT/bench/results/gpu_check}
PY=${PYTHON:-python3}
mkdir -p "$OUT_DIR"
rm -f "$OUT_DIR"/{tests.xml,data_path.json,sweep.json,gpu_check.json}
exec > >(tee "$OUT_DIR/gpu_check.log") 2>&1
cd "$ROOT"

WHEELS=$ROOT/.whl/gpu
SITE=$ROOT/.whl/site
if [[ $MODE == cuda && -f $WHEELS/requirements.txt ]]; then
  echo "== wheels: $WHEELS -> $SITE"
  timeout 120 "$PY" -m pip install --quiet --no-index --no-deps --find-links "$WHEELS" --target "$SITE" \
    -r "$WHEELS/requirements.txt" || echo "== wheels: pip install failed (rc $?); going on with what is installed"
fi
export PYTHONPATH=$ROOT${SITE:+:$SITE}${PYTHONPATH:+:$PYTHONPATH}
export PYTHONDONTWRITEBYTECODE=1

if [[ $MODE == cuda ]]; then
  DEVICE=cuda; LAYOUT=flash; SIZE=full; T_TESTS=150; T_DATA=60; T_SWEEP=120
  "$PY" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' \
    || echo "== no CUDA device visible to torch: the gpu tests will skip and the sweep will fail"
else
  DEVICE=cpu; LAYOUT=cpu; SIZE=smoke; T_TESTS=120; T_DATA=60; T_SWEEP=60
fi
echo "== gpu_check mode=$MODE python=$("$PY" -c 'import sys; print(sys.version.split()[0])') out=$OUT_DIR"

echo "== 1. tests (gpu-marked, and their CPU twins)"
timeout "$T_TESTS" "$PY" -m pytest -q -p no:cacheprovider -o addopts="" -rs --junitxml="$OUT_DIR/tests.xml" \
  tests/gpu tests/unit/test_device_seam.py tests/unit/test_pcp_device.py tests/unit/test_device_reads.py
RC_TESTS=$?

echo "== 2. data path without vLLM ($DEVICE, $LAYOUT layout)"
timeout "$T_DATA" "$PY" tests/unit/data_path_child.py --device "$DEVICE" --layout "$LAYOUT" > "$OUT_DIR/data_path.raw"
RC_DATA=$?
tail -n 1 "$OUT_DIR/data_path.raw" > "$OUT_DIR/data_path.json"; rm -f "$OUT_DIR/data_path.raw"

echo "== 3. sweep ($SIZE)"
timeout "$T_SWEEP" "$PY" bench/gpu_sweep.py --device "$DEVICE" --size "$SIZE" --out "$OUT_DIR/sweep.json"
RC_SWEEP=$?

echo "== report: $OUT_DIR/gpu_check.json"
"$PY" bench/gpu_check_report.py "$OUT_DIR" --mode "$MODE" --rc-tests "$RC_TESTS" --rc-data-path "$RC_DATA" \
  --rc-sweep "$RC_SWEEP"
