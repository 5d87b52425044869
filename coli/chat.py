"""``coli chat``: a multi-turn chat in the terminal, through the model's chat template.

Each turn renders the whole conversation (``--system`` first) with the file's ``tokenizer.chat_template``
and generates the answer with :meth:`coli.Engine.chat`, which keeps the KV cache between turns: only the
tokens after the common prefix with the previous turn are computed (the start line of each answer's speed
line says how many were reused). Commands: ``/reset`` (forget the conversation), ``/exit`` (or Ctrl-D).
Ctrl-C while an answer streams stops that answer (what was printed stays in the conversation); Ctrl-C at the
prompt clears the line.
"""
from __future__ import annotations

import signal
import sys
import threading

from coli.base.errors import ColiError
from coli.tokenizer import check_text

HELP = "/reset forgets the conversation, /exit (or Ctrl-D) quits; Ctrl-C stops an answer"


def run_chat(eng, a, inp=input, out=sys.stdout) -> int:
    """The REPL over ``eng`` with the options ``a`` of ``coli chat`` (system, n, sampling, quiet). Returns 0."""
    try:  # line editing and history at the prompt, where the platform has it
        import readline  # noqa: F401
    except ImportError:
        pass

    def fresh():
        return [{"role": "system", "content": a.system}] if a.system else []

    msgs = fresh()
    if not a.quiet:
        print(f"coli: {HELP}", file=sys.stderr)
    stop = threading.Event()

    def on_sigint(signum, frame):  # during an answer: stop it after the current token
        stop.set()

    while True:
        try:
            line = inp("> ")
        except EOFError:
            out.write("\n")
            return 0
        except KeyboardInterrupt:
            out.write("\n")
            continue
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
        msgs.append({"role": "user", "content": line})
        stop.clear()
        old = signal.signal(signal.SIGINT, on_sigint)
        try:
            s = eng.chat(msgs, stream=True, max_tokens=a.n, temp=a.temp, top_k=a.top_k, top_p=a.top_p,
                         min_p=a.min_p, repeat_penalty=a.repeat_penalty, repeat_last_n=a.repeat_last_n,
                         stop=a.stop, seed=None if a.seed == -1 else a.seed, should_stop=stop.is_set)
            for piece in s:
                out.write(piece)
                out.flush()
        except ColiError as e:  # e.g. the conversation no longer fits the context: say so, keep the REPL
            msgs.pop()
            print(f"coli: {e} (/reset starts over)", file=sys.stderr)
            continue
        finally:
            signal.signal(signal.SIGINT, old)
        r = s.result
        out.write("\n")
        out.flush()
        if r.finish_reason == "cancelled":
            print("coli: stopped", file=sys.stderr)
        msgs.append({"role": "assistant", "content": r.text})
        if not a.quiet:
            st = r.stats
            print(f"coli: {st['prompt_tokens'] - st['cached_tokens']} new prompt tokens "
                  f"({st['cached_tokens']} reused from the KV cache), " + eng.stats_line(st), file=sys.stderr)
