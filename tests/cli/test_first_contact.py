"""What a new user meets first (faults a QA run found): the device flags on a dense model, the flag a device error
names, a --tier-gb that holds no expert, the perplexity lines. Runs ``coli.cli.main`` in-process on the tiny
oracle llama (tests/fixtures/oracles/rope_linear.gguf: 1 layer, 0.3 MiB) and the tiny MoE: seconds each."""
from __future__ import annotations

import pytest

from conftest import FIXTURES
from tiny_moe import build_tiny_moe
from vk_util import requires_vulkan

DENSE = FIXTURES / "oracles" / "rope_linear.gguf"


def _main(capsys, *argv):
    from coli.cli import main

    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.mark.parametrize("flags, env, named", [
    (["--cpu-moe"], {}, "--cpu-moe"), (["--n-cpu-moe", "2"], {}, "--n-cpu-moe 2"),
    (["--gpu-layers", "1"], {}, "--gpu-layers 1"), (["--balance"], {}, "--balance"), (["--tier-gb", "1"], {}, "--tier-gb"),
    (["--device", "vulkan"], {}, "--device vulkan"), ([], {"COLI_VULKAN": "1"}, "COLI_VULKAN=1"),
    ([], {"COLI_VK_LAYERS": "1"}, "COLI_VK_LAYERS=1")])
def test_a_missing_device_names_the_flag_that_asked_for_it(capsys, monkeypatch, flags, env, named):
    """No Vulkan device to open (here: open_device fails as on a machine with only llvmpipe): the one error line
    names the flag the user gave, not ``--device vulkan`` they did not give."""
    import coli.vulkan as cvk

    def no_gpu(*a, **kw):
        raise cvk.VulkanError("no GPU: the only Vulkan device is 0: llvmpipe")

    monkeypatch.setattr(cvk, "open_device", no_gpu)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    rc, out, err = _main(capsys, "run", "-m", str(DENSE), "-p", "x", "-n", "1", *flags)
    assert (rc, out) == (2, "") and err.endswith(f"coli: {named}: no GPU: the only Vulkan device is 0: llvmpipe\n"), err
    assert named == "--device vulkan" or "--device vulkan" not in err


@requires_vulkan
@pytest.mark.parametrize("flags", [["--cpu-moe"], ["--n-cpu-moe", "1"]])
def test_cpu_moe_on_a_dense_model_runs_its_layers_on_the_device(capsys, flags):
    """--cpu-moe / --n-cpu-moe on a dense model (no routed experts): as llama.cpp, the layers go to the device all the
    same (--gpu-layers -1 implied: the layer and the head), one line says the flag keeps nothing on the CPU, and the
    device ran the prompt rows and the decode row (it ran on the CPU, the dense notice's path)."""
    rc, out, err = _main(capsys, "run", "-m", str(DENSE), "-p", "a b c", "-n", "2", "--temp", "0", *flags)
    assert rc == 0, err
    assert f"[VK] rope_linear.gguf: {' '.join(flags)}: a dense model has no routed experts to keep on the CPU" in err
    assert "layer 0 of 1 and the head on the device" in err and "this run is on the CPU" not in err
    assert "device layers ran 1 decode token," in err    # the second token's forward: one decode row on the device
    n = int(err.split("prompt rows on the device: ")[1].split(" of ")[0])
    assert n > 0 and f"prompt rows on the device: {n} of {n}" in err


@requires_vulkan
def test_a_tier_gb_that_holds_no_expert_is_refused(tmp_path, capsys):
    """--tier-gb below one expert (and, with --gpu-layers, below a layer): one line naming --tier-gb and the least
    that holds an expert, exit 2 (it ran a tier of 0 experts, "balanced against the CPU" with device share 1.00)."""
    tiny = build_tiny_moe(tmp_path)
    for extra, nor in (([], ""), (["--gpu-layers", "2"], " nor a decoder layer")):
        rc, out, err = _main(capsys, "run", "-m", str(tiny), "-p", "x", "-n", "1", "--tier-gb", "1e-8", *extra)
        assert (rc, out) == (2, "") and "Traceback" not in err
        last = err.strip().splitlines()[-1]
        assert last.startswith("coli: --tier-gb 1e-08: 0.00 MiB holds no routed expert (0.01 MiB each)" + nor), last
        assert last.endswith("; give 0.001 or more, or leave it out (the budget rule: docs/tier.md)"), last


def test_perplexity_lines_name_the_file_and_count_right(tmp_path, capsys):
    """coli perplexity: a text too short names the file (not ``text:``), also with --max-tokens; one chunk is "1
    chunk"."""
    f = tmp_path / "short.txt"
    f.write_text("the cat sat on the mat. " * 2)
    rc, out, err = _main(capsys, "perplexity", "-m", str(DENSE), "-f", str(f), "--ctx", "64")
    assert rc == 2 and err.splitlines()[-1] == (f"coli: {f}: 41 tokens; llama-perplexity's convention needs at least "
                                                "2 x --ctx = 128 (lower --ctx, or score every token with --all-tokens)")
    f.write_text("the cat sat on the mat. " * 40)
    rc, out, err = _main(capsys, "perplexity", "-m", str(DENSE), "-f", str(f), "--ctx", "64", "--max-tokens", "100")
    assert rc == 2 and err.splitlines()[-1].startswith(f"coli: {f} (--max-tokens 100): 100 tokens; "), err
    rc, out, err = _main(capsys, "perplexity", "-m", str(DENSE), "-f", str(f), "--ctx", "16", "--chunks", "1")
    assert rc == 0 and f"{f}: 7 tokens scored in 1 chunk of 16," in out, (out, err)


def test_one_of_a_kind_is_singular(capsys):
    """A prompt of 1 token in a context of 1 position: "1 token", "1 position" (it read "1 prompt tokens ...
    of 1 positions"); a model of 1 layer has "1 layer" on its start line;
    one token generated has no decode rate."""
    rc, out, err = _main(capsys, "run", "-m", str(DENSE), "-p", "a", "--ctx", "1", "-n", "1")   # before the load
    assert (rc, err) == (2, "coli: -n: 1 token to generate and the prompt exceed the context of 1 position (--ctx)\n")
    rc, out, err = _main(capsys, "run", "-m", str(DENSE), "-p", "a", "--ctx", "1", "-n", "-1")
    assert (rc, err) == (2, "coli: prompt: 1 token fills the context of 1 position (--ctx)\n")
    rc, out, err = _main(capsys, "run", "-m", str(DENSE), "-p", "a", "-n", "1")   # the start line: "1 layer"
    assert rc == 0 and "coli: rope_linear.gguf: llama, 1 layer, " in err, err
    # -n 1: the token came from the prompt's logits, no decode step ran: no rate (it read "at 0.0 tok/s")
    assert ", decode 1 tok (from the prompt's logits: no decode step to time)" in err and "0.0 tok/s" not in err, err


def test_a_piped_prompt_that_is_not_utf8_names_stdin(capsys, monkeypatch):
    """Bytes that are not UTF-8 on stdin (which a C locale passes on as lone surrogates): one line naming stdin and
    the byte (it named "text:", the tokenizer's check)."""
    import io

    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(b"ok \xff\xfehi"), encoding="utf-8",
                                                       errors="surrogateescape"))
    rc, out, err = _main(capsys, "run", "-m", str(DENSE), "-n", "1")
    assert (rc, out, err) == (2, "", "coli: stdin: not UTF-8 text (byte 3)\n")


@requires_vulkan
def test_device_layers_that_did_all_the_work_do_not_end_with_0_matmuls(capsys):
    """--gpu-layers on a dense model: the device layers ran every dispatch and no single matmul, so the closing
    line counts their dispatches "on the GPU" (it read "0 matmuls on the GPU, N dispatches of the device layers")."""
    import re

    rc, out, err = _main(capsys, "run", "-m", str(DENSE), "-p", "a b", "-n", "2", "--temp", "0", "--gpu-layers", "1")
    assert rc == 0, err
    last = err.strip().splitlines()[-1]
    m = re.fullmatch(r"\[VK\] rope_linear\.gguf: (\d+) dispatches of the device layers on the GPU", last)
    assert m and int(m.group(1)) > 0 and "matmuls on the GPU" not in err, err


def test_a_byte_order_mark_opening_the_prompt_is_not_text(tmp_path, capsys, monkeypatch):
    """A UTF-8 BOM (EF BB BF, as Windows editors write) opening a -f file or a piped prompt is dropped: the run
    prints (echo and greedy text) exactly what the same prompt without it gives (the BOM was echoed and tokenized)."""
    import io

    args = ("-n", "3", "--temp", "0")
    rc, want, err = _main(capsys, "run", "-m", str(DENSE), "-p", "a b c", *args)
    assert rc == 0 and want.startswith("a b c"), err
    f = tmp_path / "bom.txt"
    f.write_bytes(b"\xef\xbb\xbfa b c")
    rc, out, err = _main(capsys, "run", "-m", str(DENSE), "-f", str(f), *args)
    assert (rc, out) == (0, want), err
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(b"\xef\xbb\xbfa b c"), encoding="utf-8"))
    rc, out, err = _main(capsys, "run", "-m", str(DENSE), *args)
    assert (rc, out) == (0, want), err
    f.write_bytes(b"\xef\xbb\xbf")   # a BOM alone is an empty file
    rc, out, err = _main(capsys, "run", "-m", str(DENSE), "-f", str(f), *args)
    assert (rc, out, err) == (2, "", f"coli: -f {f}: empty (no prompt in it)\n")


def test_moe_flags_on_a_dense_model_say_they_do_nothing(tmp_path, capsys):
    """--expert-cache and --usage on a dense model (no routed experts): coli run and coli plan say in one line that
    the flag does nothing (both were silent); a negative --expert-cache is refused on any model (coli plan took -1)."""
    usage = tmp_path / "u.usage"
    rc, out, err = _main(capsys, "run", "-m", str(DENSE), "-p", "a", "-n", "1", "--expert-cache", "4",
                         "--usage", str(usage))
    assert rc == 0, err
    for flag in ("--expert-cache", "--usage"):
        assert (f"coli: {flag}: rope_linear.gguf is a dense model (no routed experts): the flag does nothing\n"
                in err), err
    assert not usage.exists()
    rc, out, err = _main(capsys, "plan", "-m", str(DENSE), "--expert-cache", "4", "--json")
    assert rc == 0 and '"moe_layers": 0' in out
    assert err == ("coli plan: --expert-cache: rope_linear.gguf is a dense model (no routed experts): the flag does "
                   "nothing\n"), err
    for cmd in ("plan", "run"):
        rc, out, err = _main(capsys, cmd, "-m", str(DENSE), "--expert-cache", "-1", *(["-p", "a"] if cmd == "run" else []))
        assert (rc, out) == (2, "") and err.splitlines()[-1].startswith("coli: --expert-cache: -1 ("), err


@pytest.mark.parametrize("flag, value, named", [
    ("-ngl", "1,2", "-ngl 1 (of 1,2)"), ("--gpu-layers", "1", "--gpu-layers 1"), ("-ngl", "0-2", "-ngl 1 (of 0-2)")])
def test_a_bench_gpu_layers_list_names_the_value_that_failed(capsys, monkeypatch, flag, value, named):
    """coli bench -ngl LIST (llama-bench's list): an error opening one value's engine names that value, the list and
    the flag as typed (it named "--gpu-layers 1", a flag the user did not give, and not the list)."""
    import coli.vulkan as cvk

    def no_gpu(*a, **kw):
        raise cvk.VulkanError("no GPU: the only Vulkan device is 0: llvmpipe")

    monkeypatch.setattr(cvk, "open_device", no_gpu)
    rc, out, err = _main(capsys, "bench", "-m", str(DENSE), "-p", "0", "-n", "1", "-r", "1", flag, value)
    assert rc == 2 and err.endswith(f"coli: {named}: no GPU: the only Vulkan device is 0: llvmpipe\n"), err
    if value == "0-2":   # the value 0 ran (on the CPU) before 1 failed
        assert "Traceback" not in err


def test_a_trace_that_cannot_be_written_is_one_line(tmp_path, capsys, monkeypatch):
    """--trace FILE on a disk that fills up: the write's ENOSPC at close is one line naming --trace and the file,
    exit 2 (it was a traceback out of atomic_write_text after the run's text)."""
    import errno
    import os

    import scheduler.trace as st

    def full(path, text):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(st, "atomic_write_text", full)
    t = tmp_path / "t.json"
    rc, out, err = _main(capsys, "run", "-m", str(DENSE), "-p", "a b", "-n", "2", "--trace", str(t))
    assert rc == 2 and out.startswith("a b") and not t.exists(), err
    assert err.endswith(f"coli: --trace {t}: not written (No space left on device)\n"), err


def test_an_api_key_file_that_is_not_utf8_is_one_line(tmp_path, capsys):
    """coli serve --api-key-file with bytes that are not UTF-8: one line naming the flag, the file and the byte, before
    the port is bound or the model read (it was a UnicodeDecodeError traceback)."""
    f = tmp_path / "key"
    f.write_bytes(b"\xef\xbb\xbfsecret\xff\n")   # the BOM is fine; the 0xff after 'secret' is not UTF-8
    rc, out, err = _main(capsys, "serve", "-m", str(DENSE), "--api-key-file", str(f), "--port", "0")
    assert (rc, out, err) == (2, "", f"coli: --api-key-file {f}: not UTF-8 text (byte 9)\n")


@pytest.mark.parametrize("value", ["0", "1.5", "nan"])
def test_chat_truncate_max_keep_out_of_range_is_one_line(capsys, value):
    """coli serve --chat-truncate-max-keep outside (0, 1] (llama-server refuses 0 too): one line naming the flag,
    before the port is bound or the model read."""
    rc, out, err = _main(capsys, "serve", "-m", str(DENSE), "--chat-truncate-max-keep", value, "--port", "0")
    assert (rc, out) == (2, "") and err.startswith(f"coli: --chat-truncate-max-keep: {float(value)} ") and \
        len(err.splitlines()) == 1, err


@pytest.mark.parametrize("change, says", [
    ({"drop_key": "llama.context_length"}, "metadata 'llama.context_length' is missing"),
    ({"zero": "llama.context_length"}, "metadata 'llama.context_length': 0 (must be at least 1)")])
def test_a_file_without_its_trained_context_is_refused(tmp_path, capsys, change, says):
    """A GGUF without <arch>.context_length (or with 0): one line naming the file and the key, exit 2, as llama.cpp's
    loader refuses it ("key not found in model: llama.context_length"); it ran at a made-up 4096 positions."""
    from oracle_check import malformed_copy

    path = malformed_copy(DENSE, tmp_path / "no_ctx.gguf", **change)
    rc, out, err = _main(capsys, "run", "-m", str(path), "-p", "a", "-n", "1")
    assert (rc, out, err) == (2, "", f"coli: no_ctx.gguf: {says}\n")


def test_a_compile_while_the_model_loads_is_announced(tmp_path):
    """A cold kernel cache compiles first while the model loads (the weights' repack), minutes on a busy machine:
    the compile notice comes then, not after the load (a fresh clone's first `coli run` printed nothing for 20
    minutes after the demo build). A subprocess: Numba's compile event fired from inside the load."""
    import subprocess
    import sys

    code = ("import cpu_kernels, numba.core.event as ev, coli.runtime as rt  # cpu_kernels first: the threads\n"
            "from coli.base.errors import ColiError\n"
            "def build(eng, **kw):\n"
            "    with ev.trigger_event('numba:compile', data={}):\n"
            "        raise ColiError('stopped in the load')\n"
            "rt.build = build\n"
            "from coli.engine import Engine\n"
            f"Engine({str(DENSE)!r})\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       env={**__import__("os").environ, "COLI_CACHE": str(tmp_path)})
    lines = r.stderr.splitlines()
    assert r.returncode == 1 and lines[-1].endswith("ColiError: stopped in the load"), r.stderr
    assert "coli: compiling the CPU kernels, once: about 5 minutes on a first run" in lines[0], r.stderr


def test_a_compile_while_coli_plan_reads_the_model_is_announced(tmp_path):
    """coli plan imports the family's module, which loads the CPU kernels (cpu_kernels.experts compiles its cfunc at
    import: 20-40 s on a cold cache at load 1-10): the compile notice comes then (it was silent). A subprocess, as
    above: the compile event fired from inside the model's reading."""
    import subprocess
    import sys

    code = ("import cpu_kernels, numba.core.event as ev, coli.plan as plan  # cpu_kernels first: the threads\n"
            "from coli.base.errors import ColiError\n"
            "def model_args(g):\n"
            "    with ev.trigger_event('numba:compile', data={}):\n"
            "        raise ColiError('stopped in the reading')\n"
            "plan.model_args = model_args\n"
            "from coli.cli import main\n"
            f"raise SystemExit(main(['plan', '-m', {str(DENSE)!r}]))\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       env={**__import__("os").environ, "COLI_CACHE": str(tmp_path)})
    lines = r.stderr.splitlines()
    assert r.returncode == 2 and lines[-1] == "coli: stopped in the reading", r.stderr
    assert "coli: compiling the CPU kernels, once: about 5 minutes on a first run" in lines[0], r.stderr


def test_a_terminal_that_is_not_utf8_gets_the_text_as_utf8(capsys, monkeypatch):
    """stdout in another encoding (a Latin-1 terminal, PYTHONIOENCODING=ascii): the echoed prompt and the answer go
    out as UTF-8 bytes, as llama-cli writes them (it was a UnicodeEncodeError traceback at the first 'é')."""
    import io
    import sys

    out = io.TextIOWrapper(io.BytesIO(), encoding="ascii")
    capsys.readouterr()
    monkeypatch.setattr(sys, "stdout", out)
    from coli.cli import main

    rc = main(["run", "-m", str(DENSE), "-p", "héllo ✓", "-n", "1", "-q"])
    out.flush()
    assert rc == 0 and out.buffer.getvalue().decode("utf-8").startswith("héllo ✓"), capsys.readouterr().err


def test_a_bench_context_too_big_names_the_tests_not_ctx(capsys, monkeypatch):
    """coli bench picks its context from -p / -n (llama-bench's n_prompt + n_gen): a KV cache past the memory budget
    names the tests that asked for it, not --ctx the user did not give; with -c it names --ctx. The process's own
    bytes held at a fresh process's (a whole-suite process holds GiBs: the dense-part check would refuse first)."""
    from coli.base import memory

    monkeypatch.setattr(memory, "process_rss", lambda: 300 << 20)
    rc, out, err = _main(capsys, "bench", "-m", str(DENSE), "-p", "99999999", "-n", "0", "-r", "1", "--mem", "1")
    assert (rc, out) == (2, "") and err.startswith("coli: -p 99999999 -n 0 (a context of the longest test + 1; -c "
                                                   "sets it): 100000000 positions need "), err
    rc, out, err = _main(capsys, "bench", "-m", str(DENSE), "-p", "8", "-n", "0", "-r", "1", "--mem", "1",
                         "-c", "99999999")
    assert (rc, out) == (2, "") and err.startswith("coli: --ctx: 99999999 positions need "), err


def test_ctx_0_is_the_trained_context_as_llama_cpp_reads_it(capsys):
    """``-c 0`` is the model's trained context (llama.cpp: ``n_ctx = n_ctx_train`` when 0), in coli run and coli plan;
    it was refused ("--ctx: 0 (at least 1)"). The trained context is gguf-py's reading of the file's header. A
    negative one is one line saying what --ctx takes."""
    import gguf

    from coli.plan import make_plan

    trained = int(gguf.GGUFReader(DENSE).fields["llama.context_length"].parts[-1][0])
    rc, out, err = _main(capsys, "run", "-m", str(DENSE), "-p", "x", "-n", "1", "-c", "0")
    assert rc == 0 and f", ctx {trained}, " in err and " trained (" not in err, err
    assert make_plan(DENSE, ctx=0)["ctx"] == trained
    rc, out, err = _main(capsys, "run", "-m", str(DENSE), "-p", "x", "-n", "1", "-c", "-1")
    assert (rc, out, err) == (2, "", "coli: --ctx: -1 (positions, at least 1; 0: the model's trained context)\n")


@pytest.mark.parametrize("argv, says", [(["run", "--mem", "1_0"], "argument --mem: invalid float value: '1_0'"),
                                        (["bench", "-r", "1_0"], "argument -r/--repetitions: invalid int value: '1_0'"),
                                        (["run", "-c", "\u0661\u0660"], "argument --ctx/-c/--ctx-size: invalid int value")])
def test_a_number_flag_with_a_digit_separator_is_refused(capsys, argv, says):
    """Python's int() / float() read "1_0" as 10 (and other scripts' digits): argparse took --mem 1_0 as 10 GiB, where
    llama.cpp's std::stoi / stof read a number C's way. Now argparse's own error line, exit 2, as COLI_MEM=1_0 is."""
    with pytest.raises(SystemExit) as e:
        _main(capsys, *argv, "-p", "x")
    err = capsys.readouterr().err
    assert e.value.code == 2 and says in err.splitlines()[-1], err


def test_a_quoted_tilde_in_the_model_path_is_the_home_folder(tmp_path, monkeypatch):
    """``-m '~/m.gguf'`` (quoted, or from a unit file: no shell expands it) was "no such file"; it is the home
    folder's file, as COLI_CACHE's ~ is (os.path.expanduser)."""
    import shutil

    from coli.resolve import resolve

    monkeypatch.setenv("HOME", str(tmp_path))
    shutil.copy(DENSE, tmp_path / "m.gguf")
    assert resolve("~/m.gguf") == str(tmp_path / "m.gguf")


@pytest.mark.parametrize("argv, attr", [
    (["run", "-f", "~/p.txt"], "file"), (["run", "--usage", "~/u.coli_usage"], "usage"),
    (["chat", "--trace", "~/t.json"], "trace"), (["serve", "--api-key-file", "~/key"], "api_key_file"),
    (["perplexity", "-f", "~/w.txt"], "file"), (["trace", "~/t.json"], "trace"), (["tune", "--out", "~/o"], "out")])
def test_a_quoted_tilde_in_any_path_flag_is_the_home_folder(tmp_path, monkeypatch, argv, attr):
    """-m's rule for every path flag (``coli.base.paths.user_path``): a leading ``~`` no shell expanded is the home
    folder (these flags took it as a folder named ``~`` under the current one)."""
    from coli.cli import build_parser

    monkeypatch.setenv("HOME", str(tmp_path))
    assert getattr(build_parser().parse_args(argv), attr) == str(tmp_path / argv[-1][2:])


def test_a_quoted_tilde_in_a_path_flag_reaches_the_command(tmp_path):
    """The same through a real ``coli serve`` process: the error names the home folder's file, exit 2, before
    any model loads."""
    import os
    import subprocess
    import sys

    from conftest import ROOT

    env = dict(os.environ, HOME=str(tmp_path), PYTHONPATH=str(ROOT))
    r = subprocess.run([sys.executable, "-m", "coli", "serve", "-m", str(DENSE), "--api-key-file", "~/key"],
                       env=env, capture_output=True, text=True, timeout=120)
    assert (r.returncode, r.stdout) == (2, "") and r.stderr == \
        f"coli: --api-key-file {tmp_path / 'key'}: No such file or directory\n", r.stderr


def test_a_misspelt_model_name_names_the_closest():
    """``-m smolm2``: "no such file" named the value alone; now the closest model name too (difflib), as an unknown
    option or COLI_* variable does. A path (with a separator) is not matched against the names."""
    from coli.base.errors import ColiError
    from coli.resolve import resolve

    with pytest.raises(ColiError, match=r"^smolm2: no such file; did you mean smollm2\? \(give a GGUF path"):
        resolve("smolm2")
    with pytest.raises(ColiError, match=r"^/x/smolm2: no such file \(give a GGUF path"):
        resolve("/x/smolm2")


@pytest.mark.parametrize("t", ["0", "-1"])
def test_threads_0_or_negative_is_the_default_as_llama_cpp_reads_it(capsys, t):
    """``-t 0`` / ``-t -1`` run with the default thread count (llama.cpp common/arg.cpp: ``n_threads <= 0`` is the
    default); they were refused ("threads: 0 (at least 1)"). A value that is not a number is still argparse's line."""
    import cpu_kernels

    n = cpu_kernels.default_threads()
    rc, out, err = _main(capsys, "run", "-m", str(DENSE), "-p", "x", "-n", "1", "-t", t)
    assert rc == 0 and f", {n} thread{'s' if n != 1 else ''}, ctx " in err, err
    with pytest.raises(SystemExit) as e:
        _main(capsys, "run", "-m", str(DENSE), "-p", "x", "-t", "two")
    assert e.value.code == 2 and "argument -t/--threads: invalid int value: 'two'" in capsys.readouterr().err


def test_a_folder_model_error_names_the_whole_path(tmp_path, capsys):
    """``-m DIR`` that is not a model folder: the line names the folder as given, not its last part alone
    ("coli: x: config.json: missing" said which x only to whoever remembered typing it)."""
    d = tmp_path / "x"
    d.mkdir()
    rc, out, err = _main(capsys, "run", "-m", str(d), "-p", "x", "-n", "1")
    assert (rc, out) == (2, "") and err.startswith(f"coli: {d}: config.json: missing"), err


@pytest.mark.parametrize("cmd", ["run", "chat"])
@pytest.mark.parametrize("flags, says", [
    (["--top-p", "2"], "top_p (--top-p): 2.0 (in [0, 1]; 1 = off)"),
    (["--repeat-penalty", "0"], "repeat_penalty (--repeat-penalty): 0.0 (above 0; 1 = off)"),
    (["-n", "-5"], "-n: -5 tokens to generate (at least 0, or -1 for up to the end of the context)"),
    (["-n", "8", "--ctx", "8"], "-n: 8 tokens to generate and the prompt exceed the context of 8 positions (--ctx)"),
    (["-ctk", "q9"], "--cache-type-k: 'q9' (f32, f16, bf16 or q8_0)")])
def test_a_number_flag_out_of_range_is_refused_before_the_model_loads(tmp_path, capsys, cmd, flags, says):
    """A sampling flag, -n or a KV cache type out of range is one line at once, before the model is even looked for
    (here it does not exist): each came after the load, whose first run compiles kernels for minutes (chat's -n -5
    even in every answer, exit 0)."""
    rc, out, err = _main(capsys, cmd, "-m", str(tmp_path / "none.gguf"), *(["-p", "x"] if cmd == "run" else []),
                         *flags)
    assert (rc, out) == (2, "") and err == f"coli: {says}\n", err


def test_a_folder_is_checked_without_the_kernels():
    """Opening a Hugging Face folder imports no CPU kernels (``coli.hf_folder`` makes its expert source on first use):
    ``coli info DIR`` / ``coli run -m DIR`` on a folder without config.json waited for the first run's compile
    (minutes, silent for info) before its one line."""
    import subprocess
    import sys

    code = ("import sys, coli.hf_folder; bad = sorted(m for m in sys.modules if m.split('.')[0] in "
            "('cpu_kernels', 'numba', 'scheduler')); print(bad)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert (r.returncode, r.stdout) == (0, "[]\n"), r.stderr
