#!/usr/bin/env bash
# On the H200 machine (device tool): the device test suites at the current tree, then the tier speed run.
#   run tool: command "bash scripts/h200_check.sh", carry [".gl", ".whl", ".whl_tier"], timeout_s 600
# 1. set-up as scripts/h200_tier_run.sh does (loader .debs, Python 3.12 wheels, TBB's libraries);
# 2. pytest: tests/test_vulkan.py, test_vulkan_alloc.py, test_tier_device.py, test_oracles.py, test_threading.py
#    (the suites that need no downloaded model) on the NVIDIA device;
# 3. scripts/h200_tier_run.sh's coli bench arms (CPU only; tier and balanced at 25/50/75 % resident).
set -u
OUT=${OUT:-/tmp/h2out}; mkdir -p "$OUT"
for f in .gl/*.deb; do dpkg -x "$f" /; done; ldconfig
export VK_DRIVER_FILES=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl .whl_tier/*.whl || exit 2
python3 - <<'PY'
import glob, os, zipfile
os.makedirs("/tmp/site/lib", exist_ok=True)
for w in glob.glob(".whl_tier/tbb-*.whl") + glob.glob(".whl_tier/tcmlib-*.whl"):
    with zipfile.ZipFile(w) as z:
        for n in z.namelist():
            if "/data/lib/" in n:
                open("/tmp/site/lib/" + os.path.basename(n), "wb").write(z.read(n))
PY
export PYTHONPATH=/tmp/site:$PWD LD_LIBRARY_PATH=/tmp/site/lib NUMBA_CACHE_DIR=/tmp/nbcache PYTHONUNBUFFERED=1
export COLI_CACHE=/tmp/colicache
python3 -c "import cpu_kernels as c; print('threading', c.threading_layer(), 'DEFAULT_ACT', c.DEFAULT_ACT, 'threads', c.default_threads())"
timeout ${H2_PYTEST_S:-200} python3 -m pytest -q -p no:cacheprovider tests/test_vulkan.py tests/test_vulkan_alloc.py \
  tests/test_tier_device.py tests/test_oracles.py tests/test_threading.py 2>&1 | tee "$OUT/pytest.log" | tail -15
H2_SETUP=0 PY=python3 H2_BT=" " OUT="$OUT" bash scripts/h200_tier_run.sh
