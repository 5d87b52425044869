"""What a first run shows while the kernels compile: on a terminal the model's text is never erased by the compile
bar (it redrew its line with ``\\r`` and erased the echoed prompt and the first tokens); in a pipe one line says
kernels compile and about how long (there was nothing for minutes). A cold cache is simulated: the driver below
fires Numba's ``numba:compile`` event (the one a cache miss fires) around the prefill and the first decode step,
so the test takes seconds instead of the minutes of a real first compile."""
from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from conftest import ROOT

pexpect = pytest.importorskip("pexpect")

DRIVER = r"""
import os, sys, time
COMPILING = [int(c) for c in os.environ.get("TEST_COMPILING", "1,2").split(",")]
import cpu_kernels  # before numba: it picks the threading layer
import numba.core.event as ev
import coli.engine as E

orig = E.Engine.__init__


def init(self, *a, **kw):
    orig(self, *a, **kw)
    fwd, calls = self.model.forward, [0]

    def forward(*a, **kw):
        calls[0] += 1
        if calls[0] in COMPILING:  # the prefill and the first decode step compile, as on a cold cache
            ev.start_event("numba:compiler_lock")
            ev.start_event("numba:compile")
            time.sleep(0.4)
            ev.end_event("numba:compile")
            ev.end_event("numba:compiler_lock")
        return fwd(*a, **kw)
    self.model.forward = forward


E.Engine.__init__ = init
from coli.cli import main
sys.exit(main(sys.argv[1:]))
"""
P = "The capital of France is"
ARGS = ["-m", "smollm2", "--cpu-act", "f32", "--temp", "0", "-n", "8"]


@pytest.fixture(scope="module")
def want(model_path, engine):
    return engine(model_path("smollm2"), cpu_act="f32").generate(P, max_tokens=8, temp=0.0).text


def _env():
    return dict(os.environ, PYTHONPATH=str(ROOT), TERM="xterm")


def _erasing(s: str) -> list[str]:
    """What in a terminal's byte stream moves back over a line: a carriage return not part of a newline, or a
    CSI escape (cursor movement, erase in line)."""
    return re.findall(r"\r(?!\n)|\x1b\[[0-9;?]*[A-Za-z]", s)


def test_terminal_run_keeps_the_text(want):
    child = pexpect.spawn(sys.executable, ["-c", DRIVER, "run", *ARGS, "-p", P], cwd=str(ROOT), env=_env(),
                          encoding="utf-8", timeout=240, dimensions=(40, 200))
    child.expect(pexpect.EOF)
    child.close()
    out = child.before
    assert child.exitstatus == 0, out
    assert "compiling the CPU kernels, once" in out  # the bar was drawn, on its own line
    i = out.index(P)
    assert out[i:].startswith(P + want.replace("\n", "\r\n") + "\r\n"), out
    assert _erasing(out[i:]) == [], repr(out[i:])  # nothing after the first character of text moves back over it


def test_terminal_chat_keeps_the_first_answer(model_path, engine):
    ref = engine(model_path("smollm2"), cpu_act="f32", ctx=256)
    a1 = ref.chat([{"role": "user", "content": "Hi"}], max_tokens=8, temp=0.0, keep_kv=False).text
    child = pexpect.spawn(sys.executable, ["-c", DRIVER, "chat", *ARGS, "--ctx", "256"], cwd=str(ROOT),
                          env=_env(), encoding="utf-8", timeout=240, dimensions=(40, 200))
    try:
        child.expect_exact("> ")
        child.sendline("Hi")
        child.expect_exact("\r\n> ")
        shown = child.before
        child.sendline("/exit")
        child.expect(pexpect.EOF)
    finally:
        child.close()
    assert "compiling the CPU kernels, once" in shown
    tail = shown[shown.index(a1.replace("\n", "\r\n")):]
    assert _erasing(tail) == [], repr(tail)


def test_piped_run_says_once_that_kernels_compile(want, tmp_path):
    r = subprocess.run([sys.executable, "-c", DRIVER, "run", *ARGS, "-p", P], capture_output=True, text=True,
                       cwd=ROOT, env=_env(), timeout=240)
    assert r.returncode == 0, r.stderr
    assert r.stdout == P + want + "\n"
    lines = [l for l in r.stderr.splitlines() if "compil" in l and not l.startswith("coli: prefill")]  # stats apart
    assert lines == [f"coli: compiling the CPU kernels, once: about 5 minutes on a first run, longer on a busy "
                     f"machine; later runs load them from {os.environ['NUMBA_CACHE_DIR']}"], r.stderr
    assert r.stderr.index(lines[0]) < r.stderr.index("prefill")  # before the stats line, not after the wait


def test_a_compile_in_the_first_decode_step_does_not_split_the_text(want):
    """Only the first decode step compiles (a path the prompt's step did not take: the device layers' CPU join, a
    partly warm cache), stdout and stderr in one file: the notice comes before the text, which is whole (the
    first piece was written before the compile started, and the notice split it). The closing line gives the
    compile's seconds apart from the speeds, as llama.cpp gives its load time."""
    r = subprocess.run([sys.executable, "-c", DRIVER, "run", *ARGS, "-p", P], stdout=subprocess.PIPE,
                       stderr=subprocess.STDOUT, text=True, cwd=ROOT, env=dict(_env(), TEST_COMPILING="2"),
                       timeout=240)
    assert r.returncode == 0, r.stdout
    assert P + want + "\n" in r.stdout and r.stdout.index("compiling the CPU kernels") < r.stdout.index(P), r.stdout
    kernels = re.search(r"\| kernels (\d+\.\d) s \(compiled or loaded from the cache; not in the speeds\)", r.stdout)
    assert kernels and float(kernels[1]) >= 0.4, r.stdout


def test_quiet_run_gives_no_compile_notice(want):
    """``-q`` (stdout and errors only): no compile line in a pipe, no bar on a terminal; the text is the same."""
    r = subprocess.run([sys.executable, "-c", DRIVER, "run", *ARGS, "-q", "-p", P], capture_output=True, text=True,
                       cwd=ROOT, env=_env(), timeout=240)
    assert r.returncode == 0, r.stderr
    assert r.stdout == P + want + "\n" and "compil" not in r.stderr, r.stderr
    child = pexpect.spawn(sys.executable, ["-c", DRIVER, "run", *ARGS, "-q", "-p", P], cwd=str(ROOT), env=_env(),
                          encoding="utf-8", timeout=240, dimensions=(40, 200))
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0 and "compil" not in child.before, child.before
    assert P + want.replace("\n", "\r\n") in child.before


def test_the_logged_notice_starts_its_own_line():
    """Piped, the notice follows model text on a line of its own (stdout and stderr often share one file): a newline
    first when text holds the current line, none otherwise."""
    from coli.base import progress

    try:
        progress.text_on_line(True)
        assert progress.notice_line() == "\ncoli: " + progress.compile_notice()
        progress.text_on_line(False)
        assert progress.notice_line() == "coli: " + progress.compile_notice()
    finally:
        progress.text_on_line(False)
