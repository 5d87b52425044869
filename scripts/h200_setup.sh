# Sourced (not run) by the H200 scripts (h200_check.sh, h200_tier_run.sh): the set-up of a
# fresh H200 machine (docs/h200.md) from the carried folders: the Vulkan loader .debs of .gl unpacked into / (when
# .gl was carried), the Python 3.12 wheels of .whl and .whl_tier into /tmp/site, TBB's libraries taken out of its
# wheel into /tmp/site/lib (`pip --target` drops a wheel's data/lib; without them Numba falls back to OpenMP).
# Exports PYTHONPATH, LD_LIBRARY_PATH, VK_DRIVER_FILES. Needs $PY. Returns 2 when the wheels do not install.
if [ -d .gl ]; then
  for f in .gl/*.deb; do dpkg -x "$f" /; done
  ldconfig
fi
export VK_DRIVER_FILES=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json
$PY -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl .whl_tier/*.whl || return 2
$PY - <<'PYEOF' || return 2
import glob, os, zipfile
os.makedirs("/tmp/site/lib", exist_ok=True)
for w in glob.glob(".whl_tier/tbb-*.whl") + glob.glob(".whl_tier/tcmlib-*.whl"):
    with zipfile.ZipFile(w) as z:
        for n in z.namelist():
            if "/data/lib/" in n:
                open("/tmp/site/lib/" + os.path.basename(n), "wb").write(z.read(n))
print("TBB libraries:", sorted(os.listdir("/tmp/site/lib")))
PYEOF
export PYTHONPATH=/tmp/site:$PWD
export LD_LIBRARY_PATH=/tmp/site/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
