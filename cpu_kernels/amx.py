"""Does this CPU run AMX (Advanced Matrix Extensions) tile instructions? Asked of a child process.

A CPU may report AMX in CPUID while the machine refuses it: a VM whose hypervisor leaves the tile state out of
XCR0 kills a process at its first tile instruction (SIGILL), and Linux hands a process the tile state only after
``arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)``. So the answer comes from a child process (this file run
as a script: standard library only, no Numba) that

1. reads CPUID leaf 7 (EDX bit 24 AMX-TILE, bit 25 AMX-INT8),
2. requests the tile state with ``arch_prctl(ARCH_REQ_XCOMP_PERM, 18)``,
3. runs ``ldtilecfg``, two ``tileloadd``, ``tilezero``, ``tdpbusd`` (u8 x s8 -> s32), ``tilestored``,
   ``tilerelease`` on a 16 x 64 byte tile pair (machine code in an executable mapping) and checks the 16 x 16
   int32 product against Python's integer arithmetic.

The parent reads the child's one line, or its death by a signal, into ``(ok, line)``; :func:`probe` runs it once a
process and keeps a definitive answer in the cache folder per CPU, kernel and coli version (``<cache>/amx/``), so
a later run on the same machine starts no child. AMX kernels do not exist yet: the answer is reported (the start line of ``coli run``/``serve``/``chat``)
and the int8 kernels stay on AVX-512 VNNI where it is no (docs/cpu_kernels.md "AMX probe").
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import json
import mmap
import os
import platform
import signal
import subprocess
import sys
from importlib import metadata

from coli.base.errors import ColiError
from coli.base.paths import atomic_write_text, cache_dir

# cpuid(leaf: edi, out: rsi -> u32[4] eax ebx ecx edx), subleaf 0:
#   push rbx; mov eax, edi; xor ecx, ecx; cpuid; mov [rsi], eax; mov [rsi+4], ebx; mov [rsi+8], ecx;
#   mov [rsi+12], edx; pop rbx; ret
_CPUID = bytes.fromhex("53 89f8 31c9 0fa2 8906 895e04 894e08 89560c 5b c3")
# amx(cfg: rdi, a: rsi, b: rdx, c: rcx), all rows 64 bytes apart:
#   ldtilecfg [rdi]; mov r8, 64; tileloadd tmm1, [rsi+r8]; tileloadd tmm2, [rdx+r8]; tilezero tmm0;
#   tdpbusd tmm0, tmm1, tmm2; tilestored [rcx+r8], tmm0; tilerelease; xor eax, eax; ret
# (GNU as 2.40 encodings)
_AMX = bytes.fromhex("c4e2784907 49c7c040000000 c4a27b4b0c06 c4a27b4b1402 c4e27b49c0 c4e2695ec1 c4a27a4b0401 "
                     "c4e27849c0 31c0 c3")
_SYS_ARCH_PRCTL = 158
_ARCH_REQ_XCOMP_PERM = 0x1023
_XFEATURE_XTILEDATA = 18
_TIMEOUT_S = 30


def _child(force: bool) -> int:
    """The probe itself (in the child): prints ``ok ...`` (exit 0) or ``no ...`` (exit 1); may die of SIGILL."""
    def fn(code, *argtypes):
        buf = mmap.mmap(-1, mmap.PAGESIZE, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)
        buf.write(code)
        keep.append(buf)
        addr = ctypes.addressof(ctypes.c_char.from_buffer(buf))
        return ctypes.CFUNCTYPE(ctypes.c_int, *argtypes)(addr)

    keep = []
    try:
        cpuid = fn(_CPUID, ctypes.c_uint32, ctypes.c_void_p)
        amx = fn(_AMX, *[ctypes.c_void_p] * 4)
    except (OSError, ValueError) as e:  # a policy forbidding executable mappings
        print(f"no AMX: the probe could not map its code executable ({e})")
        return 1
    regs = (ctypes.c_uint32 * 4)()
    cpuid(0, ctypes.addressof(regs))
    edx = 0
    if regs[0] >= 7:
        cpuid(7, ctypes.addressof(regs))
        edx = regs[3]
    if not (edx >> 24 & 1 and edx >> 25 & 1) and not force:
        print("no AMX: the CPU does not report AMX-TILE and AMX-INT8 (CPUID leaf 7)")
        return 1
    libc = ctypes.CDLL(None, use_errno=True)
    r = libc.syscall(_SYS_ARCH_PRCTL, _ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA)
    if r != 0 and not force:
        err = ctypes.get_errno()
        print(f"no AMX: the CPU reports AMX but the kernel refused the tile state "
              f"(arch_prctl(ARCH_REQ_XCOMP_PERM): {os.strerror(err)})")
        return 1
    cfg = (ctypes.c_uint8 * 64)()
    cfg[0] = 1  # palette 1; tiles 0, 1, 2: 16 rows of 64 bytes
    for t in range(3):
        cfg[16 + 2 * t] = 64
        cfg[48 + t] = 16
    a_u8 = [(7 * i + 3) % 256 for i in range(1024)]
    b_s8 = [(11 * i + 5) % 256 - 128 for i in range(1024)]
    a = (ctypes.c_uint8 * 1024)(*a_u8)
    b = (ctypes.c_int8 * 1024)(*b_s8)
    c = (ctypes.c_int32 * 256)()
    amx(ctypes.addressof(cfg), ctypes.addressof(a), ctypes.addressof(b), ctypes.addressof(c))
    # tdpbusd: C[m, n] = sum over k < 16, i < 4 of A[m, 4k + i] * B[k, 4n + i]
    want = [sum(a_u8[64 * m + 4 * k + i] * b_s8[64 * k + 4 * n + i] for k in range(16) for i in range(4))
            for m in range(16) for n in range(16)]
    if list(c) != want:
        print("no AMX: the tile product (tdpbusd) differs from integer arithmetic")
        return 1
    print("ok AMX: int8 tile product (tdpbusd) checked in a child process")
    return 0


def _run_child(force: bool) -> tuple[bool, str, bool]:
    """``(ok, line, definitive)`` from one child process; ``definitive`` False for a timeout, a failed start or an
    unexpected exit (not cached: the next run asks again)."""
    cmd = [sys.executable, "-I", os.path.abspath(__file__), "--child"] + (["--force"] if force else [])
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return False, f"no AMX: the probe process did not answer in {_TIMEOUT_S} s", False
    except OSError as e:
        return False, f"no AMX: the probe process did not start ({e})", False
    line = r.stdout.strip().splitlines()[-1] if r.stdout.strip() else ""
    if r.returncode < 0:
        name = signal.Signals(-r.returncode).name
        why = "" if force else "the CPU reports AMX but "
        return False, f"no AMX: {why}the machine killed the probe's tile instruction ({name})", name == "SIGILL"
    if r.returncode == 0 and line.startswith("ok "):
        return True, line[3:], True
    if line.startswith("no AMX"):
        return False, line, True
    return False, f"no AMX: the probe process failed (exit {r.returncode}: {r.stderr.strip()[-200:]})", False


def cache_key() -> dict:
    """What the verdict depends on: the CPU (``model name`` and the ``flags`` Linux shows, which drop AMX where the
    tile state is not enabled, from /proc/cpuinfo), the kernel (``platform.release()``/``version()``) and this
    probe (coli's version and a digest of this file). A change of any of them asks the child again."""
    model = flags = ""
    try:
        with open("/proc/cpuinfo") as f:
            for ln in f:
                k, _, v = ln.partition(":")
                k = k.strip()
                if k == "model name" and not model:
                    model = v.strip()
                elif k == "flags" and not flags:
                    flags = hashlib.sha1(" ".join(sorted(v.split())).encode()).hexdigest()[:16]
    except OSError:
        pass
    try:
        version = metadata.version("coli")
    except metadata.PackageNotFoundError:
        version = "unknown"
    with open(os.path.abspath(__file__), "rb") as f:
        src = hashlib.sha1(f.read()).hexdigest()[:16]
    return {"cpu": model, "cpu_flags": flags, "kernel": f"{platform.release()} {platform.version()}",
            "coli": version, "probe": src}


def cache_path(key: dict) -> "Path | None":
    """``<cache>/amx/<digest of key>.json``, or None when the cache folder cannot be made or written (the probe
    then runs every time; coli's other caches say so on stderr)."""
    try:
        d = cache_dir("amx")
    except ColiError:
        return None
    return d / (hashlib.sha1(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16] + ".json")


@functools.lru_cache(maxsize=None)
def probe(force: bool = False) -> tuple[bool, str]:
    """``(ok, line)``: whether AMX tile instructions run here, and one line saying so (``"AMX: ..."`` or
    ``"no AMX: <why>"``), from a child process (module docstring); once a process, and the child's definitive
    answer is kept in the cache folder (``cache_path(cache_key())``: per CPU model and flags, kernel and coli
    version), so later runs on the same machine start no child. A cache file that does not parse or names
    another key is asked again and rewritten. ``force``: run the tile instructions even where CPUID or
    arch_prctl said no (tests: the child must then die and be reported); never cached."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return False, f"no AMX: not an x86-64 CPU ({platform.machine()})"
    if force:
        return _run_child(True)[:2]
    key = cache_key()
    path = cache_path(key)
    if path is not None:
        try:
            rec = json.loads(path.read_text())
            if (isinstance(rec, dict) and rec.get("key") == key and isinstance(rec.get("ok"), bool)
                    and isinstance(rec.get("line"), str) and "\n" not in rec["line"]):
                return rec["ok"], rec["line"]
        except (OSError, ValueError):
            pass
    ok, line, definitive = _run_child(False)
    if definitive and path is not None:
        try:
            atomic_write_text(path, json.dumps({"key": key, "ok": ok, "line": line}, sort_keys=True) + "\n")
        except OSError:
            pass
    return ok, line


if __name__ == "__main__" and "--child" in sys.argv:
    sys.exit(_child("--force" in sys.argv))
