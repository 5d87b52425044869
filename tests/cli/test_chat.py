"""``coli chat`` on a pseudo-terminal (pexpect): the answers equal the library's greedy chat on the same
messages (SmolLM2, f32 activations), the KV cache carries across turns, /reset forgets, Ctrl-C stops an
answer and not the program, Ctrl-C at the prompt ends it with status 130 (llama-cli's), /exit with 0."""
from __future__ import annotations

import os
import re
import signal
import sys

import pytest

from conftest import ROOT

pexpect = pytest.importorskip("pexpect")

N = 40
CTX = 1024
Q1 = "What is the capital of France?"
Q2 = "And of Italy?"
LONG = "Write a long story about a dragon who learns to cook."


def _sigint_default() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _tty(s: str) -> str:
    return s.replace("\n", "\r\n")


def test_chat_repl(model_path, engine):
    ref = engine(model_path("smollm2"), ctx=CTX, cpu_act="f32")
    kw = dict(max_tokens=N, temp=0.0, keep_kv=False)
    a1 = ref.chat([{"role": "user", "content": Q1}], **kw)
    long_ = ref.chat([{"role": "user", "content": LONG}], **kw)
    assert long_.finish_reason == "length"  # the answer Ctrl-C interrupts is longer than what we wait for

    env = dict(os.environ, PYTHONPATH=str(ROOT))
    child = pexpect.spawn(sys.executable, ["-m", "coli", "chat", "-m", str(ref.path), "--ctx", str(CTX),
                                           "--cpu-act", "f32", "--temp", "0", "-n", str(N)],
                          cwd=str(ROOT), env=env, encoding="utf-8", timeout=240, dimensions=(50, 400),
                          # as from a shell: a pytest-xdist worker ignores SIGINT, an ignored SIGINT is inherited,
                          # and coli keeps it ignored (a background job's), so Ctrl-C would do nothing
                          preexec_fn=_sigint_default)
    try:
        child.expect_exact("> ")
        # turn 1: the library's answer, streamed
        child.sendline(Q1)
        child.expect_exact(_tty(a1.text) + "\r\n")
        child.expect(r"coli: (\d+) new prompt tokens \((\d+) reused")
        first_prompt = int(child.match.group(1)) + int(child.match.group(2))
        assert first_prompt == len(a1.prompt_ids)
        # turn 2: the conversation so far is reused from the KV cache
        child.expect_exact("> ")
        child.sendline(Q2)
        a2 = ref.chat([{"role": "user", "content": Q1}, {"role": "assistant", "content": a1.text},
                       {"role": "user", "content": Q2}], **kw)
        child.expect_exact(_tty(a2.text) + "\r\n")
        child.expect(r"coli: (\d+) new prompt tokens \((\d+) reused")
        assert int(child.match.group(2)) >= first_prompt
        # /reset: the next answer is the fresh one again
        child.expect_exact("> ")
        child.sendline("/reset")
        child.expect_exact("conversation reset")
        child.expect_exact("> ")
        child.sendline(Q1)
        child.expect_exact(_tty(a1.text) + "\r\n")
        # Ctrl-C during an answer: the answer stops, the REPL goes on
        child.expect_exact("> ")
        child.sendline(LONG)
        child.expect_exact(LONG + "\r\n")  # the terminal's echo
        child.expect_exact(long_.text.split()[0])
        child.sendintr()
        child.expect_exact("coli: stopped")
        child.expect(r"coli: (\d+) new prompt tokens \((\d+) reused from the KV cache\), prefill (\d+) tok at [\d.]+ "
                     r"tok/s, decode (\d+) tok")
        new, reused, prefilled, decoded = (int(g) for g in child.match.groups())
        assert decoded < N
        assert reused > 0 and prefilled == new   # the stats count the tokens prefilled, not the reused prefix
        child.expect_exact("> ")
        child.sendintr()  # at the prompt: quits (it re-prompted; llama-cli exits 130)
        child.expect(pexpect.EOF)
    finally:
        child.close()
    assert child.exitstatus == 130 and "coli: interrupted" in child.before and "Traceback" not in child.before, \
        child.before


def test_chat_exit_command_ends_with_status_0():
    """/exit (and /quit, /bye) end the REPL with status 0 before any message reaches the engine."""
    from types import SimpleNamespace

    from coli.chat import run_chat

    for cmd in ("/exit", "/quit", "/bye"):
        lines = iter(["", cmd, "never read"])
        assert run_chat(None, SimpleNamespace(system=None, quiet=True), inp=lambda _p: next(lines),
                        out=sys.stdout) == 0
        assert next(lines) == "never read"


def test_chat_no_template_is_one_error(tmp_path):
    """A file that is not GGUF: one line naming it, status 2, no traceback."""
    bad = tmp_path / "x.gguf"
    bad.write_bytes(b"not a gguf file at all")
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    child = pexpect.spawn(sys.executable, ["-m", "coli", "chat", "-m", str(bad)], cwd=str(ROOT), env=env,
                          encoding="utf-8", timeout=120)
    child.expect(pexpect.EOF)
    child.close()
    out = child.before
    assert child.exitstatus == 2 and "Traceback" not in out
    assert re.search(r"coli: .*x\.gguf", out)


def test_chat_input_that_is_not_utf8(capsys):
    """Invalid bytes on stdin: a line read with surrogateescape (the C locale) is skipped with one line naming
    stdin and the byte, the chat goes on; a strict stdin that cannot decode ends it with one ColiError (the CLI's
    exit 2), as a non-UTF-8 ``coli run`` prompt does. The engine is never reached with either."""
    from types import SimpleNamespace

    from coli.base.errors import ColiError
    from coli.chat import run_chat

    lines = iter(["hi \udcff\udcfe there"])

    def inp(_prompt):
        try:
            return next(lines)
        except StopIteration:
            raise EOFError from None

    a = SimpleNamespace(system=None, quiet=True)
    assert run_chat(None, a, inp=inp, out=sys.stdout) == 0
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "stdin: not valid Unicode: a lone surrogate U+DCFF at character 3, the byte " \
                                    "0xFF that is not UTF-8" in err and "line skipped" in err

    def strict(_prompt):
        b"\xff".decode("utf-8")

    with pytest.raises(ColiError, match=r"^stdin: not UTF-8 text \(byte 0\)$"):
        run_chat(None, a, inp=strict, out=sys.stdout)


def test_chat_unknown_command_is_not_a_message(capsys):
    """A line that is one unknown /word (a mistyped /exit) is said to be an unknown command and never reaches the
    engine (None here); /help and a message that only starts with a path are not taken for one."""
    from types import SimpleNamespace

    from coli.chat import run_chat

    lines = iter(["/exti", "/help", "/exit"])

    def inp(_prompt):
        return next(lines)

    assert run_chat(None, SimpleNamespace(system=None, quiet=True), inp=inp, out=sys.stdout) == 0
    err = capsys.readouterr().err.splitlines()
    assert err[0] == "coli: unknown command /exti (/help lists them)" and err[1].startswith("coli: /reset forgets")
    assert len(err) == 2


def _opts(**kw):
    import argparse

    d = dict(system=None, n=8, temp=0.0, top_k=40, top_p=0.95, min_p=0.05, repeat_penalty=1.0, repeat_last_n=64,
             stop=None, seed=0, quiet=False)
    d.update(kw)
    return argparse.Namespace(**d)


def _feed(lines):
    it = iter(lines)

    def inp(prompt):
        try:
            return next(it)
        except StopIteration:
            raise EOFError from None
    return inp


def test_read_message_blocks_and_pastes():
    """A message of several lines: between lines of three double quotes (first and last line may carry text), or
    a bracketed paste whose markers reach ``input`` (no readline): the lines up to the end marker."""
    from coli.chat import read_message

    assert read_message(_feed(['"""', "a", 'b"""'])) == "a\nb"
    assert read_message(_feed(['"""x', "", "a", '"""'])) == "x\n\na"
    assert read_message(_feed(['"""one"""'])) == "one"
    assert read_message(_feed(["\x1b[200~l1", "l2", "l3\x1b[201~"])) == "l1\nl2\nl3"
    assert read_message(_feed(["plain"])) == "plain"


def test_chat_full_context_drops_the_oldest_turns(model_path, engine, capsys):
    """A conversation that no longer leaves ``-n`` positions in the context: the oldest turn is dropped, said in
    one line, and the answer is the library's answer to the conversation without it (it was an error, a dead end
    until /reset)."""
    import io

    from coli.chat import run_chat

    ref = engine(model_path("smollm2"), ctx=CTX, cpu_act="f32")
    kw = dict(max_tokens=8, temp=0.0, keep_kv=False)
    qs = ["Name a fruit.", "Name a colour.", "Name an animal."]
    m = []
    for q in qs[:2]:
        m += [{"role": "user", "content": q}, {"role": "assistant", "content": ref.chat(m + [{"role": "user", "content": q}], **kw).text}]
    full = len(ref.chat_ids(m + [{"role": "user", "content": qs[2]}]))
    kept = m[2:] + [{"role": "user", "content": qs[2]}]
    want = ref.chat(kept, **kw).text
    from coli.engine import Engine

    with Engine(ref.path, ctx=full + 8 - 1, cpu_act="f32", save_usage=False) as eng:  # one position short
        out = io.StringIO()
        assert run_chat(eng, _opts(n=8), inp=_feed(qs), out=out) == 0
    answers = out.getvalue().split("\n")
    assert answers[2] == want, out.getvalue()
    err = capsys.readouterr().err
    assert err.count("is full") == 1 and f"coli: the context ({full + 7} positions) is full: the oldest 1 turn dropped" in err


def test_chat_paste_of_several_lines_is_one_message(model_path, engine):
    """A terminal paste of three lines (bracketed paste, readline's by default) is one message: the answer is the
    library's to that message, and the next prompt comes once."""
    ref = engine(model_path("smollm2"), ctx=CTX, cpu_act="f32")
    msg = "Here is a list:\napples\npears"
    a1 = ref.chat([{"role": "user", "content": msg}], max_tokens=12, temp=0.0, keep_kv=False)
    env = dict(os.environ, PYTHONPATH=str(ROOT), TERM="xterm")
    child = pexpect.spawn(sys.executable, ["-m", "coli", "chat", "-m", str(ref.path), "--ctx", str(CTX),
                                           "--cpu-act", "f32", "--temp", "0", "-n", "12"],
                          cwd=str(ROOT), env=env, encoding="utf-8", timeout=240, dimensions=(50, 400),
                          # as from a shell: a pytest-xdist worker ignores SIGINT, an ignored SIGINT is inherited,
                          # and coli keeps it ignored (a background job's), so Ctrl-C would do nothing
                          preexec_fn=_sigint_default)
    try:
        child.expect_exact("> ")
        child.send("\x1b[200~" + msg + "\x1b[201~")
        child.send("\r")
        child.expect(r"coli: (\d+) new prompt tokens \((\d+) reused")
        assert int(child.match.group(1)) + int(child.match.group(2)) == len(a1.prompt_ids)
        assert _tty(a1.text) in child.before
        child.expect_exact("> ")
        child.sendline("/exit")
        child.expect(pexpect.EOF)
    finally:
        child.close()
    assert child.exitstatus == 0


def test_chatml_fallback_warns_and_stops_at_im_end(model_path, capsys):
    """Gemma-3-270M (no chat template) in a chat: one warning that the ChatML fallback runs, and the fallback's
    end of turn ``<|im_end|>`` ends the answer (it was printed and generation went on): the answer is the text
    of the same greedy generation without the stop, cut before its first ``<|im_end|>``."""
    import io

    from coli.chat import run_chat
    from coli.engine import Engine

    with Engine(model_path("gemma3"), ctx=256, cpu_act="f32", save_usage=False, quiet=False) as eng:
        msgs = [{"role": "user", "content": "What is the capital of France?"}]
        raw = eng.generate(ids=eng.chat_ids(msgs), max_tokens=40, temp=0.0).text
        assert "<|im_end|>" in raw  # the model writes the marker: without the stop it is printed and it goes on
        r = eng.chat(msgs, max_tokens=40, temp=0.0, keep_kv=False)
        assert r.text == raw.split("<|im_end|>")[0] and r.finish_reason == "stop"
        out = io.StringIO()
        run_chat(eng, _opts(n=40, quiet=True), inp=_feed([msgs[0]["content"]]), out=out)
        assert out.getvalue().split("\n")[0] == r.text
    err = capsys.readouterr().err
    assert err.count("has no tokenizer.chat_template: using llama.cpp's fallback, ChatML") == 1, err
