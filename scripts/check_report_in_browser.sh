#!/usr/bin/env bash
# Render `range-connector report` of some result files and screenshot the page in headless Chromium (issue 19, item 4).
#
#   scripts/check_report_in_browser.sh [RESULT.json ...]    (default: every bench/results/*.json)
#
# Writes $OUT_DIR/report.html and $OUT_DIR/report.png (OUT_DIR defaults to ${TMPDIR:-/tmp}/range-report-check) and
# checks that the screenshot shows the plots (coloured pixels; a broken image would show none). Chromium runs with
# every host name unresolvable, so a page that needed the network would show it. Debian's `chromium` is installed
# with apt-get when no chromium is on PATH; when apt cannot reach a mirror the script says so and exits 3.
# Environment: PYTHON (default .venv/bin/python of the repository), OUT_DIR, WINDOW (default 1280,3200: width,height
# in CSS pixels; headless Chromium shoots the window, not the whole page).
# Exit status: 0 ok, 1 the report or the screenshot failed, 2 no result files, 3 no chromium and none installable.
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PYTHON=${PYTHON:-$REPO/.venv/bin/python}
OUT_DIR=${OUT_DIR:-${TMPDIR:-/tmp}/range-report-check}
WINDOW=${WINDOW:-1280,3200}

results=("$@")
if [ ${#results[@]} -eq 0 ]; then
    shopt -s nullglob
    results=("$REPO"/bench/results/*.json)
    shopt -u nullglob
fi
if [ ${#results[@]} -eq 0 ]; then
    echo "error: no result files given and none in $REPO/bench/results (bench/replay.py, bench/*.py and make demo write them)" >&2
    exit 2
fi
if [ ! -x "$PYTHON" ]; then
    echo "error: no Python at $PYTHON (make venv, or set PYTHON)" >&2
    exit 1
fi

find_chromium() {
    local name
    for name in chromium chromium-browser google-chrome; do
        if command -v "$name" >/dev/null 2>&1; then
            command -v "$name"
            return 0
        fi
    done
    return 1
}

if ! CHROMIUM=$(find_chromium); then
    echo "no chromium on PATH: installing Debian's chromium with apt-get"
    SUDO=()
    if [ "$(id -u)" -ne 0 ]; then
        if ! command -v sudo >/dev/null 2>&1; then
            echo "error: chromium is not installed and installing it needs root (apt-get install chromium)" >&2
            exit 3
        fi
        SUDO=(sudo)
    fi
    update_log=$(mktemp)
    if ! "${SUDO[@]}" apt-get update -q >"$update_log" 2>&1 || grep -qE '^(W|E): (Failed to fetch|Some index files)' "$update_log"; then
        tail -5 "$update_log" >&2
        echo "error: apt-get update could not reach a Debian mirror from here, so chromium cannot be installed;" \
             "install it by hand (apt-get install chromium) or run this where a mirror is reachable" >&2
        rm -f "$update_log"
        exit 3
    fi
    rm -f "$update_log"
    if ! DEBIAN_FRONTEND=noninteractive "${SUDO[@]}" apt-get install -y -q --no-install-recommends chromium; then
        echo "error: apt-get install chromium failed (see above): no chromium, no screenshot" >&2
        exit 3
    fi
    CHROMIUM=$(find_chromium) || { echo "error: chromium installed but not on PATH" >&2; exit 3; }
fi
echo "chromium: $CHROMIUM ($("$CHROMIUM" --version 2>/dev/null || echo 'version unknown'))"

mkdir -p "$OUT_DIR"
HTML=$OUT_DIR/report.html
PNG=$OUT_DIR/report.png
rm -f "$HTML" "$PNG"
PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}" "$PYTHON" -m range_connector.cli report "${results[@]}" -o "$HTML"

profile=$(mktemp -d)
trap 'rm -rf "$profile"' EXIT
# --no-sandbox: Chromium's sandbox refuses to run as root; the page is our own file and has no script.
timeout 120 "$CHROMIUM" --headless=new --no-sandbox --disable-gpu --hide-scrollbars --no-first-run \
    --disable-extensions --disable-background-networking --disable-sync --user-data-dir="$profile" \
    --host-resolver-rules="MAP * ~NOTFOUND" --window-size="$WINDOW" --screenshot="$PNG" "file://$HTML" \
    2> >(grep -vE 'dbus|Fontconfig|gpu|GPU|sandbox' >&2 || true)
if [ ! -s "$PNG" ]; then
    echo "error: chromium wrote no screenshot" >&2
    exit 1
fi

"$PYTHON" - "$PNG" <<'PY'
import sys

import numpy as np
from PIL import Image

pixels = np.asarray(Image.open(sys.argv[1]).convert("RGB")).astype(np.int16)
coloured = int(((pixels.max(axis=2) - pixels.min(axis=2)) > 60).sum())
height, width, _ = pixels.shape
print(f"screenshot {sys.argv[1]}: {width} x {height} pixels, {coloured} coloured (plot) pixels")
if coloured < 1000:
    sys.exit("error: the screenshot shows no plot (fewer than 1000 coloured pixels)")
PY
echo "page: $HTML"
