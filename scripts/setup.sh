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
# Debian's own python3 (3.11 on Debian 12) unless PYTHON says otherwise: it is built with optimisations, and
# coli's per-token Python overhead is measurably lower on it than on an unoptimised local build.
if [ -z "${PYTHON:-}" ] && [ -x /usr/bin/python3 ] && /usr/bin/python3 -c 'import venv, ensurepip' 2>/dev/null; then
  PY=/usr/bin/python3
else
  PY=${PYTHON:-python3}
fi
if ! "$PY" -c 'import venv, ensurepip' 2>/dev/null; then
  echo "coli: $PY has no venv/ensurepip: install python3-venv (apt-get install python3-venv, as root)" >&2
  exit 1
fi
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
# pip -q prints nothing for the minutes it takes (3.5 min on a 2-core VM): say what is going on
echo "coli: installing the pinned Python packages into $(pwd)/.venv (a few minutes; pip is quiet)" >&2
.venv/bin/python -m pip install -q --disable-pip-version-check -e '.[test]'
echo "coli: installed in $(pwd)/.venv ($(.venv/bin/python --version))" >&2
