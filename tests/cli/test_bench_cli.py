"""``coli bench`` as llama-bench: list syntax, output formats, the records' schema and statistics."""
from __future__ import annotations

import csv
import io
import json
import math
import statistics
import subprocess
import sys

import gguf
import numba
import pytest

from coli.bench import COLI_FIELDS, FIELDS, parse_int_list
from coli.base.errors import ColiError
from tiny_moe import ROOT, build_tiny_moe
from vk_util import requires_vulkan

# llama.cpp tools/llama-bench/llama-bench.cpp, test::get_fields (the ones that apply to coli) and the
# json/jsonl samples
LLAMA_BENCH_FIELDS = ["build_commit", "build_number", "cpu_info", "gpu_info", "backends", "model_filename",
                      "model_type", "model_size", "model_n_params", "n_batch", "n_ubatch", "n_threads", "type_k",
                      "type_v", "n_gpu_layers", "n_prompt", "n_gen", "n_depth", "test_time", "avg_ns",
                      "stddev_ns", "avg_ts", "stddev_ts"]
OWN = ["device", "balance", "cpu_act", "expert_cache", "io_threads", "load_avg"]


@pytest.mark.parametrize("text,want", [
    ("1,2,4", [1, 2, 4]), ("1-4", [1, 2, 3, 4]), ("1-16*2", [1, 2, 4, 8, 16]), ("2-9+3", [2, 5, 8]),
    ("8", [8]), ("4,1-3,4", [4, 1, 2, 3]), ("0", [0]), (" 1 , 2 ", [1, 2]),
])
def test_parse_int_list(text, want):
    assert parse_int_list(text) == want


@pytest.mark.parametrize("text", ["", "1,,2", "a", "4-1", "1-4*1", "0-4*2", "1-4+0", "1.5", "-1", "1-"])
def test_parse_int_list_rejects(text):
    with pytest.raises(ColiError) as e:
        parse_int_list(text, "-t")
    assert "-t" in str(e.value)


def test_parse_int_list_minimum():
    with pytest.raises(ColiError, match="below 1"):
        parse_int_list("0,1", "-t", minimum=1)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny_moe(tmp_path_factory.mktemp("bench"))


def _coli(*args, timeout=600):
    return subprocess.run([sys.executable, "-m", "coli", *args], capture_output=True, text=True, cwd=ROOT,
                          timeout=timeout)


def test_bench_records_the_kv_cache_types(tiny):
    """type_k / type_v are the types the KV cache was opened with (llama-bench's -ctk / -ctv fields)."""
    r = _coli("bench", "-m", str(tiny), "-p", "4", "-n", "0", "-r", "1", "-o", "json", "-ctk", "f16", "-ctv", "bf16")
    assert r.returncode == 0, r.stderr
    assert [(x["type_k"], x["type_v"]) for x in json.loads(r.stdout)] == [("f16", "bf16")]


def test_bench_json_schema(tiny):
    threads = "1,2" if numba.config.NUMBA_NUM_THREADS >= 2 else "1"
    r = _coli("bench", "-m", str(tiny), "-p", "8,4", "-n", "3", "-t", threads, "-r", "2", "-o", "json",
              "--bandwidth")
    assert r.returncode == 0, r.stderr
    recs = json.loads(r.stdout)
    reader = gguf.GGUFReader(tiny)  # llama-bench's model_size / model_n_params: tensor bytes and elements
    want_size = (sum(int(t.n_bytes) for t in reader.tensors), sum(int(t.n_elements) for t in reader.tensors))
    nt = parse_int_list(threads)
    assert [(x["n_threads"], x["n_prompt"], x["n_gen"]) for x in recs] == [
        (t, p, g) for t in nt for p, g in ((8, 0), (4, 0), (0, 3))]
    for x in recs:
        assert set(LLAMA_BENCH_FIELDS + OWN) <= set(x)
        assert x["test"] == (f"pp{x['n_prompt']}" if x["n_prompt"] else f"tg{x['n_gen']}")
        assert x["model_filename"] == str(tiny)
        assert (x["model_size"], x["model_n_params"]) == want_size
        assert x["device"] == "cpu" and x["backends"] == "CPU" and x["balance"] is False
        assert x["type_k"] == x["type_v"] == "f32"
        assert x["expert_cache"] == 4 and x["io_threads"] == 4
        n = x["n_prompt"] + x["n_gen"]
        assert len(x["samples_ns"]) == len(x["samples_ts"]) == 2
        for ns, ts in zip(x["samples_ns"], x["samples_ts"]):
            assert math.isclose(ts, n * 1e9 / ns, rel_tol=1e-9)
        # llama-bench: mean and the sample standard deviation (Bessel's correction)
        assert math.isclose(x["avg_ts"], statistics.fmean(x["samples_ts"]), rel_tol=1e-9)
        assert math.isclose(x["stddev_ts"], statistics.stdev(x["samples_ts"]), rel_tol=1e-6, abs_tol=1e-9)
        assert x["avg_ns"] == int(statistics.fmean(x["samples_ns"]))
        assert x["probe_gbps"] > 0 and x["weight_gbps"] > 0 and x["weight_bytes"] > 0
        assert x["test_time"].endswith("Z")
    # tg: every decode token reads the dense matrices (less the gathered embedding) and top-k experts a layer
    tg = recs[-1]
    assert tg["weight_bytes"] > 0


def test_bench_csv_jsonl_md(tiny):
    r = _coli("bench", "-m", str(tiny), "-p", "4", "-n", "2", "-t", "1", "-r", "1", "-o", "csv")
    assert r.returncode == 0, r.stderr
    rows = list(csv.DictReader(io.StringIO(r.stdout)))
    assert list(rows[0]) == FIELDS + COLI_FIELDS
    assert [row["test"] for row in rows] == ["pp4", "tg2"]
    assert rows[0]["stddev_ts"] == "0.0"  # one sample: llama-bench's 0
    r = _coli("bench", "-m", str(tiny), "-p", "4", "-n", "0", "-t", "1", "-r", "1", "-o", "jsonl")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.strip().splitlines()
    assert len(lines) == 1 and json.loads(lines[0])["test"] == "pp4"
    r = _coli("bench", "-m", str(tiny), "-p", "0", "-n", "2", "-t", "1", "-r", "1")
    assert r.returncode == 0, r.stderr
    head, sep, row = r.stdout.strip().splitlines()
    assert head.startswith("| model | size | params | backend | threads | test | t/s |")
    assert "| tg2 |" in row and " ± " in row


@requires_vulkan
def test_bench_gpu_layers_list_opens_the_model_per_value(tiny, capsys):
    """``-ngl 0,1`` (llama-bench's list): one engine a value, each record's n_gpu_layers the device layers that
    engine ran (0: the CPU alone; 1: the last layer on the device)."""
    from coli.cli import main

    assert main(["bench", "-m", str(tiny), "-p", "4", "-n", "0", "-r", "1", "-o", "json", "-ngl", "0,1"]) == 0
    recs = json.loads(capsys.readouterr().out)
    assert [(x["n_gpu_layers"], x["backends"], x["test"]) for x in recs] == [(0, "CPU", "pp4"), (1, "CPU,Vulkan", "pp4")]
    assert parse_int_list("-1,2", "-ngl", minimum=-1) == [-1, 2]


def test_bench_bad_lists_are_one_line_errors(tiny):
    for args in (["-t", "1-"], ["-p", "x"], ["-ngl", "1,x"], ["-t", str(numba.config.NUMBA_NUM_THREADS + 1)], ["-p", "0", "-n", "0"]):
        r = _coli("bench", "-m", str(tiny), "-r", "1", *args)
        assert r.returncode == 2, (args, r.stderr)
        assert r.stderr.startswith("coli: ") and "Traceback" not in r.stderr


def _stderr_on_a_terminal(args, timeout=300):
    """Run ``python -m coli ARGS`` with stderr on a pseudo-terminal of 120 columns; (rc, what it printed)."""
    import fcntl
    import os
    import pty
    import struct
    import termios
    import threading

    m, s = pty.openpty()
    fcntl.ioctl(s, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 120, 0, 0))
    buf = []

    def read():
        while True:
            try:
                d = os.read(m, 65536)
            except OSError:
                break
            if not d:
                break
            buf.append(d)

    t = threading.Thread(target=read, daemon=True)
    t.start()
    try:
        r = subprocess.run([sys.executable, "-m", "coli", *args], stdout=subprocess.PIPE, stderr=s, cwd=ROOT,
                           timeout=timeout)
    finally:
        os.close(s)
    t.join(10)
    os.close(m)
    return r.returncode, b"".join(buf).decode("utf-8", "replace")


def test_progress_bar_only_on_a_terminal(tiny, tmp_path):
    text = tmp_path / "text.txt"
    text.write_text(" ".join(["ab"] * 40))
    args = ["perplexity", "-m", str(tiny), "-f", str(text), "--ctx", "8"]
    rc, err = _stderr_on_a_terminal(args)
    assert rc == 0, err
    # tqdm's bar over the chunks, then llama-perplexity's line of running estimates
    assert "perplexity:" in err and "/5 [" in err and "chunks/s" in err and "ppl " in err and "[5]" in err
    r = _coli(*args)
    assert r.returncode == 0, r.stderr
    assert "chunks/s" not in r.stderr and "\r" not in r.stderr and "[5]" in r.stderr


def test_compile_clock_counts_compiles_of_this_thread_only():
    import threading
    import time

    from coli.base import progress

    progress.install()

    @numba.njit  # not cached: compiled at the first call
    def f(x):
        return x * 2 + 1

    c0 = progress.compile_seconds()
    t0 = time.perf_counter()
    assert f(3) == 7
    wall = time.perf_counter() - t0
    c1 = progress.compile_seconds()
    assert 0 < c1 - c0 <= wall
    assert f(4) == 9 and progress.compile_seconds() == c1  # compiled once

    @numba.njit
    def g(x):
        return x - 1

    t = threading.Thread(target=lambda: g(1))
    t.start()
    t.join()
    assert progress.compile_seconds() == c1  # another thread's compile is its own


def test_compile_bar_on_a_terminal():
    code = ("import cpu_kernels, numba; from coli.base import progress; progress.install(); "
            "f = numba.njit(lambda x: x + 1); f(1); progress.end_compile_bar()")
    import fcntl
    import os
    import pty
    import struct
    import termios

    m, s = pty.openpty()
    fcntl.ioctl(s, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 120, 0, 0))
    try:
        r = subprocess.run([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=s, cwd=ROOT, timeout=300)
        out = os.read(m, 65536).decode("utf-8", "replace")
    finally:
        os.close(s)
        os.close(m)
    assert r.returncode == 0
    assert "compiling the CPU kernels, once" in out


def test_bench_context_is_the_longest_test(tiny, capsys, monkeypatch):
    """Without --ctx the engine gets llama-bench's n_ctx, the longest test plus one (run_bench's need), so the memory
    budget does not reserve a whole trained context's KV cache (it would shrink the RAM expert cache) that no test
    writes; a given --ctx is kept."""
    import coli.cli as cli

    seen = []
    real = cli._open_engine

    def spy(a, **kw):
        eng = real(a, **kw)
        seen.append(eng.ctx)
        return eng

    monkeypatch.setattr(cli, "_open_engine", spy)
    assert cli.main(["bench", "-m", str(tiny), "-p", "4,6", "-n", "3", "-r", "1", "-o", "json"]) == 0
    assert cli.main(["bench", "-m", str(tiny), "-p", "4", "-n", "0", "-r", "1", "-o", "json", "--ctx", "20"]) == 0
    assert seen == [7, 20]
    capsys.readouterr()


def test_bench_warm_up_and_runs_decode_ids_of_their_own(tiny, monkeypatch):
    """As llama-bench: the tg warm-up decodes one token and each run its own ids (``run_tokens``), so the timed
    decode is not that of a RAM expert cache the warm-up filled with the same ids: the first timed run still reads
    experts from the file (with the same ids as the warm-up it read none). A cache of 3 of the 4 experts a layer:
    one that holds them all is filled after the warm-up (the next test)."""
    from coli import bench
    from coli.engine import Engine

    eng = Engine(str(tiny), quiet=True, save_usage=False, expert_cache=3, ctx=16)
    try:
        fed = []
        real = eng.model.forward

        def spy(ids, kv, *a, **kw):
            fed.append(int(ids[0]))
            return real(ids, kv, *a, **kw)

        monkeypatch.setattr(eng.model, "forward", spy)
        recs = bench.run_bench(eng, n_prompt=0, n_gen=6, reps=2)
        runs = [bench.run_tokens(eng, "tg", 6, r).tolist() for r in range(3)]
        assert len(runs[0]) == 1 and fed == runs[0] + runs[1] + runs[2]
        assert runs[1] != runs[2] and runs[0] != runs[1][:1]
        assert recs[0]["expert_disk_loads"][0] > 0
    finally:
        eng.close()


def test_bench_fills_a_cache_that_holds_every_expert(tiny):
    """The steady state, as llama-bench's warm page cache: when the RAM expert cache holds every expert, the warm-up
    ends with all of them read (``fill_expert_cache``), so no timed run reads one from the file; a cache that holds
    fewer is left as the warm-up left it (its first timed run reads experts: the previous test)."""
    from coli import bench
    from coli.engine import Engine

    eng = Engine(str(tiny), quiet=True, save_usage=False, expert_cache=4, ctx=16)
    try:
        recs = bench.run_bench(eng, n_prompt=0, n_gen=6, reps=2)
        c = eng.cache
        assert recs[0]["expert_disk_loads"] == [0, 0] and recs[0]["expert_bytes_read"] == [0, 0]
        assert all(c.in_ram(l, e) for l in eng.model.moe_layers for e in range(4))
        assert bench.fill_expert_cache(eng) == 0           # nothing left to read
        c.clear()
        assert bench.fill_expert_cache(eng) == 4 * len(eng.model.moe_layers) and c.loads >= 8
    finally:
        eng.close()
    eng = Engine(str(tiny), quiet=True, save_usage=False, expert_cache=3, ctx=16)
    try:
        assert bench.fill_expert_cache(eng) == 0 and not any(eng.cache.lru.values())
    finally:
        eng.close()
