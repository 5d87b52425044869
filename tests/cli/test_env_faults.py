"""The process environment and tables that must agree: HOME a file, an unwritable COLI_CACHE, a uid with no
passwd entry (import works, one warning, no disk cache; a ``coli:`` error only where the cache is needed);
stdout closed or broken; SIGTERM and Ctrl-C (stats line, history saved, exit 143 / 130); token tables of
different lengths (refused as llama.cpp refuses them); the start line names both sides' activations."""
from __future__ import annotations

import json
import re
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from conftest import ROOT

PY = sys.executable
# import the kernel package and modules of cache=True kernels (numba resolves its cache folder when one is
# defined) and run one small kernel (it compiles, so a cache folder is really used: a few seconds). Not
# cpu_kernels.formats: it imports cpu_kernels.experts, whose ``_block_i8`` cfunc compiles at import (~75 CPU s
# uncached, in every such child); every kernel module under HOME a file is imported by the child of
# tests/kernels/test_formats.py::test_formats_without_vnni_keep_widened_codes, which compiles them uncached anyway
IMPORT_KERNELS = ("import numpy as np, cpu_kernels, cpu_kernels.attention, cpu_kernels.norms, cpu_kernels.rope; "
                  "from cpu_kernels.norms import rms_norm; "
                  "x = rms_norm(np.ones((2, 32), np.float32), np.ones(32, np.float32), 1e-6); print(float(x.sum()))")
# a second cache=True kernel compiled after the first (Numba's thread-pool probe): two cache writes in a run
IMPORT_KERNELS_TWO = IMPORT_KERNELS + "; from cpu_kernels._probe import psum; assert psum(np.ones(64)) == 64.0"


def _env(**kw):
    env = {k: v for k, v in os.environ.items()
           if k not in ("COLI_CACHE", "XDG_CACHE_HOME", "NUMBA_CACHE_DIR", "HOME")}
    env.update({k: v for k, v in kw.items() if v is not None})
    return env


def _py(code, env, **kw):
    return subprocess.run([PY, "-c", code], capture_output=True, text=True, cwd=ROOT, env=env, timeout=600, **kw)


def _warnings(stderr):
    return [l for l in stderr.splitlines() if l.startswith("coli: warning")]


# -- kind 6: the environment -----------------------------------------------------------------------------------
def test_home_is_a_file(tmp_path):
    """The issue's example: HOME points at a file: import and a kernel work, one warning naming HOME (with every
    kernel module imported: tests/kernels/test_formats.py::test_formats_without_vnni_keep_widened_codes)."""
    home = tmp_path / "home-file"
    home.write_text("x")
    r = _py(IMPORT_KERNELS, _env(HOME=str(home)))
    assert r.returncode == 0, r.stderr
    assert abs(float(r.stdout) - 64 / np.sqrt(1 + 1e-6)) < 1e-4 and "Traceback" not in r.stderr  # NumPy: x / rms
    w = _warnings(r.stderr)
    assert len(w) == 1 and "HOME=" in w[0] and "not kept on disk" in w[0]


def test_coli_cache_unwritable(tmp_path):
    """Second case: COLI_CACHE on a path that cannot be made (/proc/x)."""
    r = _py(IMPORT_KERNELS, _env(HOME=str(tmp_path), COLI_CACHE="/proc/coli-x"))
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    w = _warnings(r.stderr)
    assert len(w) == 1 and "COLI_CACHE=/proc/coli-x" in w[0]


def test_coli_cache_a_file_says_every_run_compiles(tmp_path):
    """COLI_CACHE pointing at a file: one warning line at import (before any compile), naming the variable and
    that each run compiles the kernels again; the compile notice then says so too (it read "later runs load them
    from /tmp/coli-numba-...", a folder removed at exit), and that folder is gone after the run."""
    f = tmp_path / "cache-file"
    f.write_text("x")
    code = ("import os, cpu_kernels; from coli.base import progress; "
            "print(os.environ['NUMBA_CACHE_DIR']); print(progress.compile_notice())")
    r = _py(code, _env(HOME=str(tmp_path), COLI_CACHE=str(f)))
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr == (f"coli: warning: cache folder {f}/numba/{r.stderr.split('/numba/')[1].split(' ')[0]} "
                        f"(COLI_CACHE={f}): Not a directory; set COLI_CACHE to a writable folder; compiled kernels "
                        "are not kept on disk (each run compiles them again: minutes)\n"), r.stderr
    folder, notice = r.stdout.splitlines()
    assert notice.endswith("(the warning above) every run compiles them again") and "later runs" not in notice
    assert os.path.basename(folder).startswith("coli-numba-") and not os.path.exists(folder)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run as a uid without a passwd entry")
def test_uid_without_passwd_entry(tmp_path):
    """Third case: no HOME and a uid the passwd file does not know (containers run as --user 12345)."""
    import pwd

    uid = 54321
    with pytest.raises(KeyError):
        pwd.getpwuid(uid)
    r = _py(IMPORT_KERNELS, _env(), preexec_fn=lambda: os.setuid(uid))
    if "Permission denied" in r.stderr and "Traceback" in r.stderr and "cpu_kernels" not in r.stderr:
        pytest.skip("the checkout is not readable by other users")
    assert r.returncode == 0, r.stderr
    w = _warnings(r.stderr)
    assert len(w) == 1 and "no home folder" in w[0] and f"uid {uid}" in w[0]


def test_cache_error_only_where_the_cache_is_needed(tmp_path):
    """The demo build needs the cache: one ``coli:`` line naming COLI_CACHE, exit 2, no traceback."""
    r = subprocess.run([PY, "-m", "coli", "run", "-p", "hi", "-n", "1"], capture_output=True, text=True, cwd=ROOT,
                       env=_env(HOME=str(tmp_path), COLI_CACHE="/proc/coli-x"), timeout=600)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    errs = [l for l in r.stderr.splitlines() if l.startswith("coli: ") and not l.startswith("coli: warning")]
    assert len(errs) == 1 and "COLI_CACHE=/proc/coli-x" in errs[0]


def test_stdout_closed(demo_path, tmp_path):
    """The issue's example: ``coli run ... >&-`` ends like a broken pipe: exit 0, no traceback."""
    cmd = f"exec {PY} -m coli run -m {demo_path} -p hi -n 3 --usage {tmp_path}/u >&-"
    r = subprocess.run(["bash", "-c", cmd], capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert r.returncode == 0 and "Traceback" not in r.stderr and "AttributeError" not in r.stderr, r.stderr


def test_stdout_broken_pipe(demo_path, tmp_path):
    """Second case: the reader goes away after one byte (``| head -c 1``): exit 0, nothing on stderr but the
    start and stats lines (no traceback, no "Exception ignored" at exit)."""
    cmd = (f"set -o pipefail; {PY} -m coli run -m {demo_path} -p hello -n 8 --usage {tmp_path}/u "
           f"| head -c 1; echo \" rc=$?\"")
    r = subprocess.run(["bash", "-c", cmd], capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert r.stdout == "h rc=0\n", (r.stdout, r.stderr)
    assert "Traceback" not in r.stderr and "Exception" not in r.stderr and "Error" not in r.stderr, r.stderr


def test_stderr_closed(demo_path, tmp_path):
    """Third case: ``2>&-``: the run completes and its notes do not land in stdout."""
    cmd = f"exec {PY} -m coli run -m {demo_path} -p hello -n 4 --usage {tmp_path}/u 2>&-"
    r = subprocess.run(["bash", "-c", cmd], capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert r.returncode == 0 and r.stdout.startswith("hello") and "coli:" not in r.stdout, r.stdout


def _run_and_signal(demo_path, tmp_path, sig):
    hist = tmp_path / "h.coli_usage"
    prompt = "Once upon a time"
    # the child starts with SIGINT's default disposition, as under a terminal: a suite started as a background
    # job of a non-interactive shell inherits SIGINT ignored, and Python then keeps ignoring it (as it should)
    p = subprocess.Popen([PY, "-m", "coli", "run", "-m", str(demo_path), "-p", prompt, "-n", "400",
                          "--ctx", "512", "--usage", str(hist)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=ROOT,
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    got = b""
    deadline = time.monotonic() + 500
    while len(got) < len(prompt) + 3 and time.monotonic() < deadline:  # some generated text came out
        chunk = os.read(p.stdout.fileno(), 64)
        if not chunk:
            break
        got += chunk
    p.send_signal(sig)
    out, err = p.communicate(timeout=300)
    return p.returncode, (got + out).decode(errors="replace"), err.decode(errors="replace"), hist


def test_sigterm_is_ctrl_c_with_exit_143(demo_path, tmp_path):
    """The issue's example (docker stop): stats line, history saved (and whole), exit 143, no traceback."""
    rc, out, err, hist = _run_and_signal(demo_path, tmp_path, signal.SIGTERM)
    assert rc == 143, err
    assert "Traceback" not in err and "terminated (SIGTERM)" in err and "coli: prefill" in err
    ent = json.loads(hist.read_text())["models"][demo_path.name]
    assert ent["tokens"] > 0 and sum(map(sum, ent["counts"])) == ent["tokens"] * 2 * 30


def test_sigint_keeps_exit_130(demo_path, tmp_path):
    """Second case: Ctrl-C (SIGINT) the same way, exit 130."""
    rc, out, err, hist = _run_and_signal(demo_path, tmp_path, signal.SIGINT)
    assert rc == 130 and "interrupted" in err and "coli: prefill" in err and "Traceback" not in err, err
    assert json.loads(hist.read_text())["models"][demo_path.name]["tokens"] > 0


# Numba's compile with the signal landing where it lands in a real run: while LLVM emits a kernel (C code) a
# signal's Python handler runs at the next Python code, often llvmlite's object-cache hook (a ctypes callback,
# which prints the KeyboardInterrupt as "Exception ignored" and goes on); the hook sends it here to be certain
SWALLOWED = """
import os, signal, sys, time
import numba
from numba.core import codegen
from coli import cli
sig = getattr(signal, sys.argv[1])
hook = codegen.CPUCodeLibrary._object_compiled_hook
def in_callback(ll_module, buf):
    os.kill(os.getpid(), sig)
    return hook(ll_module, buf)
codegen.CPUCodeLibrary._object_compiled_hook = staticmethod(in_callback)
def work(x):
    return x + 1
def command(a):
    numba.njit(cache=sys.argv[2] == "cache")(work)(1)
    t = time.monotonic()
    while time.monotonic() - t < 10:
        pass
    print("ran on")
    return 0
cli.cmd_info = command
sys.exit(cli.main(["info", "x"]))
"""


@pytest.mark.parametrize("sig,cache,rc,line", [("SIGINT", "nocache", 130, "coli: interrupted"),
                                               ("SIGTERM", "cache", 143, "coli: terminated (SIGTERM)")])
def test_an_interrupt_during_a_kernel_compile_is_not_lost(tmp_path, sig, cache, rc, line):
    """Ctrl-C while LLVM emits a kernel (a first run's compile, a cache load): it was swallowed by the ctypes
    callback (a traceback, then the run went on: without a cache to write "ran on", exit 0) or Numba's cache save
    failed after it (RuntimeError "no compiled object yet", a traceback, exit 1). Now the one line, 130 / 143."""
    (tmp_path / "s.py").write_text(SWALLOWED)
    r = subprocess.run([PY, str(tmp_path / "s.py"), sig, cache], capture_output=True, text=True, cwd=ROOT,
                       timeout=120, env=_env(NUMBA_CACHE_DIR=str(tmp_path / "nb"), PYTHONPATH=str(ROOT)),
                       preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    assert (r.returncode, r.stdout, r.stderr) == (rc, "", line + "\n"), (r.returncode, r.stdout, r.stderr)


def test_an_earlier_calls_interrupt_does_not_hide_this_calls_error(monkeypatch):
    """main() called again in one process (a library, the tests): an interrupt that an earlier call took back from a
    C callback is not this call's, so this call's own error is its traceback, not "coli: interrupted" (exit 130)."""
    from coli import cli

    monkeypatch.setattr(cli, "_swallowed", [signal.SIGINT])     # as an earlier call left it

    def bug():
        raise RuntimeError("this call's own error")
    monkeypatch.setattr(cli, "_check_numba_threads", bug)
    with pytest.raises(RuntimeError, match="this call's own error"):
        cli.main(["models"])


# -- kind 4: tables that must agree ----------------------------------------------------------------------------
def _tiny_llama(path, n_tokens=256, embd_rows=256, out_rows=None, vocab_size=None):
    import gguf

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(1); w.add_context_length(64); w.add_embedding_length(64); w.add_feed_forward_length(64)
    w.add_head_count(4); w.add_head_count_kv(4); w.add_layer_norm_rms_eps(1e-5)
    if vocab_size is not None:
        w.add_vocab_size(vocab_size)
    w.add_tokenizer_model("gpt2"); w.add_tokenizer_pre("default")
    w.add_token_list(["a", "b", "ab"] + [f"<t{i}>" for i in range(n_tokens - 3)]); w.add_token_types([1] * n_tokens)
    w.add_token_merges(["a b"])
    rng = np.random.default_rng(0)
    f32 = lambda *s: rng.standard_normal(s).astype(np.float32) * 0.1
    w.add_tensor("token_embd.weight", f32(embd_rows, 64)); w.add_tensor("output_norm.weight", np.ones(64, np.float32))
    if out_rows is not None:
        w.add_tensor("output.weight", f32(out_rows, 64))
    for n in ("attn_norm", "ffn_norm"):
        w.add_tensor(f"blk.0.{n}.weight", np.ones(64, np.float32))
    for n in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"):
        w.add_tensor(f"blk.0.{n}.weight", f32(64, 64))
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
    return path


def test_tables_that_agree_load_and_run(tmp_path):
    from coli.engine import Engine

    with Engine(_tiny_llama(tmp_path / "ok.gguf", out_rows=256), save_usage=False) as eng:
        assert len(eng.generate(ids=[0, 1, 2], max_tokens=4, stop_at_eos=False).ids) == 4


@pytest.mark.parametrize("kw,name", [
    (dict(embd_rows=260), "tensor 'token_embd.weight': 260 rows"),            # the example
    (dict(out_rows=300), "tensor 'output.weight': 300 rows"),                 # second case: only the output
    (dict(vocab_size=320), "kv 'llama.vocab_size': 320"),                     # third: the metadata says otherwise
])
def test_tables_that_disagree_are_refused(tmp_path, kw, name):
    """Refused at load (llama.cpp refuses the same files: its n_vocab is the token count and create_tensor checks
    the shape), never a ValueError when an extra id is sampled."""
    from coli.engine import Engine
    from coli.base.errors import ColiError

    p = _tiny_llama(tmp_path / "bad.gguf", **kw)
    with pytest.raises(ColiError) as e:
        Engine(p, save_usage=False)
    assert str(e.value).startswith("bad.gguf: ") and name in str(e.value) and "256 tokens" in str(e.value)
    r = subprocess.run([PY, "-m", "coli", "run", "-m", str(p), "-p", "ab", "-n", "2"], capture_output=True,
                       text=True, cwd=ROOT, timeout=600)
    assert r.returncode == 2 and name in r.stderr and "Traceback" not in r.stderr


def test_trace_never_overwrites_a_file_coli_did_not_write(tmp_path, demo_path):
    """``--trace notes.txt`` on an existing text file is refused; a trace coli wrote may be replaced."""
    from coli.engine import Engine
    from coli.base.errors import ColiError

    f = tmp_path / "notes.txt"
    f.write_text("keep me")
    with pytest.raises(ColiError, match="--trace .*notes.txt: exists and is not a file coli wrote"):
        Engine(demo_path, trace=f, save_usage=False)
    assert f.read_text() == "keep me"
    t = tmp_path / "t.json"
    t.write_text('[{"ph": "X", "name": "old"}]')
    Engine(demo_path, trace=t, save_usage=False).close()
    assert "old" not in t.read_text()


# -- kind 9: --balance must not change the answer without saying so ----------------------------------------------
def _vulkan_opens():
    from coli.vulkan import open_device

    d = open_device("probe", quiet=True)
    if d is None:
        return False
    d.close()
    return True


def test_balance_says_the_activations_and_f32_gives_the_same_tokens(demo_path, tmp_path):
    """The issue's example (``def fibonacci(n):`` on the demo MoE): with ``--cpu-act f32`` the run with
    ``--balance`` prints the text of the run without it, and the device did work (matmuls > 0); the start
    line names both sides' activations, and without ``--cpu-act`` both sides use the CPU's default."""
    if not _vulkan_opens():
        pytest.skip("no Vulkan device (Lavapipe) opens here")
    base = [PY, "-m", "coli", "run", "-m", str(demo_path), "-p", "def fibonacci(n):", "-n", "8",
            "--usage", str(tmp_path / "u")]
    # a device budget of its own (the shared-RAM rule gives 0 on a small box): the device must do work
    env = dict(os.environ, COLI_VK_TIER_GB="0.3")
    run = lambda *extra: subprocess.run(base + list(extra), capture_output=True, text=True, cwd=ROOT, timeout=600,
                                        env=env)
    cpu = run("--cpu-act", "f32")
    dev = run("--cpu-act", "f32", "--balance")
    assert cpu.returncode == 0 and dev.returncode == 0, (cpu.stderr, dev.stderr)
    assert "activations: CPU f32" in cpu.stderr and "device" not in cpu.stderr.split("activations:")[1].split("\n")[0]
    assert "activations: CPU f32, device f32" in dev.stderr
    matmuls = [int(l.split(": ")[1].split()[0]) for l in dev.stderr.splitlines() if l.endswith("matmuls on the GPU")]
    assert matmuls and matmuls[0] > 0
    assert dev.stdout == cpu.stdout
    import cpu_kernels

    if cpu_kernels.DEFAULT_ACT != "f32":
        d = run("--balance", "-n", "1")
        want = f"activations: CPU {cpu_kernels.DEFAULT_ACT}, device {cpu_kernels.DEFAULT_ACT}"
        assert d.returncode == 0 and want in d.stderr, d.stderr


# -- found by trying the README as a new user ------------------------------------------------------------------
def test_api_inputs_of_the_wrong_kind_are_coli_errors(model_path, engine):
    """Token ids that are not integers were truncated (1.5 -> 1) or raised ValueError; text that is not a string,
    an id outside the table in detokenize and malformed chat messages raised TypeError/ValueError."""
    from coli.base.errors import ColiError

    eng = engine(model_path("smollm2"))
    for ids, msg in (([1.5], "not integers"), ("abc", "is text"), ([[1, 2], [3]], "not a list of integers"),
                     ([5, 10**9], "id 1000000000 at index 1")):
        with pytest.raises(ColiError, match=msg):
            eng.generate(ids=ids, max_tokens=1)
    assert eng.logits(np.array([1.0, 2.0])).shape == (2, eng.args.vocab)  # integral floats are ids
    for text in (None, 123):
        with pytest.raises(ColiError, match="is not a string"):
            eng.tokenize(text)
    with pytest.raises(ColiError, match="token id 1000000000: out of range"):
        eng.detokenize([10**9])
    for msgs, msg in (("hello", "messages: str"), ([{"content": "x"}], r"messages\[0\]"),
                      ([{"role": "user", "content": 5}], r"messages\[0\]\['content'\]")):
        with pytest.raises(ColiError, match=msg):
            eng.tokenizer.encode_chat(msgs)


def test_cli_empty_text_file(model_path, tmp_path):
    f = tmp_path / "empty.txt"
    f.write_text("")
    r = subprocess.run([PY, "-m", "coli", "perplexity", "-m", str(model_path("smollm2")), "-f", str(f)],
                       capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert r.returncode == 2 and "empty.txt: empty" in r.stderr and "Traceback" not in r.stderr


def test_run_with_a_file_home_and_no_coli_cache(tmp_path):
    """``coli run -m FILE.gguf`` with HOME a file and COLI_CACHE unset runs (docker --read-only): the config
    file's place is HOME's, where there is none to read (it fell back to the cache folder, which raised: exit 2)."""
    from tiny_moe import build_tiny_moe

    tiny = build_tiny_moe(tmp_path)
    home = tmp_path / "home-file"
    home.write_text("x")
    env = _env(HOME=str(home), NUMBA_CACHE_DIR=os.environ["NUMBA_CACHE_DIR"])  # the suite's compiled kernels
    env.pop("XDG_CONFIG_HOME", None)
    r = subprocess.run([PY, "-m", "coli", "run", "-m", str(tiny), "-p", "ab", "-n", "2", "--temp", "0"],
                       capture_output=True, text=True, cwd=ROOT, env=env, timeout=600)
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    assert r.stdout.startswith("ab") and not [l for l in r.stderr.splitlines() if l.startswith("coli: ") and
                                              "warning" not in l and "tiny-moe" not in l and "prefill" not in l
                                              and "compiling the CPU kernels" not in l and "AMX" not in l]


def test_relative_coli_cache_is_an_error(tmp_path):
    """A relative COLI_CACHE would make a new cache in every working folder: one ``coli:`` line naming it."""
    r = subprocess.run([PY, "-m", "coli", "models"], capture_output=True, text=True, cwd=ROOT,
                       env=_env(HOME=str(tmp_path), COLI_CACHE="rel-cache"), timeout=600)
    assert r.returncode == 2 and r.stderr.startswith("coli: COLI_CACHE='rel-cache': a relative path"), r.stderr
    assert not (ROOT / "rel-cache").exists()


def _small_tmpfs(tmp_path, size: str):
    """``(prefix, folder)``: a command prefix that runs its command with a tmpfs of ``size`` mounted on ``folder``
    in a mount namespace of its own (a full disk, for real); skips where mounts are not allowed."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    pre = ["unshare", "-m" if os.geteuid() == 0 else "-rm", "sh", "-c",
           f'mount -t tmpfs -o size={size} tmpfs "{mnt}" && exec "$@"', "sh"]
    try:
        ok = subprocess.run(pre + ["true"], capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        ok = False
    if not ok:
        pytest.skip("no mount namespace here (unshare -m / -rm) for a small tmpfs")
    return pre, mnt


def test_full_disk_numba_cache_is_one_warning_and_runs_uncached(tmp_path):
    """Numba's cache on a full disk (an 8 KiB tmpfs): one warning line naming the folder and what the cache
    takes (once: a second kernel's write is not tried again), the kernels' results, exit 0 (it was a 130-line
    ``OSError: [Errno 28]`` traceback)."""
    pre, mnt = _small_tmpfs(tmp_path, "8k")
    r = subprocess.run(pre + [PY, "-c", IMPORT_KERNELS_TWO], capture_output=True, text=True, cwd=ROOT, timeout=600,
                       env=_env(HOME=str(tmp_path), NUMBA_CACHE_DIR=str(mnt)))
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    assert abs(float(r.stdout) - 64 / np.sqrt(1 + 1e-6)) < 1e-4
    assert _warnings(r.stderr) == [f"coli: warning: Numba's kernel cache {mnt}: No space left on device (a model's "
                                   "kernels take about 100 MiB there); compiled kernels are not kept on disk (each "
                                   "run compiles them again)"], r.stderr


def test_full_disk_demo_build_is_one_error(tmp_path, model_path):
    """The demo build on a full disk (a 4 MiB tmpfs as COLI_CACHE): one ``coli:`` line naming the folder and the
    MB it needs, exit 2, no temp file left (it was ``OSError: ... requested and ... written``)."""
    pre, mnt = _small_tmpfs(tmp_path, "4m")
    smollm2 = model_path("smollm2")
    code = (f"import os, sys; os.makedirs('{mnt}/models'); os.symlink('{smollm2}', '{mnt}/models/{smollm2.name}'); "
            f"from coli.cli import main; rc = main(['run', '-p', 'hi', '-n', '1']); "
            f"print(sorted(os.listdir('{mnt}/demo'))); sys.exit(rc)")
    r = subprocess.run(pre + [PY, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=600,
                       env=_env(HOME=str(tmp_path), COLI_CACHE=str(mnt), NUMBA_CACHE_DIR=os.environ["NUMBA_CACHE_DIR"]))
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    errs = [l for l in r.stderr.splitlines() if l.startswith("coli: ")]
    assert len(errs) == 1 and errs[0].startswith(f"coli: {mnt}/demo: the demo build could not write smollm2-moe-"), r.stderr
    assert re.search(r"it needs about (\d+) MB free there, [0-4] MB are", errs[0]) and int(
        re.search(r"about (\d+) MB", errs[0]).group(1)) > 500, errs[0]
    assert r.stdout.strip() == "['.build.lock']"  # no temp file left


@pytest.mark.parametrize("value", ["0", "-2", "four"])
def test_a_bad_numba_thread_count_is_one_line(value):
    """NUMBA_NUM_THREADS=0 was a 20-line ValueError traceback from Numba's import (a word: ignored with a warning):
    one line naming it, exit 2, before a model is read."""
    r = subprocess.run([PY, "-m", "coli", "run", "-m", "smollm2", "-p", "hi", "-n", "1"], capture_output=True,
                       text=True, cwd=ROOT, env=dict(os.environ, NUMBA_NUM_THREADS=value), timeout=120)
    assert (r.returncode, r.stdout) == (2, "") and r.stderr == (
        f"coli: NUMBA_NUM_THREADS={value!r}: Numba's thread pool, a whole number >= 1 (unset: one a core; "
        "--threads N uses fewer)\n"), r.stderr


def test_a_read_only_cache_that_holds_the_models_serves_them(tmp_path, monkeypatch, capsys):
    """A cache folder that cannot be written (a read-only mount; root writes anywhere else, so its write check
    fails here as on one) but holds a model: coli models lists it and ``-m smollm2`` resolves to it. Both stopped
    at "cache folder .../models (COLI_CACHE=...): Read-only file system" (a read-only bind mount holding SmolLM2,
    by hand: coli run -m smollm2 now runs from it)."""
    import errno
    import tempfile
    import types

    from coli import fetch
    from coli.base import paths
    from coli.cli import main

    def read_only(*a, **kw):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS))

    cache = tmp_path / "ro"
    f = cache / "models" / fetch.MODELS["smollm2"]["file"]
    f.parent.mkdir(parents=True)
    f.write_bytes(b"GGUF")
    monkeypatch.setenv("COLI_CACHE", str(cache))
    monkeypatch.setattr(paths, "tempfile", types.SimpleNamespace(TemporaryFile=read_only, mkstemp=tempfile.mkstemp))
    assert main(["models"]) == 0
    out = capsys.readouterr().out
    assert re.search(rf"^smollm2 +yes .* {re.escape(str(f))} ", out, re.M) and f"{cache}/demo/" in out, out
    assert fetch.model_path("smollm2") == f
    assert main(["run", "-m", "gemma3-270m", "-p", "x"]) == 2  # a download still needs a writable folder
    assert "Read-only file system; set COLI_CACHE to a writable folder" in capsys.readouterr().err


def test_an_interrupted_main_gives_the_caller_its_signals_back(monkeypatch):
    """cli.main() called in a program's process (a library, a notebook): after an interrupt SIGINT and SIGTERM stayed
    ignored (the caller's Ctrl-C did nothing) and after any call SIGTERM raised coli's Terminated. Now the caller's
    handlers and unraisablehook are its own again; the console entry point alone keeps them ignored up to its exit."""
    from coli import cli

    def interrupted(a):
        raise KeyboardInterrupt()
    before = (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM), sys.unraisablehook)
    monkeypatch.setattr(cli, "cmd_models", interrupted)
    assert cli.main(["models"]) == 130
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM), sys.unraisablehook) == before
    monkeypatch.setattr(cli, "cmd_models", lambda a: 0)
    assert cli.main(["models"]) == 0
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM), sys.unraisablehook) == before
