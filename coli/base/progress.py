"""Progress on long work (tqdm on stderr, only when stderr is a terminal) and the Numba compile clock.

* :func:`bar` — a ``tqdm`` bar that is disabled (prints nothing) unless stderr is a terminal, so logs, pipes
  and CI see no control characters. Used for model downloads (coli/fetch.py), the demo build
  (coli/demo.py), perplexity windows, warm start and ``coli tune`` points.
* :func:`compile_seconds` — seconds this thread has spent holding Numba's compiler lock (compiling a
  kernel, or loading it from Numba's on-disk cache), counted from numba's event API
  (``numba.core.event``, kind ``"numba:compiler_lock"``). Timed regions subtract it, so first-run
  compilation is never counted in prefill or decode tok/s.
* While Numba compiles a kernel (event ``"numba:compile"``, a cache miss) a bar "compiling the CPU kernels,
  once" counts the kernels compiled when stderr is a terminal; :func:`end_compile_bar` closes it (the engine
  calls it when a public call returns). When stderr is not a terminal (a pipe, CI, docker logs) the first
  compile prints one line instead, once a process: what compiles, about how long, where it is cached.
  :func:`quiet` turns both off (the CLI's ``-q``).
  :func:`compiles` gives the process's top-level compiles and their seconds.
* :class:`HoldFirst` keeps a generation's text off the terminal line while the first tokens' kernels compile
  (in a process's first generation, through its first decode step),
  and no bar is drawn while model text holds the current line (:func:`text_on_line`): a bar redraws its line
  with ``\r`` and would erase the text there.
"""
from __future__ import annotations

import sys
import threading
import time

_local = threading.local()
_installed = False
_install_lock = threading.Lock()
_compile_bar = None
_bar_lock = threading.Lock()
_compiles = [0, 0.0, 0, 0.0]   # top-level compiles, their seconds, nesting depth, start of the open one
# model text on the terminal's current line; the compile notice given; no notice at all (the CLI's -q); a
# generation of this process has run a decode step (its kernels are compiled or loaded)
_line = {"text": False, "told": False, "quiet": False, "stepped": False, "kept": True}
COMPILE_NOTE = "compiling the CPU kernels, once: about 5 minutes on a first run, longer on a busy machine"
UNKEPT_NOTE = ("compiling the CPU kernels: about 5 minutes, longer on a busy machine; with no writable cache folder "
               "(the warning above) every run compiles them again")


def cache_not_kept() -> None:
    """Say that Numba's cache is a folder of this process only (cpu_kernels: no writable cache folder): the
    compile notice then says every run compiles, not that later runs load the kernels."""
    _line["kept"] = False


def compile_notice() -> str:
    """The line a first compile prints when stderr is not a terminal (without the ``coli: `` prefix)."""
    import os

    if not _line["kept"]:
        return UNKEPT_NOTE
    d = os.environ.get("NUMBA_CACHE_DIR")
    return COMPILE_NOTE + (f"; later runs load them from {d}" if d else "")


def notice_line() -> str:
    """The compile notice as a log gets it: ``coli: `` and :func:`compile_notice`, on a line of its own (after a
    newline when model text holds the current line: stdout and stderr often share one terminal or file)."""
    return ("\n" if _line["text"] else "") + f"coli: {compile_notice()}"


def quiet(on: bool = True) -> None:
    """Give no compile notice in this process, neither the bar nor the logged line (the CLI's ``-q``: stdout and
    errors only); the compiles are still counted."""
    _line["quiet"] = bool(on)


def text_on_line(on: bool) -> None:
    """Say whether model text now holds the terminal's current line (no compile bar is drawn while it does)."""
    _line["text"] = bool(on)


def compiled_any() -> bool:
    """True once this process has started compiling a kernel (a cold cache: the next calls may compile too)."""
    with _bar_lock:
        return _compiles[0] > 0 or _compiles[2] > 0


class HoldFirst:
    """A writer of a generation's text pieces (``write(str)``) that holds ``head`` (the echoed prompt) and the
    first piece back until the second, through the first decode step, in a process's first generation and while
    kernels compile: that step may compile kernels the prompt's did not (a cold cache, or a path first taken
    there), and its notice or bar then has a line of its own before the text instead of splitting or erasing it
    (the text waits one decode step). Call :meth:`flush` when the generation ends or fails. Tells
    :func:`text_on_line`."""

    def __init__(self, write, head: str = ""):
        self.write, self.buf, self.n = write, [head] if head else [], 0

    def __call__(self, s: str) -> None:
        self.n += 1
        self.buf.append(s)
        if self.n < 2 and (compiled_any() or not _line["stepped"]):
            return
        _line["stepped"] = True
        self.flush()

    def flush(self) -> None:
        text = "".join(self.buf)
        self.buf.clear()
        if text:
            self.write(text)
            text_on_line(not text.endswith("\n"))


def stderr_is_terminal() -> bool:
    try:
        return sys.stderr is not None and sys.stderr.isatty()
    except (AttributeError, ValueError):
        return False


def bar(total=None, desc: str = "", unit: str = "it", **kw):
    """A ``tqdm`` progress bar on stderr, never drawn unless stderr is a terminal; ``disable=True`` turns it
    off there too (``None``/``False``: the terminal decides)."""
    from tqdm import tqdm  # tqdm loads only when a bar is drawn

    kw["disable"] = bool(kw.get("disable")) or not stderr_is_terminal()
    return tqdm(total=total, desc=desc, unit=unit, file=sys.stderr, leave=False, dynamic_ncols=True, **kw)


def _state():
    s = getattr(_local, "s", None)
    if s is None:
        s = _local.s = {"depth": 0, "t0": 0.0, "total": 0.0}
    return s


def install() -> None:
    """Register the listeners on numba's event system (idempotent, thread-safe)."""
    global _installed
    if _installed:
        return
    with _install_lock:
        if _installed:
            return
        import numba.core.event as ev  # loads Numba: only when an engine installs the notice

        class _LockClock(ev.Listener):
            # the compiler lock is re-entrant: count only the outermost hold of each thread
            def on_start(self, event):
                s = _state()
                if s["depth"] == 0:
                    s["t0"] = time.perf_counter()
                s["depth"] += 1

            def on_end(self, event):
                s = _state()
                s["depth"] = max(0, s["depth"] - 1)
                if s["depth"] == 0:
                    s["total"] += time.perf_counter() - s["t0"]

        class _CompileBar(ev.Listener):
            # also counts this process's top-level compiles (a compile nests the compiles of its callees)
            def on_start(self, event):
                global _compile_bar
                with _bar_lock:
                    if _compiles[2] == 0:
                        _compiles[3] = time.perf_counter()
                    _compiles[2] += 1
                if _line["quiet"]:
                    return
                if not stderr_is_terminal():
                    with _bar_lock:
                        told, _line["told"] = _line["told"], True
                    if not told:  # a log gets one line, not a silent wait of minutes
                        try:
                            print(notice_line(), file=sys.stderr, flush=True)
                        except (OSError, ValueError, AttributeError):
                            pass
                    return
                with _bar_lock:
                    if _compile_bar is None and not _line["text"]:  # a bar would erase the text on the line
                        _line["told"] = True
                        _compile_bar = bar(desc=f"coli: {COMPILE_NOTE if _line['kept'] else UNKEPT_NOTE}",
                                           unit=" kernels")

            def on_end(self, event):
                with _bar_lock:
                    _compiles[2] = max(0, _compiles[2] - 1)
                    if _compiles[2] == 0:
                        _compiles[0] += 1
                        _compiles[1] += time.perf_counter() - _compiles[3]
                    if _compile_bar is not None:
                        _compile_bar.update(1)

        ev.register("numba:compiler_lock", _LockClock())
        ev.register("numba:compile", _CompileBar())
        _installed = True


def compile_seconds() -> float:
    """Seconds this thread has held Numba's compiler lock since :func:`install` (a monotonic counter)."""
    install()
    s = _state()
    extra = time.perf_counter() - s["t0"] if s["depth"] else 0.0
    return s["total"] + extra


def compiles() -> tuple[int, float]:
    """``(top-level compiles, their wall seconds)`` of this process since :func:`install` (Numba's
    ``"numba:compile"`` events, cache misses; a compile's nested callee compiles are inside its seconds). The test
    suite's summary line prints it (tests/conftest.py)."""
    install()
    with _bar_lock:
        return _compiles[0], _compiles[1]


def end_compile_bar() -> None:
    """Close the "compiling the CPU kernels, once" bar if one is open (its line is cleared)."""
    global _compile_bar
    with _bar_lock:
        if _compile_bar is not None:
            _compile_bar.close()
            _compile_bar = None
