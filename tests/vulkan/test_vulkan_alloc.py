"""What needs no Vulkan device: the block allocator against a byte map, the .spv set against its sources,
and the CPU fallback when the loader or the shaders are missing (these run on machines without Vulkan)."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from coli.vulkan import shaders as S
from coli.vulkan.alloc import BlockAllocator
from conftest import ROOT


def test_spv_set_is_fresh():
    stale = S.stale()
    assert not stale, f"rebuild with coli.vulkan.build: {stale}"


def test_spv_staleness_is_detected(tmp_path):
    import shutil
    for p in S.SHADER_DIR.iterdir():
        if p.suffix in (".comp", ".glsl", ".spv", ".sha256"):
            shutil.copy(p, tmp_path / p.name)
    assert S.stale(tmp_path) == []
    (tmp_path / "fmt_q6_k.glsl").write_text((tmp_path / "fmt_q6_k.glsl").read_text() + "\n// edit\n")
    assert sorted(S.stale(tmp_path)) == sorted(f"{k}_q6_k.spv" for k in S.KERNELS + S.COOP_KERNELS)
    (tmp_path / "common.glsl").write_text((tmp_path / "common.glsl").read_text() + "\n")
    # the expert op's kernels include it (gemv, gemm, the int8 GEMVs, act_q8), not the device layers' (lmv, lmoe, lmm)
    old = {"gemv", "gemm", "gemv_i8dot", "gemv_i8emu", "act_q8"}
    q6k = {f"{k}_q6_k.spv" for k in S.KERNELS + S.COOP_KERNELS}       # still stale from the edit above
    assert sorted(S.stale(tmp_path)) == sorted({S.spv_name(k, t) for k, t in S.builds() if k in old} | q6k)
    assert len(S.stale(tmp_path)) == 2 * len(S.FORMATS) + len(S.I8_KERNELS) + 1 + len(q6k) - 2
    (tmp_path / "layer_common.glsl").write_text((tmp_path / "layer_common.glsl").read_text() + "\n")
    layer = {"lmv", "lmoe", "lmm", "lmm_cm", "rmsnorm", "topk", "rope_kv", "attn_dec", "heat", "attn_pre", "moe_sort",
             "moe_sum", "attn_comb", "attn_pre_cm", "mla", "deltanet", "dn_chunk", "dsv4_hc", "dsv4_attn", "dsv4_comp",
             "dsv4_idx"}
    assert sorted(S.stale(tmp_path)) == sorted({S.spv_name(k, t) for k, t in S.builds() if k in old | layer} | q6k)


def test_allocator_random_against_byte_map():
    BLOCK = 1 << 14
    live_blocks = {}
    released = []

    def new_block(size):
        h = object()
        live_blocks[id(h)] = (h, np.zeros(size, np.int32))   # byte map: owner id or 0
        return h

    def free_block(h):
        assert not live_blocks[id(h)][1].any(), "a block went back with bytes still owned"
        released.append(id(h))
        del live_blocks[id(h)]

    a = BlockAllocator(BLOCK, new_block, free_block, align=16)
    rng = np.random.default_rng(1234)
    live = {}
    next_owner = 1
    for step in range(20000):
        if live and (rng.random() < 0.45 or len(live) > 300):
            k = list(live)[rng.integers(len(live))]
            al, owner = live.pop(k)
            bmap = live_blocks[id(a.handle(al.block))][1]
            assert (bmap[al.offset:al.offset + al.size] == owner).all()
            bmap[al.offset:al.offset + al.size] = 0
            a.free(al)
        else:
            size = int(rng.choice([rng.integers(1, 64), rng.integers(64, 3000), rng.integers(BLOCK, 2 * BLOCK)],
                                  p=[0.5, 0.49, 0.01]))
            align = int(rng.choice([1, 16, 256]))
            al = a.alloc(size, align)
            assert al.offset % max(align, 16) == 0 and al.size == size
            bmap = live_blocks[id(a.handle(al.block))][1]
            assert al.offset + size <= bmap.size
            assert not bmap[al.offset:al.offset + size].any(), f"step {step}: overlap"
            bmap[al.offset:al.offset + size] = next_owner
            live[next_owner] = (al, next_owner)
            next_owner += 1
        if step % 500 == 0:
            used = sum(int((m != 0).sum()) for _, m in live_blocks.values())
            assert a.used_bytes == used
            assert a.free_bytes == a.reserved_bytes - used
            assert len(a.blocks) == len(live_blocks)
            f = a.free_bytes
            assert a.frag == (0.0 if f == 0 else 1 - a.largest_free / f)
    for k in list(live):
        al, owner = live.pop(k)
        live_blocks[id(a.handle(al.block))][1][al.offset:al.offset + al.size] = 0
        a.free(al)
    assert not a.blocks and not live_blocks and released


def test_allocator_best_fit_and_coalescing():
    blocks = []
    a = BlockAllocator(1000, lambda n: blocks.append(n) or len(blocks), lambda h: None, align=1)
    x = [a.alloc(100) for _ in range(10)]                 # fills one block exactly
    assert len(a.blocks) == 1 and a.free_bytes == 0
    a.free(x[1])                                          # hole of 100 at 100
    a.free(x[5]); a.free(x[6])                            # hole of 200 at 500 (coalesced)
    assert a.largest_free == 200 and a.free_bytes == 300
    assert a.frag == pytest.approx(1 - 200 / 300)
    y = a.alloc(90)                                       # best fit: the 100 hole, not the 200 one
    assert (y.block, y.offset) == (x[1].block, 100)
    z = a.alloc(250)                                      # fits nowhere: a new block
    assert len(a.blocks) == 2 and z.offset == 0
    a.free(z)
    assert len(a.blocks) == 1                             # the emptied block went back
    with pytest.raises(ValueError):
        a.free(x[5])                                      # double free


def _run_py(code: str, env: dict) -> subprocess.CompletedProcess:
    e = dict(os.environ)
    e.update(env)
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          env=e, timeout=120, cwd=str(ROOT))


def test_no_loader_runs_on_the_cpu():
    # hide the loader from the binding: its dlopen of libvulkan.so.1 fails as on a machine without one
    code = """
        import importlib.util, os, sys
        origin = importlib.util.find_spec("vulkan").origin
        spec = importlib.util.spec_from_file_location(
            "vulkan._vulkancache", os.path.join(os.path.dirname(origin), "_vulkancache.py"))
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        class Hidden:
            def __init__(self, ffi): self._ffi = ffi
            def dlopen(self, name, *a):
                raise OSError(f"cannot load library '{name}': hidden by the test")
            def __getattr__(self, k): return getattr(self._ffi, k)
        mod.ffi = Hidden(mod.ffi)
        sys.modules["vulkan._vulkancache"] = mod
        from coli.vulkan import open_device
        print("DEV", open_device("smollm2"))
    """
    r = _run_py(code, {})
    assert r.returncode == 0 and "Traceback" not in r.stderr
    assert "DEV None" in r.stdout
    assert r.stderr.strip().startswith("[VK] smollm2: no Vulkan loader (libvulkan.so.1")
    assert r.stderr.strip().endswith(", running on the CPU")
    r = _run_py("from coli.vulkan import open_device; print('DEV', open_device('m'))",
                {"COLI_VK_LOADER": "/nonexistent/libvulkan.so.1", "LD_LIBRARY_PATH": "/nonexistent"})
    assert "DEV None" in r.stdout and "Traceback" not in r.stderr
    assert r.stderr.startswith("[VK] m: no Vulkan loader (/nonexistent/libvulkan.so.1") and "running on the CPU" in r.stderr


def test_missing_shaders_run_on_the_cpu(tmp_path):
    r = _run_py("from coli.vulkan import open_device; print('DEV', open_device('m'))",
                {"COLI_VK_SHADERS": str(tmp_path)})
    assert "DEV None" in r.stdout and "Traceback" not in r.stderr
    assert r.stderr.startswith("[VK] m: missing shaders (") and r.stderr.strip().endswith("running on the CPU")
