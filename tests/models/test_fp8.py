"""FP8 checkpoints from Hugging Face folders (coli/hf_folder.py, cpu_kernels/fp8.py).

Fixture (tests/fixtures/oracles/fp8_qwen3moe/ and fp8_qwen3moe.npz, made by tests/oracles/make.py fp8): a tiny
random Qwen3-MoE (2 layers, hidden 128, 4 experts top-2, head dim 32) saved as an FP8 folder: every attention
and expert projection in E4M3 with a weight_scale_inv per 128x128 block, the rest BF16, two shards and an
index, a byte-level BPE tokenizer. Oracles: HF transformers' float model on the dequantized weights
(``logits``), the same folder loaded back by transformers' own FP8 loader (``logits_hf_loaded``), and
torch's value of every E4M3 code (``e4m3``). The FP8 GEMV/GEMM against the NumPy reference are in
tests/kernels/test_formats.py (the registry's rows).
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest

from conftest import FIXTURES, ROOT

from coli.base.errors import ColiError
from cpu_kernels import fp8
from tests.vk_util import pinned_ram_env, requires_vulkan

DIR = FIXTURES / "oracles"
FOLDER = DIR / "fp8_qwen3moe"


def _ref():
    return np.load(DIR / "fp8_qwen3moe.npz")


def test_e4m3_table_matches_torch():
    np.testing.assert_array_equal(fp8.E4M3, _ref()["e4m3"])  # NaN at 0x7F / 0xFF on both sides
    assert fp8.E4M3[0x7E] == 448.0 and fp8.E4M3[0x01] == 2.0 ** -9


def test_row_layout_and_reference():
    """to_raw + reference == E4M3[codes] times the 128x128 scale grid (exact: one f32 product per weight)."""
    rng = np.random.default_rng(1)
    O, I = 200, 256
    codes = rng.integers(0, 256, (O, I), dtype=np.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0
    s = rng.uniform(0.01, 1.0, (2, 2)).astype(np.float32)
    raw = fp8.to_raw(codes, s)
    assert raw.shape == (O, 2 * 132)
    grid = np.repeat(np.repeat(s, 128, 0), 128, 1)[:O]
    np.testing.assert_array_equal(fp8.reference(raw, (O, I)), fp8.E4M3[codes] * grid)
    with pytest.raises(ColiError, match="multiple of 128"):
        fp8.to_raw(codes[:, :100], s)
    with pytest.raises(ColiError, match="weight_scale_inv"):
        fp8.to_raw(codes, s[:1])


def test_fixture_is_sound():
    """The folder says FP8 128x128, and transformers' own loader of it gives the float model's logits."""
    cfg = json.loads((FOLDER / "config.json").read_text())
    assert cfg["quantization_config"]["weight_block_size"] == [128, 128]
    d = _ref()
    scale = np.abs(d["logits"]).max()
    assert np.abs(d["logits_hf_loaded"] - d["logits"]).max() <= 1e-5 * scale
    assert d["router_margin"].min() >= 1e-2 and d["logit_gap"].min() >= 1e-3


@pytest.mark.parametrize("cache", [None, 1])
def test_folder_logits_match_hf(cache, tmp_path):
    from coli.engine import Engine

    d = _ref()
    with Engine(FOLDER, cpu_act="f32", expert_cache=cache, usage=tmp_path / "u", save_usage=False) as eng:
        assert eng.g.tensors["blk.0.attn_q.weight"].type_name == fp8.NAME
        assert eng.g.tensors["blk.1.ffn_down_exps.weight"].type_name == fp8.NAME
        assert eng.g.tensors["token_embd.weight"].type_name == "BF16"
        got = eng.logits(d["ids"])
        if cache == 1:
            assert eng.cache.loads > 0 and eng.cache.source.bytes_read > 0  # experts streamed from the shards
    ref = d["logits"]
    err = np.abs(got - ref).max(axis=1) / np.abs(ref).max()
    assert (err <= 1e-4).all(), float(err.max())
    assert (got.argmax(axis=1) == ref.argmax(axis=1)).all()


def test_folder_tokenizer_matches_transformers():
    from transformers import AutoTokenizer

    from coli.hf_folder import open_folder

    tok = open_folder(FOLDER).tokenizer()
    hf = AutoTokenizer.from_pretrained(str(FOLDER))
    for text in ["The capital of France is Paris.", "def f(x):\n    return x * 2", "<|bos|>hi<|eos|>"]:
        assert tok.encode(text, add_bos=False) == hf(text, add_special_tokens=False)["input_ids"]
        assert tok.decode(tok.encode(text, add_bos=False)) == text
    assert tok.bos_id == 0 and 1 in tok.eos_ids


def test_cli_runs_a_folder(tmp_path):
    r = subprocess.run([sys.executable, "-m", "coli", "run", "-m", str(FOLDER), "-p", "The capital", "-n", "3",
                        "--usage", str(tmp_path / "u")], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip(), r.stdout


def test_cli_info_describes_a_folder():
    r = subprocess.run([sys.executable, "-m", "coli", "info", str(FOLDER)], capture_output=True, text=True,
                       timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    assert "Hugging Face folder" in r.stdout and "qwen3moe" in r.stdout
    assert "blk.0.attn_q.weight" in r.stdout and "FP8_E4M3_B128" in r.stdout



# ---------------------------------------------------------------------------------------- on the device tier
@requires_vulkan
@pytest.mark.parametrize("balance", [False, True])
def test_folder_on_the_tier_matches_hf(balance, tmp_path):
    """FP8 experts on the device (shaders/fmt_fp8_e4m3_b128.glsl on Lavapipe): the tier computed routed experts
    and the logits stay within 1e-4 of HF's float model on the dequantized weights, as the CPU's do."""
    from coli.engine import Engine

    d = _ref()
    with Engine(FOLDER, cpu_act="f32", device="vulkan", balance=balance, threads=1, quiet=True,
                usage=tmp_path / "u", save_usage=False) as eng:
        got = eng.logits(d["ids"])
        assert eng.tier is not None and eng.tier.on and eng.tier.device_pairs > 0, "the device did no expert"
    ref = d["logits"]
    err = np.abs(got - ref).max(axis=1) / np.abs(ref).max()
    assert (err <= 1e-4).all(), float(err.max())


@requires_vulkan
def test_cli_balance_gives_the_cpus_greedy_tokens(tmp_path):
    """`coli run -m FOLDER --device vulkan --balance`: the CPU-only run's greedy text, with experts and matmuls
    on the device (its summary line counts them; the tier's budget fixed, not the RAM free at the moment)."""
    def run(*extra):
        r = subprocess.run([sys.executable, "-m", "coli", "run", "-m", str(FOLDER), "-p", "The capital of", "-n",
                            "24", "--temp", "0", "--usage", str(tmp_path / "u"), *extra],
                           capture_output=True, text=True, timeout=300, cwd=ROOT, env={**os.environ, **pinned_ram_env()})
        assert r.returncode == 0, r.stderr
        return r
    cpu, dev = run(), run("--device", "vulkan", "--balance")
    assert dev.stdout == cpu.stdout and len(cpu.stdout.strip()) > len("The capital of")
    m = re.search(r"\[VK\] tier fp8_qwen3moe run: device (\d+) of \d+ routed experts", dev.stderr)
    assert m and int(m.group(1)) > 0, dev.stderr
    m = re.search(r"\[VK\] fp8_qwen3moe: (\d+) matmuls on the GPU", dev.stderr)
    assert m and int(m.group(1)) > 0, dev.stderr


def _broken(tmp_path, edit):
    dst = tmp_path / "m"
    shutil.copytree(FOLDER, dst)
    edit(dst)
    return dst


def _cfg(key, value):
    def edit(d):
        c = json.loads((d / "config.json").read_text())
        cur = c
        *path, last = key.split(".")
        for k in path:
            cur = cur[k]
        cur[last] = value
        (d / "config.json").write_text(json.dumps(c))
    return edit


def _drop_tensor(*names):
    def edit(d):
        import struct

        idx = json.loads((d / "model.safetensors.index.json").read_text())
        f = {idx["weight_map"].pop(n) for n in names}.pop()
        # rewrite the shard without it (raw bytes: safetensors' NumPy backend has no float8/bfloat16)
        b = (d / f).read_bytes()
        n = struct.unpack("<Q", b[:8])[0]
        head = json.loads(b[8:8 + n])
        keys = [k for k in head if k != "__metadata__" and k not in names]
        out, data, off = {}, [], 0
        for k in keys:
            s, e = head[k]["data_offsets"]
            out[k] = {**head[k], "data_offsets": [off, off + e - s]}
            data.append(b[8 + n + s:8 + n + e])
            off += e - s
        h = json.dumps(out).encode()
        h += b" " * (-len(h) % 8)
        (d / f).write_bytes(struct.pack("<Q", len(h)) + h + b"".join(data))
        (d / "model.safetensors.index.json").write_text(json.dumps(idx))
    return edit


@pytest.mark.parametrize("edit,needle", [
    (lambda d: (d / "config.json").unlink(), "config.json"),
    (lambda d: (d / "config.json").write_text("{"), "config.json"),
    (_cfg("model_type", "bert"), "model_type 'bert'"),
    (_cfg("model_type", None), "config.json: no 'model_type' (a Hugging Face config names it: "),
    (_cfg("quantization_config.quant_method", "gptq"), "quant_method"),
    (_cfg("quantization_config.weight_block_size", [64, 64]), "weight_block_size"),
    (_cfg("rope_parameters", {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e6}), "rope_type 'dynamic'"),
    (lambda d: (d / "model-00002-of-00002.safetensors").unlink(), "model-00002-of-00002.safetensors"),
    (lambda d: (d / "model-00001-of-00002.safetensors").write_bytes(b"\xff" * 64), "model-00001-of-00002"),
    (_drop_tensor("model.layers.0.self_attn.q_proj.weight_scale_inv"), "model.layers.0.self_attn.q_proj.weight"),
    (_drop_tensor("model.layers.1.mlp.experts.3.up_proj.weight_scale_inv"), "experts.3.up_proj.weight_scale_inv"),
    (_drop_tensor("model.layers.1.mlp.experts.3.up_proj.weight", "model.layers.1.mlp.experts.3.up_proj.weight_scale_inv"),
     "blk.1.ffn_up_exps.weight"),
    (lambda d: (d / "tokenizer.json").unlink(), "tokenizer.json"),
])
def test_bad_folders_are_refused(tmp_path, edit, needle):
    p = _broken(tmp_path, edit)
    r = subprocess.run([sys.executable, "-m", "coli", "run", "-m", str(p), "-p", "hi", "-n", "1"],
                       capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 2, r.stderr
    assert needle in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr
