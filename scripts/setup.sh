#!/usr/bin/env bash
# Install everything coli needs on a Debian 12 machine: apt packages (as root), a venv in .venv, pinned
# Python packages, the package itself (editable). Safe to run again.
set -euo pipefail
cd "$(dirname "$0")/.."
if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
    python3 python3-venv python3-pip ca-certificates libvulkan1 mesa-vulkan-drivers glslc >/dev/null
fi
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --disable-pip-version-check -e '.[test]'
echo "coli: installed in $(pwd)/.venv ($(.venv/bin/python --version))" >&2
