"""A pytest plugin that times Numba's compiles: per function and argument types the seconds spent compiling it
(its own, without the callees it compiled on the way), and per test the compile seconds it paid; written at the
end of the session. Loads from the disk cache are not compiles and do not count. Subprocesses a test starts are
not seen (their compiles land in the same cache folder: scripts/numba_cache_index.py lists it). Not a test.

    PYTHONPATH=scripts python -m pytest -p numba_compile_profile [pytest args]
    # -> $NUMBA_PROFILE_OUT (default: numba_compile_profile.txt in the temporary folder), path printed at the end

Uses Numba's ``numba:compile`` events (``numba.core.event``), installed at start-up after importing
``cpu_kernels`` (which must choose the threading layer before numba is imported; run from the repository root):
compiles at import (explicit signatures) count under ``<collection>``."""
from __future__ import annotations

import collections
import os
import tempfile
import time

_stack: list = []        # [start, seconds of nested compiles] per open compile
_rows: list = []         # (test, function, argument types, own seconds)
_test = ["<collection>"]
_on = [False]


def _out() -> str:
    return os.environ.get("NUMBA_PROFILE_OUT") or os.path.join(tempfile.gettempdir(), "numba_compile_profile.txt")


def pytest_configure(config):
    import cpu_kernels  # noqa: F401  (before numba)
    from numba.core import event

    class Timer(event.Listener):
        def on_start(self, ev):
            _stack.append([time.perf_counter(), 0.0])

        def on_end(self, ev):
            t0, nested = _stack.pop()
            dt = time.perf_counter() - t0
            if _stack:
                _stack[-1][1] += dt
            f = getattr((ev.data or {}).get("dispatcher"), "py_func", None)
            name = f"{getattr(f, '__module__', '?')}.{getattr(f, '__qualname__', '?')}"
            _rows.append((_test[0], name, str((ev.data or {}).get("args")), dt - nested))

    event.register("numba:compile", Timer())
    _on[0] = True


def pytest_runtest_setup(item):
    _test[0] = item.nodeid


def pytest_sessionfinish(session):
    if not _on[0]:
        return
    by_fn = collections.defaultdict(list)
    by_test = collections.defaultdict(float)
    for test, fn, args, s in _rows:
        by_fn[fn].append((s, args, test))
        by_test[test] += s
    with open(_out(), "w") as f:
        f.write(f"{sum(r[3] for r in _rows):.1f} s compiling, {len(_rows)} compiles\n\nper function (own seconds)\n")
        for fn, xs in sorted(by_fn.items(), key=lambda kv: -sum(x[0] for x in kv[1])):
            f.write(f"{sum(x[0] for x in xs):8.1f} s {len(xs):3d} x {fn}\n")
            if len(xs) > 1 or sum(x[0] for x in xs) > 5:
                for s, args, test in sorted(xs, reverse=True):
                    f.write(f"           {s:7.1f} s  {test}  {args[:400]}\n")
        f.write("\nper test\n")
        for test, s in sorted(by_test.items(), key=lambda kv: -kv[1]):
            if s >= 0.5:
                f.write(f"{s:8.1f} s {test}\n")


def pytest_terminal_summary(terminalreporter):
    if _on[0]:
        terminalreporter.write_line(f"numba compile profile: {_out()}")
