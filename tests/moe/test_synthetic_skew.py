"""scripts/make_synthetic_moe.py --skew: the router bias that gives the hot set its share (checked on an independent
Monte Carlo draw), and the file's structure that carries it (the residual's dimension 0 constant: the embedding's
column 0 one value, row 0 of every attention output and expert down matrix zero; the router's column 0 nonzero for
exactly the hot experts). The realized routing of a generated file is what ``--check`` prints (it runs the engine)."""
import subprocess
import sys

import numpy as np
import pytest

from conftest import ROOT

sys.path.insert(0, str(ROOT / "scripts"))

import make_synthetic_moe as msm  # noqa: E402


@pytest.mark.parametrize("E, k, hot, share", [(64, 8, 16, 0.8), (16, 4, 4, 0.6)])
def test_skew_bias_gives_the_hot_set_its_share(E, k, hot, share):
    b = msm.skew_bias(E, k, hot, share)
    z = np.random.default_rng(123).standard_normal((40000, E)) * 3.0        # not the solver's draw
    top = np.argpartition(-(z + np.where(np.arange(E) < hot, b, 0.0)), k - 1, axis=1)[:, :k]
    assert abs((top < hot).mean() - share) < 0.01
    assert msm.skew_bias(E, k, hot, hot / E + 1e-3) < 0.1                   # the uniform share: no bias


@pytest.mark.parametrize("qtype", ["Q8_0", "F32"])
def test_skewed_file_keeps_dimension_0_constant(tmp_path, qtype):
    from gguf import GGUFReader

    out = tmp_path / "s.gguf"
    subprocess.run([sys.executable, str(ROOT / "scripts" / "make_synthetic_moe.py"), "-o", str(out), "--layers", "2",
                    "--d", "64", "--heads", "2", "--experts", "8", "--top-k", "2", "--expert-ff", "64", "--vocab", "64",
                    "--type", qtype, "--skew", "0.8"], check=True, capture_output=True)
    from gguf.quants import dequantize
    r = GGUFReader(str(out))
    t = {x.name: dequantize(x.data, x.tensor_type).reshape(*reversed([int(n) for n in x.shape])) for x in r.tensors}
    emb = t["token_embd.weight"]
    assert np.all(emb[:, 0] == emb[0, 0]) and emb[0, 0] > 1.5
    for il in range(2):
        assert np.all(t[f"blk.{il}.attn_output.weight"][0] == 0) and np.any(t[f"blk.{il}.attn_output.weight"][1] != 0)
        assert np.all(t[f"blk.{il}.ffn_down_exps.weight"][:, 0, :] == 0)
        assert np.count_nonzero(t[f"blk.{il}.ffn_gate_inp.weight"][:, 0]) == 2          # a quarter of 8 experts


def test_spilled_file_equals_the_in_memory_writers(tmp_path, monkeypatch):
    """The file is written through per-tensor spill files (so one bigger than RAM can be made): byte for byte what
    gguf's in-memory GGUFWriter writes for the same arguments, the spill folder gone, no tensor kept in memory."""
    import gguf

    argv = ["--layers", "2", "--d", "64", "--heads", "2", "--experts", "8", "--top-k", "2", "--expert-ff", "64",
            "--vocab", "64"]
    writers = []
    real = msm.spilling_writer

    def spy(path, arch):
        writers.append(real(path, arch))
        return writers[-1]

    monkeypatch.setattr(msm, "spilling_writer", spy)
    msm.main(["-o", str(tmp_path / "spilled.gguf"), *argv])
    monkeypatch.setattr(msm, "spilling_writer", lambda path, arch: gguf.GGUFWriter(str(path), arch))
    msm.main(["-o", str(tmp_path / "memory.gguf"), *argv])
    assert (tmp_path / "spilled.gguf").read_bytes() == (tmp_path / "memory.gguf").read_bytes()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["memory.gguf", "spilled.gguf"]
    assert len(writers) == 1 and len(writers[0].spilled) == len(writers[0].tensors[0]) > 10
    assert all(ti.tensor is None for ti in writers[0].tensors[0].values())
