"""llama.cpp's flags that coli's commands do not take as coli's own: each is matched whole and either refused in one
line naming it and what coli does instead, or taken without effect where coli always does what it asks.

Why: argparse reads an unknown single-dash flag that begins with one of coli's one-letter options as that option
with the rest attached, so llama.cpp habits went wrong without a word about the flag typed: ``-fa on`` was ``-f a``
(the prompt file ``a``), ``-mg 0`` the model ``g``, ``-hf REPO`` printed the help and exited 0, ``-cnv`` was
"--ctx: invalid int value: 'nv'". argparse matches an option string typed whole before it splits one, so a flag
named here is never split.

The names and what each sets: llama.cpp ``common/arg.cpp`` (llama-cli, llama-server, llama-bench). The flags that
mean what one of coli's means are aliases of coli's own, declared beside it in ``coli/cli.py`` (``-cmoe``,
``-ncmoe``, ``-ub``, ``-b``, ``-st``, ``-a``).
"""
from __future__ import annotations

import argparse
import re

from coli.base.errors import ColiError

HF = ("llama.cpp's download from Hugging Face; coli downloads none: -m takes a GGUF path, a Hugging Face folder or "
      "a model name (coli models)")
LOAD = ("llama.cpp's loading mode; coli maps the GGUF read-only and keeps experts in its RAM expert cache "
        "(--expert-cache, --mem): nothing to set")

# (option strings, nargs, commands (None: every command that has no such option), why it is refused)
REFUSED: tuple[tuple[tuple[str, ...], object, tuple[str, ...] | None, str], ...] = (
    (("-hf", "-hfr", "--hf-repo", "-hff", "--hf-file", "-hft", "--hf-token", "-mu", "--model-url"), 1, None, HF),
    (("--mlock", "--no-mmap", "--mmap"), 0, None, LOAD),
    (("-lm", "--load-mode", "-mmp"), 1, None, LOAD),
    (("-tb", "--threads-batch"), 1, None, "coli's --threads (-t) runs the prompt and the decode both"),
    (("-sm", "--split-mode", "-ts", "--tensor-split"), 1, None, "coli runs on one device (--device vulkan:N)"),
    (("-mg", "--main-gpu", "-dev"), 1, None, "coli's device is --device cpu|vulkan|vulkan:N"),
    (("-ot", "--override-tensor"), 1, None,
     "coli places tensors itself: --cpu-moe / --n-cpu-moe N keep routed experts on the CPU (llama.cpp's exps=CPU "
     "patterns), --gpu-layers N runs the last N layers on the device"),
    (("-nkvo", "--no-kv-offload"), 0, None, "a device layer's KV cache is on the device, a CPU layer's in RAM"),
    (("-i", "--interactive", "-if", "--interactive-first", "-cnv", "--conversation", "-mli", "--multiline-input"),
     0, ("run",), "coli run answers one prompt; coli chat -m MODEL is the conversation"),
    (("-r", "--reverse-prompt"), 1, ("run", "chat"), "coli's --stop TEXT ends the answer before TEXT"),
    (("-sys", "--system-prompt", "-sysf", "--system-prompt-file"), 1, ("run",),
     "a system message is coli chat's --system TEXT (coli serve: a system message in the request)"),
    (("-np", "--parallel"), 1, None, "slots are coli serve's (coli serve -np N)"),
    (("-nocb", "--no-cont-batching"), 0, ("serve",), "coli serve always decodes its slots' rows together"),
    (("-to", "--timeout"), 1, ("serve",), "coli serve has no read/write timeout"),
    (("-co", "--color"), "?", ("run", "chat"), "coli writes plain text"),
    (("-pg",), 1, ("bench",), "coli bench runs its -p and -n tests apart (no combined prompt+generation test)"),
    (("--numa",), 1, None, "coli sets no NUMA policy: its threads and pages are where the OS puts them"),
    (("--prompt-cache",), 1, ("run",), "coli keeps no prompt cache file (coli chat and coli serve keep a "
                                       "conversation's KV cache in memory)"),
    (("--prompt-cache-all", "--prompt-cache-ro"), 0, ("run",), "coli keeps no prompt cache file"),
    (("--keep",), 1, ("run", "chat"), "coli does not shift the context: coli run stops at --ctx, coli chat drops "
                                      "the oldest turns"),
    (("--log-disable",), 0, ("run", "chat", "serve", "perplexity"), "coli's -q (--quiet) leaves out its own lines"),
    (("-v", "--verbose", "--log-verbose", "-lv", "--verbosity"), "?", None,
     "coli has no verbose log (--trace FILE.json records a run's timings)"),
)
# taken without effect, where coli always does what they ask: (option strings, commands, why)
ACCEPTED = (
    (("--jinja",), ("run", "chat", "serve"), "the GGUF's Jinja chat template is what coli renders (jinja2)"),
    (("-no-cnv", "--no-conversation"), ("run",), "coli run is one completion"),
    (("-cnv", "--conversation"), ("chat",), "coli chat is the conversation"),
    (("-cb", "--cont-batching"), ("serve",), "coli serve decodes its slots' rows together"),
)
FLASH = ("-fa", "--flash-attn")
FLASH_ON = ("on", "auto", "1", "true", "enabled")    # llama.cpp's is_truthy / is_autoy (bench: 1)
FLASH_OFF = ("off", "0", "false", "disabled")


ESCAPES = {ord("n"): b"\n", ord("r"): b"\r", ord("t"): b"\t", ord("'"): b"'", ord('"'): b'"', ord("\\"): b"\\"}
# what C's strtol(s, &end, 16) reads whole from two characters: two hex digits, or a space or sign and one
_HEX2 = re.compile(rb"[0-9a-fA-F]{2}|[ \t\n\v\f\r+-][0-9a-fA-F]")


def process_escapes(text: str, name: str) -> str:
    """llama.cpp's ``string_process_escapes`` (common/common.cpp), which llama-cli applies to its prompt (``-p`` or
    the ``-f`` file's text) and reverse prompts unless ``--no-escape``: ``\\n \\r \\t \\' \\" \\\\`` and ``\\xNN``
    (one byte, NN hexadecimal as strtol reads two characters); any other backslash is kept with the character after
    it, as is a backslash at the end.

    Works on the UTF-8 bytes, as llama.cpp; ``name`` (the flag, e.g. ``-p``) names the text in the error when
    ``\\xNN`` bytes leave it not UTF-8 (:class:`ColiError`: coli's prompts are text)."""
    if "\\" not in text:
        return text
    try:
        b = text.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:   # a lone surrogate: the tokenizer's error names it
        return text
    out, i, n = bytearray(), 0, len(b)
    while i < n:
        if b[i] != 0x5C or i + 1 == n:
            out.append(b[i])
            i += 1
            continue
        e = b[i + 1]
        if e in ESCAPES:
            out += ESCAPES[e]
        elif e == 0x78 and i + 3 < n and _HEX2.fullmatch(b[i + 2:i + 4]):   # \x needs both characters, as llama.cpp
            out.append(int(b[i + 2:i + 4], 16) & 0xFF)   # a sign wraps as C's char(val)
            i += 2
        else:
            out += b[i:i + 2]
        i += 2
    try:
        return out.decode("utf-8")
    except UnicodeDecodeError as err:
        raise ColiError(f"{name}: its \\x escapes make bytes that are not UTF-8 (byte {err.start}); "
                        f"--no-escape takes the text as written") from None


def read_file_arg(path: str, name: str) -> str:
    """The text of a file given to llama.cpp's ``-f`` (llama-cli's prompt, llama-perplexity's text) as llama.cpp reads
    it: every byte, no newline translation (``read_file``, a ``std::ifstream`` of the file, common/arg.cpp), then one
    trailing newline dropped (the ``-f`` handler: ``if (!params.prompt.empty() && params.prompt.back() == '\n')
    params.prompt.pop_back();``), so ``"a\n\n"`` is ``"a\n"`` and a CRLF line ends in ``"\r"``. Decoded as UTF-8
    (coli's prompts are text). ColiError ``<name>: <why>`` for a file that cannot be read or is not UTF-8."""
    try:
        with open(path, encoding="utf-8", newline="") as f:
            text = f.read()
    except OSError as e:
        raise ColiError(f"{name}: {e.strerror or e}") from None
    except UnicodeDecodeError as e:
        raise ColiError(f"{name}: not UTF-8 text (byte {e.start})") from None
    return text[:-1] if text.endswith("\n") else text


class Refuse(argparse.Action):
    """A llama.cpp flag coli does not take: ColiError ``<flag>: <why>`` (main prints it as one line, exit 2)."""

    def __init__(self, option_strings, dest, why="", **kw):
        super().__init__(option_strings, dest, **kw)
        self.why = why

    def __call__(self, parser, namespace, values, option_string=None):
        raise ColiError(f"{option_string}: {self.why}")


class FlashAttn(argparse.Action):
    """llama.cpp's ``-fa [on|off|auto]`` (llama-bench: ``-fa 0,1``): coli's attention is always flash-attention's
    arithmetic (key tiles with an online softmax, docs/cpu_kernels.md "Attention"), so on / auto are taken and off
    is refused."""

    def __call__(self, parser, namespace, values, option_string=None):
        given = values or "on"
        for v in given.split(","):
            v = v.strip().lower()
            if v in FLASH_OFF:
                raise ColiError(f"{option_string} {given}: coli's attention is always flash-attention's arithmetic "
                                f"(key tiles, an online softmax: docs/cpu_kernels.md \"Attention\"); there is no "
                                f"other to switch to")
            if v not in FLASH_ON:
                raise ColiError(f"{option_string}: '{given}' (on, off or auto, as llama.cpp)")


def add_llama_flags(p: argparse.ArgumentParser, command: str) -> None:
    """Declare on ``p`` (the parser of ``coli <command>``) the llama.cpp flags of :data:`REFUSED` and
    :data:`ACCEPTED` meant for it, each hidden from ``--help``, skipping a flag ``p`` already has as its own."""
    own = set(p._option_string_actions)

    def names(opts):
        return [o for o in opts if o not in own]

    for opts, nargs, cmds, why in REFUSED:
        if (cmds is None or command in cmds) and names(opts):
            p.add_argument(*names(opts), nargs=nargs, action=Refuse, why=why, dest="llama_refused",
                           help=argparse.SUPPRESS, default=argparse.SUPPRESS)
    for opts, cmds, _why in ACCEPTED:
        if command in cmds and names(opts):
            p.add_argument(*names(opts), action="store_true", dest="llama_accepted", help=argparse.SUPPRESS,
                           default=argparse.SUPPRESS)
    if names(FLASH):
        p.add_argument(*names(FLASH), nargs="?", action=FlashAttn, dest="llama_flash", help=argparse.SUPPRESS,
                       default=argparse.SUPPRESS)
