"""Split GGUF models (llama.cpp's ``gguf-split`` layout, ``NAME-0000i-of-0000N.gguf``): any shard opens the whole
model, tensors and streamed experts come from whichever shard holds them, and the logits equal the merged file's
bit for bit. The shards are written by ``llama-gguf-split`` when it is built (``LLAMA_GGUF_SPLIT`` or the PATH),
else by ``tests/gguf_split.py``, whose output equals the tool's byte for byte (checked where the tool is)."""
from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from coli.base.errors import ColiError
from coli.gguf_file import describe, open_gguf, split_path
from gguf_split import write_split
from tiny_moe import build_tiny_moe
from conftest import ROOT

TOOL = os.environ.get("LLAMA_GGUF_SPLIT") or shutil.which("llama-gguf-split")


def _split(src, prefix, max_tensors: int, tool: bool = True) -> list[Path]:
    """Shards of ``src``: the real tool's when it is built, else the layout-equal writer's."""
    if tool and TOOL:
        subprocess.run([TOOL, "--split", "--split-max-tensors", str(max_tensors), str(src), str(prefix)],
                       check=True, capture_output=True, timeout=300)
        n = -(-len(open_gguf(src).tensors) // max_tensors)
        return [Path(split_path(str(prefix), i, n)) for i in range(n)]
    return write_split(src, prefix, max_tensors)


@pytest.mark.skipif(not TOOL, reason="llama-gguf-split not built (LLAMA_GGUF_SPLIT)")
@pytest.mark.parametrize("max_tensors", [100, 7])
def test_writer_equals_llama_gguf_split_byte_for_byte(tmp_path, model_path, max_tensors):
    src = model_path("smollm2")
    ours = write_split(src, tmp_path / "ours", max_tensors)
    theirs = _split(src, tmp_path / "theirs", max_tensors)
    assert len(ours) == len(theirs)
    for a, b in zip(ours, theirs):
        assert hashlib.sha256(a.read_bytes()).digest() == hashlib.sha256(b.read_bytes()).digest(), (a, b)


def test_split_real_model_logits_equal_merged(tmp_path, model_path, engine):
    src = model_path("smollm2")
    shards = _split(src, tmp_path / "smol", 100)
    assert len(shards) == 3
    merged = engine(src, threads=2)
    ids = merged.tokenize("The capital of France is Paris. The capital of Germany is")
    want = merged.logits(ids)
    for given in (shards[0], shards[2]):  # the first shard, or any
        eng = engine(given, threads=2)
        assert eng.path == shards[0]
        assert {t.file for t in eng.g.tensors.values()} == {str(p) for p in shards}
        got = eng.logits(ids)
        assert got.dtype == want.dtype and np.array_equal(got, want)


def test_split_moe_streams_experts_from_every_shard(tmp_path, engine):
    src = build_tiny_moe(tmp_path)
    shards = _split(src, tmp_path / "moe", 3)
    g = open_gguf(shards[1])
    exp_files = {t.file for n, t in g.tensors.items() if "_exps" in n}
    assert len(exp_files) >= 3  # the expert tensors lie in several shards
    ids = list(range(1, 40))
    want = engine(src, threads=2, expert_cache=2).logits(ids)
    eng = engine(shards[-1], threads=2, expert_cache=2)  # 2 of 4 slots: experts are read from disk as routed
    got = eng.logits(ids)
    src_ = eng.cache.source
    assert src_.reads > 0 and set(src_._fds) == exp_files
    assert np.array_equal(got, want)


def test_describe_and_cli_info_list_the_shards(tmp_path, model_path):
    shards = write_split(model_path("smollm2"), tmp_path / "smol", 100)
    text = describe(open_gguf(shards[1]))
    assert "shards        3: smol-00001-of-00003.gguf (100 tensors" in text
    assert "smol-00003-of-00003.gguf (72 tensors" in text
    r = subprocess.run([sys.executable, "-m", "coli", "info", str(shards[2])], capture_output=True, text=True,
                       cwd=ROOT, timeout=120)
    assert r.returncode == 0 and "smol-00002-of-00003.gguf (100 tensors" in r.stdout


def test_missing_and_mismatched_shards_are_one_error(tmp_path, model_path):
    src = model_path("smollm2")
    a = write_split(src, tmp_path / "a", 100)
    b = write_split(src, tmp_path / "b", 200)  # 2 shards: another split of the same model
    # a missing shard, whichever shard was given
    a[1].rename(tmp_path / "away.gguf")
    for given in (a[0], a[2]):
        with pytest.raises(ColiError, match=r"^a-00002-of-00003\.gguf: missing: shard 2 of 3"):
            open_gguf(given)
    r = subprocess.run([sys.executable, "-m", "coli", "info", str(a[0])], capture_output=True, text=True,
                       cwd=ROOT, timeout=120)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "a-00002-of-00003.gguf: missing" in r.stderr
    # a shard of another split under the name of this one
    shutil.copy(b[1], a[1])
    with pytest.raises(ColiError, match=r"^a-00002-of-00003\.gguf: kv 'split.no' 1, 'split.count' 2: expected "
                                        r"shard 1 of 3"):
        open_gguf(a[0])
    # a shard renamed out of the naming scheme
    odd = tmp_path / "renamed.gguf"
    shutil.copy(a[0], odd)
    with pytest.raises(ColiError, match=r"^renamed\.gguf: shard 1 of 3 .* does not end in '-00001-of-00003\.gguf'"):
        open_gguf(odd)


def test_split_tensor_count_checked(tmp_path):
    """``split.tensors.count`` must equal the tensors the shards hold (llama.cpp: "corrupted model")."""
    src = build_tiny_moe(tmp_path)
    shards = write_split(src, tmp_path / "m", 4)
    n = len(open_gguf(src).tensors)
    raw = shards[0].read_bytes()
    key = b"split.tensors.count"
    i = raw.index(key) + len(key) + 4  # after the key and its u32 type: the i32 value
    assert int.from_bytes(raw[i:i + 4], "little") == n
    shards[0].write_bytes(raw[:i] + (n + 1).to_bytes(4, "little") + raw[i + 4:])
    with pytest.raises(ColiError, match=rf"^m-00001-of-000\d\d\.gguf: kv 'split.tensors.count': {n + 1}, but the "
                                        rf"\d+ shards hold {n} tensors"):
        open_gguf(shards[0])
