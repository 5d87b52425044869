"""``coli chat``: a multi-turn chat in the terminal, through the model's chat template.

Each turn renders the whole conversation (``--system`` first) with the file's ``tokenizer.chat_template``
and generates the answer with :meth:`coli.Engine.chat`, which keeps the KV cache between turns: only the
tokens after the common prefix with the previous turn are computed (the start line of each answer's speed
line says how many were reused). Commands: ``/reset`` (forget the conversation), ``/exit`` (or Ctrl-D).
Ctrl-C while an answer streams stops that answer (what was printed stays in the conversation); Ctrl-C at the
prompt clears the line.

A message of several lines: paste it (the terminal's bracketed paste: the pasted lines are one message, sent
with Enter), or write it between two lines of three double quotes. When the conversation no longer leaves room for an
answer in the context (``--ctx``; the room is ``-n``, or a quarter of the context with ``-n -1``), its oldest
turns are dropped (the system message stays), said in one line, as llama.cpp's chat shifts its context.
"""
from __future__ import annotations

import re

import signal
import sys
import threading

from coli.base.errors import ColiError
from coli.base.progress import HoldFirst, text_on_line
from coli.tokenizer import check_text

HELP = ('/reset forgets the conversation, /exit (or Ctrl-D) quits; Ctrl-C stops an answer (at the prompt: quits); several lines: paste '
        'them, or write them between two lines of """')
PASTE_START, PASTE_END = "\x1b[200~", "\x1b[201~"   # xterm's bracketed paste markers
PASTE_ON = "\x1b[?2004h"


def read_message(inp) -> str:
    """One user message from ``inp`` (``input``): a line; the lines of a bracketed paste (readline gives them
    as one string with newlines; without readline the markers arrive and the lines up to the end marker are
    joined); or the lines between a line starting with three double quotes and one ending with it. EOFError and
    KeyboardInterrupt pass through."""
    line = inp("> ")
    if PASTE_START in line:
        text = line
        while PASTE_END not in text:
            text += "\n" + inp("")
        return text.replace(PASTE_START, "").replace(PASTE_END, "")
    if line.lstrip().startswith('"""'):
        first = line.lstrip()[3:]
        if first.rstrip().endswith('"""'):
            return first.rstrip()[:-3]
        lines = [first] if first.strip() else []
        while True:
            nxt = inp("... ")
            if nxt.rstrip().endswith('"""'):
                last = nxt.rstrip()[:-3]
                if last.strip():
                    lines.append(last)
                return "\n".join(lines)
            lines.append(nxt)
    return line


def fit_context(eng, msgs: list, n: int) -> int:
    """Drop the oldest turns of ``msgs`` (in place; a user message and the answer after it; never the system
    message or the last message) until the rendered conversation leaves ``n`` positions for the answer
    (``n`` <= 0: a quarter of the context). Returns the turns dropped."""
    room = n if n and n > 0 else max(1, eng.ctx // 4)
    first = 1 if msgs and msgs[0]["role"] == "system" else 0
    dropped = 0
    while len(msgs) - first > 1 and len(eng.chat_ids(msgs)) + room > eng.ctx:
        del msgs[first]
        if len(msgs) - first > 1 and msgs[first]["role"] == "assistant":
            del msgs[first]
        dropped += 1
    return dropped


def run_chat(eng, a, inp=input, out=sys.stdout) -> int:
    """The REPL over ``eng`` with the options ``a`` of ``coli chat`` (system, n, sampling, quiet). Returns 0 at
    /exit or end of input; Ctrl-C at the prompt raises KeyboardInterrupt (the CLI's exit 130, as llama-cli's),
    Ctrl-C during an answer stops the answer."""
    try:  # line editing and history at the prompt, where the platform has it
        import readline  # noqa: F401
    except ImportError:
        pass

    def fresh():
        return [{"role": "system", "content": a.system}] if a.system else []

    def write(t):
        out.write(t)
        out.flush()

    msgs = fresh()
    if not a.quiet:
        print(f"coli: {HELP}", file=sys.stderr)
    if inp is input and sys.stdin.isatty() and out.isatty():
        out.write(PASTE_ON)  # a paste of several lines arrives marked, as one message (readline keeps it on)
        out.flush()
    stop = threading.Event()

    def on_sigint(signum, frame):  # during an answer: stop it after the current token
        stop.set()

    while True:
        try:
            line = read_message(inp)
        except EOFError:
            out.write("\n")
            return 0
        except KeyboardInterrupt:  # at the prompt: quit (llama-cli's interactive mode exits 130 there)
            out.write("\n")
            raise
        except UnicodeDecodeError as e:  # a strict stdin lost the buffered input: stop, as `coli run` does
            raise ColiError(f"stdin: not UTF-8 text (byte {e.start})") from None
        try:  # invalid bytes read with surrogateescape (the C locale): say so, keep the REPL
            check_text(line, "stdin")
        except ColiError as e:
            print(f"coli: {e}; line skipped", file=sys.stderr)
            continue
        text = line.strip()
        if not text:
            continue
        if text in ("/exit", "/quit", "/bye"):
            return 0
        if text == "/reset":
            msgs = fresh()
            print("coli: conversation reset", file=sys.stderr)
            continue
        if text.startswith("/") and text.split()[0] in ("/help", "/?"):
            print(f"coli: {HELP}", file=sys.stderr)
            continue
        if re.fullmatch(r"/[A-Za-z]+", text):   # a mistyped command (/exti) is not a message (ollama's habit too)
            print(f"coli: unknown command {text} (/help lists them)", file=sys.stderr)
            continue
        msgs.append({"role": "user", "content": line})
        try:
            dropped = fit_context(eng, msgs, a.n)
        except ColiError as e:  # a template error: say so, keep the REPL
            msgs.pop()
            print(f"coli: {e}", file=sys.stderr)
            continue
        if dropped:
            print(f"coli: the context ({eng.ctx} positions) is full: the oldest {dropped} turn"
                  f"{'s' if dropped > 1 else ''} dropped from the conversation", file=sys.stderr)
        stop.clear()
        hold = HoldFirst(write)  # the first token waits while the first steps compile (a bar must not erase it)
        old = signal.signal(signal.SIGINT, on_sigint)
        try:
            s = eng.chat(msgs, stream=True, max_tokens=a.n, temp=a.temp, top_k=a.top_k, top_p=a.top_p,
                         min_p=a.min_p, repeat_penalty=a.repeat_penalty, repeat_last_n=a.repeat_last_n,
                         stop=a.stop, seed=None if a.seed == -1 else a.seed, should_stop=stop.is_set)
            for piece in s:
                hold(piece)
            hold.flush()
        except ColiError as e:  # e.g. the conversation no longer fits the context: say so, keep the REPL
            hold.flush()
            msgs.pop()
            print(f"coli: {e} (/reset starts over)", file=sys.stderr)
            continue
        finally:
            signal.signal(signal.SIGINT, old)
        r = s.result
        out.write("\n")
        out.flush()
        text_on_line(False)
        if r.finish_reason == "cancelled":
            print("coli: stopped", file=sys.stderr)
        msgs.append({"role": "assistant", "content": r.text})
        if not a.quiet:
            st = r.stats
            print(f"coli: {st['prompt_tokens'] - st['cached_tokens']} new prompt tokens "
                  f"({st['cached_tokens']} reused from the KV cache), " + eng.stats_line(st), file=sys.stderr)
