"""cpu_kernels.amx: the AMX probe in a child process. Where the kernel's CPU flags (/proc/cpuinfo) lack AMX the
probe says no with one line; forced to run the tile instructions anyway, its child dies (SIGILL) and the parent
reports that instead of dying with it. (Where AMX runs, the child checks a tdpbusd tile product against integer
arithmetic: that path needs an AMX machine.)"""
from __future__ import annotations

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
