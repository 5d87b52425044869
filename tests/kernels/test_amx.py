"""cpu_kernels.amx: the AMX probe in a child process. Where the kernel's CPU flags (/proc/cpuinfo) lack AMX the
probe says no with one line; forced to run the tile instructions anyway, its child dies (SIGILL) and the parent
reports that instead of dying with it. (Where AMX runs, the child checks a tdpbusd tile product against integer
arithmetic: that path needs an AMX machine.)"""
from __future__ import annotations

import json
import platform
from pathlib import Path

import pytest

from cpu_kernels import amx


def _cpu_flags() -> set[str]:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


needs_x86 = pytest.mark.skipif(platform.machine().lower() not in ("x86_64", "amd64"), reason="x86-64 probe")


@needs_x86
def test_probe_answers_in_one_line_and_agrees_with_the_cpu_flags():
    ok, line = amx.probe()
    assert "\n" not in line and line.startswith("AMX" if ok else "no AMX: ")
    if not {"amx_tile", "amx_int8"} <= _cpu_flags():  # Linux drops them where the tile state is not enabled
        assert not ok, line


@needs_x86
def test_a_tile_instruction_that_kills_the_child_is_reported_not_fatal():
    if {"amx_tile", "amx_int8"} <= _cpu_flags():
        pytest.skip("the tile instructions run here")
    ok, line = amx.probe(force=True)
    assert not ok and line == "no AMX: the machine killed the probe's tile instruction (SIGILL)"


@needs_x86
def test_the_verdict_is_kept_per_machine_and_reused_without_a_child(tmp_path, monkeypatch):
    monkeypatch.setenv("COLI_CACHE", str(tmp_path))
    amx.probe.cache_clear()
    want = amx._run_child(False)[:2]  # the child's own answer, asked directly
    ok, line = amx.probe()
    assert (ok, line) == want
    path = amx.cache_path(amx.cache_key())
    assert path.parent == tmp_path / "amx" and json.loads(path.read_text()) == {
        "key": amx.cache_key(), "ok": ok, "line": line}

    def no_child(*a, **k):
        raise AssertionError("the cached verdict must not start a child")

    monkeypatch.setattr(amx.subprocess, "run", no_child)
    amx.probe.cache_clear()
    assert amx.probe() == (ok, line)
    amx.probe.cache_clear()


@needs_x86
def test_a_stale_or_broken_cache_file_is_asked_again(tmp_path, monkeypatch):
    monkeypatch.setenv("COLI_CACHE", str(tmp_path))
    key = amx.cache_key()
    path = amx.cache_path(key)
    calls = []
    real = amx._run_child

    def counted(force):
        calls.append(force)
        return real(force)

    monkeypatch.setattr(amx, "_run_child", counted)
    for text in ("{not json", json.dumps({"key": dict(key, kernel="another kernel"), "ok": True, "line": "AMX: x"}),
                 json.dumps({"key": key, "ok": "yes", "line": "AMX: x"})):
        path.write_text(text)
        amx.probe.cache_clear()
        ok, line = amx.probe()
        assert (ok, line) == real(False)[:2]
        assert json.loads(path.read_text()) == {"key": key, "ok": ok, "line": line}
    assert calls == [False, False, False]
    amx.probe.cache_clear()


@needs_x86
def test_the_key_names_this_cpu_kernel_and_coli_version():
    key = amx.cache_key()
    assert key["kernel"] == f"{platform.release()} {platform.version()}"
    model = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                  if ln.startswith("model name")), "")
    assert key["cpu"] == model and len(key["cpu_flags"]) == 16
    from importlib import metadata

    assert key["coli"] == metadata.version("coli")


def test_a_timeout_is_not_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("COLI_CACHE", str(tmp_path))
    monkeypatch.setattr(amx.platform, "machine", lambda: "x86_64")

    def slow(*a, **k):
        raise amx.subprocess.TimeoutExpired(a[0], amx._TIMEOUT_S)

    monkeypatch.setattr(amx.subprocess, "run", slow)
    amx.probe.cache_clear()
    assert amx.probe() == (False, f"no AMX: the probe process did not answer in {amx._TIMEOUT_S} s")
    assert not amx.cache_path(amx.cache_key()).exists()
    amx.probe.cache_clear()
