"""The device layers' prompt kernels' variants (docs/vulkan.md "Prompt routes"): attn_pre.comp's query rows a
workgroup and its GQA grouping (the q heads of a KV head in one workgroup) change no bit of a prompt's logits (each
row's sums run in the same order whatever block it is in), and
the prompt GEMM's route is the one the device can run (Lavapipe has no cooperative matrices: f32) and a bad route
name is one clear error."""
from __future__ import annotations

import numpy as np
import pytest

from coli.base import settings
from coli.base.errors import ColiError
from tests.tiny_moe import build_tiny_moe
from tests.vk_util import requires_vulkan

pytestmark = requires_vulkan

ARGS = ["--layers", "2", "--d", "128", "--heads", "4", "--kv-heads", "2", "--experts", "8", "--top-k", "3", "--expert-ff", "96",
        "--vocab", "300", "--type", "Q8_0", "--seed", "11"]
IDS = [5, 17, 200, 3, 44, 9, 120, 77, 250, 1, 64, 33, 8, 90, 12, 150, 2, 240, 7, 100]


@pytest.fixture(scope="module")
def dev(tmp_path_factory):
    from coli.engine import Engine

    out = build_tiny_moe(tmp_path_factory.mktemp("routes"), ARGS, "moe2.gguf")
    e = Engine(out, cpu_act="f32", device="vulkan", env=settings.overlay(None, COLI_VK_LAYERS=2), quiet=True,
               silent=True, save_usage=False, ctx=64, usage=str(out) + ".usage")
    yield e
    e.close()


def test_attention_rows_a_workgroup_change_no_bit(dev):
    dl = dev.model.device_layers
    assert dl is not None and dl.K.attn_pre(dl.hd)[0] == 128 and (dl.nq, dl.nkv) == (4, 2)
    out = {}
    for bq in (8, 16, 32):
        for gqa in (False, True):
            dl.K.attn_bq, dl.K.attn_gqa = bq, gqa
            assert dl.K.attn_group(dl.nq, dl.nkv, dl.hd) == (2 if gqa else 1)
            for rec in dl._precs.values():
                dl.K.free(rec)
            dl._precs = {}
            p0 = dl.prompt_tokens
            out[bq, gqa] = dev.model.forward(IDS, dev.model.new_cache(64, 64), all_logits=True)
            assert dl.prompt_tokens - p0 == len(IDS)      # the rows ran on the device
    dl.K.attn_bq, dl.K.attn_gqa = 8, True
    assert all(np.array_equal(out[8, False], o) for o in out.values())


def test_the_route_is_one_the_device_runs(dev):
    from types import SimpleNamespace

    from coli.vulkan.layers import prompt_route

    assert not dev.device.coopmat                         # Lavapipe: no VK_KHR_cooperative_matrix
    for route in ("auto", "coopmat", "f32", "COOPMAT"):
        env = settings.overlay(None, COLI_VK_PROMPT_ROUTE=route)
        assert prompt_route(dev.device, env) == "f32"
        want = "f32" if route == "f32" else "coopmat"
        assert prompt_route(SimpleNamespace(coopmat=True), env) == want
    # the settings parser's one line (the variable's choices)
    with pytest.raises(ColiError, match=r"COLI_VK_PROMPT_ROUTE='tensor': not one of its values \(auto, coopmat or f32"):
        prompt_route(dev.device, settings.overlay(None, COLI_VK_PROMPT_ROUTE="tensor"))


def test_the_attention_kernel_follows_the_route(dev):
    """The prompt attention takes attn_pre_cm.comp on the coopmat route for head dimensions it has (a multiple of 16
    up to 128: 64 rows a workgroup), attn_pre.comp elsewhere; Lavapipe (no cooperative matrices, no module) f32. Both
    kernels serve the q heads of a KV head in one workgroup (G of them, positions x heads in its rows)."""
    K = dev.model.device_layers.K
    assert K.attn_route == "f32" and ("attn_pre_cm", None) not in dev.device._modules
    assert [K.attn_kernel(hd) for hd in (64, 128, 256)] == ["attn_pre"] * 3
    try:
        K.attn_route = "coopmat"
        assert [K.attn_kernel(hd) for hd in (64, 80, 128, 72, 256)] == [
            "attn_pre_cm", "attn_pre_cm", "attn_pre_cm", "attn_pre", "attn_pre"]
        assert K.attn_pre(128) == (128, 64) and K.attn_pre(256) == (256, 8)
        # GQA: 9 q heads over 3 KV heads, 40 rows: 3 heads x 21 positions a workgroup (f32: 3 x 2 of its 8 rows)
        assert K.attn_dispatch(9, 3, 64, 40) == ("attn_pre_cm", (3, 2), 128 | 3 << 16)
        assert K.attn_dispatch(9, 3, 256, 40) == ("attn_pre", (3, 20), 256 | 3 << 16)
        K.attn_gqa = False
        assert K.attn_dispatch(9, 3, 64, 40) == ("attn_pre_cm", (9, 1), 128 | 1 << 16)
    finally:
        K.attn_route, K.attn_gqa = "f32", True


def test_decode_attention_split_over_positions_matches_the_cpu(dev, tmp_path):
    """Decode rows whose context outgrows COLI_VK_ATTN_CHUNK keys: attn_dec.comp's parts over positions, joined in
    the same dispatch by each head's last part (no attn_comb.comp dispatch), give the CPU-only f32 run's logits
    within 1e-5 of the largest."""
    from coli.engine import Engine
    from tests.vk_util import rel_err

    path = dev.path
    split = Engine(path, cpu_act="f32", device="vulkan", quiet=True, silent=True, save_usage=False, ctx=64,
                   env=settings.overlay(None, COLI_VK_LAYERS=2, COLI_VK_ATTN_CHUNK=16), usage=str(tmp_path / "u"))
    cpu = Engine(path, cpu_act="f32", quiet=True, silent=True, save_usage=False, ctx=64, usage=str(tmp_path / "u2"))
    try:
        dl = split.model.device_layers
        kinds = [getattr(op, "kernel", None) for op in dl._ops()]
        assert dl.attn_np == 4 and kinds.count("attn_dec") == 2 and "attn_comb" not in kinds
        ids = IDS + IDS[::-1] + IDS[:10]                  # 50 positions: up to 4 parts of 16 keys
        c, cc = split.model.new_cache(64, 64), cpu.model.new_cache(64, 64)
        split.model.forward(ids[:4], c)
        cpu.model.forward(ids[:4], cc)
        t0 = dl.tokens
        got = np.array([split.model.forward([t], c)[-1] for t in ids[4:]])
        ref = np.array([cpu.model.forward([t], cc)[-1] for t in ids[4:]])
        assert dl.tokens - t0 == len(ids) - 4             # every row decoded on the device
        assert rel_err(got, ref) < 1e-5, rel_err(got, ref)
    finally:
        split.close()
        cpu.close()


def test_prompt_chunk_rows_rule(dev, tmp_path):
    """A device prompt chunk's rows: 2,048 where the device holds every layer (and its chunk's scratch fits), 512 where
    it holds some of them, -ub's rows when given (COLI_UBATCH, llama.cpp's n_ubatch), COLI_VK_PROMPT_ROWS over both."""
    from coli.engine import Engine

    assert dev.model.device_layers.first == 0 and dev.prompt_chunk() == 2048
    for env, rows in ((dict(COLI_VK_LAYERS=1), 512), (dict(COLI_VK_LAYERS=2, COLI_UBATCH=32), 32),
                      (dict(COLI_VK_LAYERS=1, COLI_UBATCH=32, COLI_VK_PROMPT_ROWS=24), 24)):
        e = Engine(dev.path, cpu_act="f32", device="vulkan", env=settings.overlay(None, **env), quiet=True, silent=True,
                   save_usage=False, ctx=64, usage=str(tmp_path / "u"))
        try:
            assert e.device_layers is not None and e.prompt_chunk() == rows, env
        finally:
            e.close()


def test_prompt_attention_keys_split_matches_the_cpu(dev, tmp_path):
    """Prompt chunks whose attention splits each row block's keys over 3 workgroups (parts of 16 keys; Lavapipe splits
    none by the rule, so forced here) and joins the split rows' parts: a 50-row prompt in chunks of 20 gives the
    CPU-only f32 run's logits within 1e-5 of the largest, every row on the device."""
    from coli.engine import Engine
    from tests.vk_util import rel_err

    dl = dev.model.device_layers
    ids = IDS + IDS[::-1] + IDS[:10]
    cpu = Engine(dev.path, cpu_act="f32", quiet=True, silent=True, save_usage=False, ctx=64, usage=str(tmp_path / "u"))
    try:
        ref = cpu.model.forward(ids, cpu.model.new_cache(64, 64), all_logits=True)
    finally:
        cpu.close()
    K, rows = dl.K, dl.prompt_rows
    try:
        K.attn_pre_split, K.attn_pre_chunk, dl.prompt_rows, dl._pR = 3, 16, 20, 0   # _pR 0: the scratch made again
        p0 = dl.prompt_tokens
        got = dev.model.forward(ids, dev.model.new_cache(64, 64), all_logits=True)
        assert dl.prompt_tokens - p0 == len(ids)
        ops = [(op.kernel, op.groups) for op in dl._prompt_ops(20, True) if getattr(op, "kernel", "").startswith("attn")]
        assert ops == [("attn_pre", (2, 5, 3)), ("attn_pre", (20,))] * 2     # per layer: the split, the join
        assert rel_err(got, ref) < 1e-5, rel_err(got, ref)
    finally:
        K.attn_pre_split, K.attn_pre_chunk, dl.prompt_rows, dl._pR = None, 256, rows, 0


def test_demo_shaped_moe_prompt_on_the_device(tmp_path):
    """A prompt of 40 rows in chunks of 16 through every layer on the device, on a file of the demo MoE's layer shape
    (scripts/make_synthetic_moe.py: d 576, 9 q heads over 3 KV heads of 64, 8 experts top-2 of FFN 1536; 2 layers
    and a small vocabulary, so Lavapipe takes seconds): every row's logits within 1e-5 of the largest of the
    CPU-only f32 run's, and every prompt row ran on the device (attn_pre.comp serving 3 q heads a workgroup)."""
    from coli.engine import Engine
    from tests.vk_util import rel_err

    path = build_tiny_moe(tmp_path, ["--layers", "2", "--d", "576", "--heads", "9", "--kv-heads", "3", "--experts", "8",
                                     "--top-k", "2", "--expert-ff", "1536", "--vocab", "512", "--type", "Q8_0",
                                     "--seed", "5"], "demo_shape.gguf")
    ids = [(7 * i * i + 3 * i + 11) % 512 for i in range(40)]
    cpu = Engine(path, cpu_act="f32", quiet=True, silent=True, save_usage=False, ctx=64, usage=str(tmp_path / "u"))
    try:
        ref = cpu.model.forward(ids, cpu.model.new_cache(64, 64), all_logits=True)
    finally:
        cpu.close()
    dev = Engine(path, cpu_act="f32", device="vulkan", quiet=True, silent=True, save_usage=False, ctx=64,
                 env=settings.overlay(None, COLI_VK_LAYERS=2, COLI_VK_PROMPT_ROWS=16), usage=str(tmp_path / "u2"))
    try:
        dl = dev.model.device_layers
        assert dl is not None and dl.first == 0 and (dl.nq, dl.nkv, dl.hd) == (9, 3, 64)
        assert dl.K.attn_group(dl.nq, dl.nkv, dl.hd) == 3
        got = dev.model.forward(ids, dev.model.new_cache(64, 64), all_logits=True)
        assert (dl.prompt_tokens, dl.prompt_chunks) == (40, 3)
        assert got.shape == ref.shape == (40, 512)
        assert rel_err(got, ref) < 1e-5, rel_err(got, ref)
    finally:
        dev.close()
