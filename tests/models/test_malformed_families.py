"""Malformed copies of the new families' fixtures (tests/fixtures/oracles/*.gguf, rewritten with gguf-py's
GGUFReader/GGUFWriter): a metadata key that disagrees with the tensors gives one ColiError naming the key or the
tensor at load, never a NumPy error mid-prompt (docs/families.md)."""
import subprocess
import sys

import numpy as np
import pytest

from oracle_check import copy_gguf, malformed_copy
from conftest import FIXTURES

ORACLES = FIXTURES / "oracles"


def _refused(tmp_path, name: str, match: str, **change):
    """The fixture ``name`` through ``malformed_copy(**change)``: loading it is one ColiError matching ``match``."""
    from coli.engine import Engine
    from coli.base.errors import ColiError

    path = malformed_copy(ORACLES / f"{name}.gguf", tmp_path / f"{name}.gguf", **change)
    with pytest.raises(ColiError, match=match):
        Engine(str(path), threads=1, ctx=32)


# head_count_kv missing: llama.cpp (and coli) default it to head_count, which the fixtures' attn_k rows
# (2 KV heads) contradict. expert_used_count missing: llama.cpp asserts n_expert_used > 0 for a MoE file.
# DeepSeek-V4 ropes the last rope.dimension_count dims of its heads: the head-width default broke the indexer.
@pytest.mark.parametrize("name, drop_key, match", [
    ("gptoss", "gpt-oss.attention.head_count_kv", r"gptoss\.gguf: tensor 'blk\.0\.attn_k\.weight' has 32 rows.*"
                                                  r"expected 64 \(attention\.head_count_kv 4"),
    ("qwen3next", "qwen3next.attention.head_count_kv", r"tensor 'blk\.3\.attn_k\.weight' has \d+ rows"),
    ("gptoss", "gpt-oss.expert_used_count", r"gptoss\.gguf: metadata 'gpt-oss\.expert_used_count' is missing"),
    ("qwen3next", "qwen3next.expert_used_count", r"metadata 'qwen3next\.expert_used_count' is missing"),
    ("deepseek4", "deepseek4.rope.dimension_count", r"metadata 'deepseek4\.rope\.dimension_count' is missing"),
])
def test_missing_key_is_one_clear_error(tmp_path, name, drop_key, match):
    _refused(tmp_path, name, match, drop_key=drop_key)


# gpt-oss's biases are required by llama.cpp's loader; a shared expert with a part missing is a broken file (it
# was silently dropped; so was Qwen3-Next's shared-expert gate); MiMo-V2's V heads are attention.value_length wide (default key_length: 16 != 24).
@pytest.mark.parametrize("name, drop_key, drop_tensor, match", [
    ("gptoss", "", "blk.1.attn_q.bias", r"gptoss\.gguf: tensor 'blk\.1\.attn_q\.bias' is missing"),
    ("gptoss", "", "blk.2.ffn_gate_inp.bias", r"tensor 'blk\.2\.ffn_gate_inp\.bias' is missing"),
    ("qwen3next", "", "blk.0.ffn_gate_shexp.weight", r"tensor 'blk\.0\.ffn_gate_shexp\.weight' is missing"),
    ("qwen35moe", "", "blk.1.ffn_gate_inp_shexp.weight", r"tensor 'blk\.1\.ffn_gate_inp_shexp\.weight' is missing"),
    ("mimo2", "mimo2.attention.value_length", "", r"tensor 'blk\.0\.attn_v\.weight' has \d+ rows.*value_length"),
])
def test_broken_tensor_is_one_clear_error(tmp_path, name, drop_key, drop_tensor, match):
    _refused(tmp_path, name, match, drop_key=drop_key, drop_tensor=drop_tensor)


def test_cli_prints_one_line_and_exits_2(tmp_path):
    """The CLI's side of it: ``coli run`` on such a file prints one ``coli: ...`` line, exit code 2."""
    path = malformed_copy(ORACLES / "gptoss.gguf", tmp_path / "gptoss.gguf", "gpt-oss.expert_used_count")
    r = subprocess.run([sys.executable, "-m", "coli", "run", "-m", str(path), "-p", "Hi", "-n", "2"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 2
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "expert_used_count" in lines[0] and lines[0].startswith("coli: "), r.stderr
    assert "Traceback" not in r.stderr + r.stdout


# One column too many in a tensor whose width the metadata fixes: ColiError naming it at load (before: NumPy
# broadcast / matmul errors in the first forward pass).
@pytest.mark.parametrize("name, widen, match", [
    ("gptoss", "token_embd.weight", r"'token_embd\.weight' has shape \[320, 65\].*64 columns \(embedding_length\)"),
    ("gptoss", "blk.0.attn_k.bias", r"'blk\.0\.attn_k\.bias' has shape \[33\].*\[32\] \(the rows of its weight\)"),
    ("qwen3next", "blk.0.ffn_gate_inp.weight", r"'blk\.0\.ffn_gate_inp\.weight'.*64 columns"),
    ("qwen3next", "blk.3.attn_output.weight", r"'blk\.3\.attn_output\.weight' has 65 columns.*expected 64"),
    ("mimo2", "blk.1.exp_probs_b.bias", r"'blk\.1\.exp_probs_b\.bias'.*8 experts \(expert_count\)"),
    ("glmdsa", "output.weight", r"glmdsa\.gguf: tensor 'output\.weight'.*embedding_length"),
    ("deepseek4", "blk.0.ffn_down_shexp.weight", r"'blk\.0\.ffn_down_shexp\.weight'.*the rows of its ffn_up"),
])
def test_wrong_width_is_one_clear_error(tmp_path, name, widen, match):
    _refused(tmp_path, name, match, widen=widen)


@pytest.mark.parametrize("name, key", [("gptoss", "gpt-oss.block_count"), ("qwen3next", "qwen3next.ssm.state_size"),
                                       ("deepseek2_lite", "deepseek2.attention.kv_lora_rank")])
def test_numeric_key_as_string_is_one_clear_error(tmp_path, name, key):
    """A string where llama.cpp's key table has a number: ColiError naming the key when the file opens (before: a
    ValueError from int() in the family's argument parsing)."""
    _refused(tmp_path, name, rf"{name}\.gguf: kv '{key}': type string, expected a number", to_str=key)


def test_block_count_above_the_blocks_is_refused_by_run_and_plan(tmp_path, capsys):
    """block_count 1,000,000 in a 4-block file: coli plan printed a plan of "1000000 layers" (3.3 GiB of KV cache)
    while coli run failed on 'blk.4.attn_norm.weight'; both now print the same line naming the key, exit 2."""
    from coli.cli import main

    path = copy_gguf(ORACLES / "mixtral.gguf", tmp_path / "m.gguf", keys={"llama.block_count": 1000000})
    says = "coli: m.gguf: metadata 'llama.block_count' is 1000000, but the file has 4 blocks (no tensor 'blk.4.*')\n"
    for argv in (["plan", "-m", str(path)], ["run", "-m", str(path), "-p", "Hi", "-n", "1", "-q"]):
        assert main(argv) == 2
        out, err = capsys.readouterr()
        assert (out, err) == ("", says), argv


def test_numeric_key_as_bool_is_one_clear_error(tmp_path):
    """A bool where llama.cpp's key table has a number (context_length true): refused as a string is; it was read
    as the integer 1 (a context of 1 position, blamed on --ctx)."""
    import gguf
    from oracle_check import Typed

    from coli.base.errors import ColiError
    from coli.gguf_file import open_gguf

    path = copy_gguf(ORACLES / "mixtral.gguf", tmp_path / "m.gguf",
                     keys={"llama.context_length": Typed(True, gguf.GGUFValueType.BOOL)})
    with pytest.raises(ColiError, match=r"m\.gguf: kv 'llama\.context_length': type bool, expected a number"):
        open_gguf(str(path))


@pytest.mark.parametrize("base", [0.0, -1.0, float("nan")])
def test_rope_base_not_above_zero_is_one_clear_error(tmp_path, base):
    """rope.freq_base 0, -1 or NaN: ColiError naming the key when the model loads (it ran: a RuntimeWarning from
    NumPy's power, NaN rotations, NaN logits)."""
    import gguf
    from oracle_check import Typed

    from coli.base.errors import ColiError
    from coli.engine import Engine

    path = copy_gguf(ORACLES / "mixtral.gguf", tmp_path / "m.gguf",
                     keys={"llama.rope.freq_base": Typed(base, gguf.GGUFValueType.FLOAT32)})
    with pytest.raises(ColiError, match=rf"m\.gguf: metadata 'llama\.rope\.freq_base': {base:g} \(must be above 0\)"):
        Engine(str(path), threads=1, ctx=32)


def test_unsupported_type_names_file_and_tensor(tmp_path):
    """A norm stored as I32 (a type no kernel reads): the error names the file and the tensor (before: only
    'tensor type I32 is not supported')."""
    import gguf

    from coli.engine import Engine
    from coli.base.errors import ColiError

    norm = next(t for t in gguf.GGUFReader(str(ORACLES / "gptoss.gguf")).tensors if t.name == "output_norm.weight")
    path = copy_gguf(ORACLES / "gptoss.gguf", tmp_path / "gptoss.gguf",
                     tensors={"output_norm.weight": np.asarray(norm.data).astype(np.int32)})
    with pytest.raises(ColiError, match=r"gptoss\.gguf: tensor 'output_norm\.weight': tensor type I32 is not supported"):
        Engine(str(path), threads=1, ctx=32)


# MLA / DSA internals (coli/models/mla.py, glmdsa.py; blocks.expect_shapes): one column too many in a tensor whose
# shape the MLA / indexer hyper-parameters fix is a ColiError naming the file and the tensor at load (before: a
# NumPy matmul / broadcast ValueError in the first forward pass; a widened q_a / kv_a norm was read short silently).
@pytest.mark.parametrize("name, widen, match", [
    ("glmdsa", "blk.1.indexer.attn_q_b.weight",
     r"glmdsa\.gguf: tensor 'blk\.1\.indexer\.attn_q_b\.weight' has shape \[128, 21\].*\[128, 20\]"),
    ("glmdsa", "blk.1.indexer.attn_k.weight", r"glmdsa\.gguf: tensor 'blk\.1\.indexer\.attn_k\.weight'.*\[16, 32\]"),
    ("glmdsa", "blk.1.indexer.k_norm.bias", r"glmdsa\.gguf: tensor 'blk\.1\.indexer\.k_norm\.bias'.*\[16\]"),
    ("glmdsa", "blk.1.indexer.proj.weight", r"glmdsa\.gguf: tensor 'blk\.1\.indexer\.proj\.weight'.*\[8, 32\]"),
    ("glmdsa", "blk.2.attn_q_b.weight", r"glmdsa\.gguf: tensor 'blk\.2\.attn_q_b\.weight'.*\[96, 20\].*q_lora_rank"),
    ("glmdsa", "blk.1.attn_output.weight", r"glmdsa\.gguf: tensor 'blk\.1\.attn_output\.weight'.*\[32, 96\]"),
    ("glmdsa", "blk.1.attn_q_a_norm.weight", r"glmdsa\.gguf: tensor 'blk\.1\.attn_q_a_norm\.weight'.*\[20\]"),
    ("glmdsa", "blk.4.nextn.eh_proj.weight", r"glmdsa\.gguf: tensor 'blk\.4\.nextn\.eh_proj\.weight'.*\[32, 64\]"),
    ("deepseek2_lite", "blk.1.attn_output.weight",
     r"deepseek2_lite\.gguf: tensor 'blk\.1\.attn_output\.weight'.*\[32, 96\]"),
    ("deepseek3", "blk.1.attn_q_b.weight", r"deepseek3\.gguf: tensor 'blk\.1\.attn_q_b\.weight'.*\[96, 20\]"),
    ("kimi", "blk.2.attn_output.weight", r"kimi\.gguf: tensor 'blk\.2\.attn_output\.weight'.*\[32, 96\]"),
    ("kimi", "blk.2.attn_kv_a_norm.weight",
     r"kimi\.gguf: tensor 'blk\.2\.attn_kv_a_norm\.weight'.*\[24\].*kv_lora_rank"),
])
def test_mla_internal_wrong_width_is_one_clear_error(tmp_path, name, widen, match):
    _refused(tmp_path, name, match, widen=widen)


# The correction bias of a MoE layer is part of GLM-5's and Kimi-Linear's router (HF GlmMoeDsaTopkRouter /
# KimiLinearTopkRouter always have e_score_correction_bias; llama.cpp's kimi-linear loader requires it): a file
# without it is a broken conversion, not a model routed without a bias.
@pytest.mark.parametrize("name, drop_tensor", [("glmdsa", "blk.1.exp_probs_b.bias"),
                                               ("kimi", "blk.1.exp_probs_b.bias")])
def test_missing_correction_bias_is_one_clear_error(tmp_path, name, drop_tensor):
    _refused(tmp_path, name, rf"{name}\.gguf: tensor '{drop_tensor}' is missing", drop_tensor=drop_tensor)


# DeepSeek-V4's own tensors (attention, grouped output, compressors, indexer) one column too wide: before, NumPy
# matmul / broadcast errors in the first forward pass or (the norms) silently read short.
@pytest.mark.parametrize("widen, want", [
    ("blk.1.attn_kv.weight", "[32, 32]"),
    ("blk.0.attn_kv_a_norm.weight", "[32]"),
    ("blk.1.attn_q_b.weight", "[128, 16]"),
    ("blk.2.attn_output_a.weight", "[16, 64]"),
    ("blk.3.attn_output_b.weight", "[32, 16]"),
    ("blk.2.attn_compressor_gate.weight", "[32, 32]"),
    ("blk.1.attn_compressor_norm.weight", "[32]"),
    ("blk.3.indexer_compressor_kv.weight", "[32, 32]"),
    ("blk.1.indexer.proj.weight", "[8, 32]"),
    ("blk.3.indexer.attn_q_b.weight", "[128, 16]"),
])
def test_deepseek4_internal_width_is_one_clear_error(tmp_path, widen, want):
    import re

    _refused(tmp_path, "deepseek4", rf"deepseek4\.gguf: tensor '{re.escape(widen)}' has shape \[.*\] "
                                    rf"\(NumPy order\), expected {re.escape(want)} \(", widen=widen)


@pytest.mark.parametrize("name, key", [("gptoss", "gpt-oss.attention.head_count"),
                                       ("mimo2", "mimo2.attention.head_count"),
                                       ("deepseek4", "deepseek4.embedding_length")])
def test_zero_head_count_or_width_is_one_clear_error(tmp_path, name, key):
    """A head count or model width of 0 was a ZeroDivisionError while the file's shapes were worked out."""
    _refused(tmp_path, name, rf"{name}\.gguf: metadata '{key}': 0 \(must be at least 1\)", zero=key)
