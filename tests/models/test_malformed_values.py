"""Damaged weight values and expert tensors of the wrong shape, in copies of the small fixtures (rewritten with
``oracle_check.malformed_copy``): one ColiError naming the file and the tensor (and the expert), at load for
the dense tensors and at the expert's read for the experts the RAM cache reads lazily, never normal-looking
tokens, a NumPy error or a kernel's ZeroDivisionError (docs/formats.md "Damaged weights", docs/families.md)."""
import subprocess
import sys

import numpy as np
import pytest

from conftest import FIXTURES
from oracle_check import malformed_copy
from tiny_moe import build_tiny_moe

ORACLES = FIXTURES / "oracles"

F16_INF = np.array([0x00, 0x7C], np.uint8)   # +inf as f16 little-endian bytes (IEEE 754 binary16)
F16_NAN = np.array([0x00, 0x7E], np.uint8)


def _set(flat_index: int, value):
    """An ``edit`` of ``malformed_copy``: value ``value`` at flat index ``flat_index`` of the tensor's data."""
    def f(a):
        a.reshape(-1)[flat_index] = value
        return a
    return f


def _q8_scale(row: int, block: int, code: np.ndarray):
    """An ``edit`` setting the f16 scale ``d`` (bytes 0-1 of a 34-byte block; ggml-common.h ``block_q8_0``) of block
    ``block`` of row ``row`` of a Q8_0 tensor's raw bytes [..., row bytes] (3-D: the rows of every expert)."""
    def f(a):
        rows = a.reshape(-1, a.shape[-1])
        rows[row, block * 34:block * 34 + 2] = code
        return a
    return f


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """scripts/make_synthetic_moe.py's tiny Q8_0 MoE (tests/tiny_moe.py): 2 layers, d 64, 4 experts."""
    return build_tiny_moe(tmp_path_factory.mktemp("tiny"))


@pytest.mark.parametrize("name, tensor, edit, match", [
    ("qwen3moe", "blk.0.attn_norm.weight", _set(3, np.nan),
     r"qwen3moe\.gguf: tensor 'blk\.0\.attn_norm\.weight' has a non-finite value \(nan\) in element 3"),
    ("gptoss", "blk.1.attn_q.weight", _set(5 * 64 + 2, np.inf),
     r"gptoss\.gguf: tensor 'blk\.1\.attn_q\.weight' has a non-finite value \(inf\) in row 5 \(F32"),
    ("olmoe", "output.weight", _set(7 * 64, -np.inf),
     r"olmoe\.gguf: tensor 'output\.weight' has a non-finite value \(-inf\) in row 7"),
    ("qwen2moe", "blk.1.ffn_gate_inp.weight", _set(9, np.nan),
     r"qwen2moe\.gguf: tensor 'blk\.1\.ffn_gate_inp\.weight' has a non-finite value \(nan\) in row 0"),
    ("qwen2moe", "blk.0.ffn_up_shexp.weight", _set(64 * 10, np.nan),
     r"qwen2moe\.gguf: tensor 'blk\.0\.ffn_up_shexp\.weight' has a non-finite value \(nan\) in row 10"),
])
def test_nan_or_inf_weight_is_one_clear_error(tmp_path, name, tensor, edit, match):
    """Before: a NaN norm weight gave normal-looking tokens with int8 activations (a NaN row rounds to finite int8
    codes, so no logit is non-finite) and a ZeroDivisionError in the attention kernel with f32 activations."""
    from coli.engine import Engine
    from coli.base.errors import ColiError

    path = malformed_copy(ORACLES / f"{name}.gguf", tmp_path / f"{name}.gguf", edit={tensor: edit})
    with pytest.raises(ColiError, match=match):
        Engine(str(path), threads=1, ctx=32)


def test_non_finite_block_scale_is_one_clear_error(tmp_path, tiny):
    """A Q8_0 weight with an infinite block scale (its codes are integers: the scales are its only float field)."""
    from coli.engine import Engine
    from coli.base.errors import ColiError

    path = malformed_copy(tiny, tmp_path / "tiny.gguf", edit={"blk.1.attn_v.weight": _q8_scale(6, 1, F16_INF)})
    with pytest.raises(ColiError, match=r"tiny\.gguf: tensor 'blk\.1\.attn_v\.weight' has a non-finite block scale "
                                        r"\(inf\) in row 6 \(Q8_0"):
        Engine(str(path), threads=1, ctx=32)


def test_non_finite_embedding_row_names_the_token(tmp_path):
    """The embedding table is read row by row (not checked whole at load): the token's row is checked when it is
    embedded; the other rows still run."""
    from coli.engine import Engine
    from coli.base.errors import ColiError

    path = malformed_copy(ORACLES / "qwen3moe.gguf", tmp_path / "qwen3moe.gguf",
                          edit={"token_embd.weight": _set(7 * 64 + 1, np.nan)})
    with Engine(str(path), threads=1, ctx=32) as eng:
        assert np.isfinite(eng.logits([5, 6])).all()
        with pytest.raises(ColiError, match=r"qwen3moe\.gguf: tensor 'token_embd\.weight' has a non-finite value "
                                            r"in row 7"):
            eng.logits([5, 7])


@pytest.mark.parametrize("src, tensor, edit, layer, expert, match", [
    ("mixtral", "blk.1.ffn_down_exps.weight", _set(5 * 64 * 32 + 3 * 32 + 1, np.nan), 1, 5,
     r"mixtral\.gguf: tensor 'blk\.1\.ffn_down_exps\.weight' expert 5 has a non-finite value \(nan\) in row 3"),
    ("tiny", "blk.0.ffn_up_exps.weight", _q8_scale(2 * 64 + 9, 0, F16_NAN), 0, 2,
     r"tiny\.gguf: tensor 'blk\.0\.ffn_up_exps\.weight' expert 2 has a non-finite block scale \(nan\) in row 9"),
])
def test_non_finite_expert_is_one_clear_error_from_the_reader(tmp_path, tiny, src, tensor, edit, layer, expert,
                                                               match):
    """An expert is read lazily by the RAM cache's reader threads: the check runs there, and the ColiError reaches
    the caller through the read's Future (no hang, no thread traceback); the expert's neighbours still load."""
    from coli.engine import Engine
    from coli.base.errors import ColiError

    name = "tiny" if src == "tiny" else src
    path = malformed_copy(tiny if src == "tiny" else ORACLES / f"{name}.gguf", tmp_path / f"{name}.gguf",
                          edit={tensor: edit})
    with Engine(str(path), threads=1, ctx=32, expert_cache=2) as eng:
        eng.cache.fetch(layer, expert - 1).result(timeout=60)
        with pytest.raises(ColiError, match=match):
            eng.cache.fetch(layer, expert).result(timeout=60)


def test_cli_non_finite_expert_prints_one_line_and_exits_2(tmp_path):
    """``coli run`` on a file whose every layer-0 gate expert holds a NaN: whichever expert the first token routes
    to, one ``coli:`` line naming the tensor and the expert, exit 2, no traceback."""
    def every_expert(a):
        a[:, 4, 7] = np.nan  # [E, F, D]: row 4 of each expert
        return a

    path = malformed_copy(ORACLES / "mixtral.gguf", tmp_path / "mixtral.gguf",
                          edit={"blk.0.ffn_gate_exps.weight": every_expert})
    r = subprocess.run([sys.executable, "-m", "coli", "run", "-q", "-m", str(path), "-p", "Hi", "-n", "2"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 2, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("coli: mixtral.gguf: tensor 'blk.0.ffn_gate_exps.weight' expert "), \
        r.stderr
    assert "non-finite value (nan) in row 4" in lines[0]
    assert "Traceback" not in r.stderr + r.stdout
    assert r.stdout.startswith("Hi") and r.stdout.endswith("\n")  # the echoed prompt's line ends before the error


@pytest.mark.parametrize("fill", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("kernel", ["serial", "parallel"])
def test_attention_with_a_non_finite_score_gives_nan_not_an_exception(fill, kernel):
    """A non-finite query (activations overflowed) left the softmax sum 0 or NaN and the serial kernel raised
    ZeroDivisionError; the row is NaN now (the engine's non-finite check reports it) and the other heads are
    unchanged: all-ones K and V give exactly 1 (softmax weights summing to 1 times V = 1)."""
    from cpu_kernels import attention
    from cpu_kernels import kvcache

    q = np.ones((1, 2, 8), np.float32)
    q[0, 0, 0] = fill
    kc = np.ones((1, 4, 8), np.float32)
    vc = np.ones((1, 4, 8), np.float32)
    out = np.empty((1, 2, 8), np.float32)
    fn = attention._attend_serial if kernel == "serial" else attention._attend
    fn(q, kvcache.as_side(kc), kvcache.as_side(vc), 3, np.float32(0.35), 0, np.zeros(0, np.float32), out)
    assert np.isnan(out[0, 0]).all()
    np.testing.assert_allclose(out[0, 1], 1.0, rtol=1e-6)


def _first(n: int, axis: int = 0):
    """An ``edit`` keeping the first ``n`` entries of a tensor's data along ``axis`` (NumPy order)."""
    return lambda a: np.ascontiguousarray(np.take(a, np.arange(n), axis=axis))


# Expert tensors that disagree with expert_count, embedding_length or each other (blocks.MoE, every MoE family:
# gpt-oss's and DeepSeek-V4's MoE blocks subclass it). Before: fewer experts than expert_count read the next
# tensor's bytes as the missing experts, or a ValueError in scheduler/usage.py.
@pytest.mark.parametrize("name, tensor, edit, match", [
    ("mixtral", "blk.1.ffn_up_exps.weight", _first(6),
     r"mixtral\.gguf: tensor 'blk\.1\.ffn_up_exps\.weight' has shape \[6, 32, 64\] \(NumPy order\), expected "
     r"\[8, 32, 64\] \(expert_count 8, embedding_length 64, expert width 32 of 'blk\.1\.ffn_gate_exps\.weight'\)"),
    ("qwen3moe", "blk.0.ffn_gate_exps.weight", _first(4),
     r"qwen3moe\.gguf: tensor 'blk\.0\.ffn_gate_exps\.weight' has shape \[4, 32, 64\].*expected \[8, 32, 64\]"),
    ("olmoe", "blk.0.ffn_down_exps.weight", _first(16, axis=2),
     r"olmoe\.gguf: tensor 'blk\.0\.ffn_down_exps\.weight' has shape \[8, 64, 16\].*expected \[8, 64, 32\]"),
    ("gptoss", "blk.1.ffn_down_exps.weight", _first(5),
     r"gptoss\.gguf: tensor 'blk\.1\.ffn_down_exps\.weight' has shape \[5, 64, 64\].*expected \[8, 64, 64\]"),
    ("gptoss", "blk.0.ffn_down_exps.bias", _first(6),
     r"gptoss\.gguf: tensor 'blk\.0\.ffn_down_exps\.bias' has shape \[6, 64\].*expected \[8, 64\]"),
    ("deepseek4", "blk.2.ffn_up_exps.weight", _first(7),
     r"deepseek4\.gguf: tensor 'blk\.2\.ffn_up_exps\.weight' has shape \[7, 32, 32\].*expected \[8, 32, 32\]"),
    ("qwen2moe", "blk.1.ffn_gate_shexp.weight", _first(48),
     r"qwen2moe\.gguf: tensor 'blk\.1\.ffn_gate_shexp\.weight' has shape \[48, 64\].*expected \[64, 64\] "
     r"\(embedding_length 64, shared-expert width 64 of 'blk\.1\.ffn_up_shexp\.weight'\)"),
])
def test_expert_shape_is_one_clear_error(tmp_path, name, tensor, edit, match):
    from coli.engine import Engine
    from coli.base.errors import ColiError

    path = malformed_copy(ORACLES / f"{name}.gguf", tmp_path / f"{name}.gguf", edit={tensor: edit})
    with pytest.raises(ColiError, match=match):
        Engine(str(path), threads=1, ctx=32)


# A count key present with value 0 was reported as missing (a truthiness test on its value).
@pytest.mark.parametrize("name, zero, drop_key, match", [
    ("mimo2", "mimo2.attention.sliding_window", "",
     r"mimo2\.gguf: metadata 'mimo2\.attention\.sliding_window': 0 \(must be at least 1; the pattern has sliding"),
    ("mimo2", "mimo2.block_count", "", r"mimo2\.gguf: metadata 'mimo2\.block_count': 0 \(must be at least 1\)"),
    ("gptoss", "gpt-oss.block_count", "", r"gptoss\.gguf: metadata 'gpt-oss\.block_count': 0 \(must be at least 1\)"),
    ("deepseek4", "deepseek4.attention.sliding_window", "",
     r"deepseek4\.gguf: metadata 'deepseek4\.attention\.sliding_window': 0 \(must be at least 1\)"),
    ("deepseek4", "deepseek4.attention.indexer.top_k", "",
     r"deepseek4\.gguf: metadata 'deepseek4\.attention\.indexer\.top_k': 0 \(must be at least 1; layers with"),
    ("deepseek4", "deepseek4.attention.indexer.head_count", "",
     r"deepseek4\.gguf: metadata 'deepseek4\.attention\.indexer\.head_count': 0 \(must be at least 1"),
    ("deepseek4", "", "deepseek4.attention.indexer.top_k",
     r"deepseek4\.gguf: metadata 'deepseek4\.attention\.indexer\.top_k' is missing \(layers with compress ratio 4"),
    ("mixtral", "llama.expert_count", "",
     r"mixtral\.gguf: metadata 'llama\.expert_count': 0 \(must be at least 1; the layer has routed experts"),
    ("mixtral", "", "llama.expert_count",
     r"mixtral\.gguf: metadata 'llama\.expert_count' is missing \(the layer has routed experts 'blk\.0\."),
    ("mimo2", "", "mimo2.attention.sliding_window",
     r"mimo2\.gguf: metadata 'mimo2\.attention\.sliding_window' is missing \(the pattern has sliding layers\)"),
])
def test_zero_count_is_not_reported_missing(tmp_path, name, zero, drop_key, match):
    from coli.engine import Engine
    from coli.base.errors import ColiError

    path = malformed_copy(ORACLES / f"{name}.gguf", tmp_path / f"{name}.gguf", drop_key=drop_key, zero=zero)
    with pytest.raises(ColiError, match=match):
        Engine(str(path), threads=1, ctx=32)


def _scale_types():
    from coli.types import table as tensor_types
    from cpu_kernels import formats

    return [n for n in formats.FORMATS if tensor_types.get(n).scale_offsets]


@pytest.mark.parametrize("type_name", ["F32", "F16", "BF16"] + _scale_types())
def test_raw_check_finds_the_row_the_reference_decodes_non_finite(type_name):
    """``coli.finite.first_bad_raw_row`` (the device tier's warm start uploads the bytes as read) against gguf's
    reference decoder (``gguf.quants.dequantize``) and the packed-array check of ``check_weight``: one block scale
    (each f16 scale field in turn) or value set to inf in row 2 of 4 random rows."""
    from coli import finite
    from coli.types import table as tensor_types
    from cpu_kernels import formats

    t = tensor_types.get(type_name)
    I = 512  # two blocks of 256, sixteen of 32
    raw0 = tensor_types.random_blocks(type_name, 4, I, np.random.default_rng(1))
    assert finite.first_bad_raw_row(type_name, raw0) is None
    offsets = t.scale_offsets or (None,)
    for off in offsets:
        raw = raw0.copy()
        if off is None:  # a float type: one value
            v = raw[2].view({"F32": np.float32, "F16": np.float16, "BF16": np.uint16}[type_name])
            v[5] = np.float32(np.inf).view(np.uint32) >> 16 if type_name == "BF16" else np.inf
        else:
            raw[2, t.type_size + off:t.type_size + off + 2] = F16_INF  # block 1 of row 2
        with np.errstate(invalid="ignore", over="ignore"):  # inf x 0 codes: NaN, as ggml's decode
            ref = t.reference(raw, (4, I))
        assert not np.isfinite(ref[2]).all() and np.isfinite(ref[[0, 1, 3]]).all()
        assert finite.first_bad_raw_row(type_name, raw) == 2
        w = formats.prepare(type_name, raw, (4, I))
        with pytest.raises(Exception, match=r"row 2"):
            finite.check_weight(w, "t")


def test_device_warm_start_refuses_a_non_finite_expert(tmp_path, tiny):
    """The device tier's warm start uploads experts as read from the file (no CPU preparation): their bytes are
    checked there (``ExpertSource.read_checked``), so the Engine refuses the file while it starts (before: the
    device computed NaN rows that int8 activations on the CPU turned into normal-looking tokens)."""
    from tests.vk_util import HAVE_LOADER

    if not HAVE_LOADER:  # only a machine without the loader skips (tests/vk_util.py's rule)
        pytest.skip("libvulkan.so.1 not found (apt install libvulkan1 mesa-vulkan-drivers)")
    from coli.engine import Engine
    from coli.base.errors import ColiError

    def every_expert(a):  # Q8_0 [E, D, row bytes]: block 1's scale of row 9 of each expert
        a[:, 9, 34:36] = F16_NAN
        return a

    path = malformed_copy(tiny, tmp_path / "tiny.gguf", edit={"blk.1.ffn_down_exps.weight": every_expert})
    with pytest.raises(ColiError, match=r"tiny\.gguf: tensor 'blk\.1\.ffn_down_exps\.weight' expert \d has a "
                                        r"non-finite block scale or minimum in row 9 \(Q8_0\)"):
        Engine(str(path), threads=1, ctx=32, device="vulkan", quiet=True, usage=str(tmp_path / "none.coli_usage"))


def test_fp8_nan_code_is_found_by_both_checks():
    """FP8_E4M3_B128 (from FP8 Hugging Face checkpoints): its codes are bytes in the packed arrays, and
    float8_e4m3fn's S.1111.111 is NaN (coli.types.fp8_blocks' reference decodes it so): both checks name the row."""
    from coli import finite
    from coli.types import fp8_blocks, table as tensor_types
    from coli.base.errors import ColiError
    from cpu_kernels import formats

    raw = tensor_types.random_blocks("FP8_E4M3_B128", 4, 256, np.random.default_rng(2))
    assert finite.first_bad_raw_row("FP8_E4M3_B128", raw) is None
    raw[3, fp8_blocks.TYPE_SIZE + 4 + 17] = 0xFF  # block 1 of row 3: code 17
    assert np.isnan(fp8_blocks.reference(raw, (4, 256))[3, 128 + 17])
    assert finite.first_bad_raw_row("FP8_E4M3_B128", raw) == 3
    with pytest.raises(ColiError, match=r"^t has a non-finite NaN code in row 3 \(FP8_E4M3_B128"):
        finite.check_weight(formats.prepare("FP8_E4M3_B128", raw, (4, 256)), "t")


def test_non_finite_hidden_row_gives_nan_logits_with_int8_activations(tiny):
    """A NaN in the residual stream (activations overflowed; the weights are checked at load) reached the head,
    whose int8 activations rounded it to finite codes: normal-looking logits. The head now makes that row's logits
    NaN, so ``Engine.logits`` shows it and ``generate`` stops with the sampler's ColiError (coli.sampling)."""
    from coli.engine import Engine
    from coli.base.errors import ColiError
    from cpu_kernels import formats

    x = np.ones((1, 64), np.float32)
    x[0, 3] = np.nan
    w = formats.prepare("Q8_0", tiny_q8(64, 64), (64, 64))
    assert np.isfinite(formats.matmul(w, x, act="int8")).all()   # the rounding this guards against
    with Engine(str(tiny), threads=1, ctx=32, cpu_act="int8", quiet=True) as eng:
        clean = eng.logits([1, 2, 3])
        assert np.isfinite(clean).all()
        layer = eng.model.layers[1]
        call = layer.__call__

        class Poisoned:  # the last layer, with a NaN in its output rows from position 1 on
            def __getattr__(self, k):
                return getattr(layer, k)

            def __call__(self, h, c, pos0):
                h = call(h, c, pos0)
                h[max(0, 1 - pos0):, 5] = np.nan
                return h

        eng.model.layers[1] = Poisoned()
        lg = eng.logits([1, 2, 3])
        assert np.isnan(lg[1:]).all() and np.array_equal(lg[0], clean[0])
        with pytest.raises(ColiError, match=r"non-finite logits: all 256 logits are NaN"):
            eng.generate(ids=[1, 2, 3], max_tokens=2)


def tiny_q8(O: int, I: int) -> np.ndarray:
    from coli.types import table as tensor_types

    return tensor_types.random_blocks("Q8_0", O, I, np.random.default_rng(3))


def test_first_bad_row_in_chunks(monkeypatch):
    """``coli.finite.first_bad_row`` checks a large tensor a chunk of rows at a time (a bounded temporary): the bad
    row is found in a later chunk, in a 1-D array, and none in a finite one."""
    from coli import finite

    monkeypatch.setattr(finite, "CHUNK", 64)
    a = np.zeros((50, 16), np.float32)
    assert finite.first_bad_row(a) is None
    a[37, 15] = -np.inf
    a[41, 0] = np.nan
    assert finite.first_bad_row(a) == 37
    v = np.zeros(1000, np.float16)
    v[700] = np.inf
    assert finite.first_bad_row(v) == 700
    assert finite.first_bad_row(np.zeros((3, 4), np.int8)) is None


def _mla_case(fill):
    from cpu_kernels.mla import mla_attend

    qn = np.ones((1, 2, 8), np.float32)
    qn[0, 0, 0] = fill
    H, r = 2, 6
    return mla_attend(qn, np.ones((1, H, 4), np.float32), np.ones((H, r, 8), np.float32),
                      np.ones((H, 5, r), np.float32), np.ones((4, r), np.float32), np.ones((4, 4), np.float32), 3, 0.3)


def _dsv4_case(fill):
    from cpu_kernels import dsv4

    q = np.ones((1, 2, 8), np.float32)
    q[0, 0, 0] = fill
    return dsv4.attend(q, np.ones((1, 8), np.float32), np.ones((4, 8), np.float32), 3, np.zeros((0, 8), np.float32),
                       0, None, np.full(2, -30.0, np.float32), np.ones((8, 2), np.float32), np.zeros((8, 2), np.float32))


@pytest.mark.parametrize("fill", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("case", [_mla_case, _dsv4_case], ids=["mla", "dsv4"])
def test_mla_and_dsv4_attention_with_a_non_finite_score_do_not_raise(case, fill):
    """The MLA (DeepSeek-V2/V3, GLM-5, Kimi) and DeepSeek-V4 kernels had the same ZeroDivisionError as
    ``cpu_kernels.attention`` at a softmax sum of 0 / NaN: the poisoned head is NaN now (DeepSeek-V4's sink takes
    a row whose scores are all -inf: 0, the softmax's value), the other head is exactly the clean run's."""
    clean = case(0.0)
    out = case(fill)
    np.testing.assert_array_equal(out[0, 1], clean[0, 1])
    if case is _dsv4_case and fill == -np.inf:
        np.testing.assert_array_equal(out[0, 0], 0.0)
    else:
        assert np.isnan(out[0, 0]).all()
