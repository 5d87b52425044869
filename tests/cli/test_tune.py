"""``coli tune`` on a tiny MoE with two points: the CSV has one row a run, the PNG is matplotlib's, the
recommendation is one of the points, ``--save`` writes the config that ``coli run`` reads and names."""
from __future__ import annotations

import csv
import json
import os
import struct
import subprocess
import sys

import pytest

import cpu_kernels
from coli.base.errors import ColiError
from coli.tune import load_config, save_config
from tiny_moe import ROOT, build_tiny_moe


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny_moe(tmp_path_factory.mktemp("tune"))


def _png_chunks(data: bytes) -> list[tuple[bytes, bytes]]:
    """(type, payload) of each chunk (PNG spec, section 5.3: length, type, data, CRC)."""
    out, i = [], 8
    while i < len(data):
        (n,) = struct.unpack(">I", data[i:i + 4])
        out.append((data[i + 4:i + 8], data[i + 8:i + 8 + n]))
        i += 12 + n
    return out


def _tune(tiny, out, home, *extra):
    env = dict(os.environ, HOME=str(home))
    env.pop("XDG_CONFIG_HOME", None)
    return subprocess.run([sys.executable, "-m", "coli", "tune", "-m", str(tiny), "--out", str(out),
                           "--layers", cpu_kernels.threading_layer(), "--reps", "2", "-p", "4", "-n", "2", *extra],
                          capture_output=True, text=True, cwd=ROOT, env=env, timeout=600)


def test_tune_two_points_csv_png_recommendation_save(tiny, tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    out = tmp_path / "out"
    r = _tune(tiny, out, home, "--threads", "1", "--io-threads", "1,4", "--max-load", "1e9", "--save")
    assert r.returncode == 0, r.stderr
    rows = list(csv.DictReader(open(out / "tune.csv")))
    assert len(rows) == 2 * 2  # 2 points x 2 runs, one row a run
    points = {(row["threads"], row["io_threads"]) for row in rows}
    assert points == {("1", "1"), ("1", "4")}
    assert sorted(row["rep"] for row in rows) == ["0", "0", "1", "1"]
    assert all(float(row["decode_tps"]) > 0 and float(row["prefill_tps"]) > 0 for row in rows)
    png = (out / "tune.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    chunks = _png_chunks(png)
    assert chunks[0][0] == b"IHDR" and chunks[-1][0] == b"IEND"
    w, h = struct.unpack(">II", chunks[0][1][:8])
    assert (w, h) == (1100, 420)  # figsize 11 x 4.2 in at 100 dpi
    soft = [p for t, p in chunks if t == b"tEXt" and p.startswith(b"Software\0")]
    assert soft and soft[0].startswith(b"Software\0Matplotlib")
    summary = json.loads((out / "tune.json").read_text())
    rec = summary["recommended"]
    assert (str(rec["threads"]), str(rec["io_threads"])) in points
    assert "recommended:" in r.stdout
    cfg, path = load_config(home / ".config" / "coli" / "config.toml")
    assert path is not None and cfg["threads"] == rec["threads"] and cfg["io_threads"] == rec["io_threads"]
    # coli run reads the saved settings and names the file in its start line
    env = dict(os.environ, HOME=str(home))
    env.pop("XDG_CONFIG_HOME", None)
    run = subprocess.run([sys.executable, "-m", "coli", "run", "-m", str(tiny), "ab", "-n", "2"], capture_output=True,
                         text=True, cwd=ROOT, env=env, timeout=300)
    assert run.returncode == 0, run.stderr
    start = run.stderr.splitlines()[0]
    n = int(rec['threads'])
    assert f"{n} thread{'s' if n != 1 else ''}," in start and str(path) in start


def test_tune_busy_machine_no_recommendation(tiny, tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    r = _tune(tiny, tmp_path / "out", home, "--threads", "1", "--reps", "1", "--max-load", "-1", "--save")
    assert r.returncode == 2 and "busy" in r.stderr and "not saved" in r.stderr, r.stderr
    assert json.loads((tmp_path / "out" / "tune.json").read_text())["recommended"] is None
    assert not (home / ".config" / "coli" / "config.toml").exists()


def test_tune_device_as_coli_run_takes_it(tiny, tmp_path):
    """``--device vulkan:N`` as ``coli run`` takes it (``coli.vulkan.device_flag``): the sweep's device rows name
    it; an index past the devices is coli run's one error line, before the sweep; a bad value names the flag."""
    pytest.importorskip("vulkan")
    home = tmp_path / "home"
    home.mkdir()
    r = _tune(tiny, tmp_path / "bad", home, "--device", "vulkan:57")
    assert r.returncode == 2 and len(r.stderr.splitlines()) == 1, r.stderr
    assert r.stderr.startswith("coli: --device vulkan:57: no device 57 (the Vulkan device"), r.stderr
    r = _tune(tiny, tmp_path / "bad", home, "--device", "gpu")
    assert (r.returncode, r.stderr) == (2, "coli: --device: 'gpu' (cpu, vulkan or vulkan:N)\n")
    r = _tune(tiny, tmp_path / "out", home, "--device", "vulkan:0", "--threads", "1", "--reps", "1",
              "--max-load", "1e9")
    assert r.returncode == 0, r.stderr
    rows = list(csv.DictReader(open(tmp_path / "out" / "tune.csv")))
    assert sorted((row["device"], row["balance"]) for row in rows) == [("cpu", ""), ("vulkan:0", "off"),
                                                                        ("vulkan:0", "on")]


def test_tune_device_on_a_dense_model_is_one_line_before_the_sweep(model_path, tmp_path):
    """The device points are the expert tier's: ``--device vulkan`` on a dense model (SmolLM2) is one error line
    naming the flag, before the sweep's start line (it failed in the worker after it)."""
    home = tmp_path / "home"
    home.mkdir()
    r = _tune(model_path("smollm2"), tmp_path / "out", home, "--device", "vulkan")
    assert r.returncode == 2 and len(r.stderr.splitlines()) == 1, r.stderr
    assert r.stderr.startswith("coli: --device vulkan: ") and "dense model" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr and not (tmp_path / "out").exists()


def test_config_file_rules(tmp_path):
    p = tmp_path / "config.toml"
    p.write_text("[run]\nthreads = 3\n")
    with pytest.raises(ColiError, match="not written by coli tune"):
        save_config(dict(threads=2, io_threads=4, layer="tbb"), "x", p)
    assert p.read_text() == "[run]\nthreads = 3\n"
    assert load_config(p) == ({"threads": 3}, p)
    q = tmp_path / "c2.toml"
    save_config(dict(threads=2, io_threads=4, layer="omp"), "note", q)
    assert load_config(q)[0] == {"threads": 2, "io_threads": 4, "threading_layer": "omp"}
    q.write_text("[run]\nthreads = 0\n")
    with pytest.raises(ColiError, match="run.threads"):
        load_config(q)
    q.write_text("[run\n")
    with pytest.raises(ColiError, match="TOML"):
        load_config(q)


def test_config_unknown_keys_are_named(tmp_path):
    """A misspelt key (``thread``) or a table coli does not read is an error naming it, not ignored; io_threads
    past the engine's most (64) is refused as ``--io-threads`` is."""
    q = tmp_path / "c.toml"
    q.write_text("[run]\nthread = 3\n")
    with pytest.raises(ColiError, match=r"unknown key run\.thread \(known: threads, io_threads, threading_layer\)"):
        load_config(q)
    q.write_text("[runn]\nthreads = 3\n")
    with pytest.raises(ColiError, match="unknown table or key 'runn'"):
        load_config(q)
    q.write_text("[run]\nio_threads = 1000\n")
    with pytest.raises(ColiError, match=r"run\.io_threads = 1000 .*at most 64"):
        load_config(q)


def test_config_path_with_a_file_or_read_only_home(tmp_path, monkeypatch):
    """HOME a file (or read-only): the config path is still HOME's (nothing to read there: no config, no error;
    it fell back to the cache folder, which raised); ``--save`` there is one error naming the path. A relative
    XDG_CONFIG_HOME is ignored, as the XDG spec says."""
    from coli.tune import config_path

    home = tmp_path / "home-file"
    home.write_text("x")
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.delenv("XDG_CONFIG_HOME", raising=False)
    monkeypatch.delenv("COLI_CACHE", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    assert config_path() == home / ".config" / "coli" / "config.toml"
    assert load_config() == ({}, None)
    with pytest.raises(ColiError, match=rf"--save: {home}/.config/coli/config.toml: Not a directory"):
        save_config(dict(threads=2, io_threads=4, layer="tbb"), "x")
    monkeypatch.setenv("XDG_CONFIG_HOME", "relative/cfg")
    assert config_path() == home / ".config" / "coli" / "config.toml"


def test_plot_titles_axes_from_zero():
    """The figure's title is the model and the sweep (a loop variable named ``title`` overwrote it with
    "prefill"); each panel names its measure; both y axes start at 0; one thread is "1 thread"."""
    from coli.tune import plot, recommend

    pts = [dict(layer="tbb", threads=t, io_threads=4, device="cpu", balance="", runs=2, decode_mean=10.0 + t,
                decode_min=9.5 + t, decode_max=10.5 + t, prefill_mean=50.0 + t, prefill_min=49 + t,
                prefill_max=51 + t) for t in (1, 2)]
    fig = plot(pts, None, "coli tune: tiny.gguf, 2 runs a point")
    assert fig._suptitle.get_text() == "coli tune: tiny.gguf, 2 runs a point"
    assert [ax.get_title() for ax in fig.axes] == ["decode tok/s (mean, min-max)", "prefill tok/s (mean, min-max)"]
    assert all(ax.get_ylim()[0] == 0 for ax in fig.axes)
    best, dflt, s = recommend(pts, dict(layer="tbb", threads=1, io_threads=4, device="cpu", balance=""))
    assert best["threads"] == 2 and "(1 thread: 11.00 tok/s)" in s and "1 threads" not in s
