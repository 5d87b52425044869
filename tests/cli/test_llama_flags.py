"""llama.cpp's flags in coli's commands (coli/llama_flags.py): each refused in one line naming it, taken where coli
always does what it asks, or an alias of coli's own; none read as one of coli's one-letter options with the rest
attached (``-fa on`` was the prompt file ``a``, ``-mg 0`` the model ``g``, ``-hf`` the help with exit 0). Parsing
only: no model is opened (``-m`` a missing file where a flag is taken)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

NOPE = "/nonexistent/model.gguf"


def _main(capsys, *argv):
    from coli.cli import main

    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.mark.parametrize("argv, says", [
    (["run", "-p", "hi", "-fa", "off"], "-fa off: coli's attention is always flash-attention's arithmetic"),
    (["bench", "-fa", "0,1"], "-fa 0,1: coli's attention is always flash-attention's arithmetic"),
    (["run", "-p", "hi", "-fa", "maybe"], "-fa: 'maybe' (on, off or auto, as llama.cpp)"),
    (["run", "-mg", "0", "-p", "hi"], "-mg: coli's device is --device cpu|vulkan|vulkan:N"),
    (["run", "-hf", "org/repo"], "-hf: llama.cpp's download from Hugging Face; coli downloads none"),
    (["serve", "-hf", "org/repo"], "-hf: llama.cpp's download from Hugging Face"),
    (["info", "-hf", "org/repo"], "-hf: llama.cpp's download from Hugging Face"),
    (["run", "-cnv"], "-cnv: coli run answers one prompt; coli chat -m MODEL is the conversation"),
    (["run", "-ot", "exps=CPU"], "-ot: coli places tensors itself: --cpu-moe / --n-cpu-moe N"),
    (["run", "-tb", "2"], "-tb: coli's --threads (-t) runs the prompt and the decode both"),
    (["run", "-b", "0", "-p", "x"], "--batch-size: 0 (the most rows of a prompt step, 1 or more)"),
    (["run", "-np", "4"], "-np: slots are coli serve's"),
    (["run", "--mlock"], "--mlock: llama.cpp's loading mode"),
    (["bench", "-mmp", "0"], "-mmp: llama.cpp's loading mode"),
    (["bench", "-pg", "512,128"], "-pg: coli bench runs its -p and -n tests apart"),
    (["serve", "-to", "600"], "-to: coli serve has no read/write timeout"),
    (["run", "-sys", "be brief", "-p", "x"], "-sys: a system message is coli chat's --system TEXT"),
    (["run", "-ub", "0", "-p", "x"], "--ubatch-size: 0 (rows of a prompt step, 1 or more)"),
    # argparse's usage and "unrecognized arguments" before: flags a llama.cpp user types
    (["run", "--numa", "distribute", "-p", "x"], "--numa: coli sets no NUMA policy"),
    (["run", "--prompt-cache", "p.bin", "-p", "x"], "--prompt-cache: coli keeps no prompt cache file"),
    (["run", "--keep", "4", "-p", "x"], "--keep: coli does not shift the context"),
    (["serve", "--log-disable"], "--log-disable: coli's -q (--quiet)"),
    (["run", "-v", "-p", "x"], "-v: coli has no verbose log"), (["bench", "-lv", "3"], "-lv: coli has no verbose log"),
])
def test_a_llama_cpp_flag_coli_does_not_take_is_one_line(capsys, argv, says):
    """One line ``coli: <flag as typed>: ...`` on stderr, exit 2, nothing on stdout, no model opened."""
    rc, out, err = _main(capsys, *argv)
    assert (rc, out) == (2, ""), (rc, out, err)
    assert err.startswith(f"coli: {says}") and err.count("\n") == 1, err


@pytest.mark.parametrize("argv", [
    ["run", "-p", "hi", "-fa", "on"], ["run", "-p", "hi", "-fa"], ["run", "-p", "hi", "--flash-attn", "auto"],
    ["bench", "-fa", "1"], ["run", "-p", "hi", "--jinja", "-no-cnv"], ["chat", "-cnv", "--jinja"],
    ["serve", "--jinja", "-fa", "on", "-cb"]])
def test_a_llama_cpp_flag_coli_always_honours_is_taken(capsys, argv):
    """``-fa on|auto`` (coli's attention is flash-attention's arithmetic), ``--jinja`` (the GGUF's template is what
    coli renders), ``-no-cnv`` on run, ``-cnv`` on chat, ``-cb`` on serve: the command goes on to open the model."""
    rc, out, err = _main(capsys, *argv, "-m", NOPE)
    assert (rc, out) == (2, "") and err.startswith(f"coli: {NOPE}: no such file"), err


def test_llama_cpp_short_names_are_coli_flags():
    """``-cmoe`` / ``-ncmoe N`` (llama.cpp's --cpu-moe / --n-cpu-moe), ``-ub N`` (n_ubatch), ``-st`` (one chat turn:
    coli run --chat), serve's ``-a`` (--alias): the same options as coli's long names."""
    from coli.cli import build_parser

    p = build_parser()
    a = p.parse_args(["run", "-cmoe", "-ub", "64", "-st", "x"])
    assert (a.cpu_moe, a.ubatch_size, a.chat) == (True, 64, True)
    assert p.parse_args(["run", "-ncmoe", "3", "x"]).n_cpu_moe == 3
    assert p.parse_args(["serve", "-a", "mine"]).alias == "mine"
    assert p.parse_args(["bench", "-ub", "32"]).ubatch_size == 32


def test_ubatch_size_is_the_prompt_step(monkeypatch, capsys):
    """``-ub N`` reaches the engine as COLI_UBATCH, which ``Engine.prompt_chunk`` returns as the CPU prompt step."""
    import coli.engine
    from coli.engine import Engine

    seen = {}

    def fake(model, **kw):
        seen.update(kw)
        raise SystemExit(0)

    monkeypatch.setattr(coli.engine, "Engine", fake)
    with pytest.raises(SystemExit):
        _main(capsys, "run", "-ub", "7", "-p", "x", "-m", str(__file__))   # resolve takes any existing file
    assert seen["env"]["COLI_UBATCH"] == "7"
    assert Engine.prompt_chunk(SimpleNamespace(device_layers=None, model=None, env=seen["env"])) == 7


# (typed, what llama.cpp's string_process_escapes (common/common.cpp, compiled from the vendored source) gives)
ESCAPED = [(r"Q:\nA:", "Q:\nA:"), (r"a\tb\\c\rd", "a\tb\\c\rd"), (r"it\'s \"x\"", "it's \"x\""),
           (r"\x41\x4", "A\\x4"), ("\\x", "\\x"), ("end\\", "end\\"), (r"\q\é", r"\q\é"),
           (r"\x 9\x+a", "\t\n"), (r"\xzz", r"\xzz"), (r"caf\xc3\xa9", "café"), (r"\\n", r"\n")]


@pytest.mark.parametrize("typed, expect", ESCAPED)
def test_escapes_are_llama_cpps(typed, expect):
    """``process_escapes`` gives what llama-cli's does to its prompt (it matched the compiled C on 3,000 random
    strings of backslashes, x, hex digits, signs and UTF-8)."""
    from coli.llama_flags import process_escapes

    assert process_escapes(typed, "-p") == expect


def test_run_processes_escapes_in_the_prompt_and_stop_unless_no_escape(tmp_path):
    """coli run, as llama-cli: ``-p``'s text, ``-f``'s file and ``--stop`` have their escapes processed by default
    (``-e`` says so, llama.cpp's old spelling); ``--no-escape`` takes them as written; chat's --stop too."""
    from coli.cli import _escape_stops, _read_prompt, build_parser

    p = build_parser()
    assert _read_prompt(p.parse_args(["run", "-p", r"Q:\nA:"])) == "Q:\nA:"
    assert _read_prompt(p.parse_args(["run", "-e", r"Q:\tA:"])) == "Q:\tA:"
    assert _read_prompt(p.parse_args(["run", "--no-escape", "-p", r"Q:\nA:"])) == r"Q:\nA:"
    f = tmp_path / "p.txt"
    f.write_text(r"one\ntwo")
    assert _read_prompt(p.parse_args(["run", "-f", str(f)])) == "one\ntwo"
    for cmd in (["run", "x"], ["chat"]):
        a = p.parse_args([*cmd, "--stop", r"\n\n"])
        _escape_stops(a)
        assert a.stop == ["\n\n"]
        a = p.parse_args([*cmd, "--stop", r"\n", "--no-escape"])
        _escape_stops(a)
        assert a.stop == [r"\n"]


def test_an_escape_that_is_not_utf8_is_one_line(capsys):
    """``\\xff`` alone is not UTF-8 text: one line naming the flag and --no-escape, exit 2, no model opened."""
    rc, out, err = _main(capsys, "run", "-p", r"a\xffb", "-m", NOPE)
    assert (rc, out) == (2, "")
    assert err == "coli: -p: its \\x escapes make bytes that are not UTF-8 (byte 1); --no-escape takes the text as written\n"


@pytest.mark.parametrize("flags, step", [(["-b", "2048", "-ub", "512"], "512"), (["-b", "64", "-ub", "512"], "64"),
                                         (["-b", "2048"], None), (["--batch-size", "100"], "100"),
                                         (["-b", "2048", "-ub", "512", "-b", "32"], "32")])
def test_batch_size_caps_the_prompt_step(monkeypatch, capsys, flags, step):
    """A pasted llama-server line's ``-b N`` runs (it was refused): the prompt step (COLI_UBATCH) is
    min(-b, -ub or its default 256), as llama-context.cpp's ``n_ubatch = min(n_batch, n_ubatch)``; a ``-b`` at or
    above the default step alone sets nothing (None), so device layers keep their own chunk rule (``-b 2048``,
    llama-bench's default, made them take 256-row chunks)."""
    import coli.engine

    seen = {}

    def fake(model, **kw):
        seen.update(kw)
        raise SystemExit(0)

    monkeypatch.delenv("COLI_UBATCH", raising=False)
    monkeypatch.setattr(coli.engine, "Engine", fake)
    with pytest.raises(SystemExit):
        _main(capsys, "run", *flags, "-p", "x", "-m", str(__file__))
    assert seen["env"].get("COLI_UBATCH") == step


def test_top_k_minus_one_is_off():
    """``--top-k -1``: off (0), as llama.cpp's sampler skips k <= 0 and coli serve's ``top_k: -1``; it was refused
    ("-1 (0 for all, or above)")."""
    from coli.cli import build_parser

    p = build_parser()
    assert p.parse_args(["run", "--top-k", "-1", "x"]).top_k == 0
    assert p.parse_args(["chat", "--top-k", "-1"]).top_k == 0
    assert p.parse_args(["run", "--top-k", "5", "x"]).top_k == 5


def test_the_readmes_use_lines_parse():
    """Every ``coli ...`` line of README.md's "Use" block parses with coli's parser (the llama.cpp flags declared
    beside coli's own take none of its documented arguments: ``-n -1``, ``-ctk q8_0``, ``-r 5``, ``-f FILE``, ...),
    and the values it sets are the line's. Parsing only: no model opened."""
    import re
    import shlex
    from pathlib import Path

    from coli.cli import build_parser

    text = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    block = re.search(r"## Use\n\n```bash\n(.*?)```", text, re.S).group(1)
    lines = [part.strip() for line in block.splitlines()
             for part in re.split(r"\s{2,}#", line)[0].split("|")[-1].split("&&")]  # comments, echo ... |, && ...
    lines = [line for line in lines if line.startswith("coli ")]
    assert len(lines) >= 15
    p = build_parser()
    for line in lines:
        p.parse_args(shlex.split(line)[1:])  # a refused flag raises ColiError, a bad one SystemExit
    a = p.parse_args(shlex.split('run -m smollm2 -f prompt.txt -n -1 --stop "###" --no-display-prompt -q'))
    assert (a.model, a.file, a.n, a.stop) == ("smollm2", "prompt.txt", -1, ["###"])


@pytest.mark.parametrize("cmd", ["run", "chat", "serve", "bench", "perplexity", "tune"])   # those with --threads
def test_a_long_option_is_spelled_whole(capsys, cmd):
    """As llama.cpp's (common/arg.cpp matches a flag whole): ``--thread 2`` is one error naming ``--thread`` and the
    closest option, exit 2,
    not argparse's prefix match (with llama_flags' hidden ``--threads-batch`` beside ``--threads`` it was
    "ambiguous option: --thread could match --threads, --threads-batch"); ``--threads 2`` is coli's option."""
    from coli.cli import build_parser

    p = build_parser()
    req = ["-f", "text.txt"] if cmd == "perplexity" else []    # its required flag, so the typo is what is left
    with pytest.raises(SystemExit) as e:
        p.parse_args([cmd, *req, "--thread", "2"])
    err = capsys.readouterr().err
    last = err.splitlines()[-1]   # the "2" is run's PROMPT; the others have no positional to take it
    # and the closest option named (difflib), as an unknown COLI_* variable's warning does; it said the typo alone
    hint = "coli: error: unrecognized arguments: --thread (did you mean --threads?)"
    assert e.value.code == 2 and last in (hint, hint + " 2"), err
    assert "ambiguous" not in err
    assert str(p.parse_args([cmd, *req, "--threads", "2"]).threads) == "2"   # bench's and tune's: a LIST


@pytest.mark.parametrize("text, prompt", [
    ("hi\n", "hi"), ("hi\n\n", "hi\n"), ("hi", "hi"), ("a\r\nb\r\n", "a\r\nb\r"), ("hi\\n\n", "hi\n")])
def test_a_prompt_file_loses_one_trailing_newline_as_llama_cli(tmp_path, text, prompt):
    """llama.cpp's ``-f`` handler (common/arg.cpp, llama-cli's and llama-perplexity's): the file as
    ``read_file``'s std::ifstream reads it (no newline translation: a CRLF stays), then ``if
    (!params.prompt.empty() && params.prompt.back() == '\\n') params.prompt.pop_back();``: one newline dropped, the
    escapes processed after it (a written ``\\n`` at the end stays a newline). A file of one newline is empty."""
    from coli.base.errors import ColiError
    from coli.cli import _read_prompt, build_parser
    from coli.llama_flags import read_file_arg

    f = tmp_path / "p.txt"
    f.write_bytes(text.encode())
    assert _read_prompt(build_parser().parse_args(["run", "-f", str(f)])) == prompt
    assert read_file_arg(str(f), "t") == text.removesuffix("\n")          # coli perplexity -f's text
    f.write_bytes(b"\n")
    with pytest.raises(ColiError, match=rf"^-f {f}: empty \(no prompt in it\)$"):
        _read_prompt(build_parser().parse_args(["run", "-f", str(f)]))
