"""GLM-5's MLA with the DSA indexer on the device (shaders/mla.comp modes 4-6 before the MLA modes; docs/vulkan.md
"MLA on the device"): the indexer's keys in the device's latent rows, its scores and top-k with the CPU's tie rule,
MLA over the chosen keys only; shared layers reading the last full layer's positions."""
from __future__ import annotations

import numpy as np
import pytest

from tests.vk_util import check_greedy_like_cpu, device_engine, greedy_rows, rel_err, requires_vulkan
from tests.vulkan.test_device_layers import _padded_q_lora

pytestmark = requires_vulkan


@pytest.fixture(scope="module")
def glm_q32(tmp_path_factory):
    """The glmdsa oracle with q_lora_rank padded from 20 to 32 (the device's matrix widths)."""
    return _padded_q_lora(tmp_path_factory.mktemp("glm") / "glm_q32.gguf", "glmdsa", "glm-dsa")


def test_dsa_against_hf(glm_q32):
    """Every layer (full and shared indexer layers, the leading dense one) and the head on the device: the 96-row
    prompt (past index_topk 24: the indexer's choice matters) in chunks of 40 and 8 greedy decode rows within the CPU
    path's bound of HF transformers' (1e-4 of the largest logit) with HF's tokens; the CPU-only run's logits within
    1e-5 and its greedy tokens; the device did the work."""
    from tests.conftest import FIXTURES
    from tests.oracle_check import check_prompt_and_decode

    oracle = np.load(FIXTURES / "oracles" / "glmdsa.npz")
    assert len(oracle["ids"]) > 24
    cpu = device_engine(glm_q32, ctx=128)
    e = device_engine(glm_q32, COLI_VK_LAYERS=-1, ctx=128)
    try:
        m, dl = e.model, e.model.device_layers
        assert dl is not None and dl.first == 0 and dl.head is not None and dl.dsa == (8, 16, 24)
        assert [("i_q" in d) for d in dl.per] == [True, True, False, True] and all(d["dsa"] for d in dl.per)
        dl.prompt_rows = 40
        d0 = e.device.layer_dispatches
        got = check_prompt_and_decode(m, m.new_cache(128, 128), oracle)
        assert (dl.prompt_tokens, dl.prompt_chunks, dl.tokens) == (len(oracle["ids"]), 3, 8)
        assert dl.mla_keys == 24 and dl.mla_expanded == 0     # every chunk sees more keys than index_topk: absorbed
        assert e.device.layer_dispatches - d0 >= 8 * 4 * 7
        ref = greedy_rows(cpu.model, cpu.model.new_cache(128, 128), oracle["ids"], 8)
        check_greedy_like_cpu(m, ref, oracle["ids"], got, 1e-5, 1e-5)
    finally:
        e.close()
        cpu.close()


def test_expanded_while_every_key_is_chosen(glm_q32):
    """A chunk whose rows see at most ``index_topk`` keys (every key chosen: dense attention) takes MLA's expanded
    form with the indexer still writing its keys into the cache rows; the chunks after it (past 24 keys) take the
    absorbed form over the indexer's choice, which reads those keys. A 48-row prompt in chunks of 16 (the first
    expanded) and 4 decode rows: the CPU-only run's logits at every row within 1e-5 of the largest."""
    from tests.conftest import FIXTURES

    ids = np.load(FIXTURES / "oracles" / "glmdsa.npz")["ids"][:52]
    cpu = device_engine(glm_q32, ctx=64)
    e = device_engine(glm_q32, COLI_VK_LAYERS=-1, ctx=64)

    def run(m):
        c = m.new_cache(64, 64)
        return np.concatenate([m.forward(ids[:48], c, all_logits=True)] + [m.forward([int(t)], c) for t in ids[48:]])

    try:
        dl = e.model.device_layers
        dl.prompt_rows = 16
        assert dl.mla_keys == 24
        ref, got = run(cpu.model), run(e.model)
        assert (dl.prompt_tokens, dl.prompt_chunks, dl.mla_expanded, dl.tokens) == (48, 3, 1, 4)
        assert rel_err(got, ref) < 1e-5, rel_err(got, ref)
    finally:
        e.close()
        cpu.close()


def test_the_selection_matters_and_rows_move_both_ways(glm_q32):
    """The indexer's choice is what the device attends to: with ``index_topk`` raised past the context (every key)
    the CPU's logits move (so a device that ignored the selection would fail the tolerance), and the device's follow
    the CPU's either way. Rows the CPU wrote (a prompt with the device layers off) are uploaded, with the indexer keys,
    before device decode rows; rows a device prompt wrote come back on ``host_kv``: latent, rope key and indexer key
    within 1e-5 of the CPU's, and the CPU decodes on from them."""
    from tests.conftest import FIXTURES

    ids = np.load(FIXTURES / "oracles" / "glmdsa.npz")["ids"][:60]
    cpu = device_engine(glm_q32, ctx=64)
    e = device_engine(glm_q32, COLI_VK_LAYERS=-1, ctx=64)
    try:
        m, dl = e.model, e.model.device_layers
        cc = cpu.model.new_cache(64, 64)
        ref = np.concatenate([cpu.model.forward(ids[:56], cc, all_logits=True)]
                             + [cpu.model.forward([int(t)], cc) for t in ids[56:]])
        # the selection changes the result: every key attended gives other logits
        a = cpu.model.args
        k0 = a.idx_topk
        for L in cpu.model.layers:
            if L.attn.indexer is not None:
                L.attn.indexer.K = 64
        try:
            dense = cpu.model.forward(ids, cpu.model.new_cache(64, 64), all_logits=True)
        finally:
            for L in cpu.model.layers:
                if L.attn.indexer is not None:
                    L.attn.indexer.K = k0
        assert rel_err(dense[30:], ref[30:]) > 1e-3
        assert rel_err(dense[:24], ref[:24]) < 1e-6     # while there are at most top_k keys: all of them
        # CPU prompt, device decode rows
        c = m.new_cache(64, 64)
        m.device_layers = None
        out = [m.forward(ids[:56], c, all_logits=True)]
        m.device_layers = dl
        out += [m.forward([int(t)], c) for t in ids[56:]]
        assert dl.tokens == 4 and dl.prompt_tokens == 0
        assert rel_err(np.concatenate(out), ref) < 1e-5
        # device prompt, its rows read back, the CPU goes on
        c2 = m.new_cache(64, 64)
        got = [m.forward(ids[:56], c2, all_logits=True)]
        assert dl.prompt_tokens == 56
        assert not c2.layers[1].ik[:56].any()      # the device's only, until asked for
        dl.host_kv(c2)
        for il in (0, 1, 2, 3):
            for part in ("lat", "kr", "ik"):
                if not hasattr(cc.layers[il], part):
                    continue
                x, y = getattr(c2.layers[il], part)[:56], getattr(cc.layers[il], part)[:56]
                assert np.abs(x - y).max() <= 1e-5 * np.abs(y).max(), (il, part)
        m.device_layers = None
        got += [m.forward([int(t)], c2) for t in ids[56:]]
        m.device_layers = dl
        assert rel_err(np.concatenate(got), ref) < 1e-5
    finally:
        e.close()
        cpu.close()


def test_ties_go_to_the_earlier_positions(glm_q32, tmp_path):
    """Layer 0's indexer with ``indexer.proj`` zero: every key scores 0, so its choice is the CPU's tie rule alone
    (the stable sort: the first index_topk positions). The device's logits follow the CPU-only run's within 1e-5 over
    a prompt of 40 rows in chunks of 16 and 4 decode rows, and the choice matters (the tied file's logits differ from
    the original's past index_topk rows)."""
    from tests.conftest import FIXTURES
    from tests.oracle_check import copy_gguf

    path = copy_gguf(glm_q32, tmp_path / "tied.gguf", tensors={"blk.0.indexer.proj.weight": np.zeros((8, 32), np.float32)})
    ids = np.load(FIXTURES / "oracles" / "glmdsa.npz")["ids"][:44]
    orig = device_engine(glm_q32, ctx=64)
    cpu = device_engine(path, ctx=64)
    e = device_engine(path, COLI_VK_LAYERS=-1, ctx=64)

    def run(m):
        c = m.new_cache(64, 64)
        return np.concatenate([m.forward(ids[:40], c, all_logits=True)] + [m.forward([int(t)], c) for t in ids[40:]])

    try:
        e.model.device_layers.prompt_rows = 16
        ref, got = run(cpu.model), run(e.model)
        assert e.model.device_layers.prompt_chunks == 3 and e.model.device_layers.tokens == 4
        assert rel_err(got, ref) < 1e-5, rel_err(got, ref)
        assert rel_err(run(orig.model)[30:], ref[30:]) > 1e-3
    finally:
        e.close()
        cpu.close()
        orig.close()


def test_a_failed_device_hands_the_indexed_rows_back(glm_q32, monkeypatch):
    """The device fails at a decode row after a device prompt of 40 rows (past index_topk) and a decode row, whose
    latent and indexer keys only the device held: those rows are computed again on the CPU from the kept input rows (the full layers'
    indexers first), and the logits and greedy tokens stay the CPU-only run's (within 1e-5)."""
    from tests.conftest import FIXTURES
    from tests.vk_util import lose_device_on_call

    ids = [int(t) for t in np.load(FIXTURES / "oracles" / "glmdsa.npz")["ids"][:45]]
    cpu = device_engine(glm_q32, ctx=64)
    e = device_engine(glm_q32, COLI_VK_LAYERS=-1, ctx=64)
    try:
        cc = cpu.model.new_cache(64, 64)
        ref = np.concatenate([cpu.model.forward(ids[:40], cc)] + [cpu.model.forward([t], cc) for t in ids[40:]])
        m, dl = e.model, e.model.device_layers
        c = m.new_cache(64, 64)
        got = [m.forward(ids[:40], c), m.forward([ids[40]], c)]
        assert dl.prompt_tokens == 40 and dl.tokens == 1 and (dl._lo, dl._hi) == (0, 41)
        lose_device_on_call(monkeypatch, dl.K, "submit", 1, after=True)
        got += [m.forward([t], c) for t in ids[41:]]
        assert m.device_layers is None
        got = np.concatenate(got)
        assert rel_err(got, ref) < 1e-5, rel_err(got, ref)
        assert (got.argmax(1) == ref.argmax(1)).all()
    finally:
        e.close()
        cpu.close()


def test_the_device_run_starts_at_a_full_indexer_layer(glm_q32):
    """A shared DSA layer reads the positions of the full layer before it: ``plan`` starts the device's run at a
    layer with an indexer of its own (the glmdsa layers are full, full, shared, full: two asked for give layer 3
    alone), and every layer qualifies."""
    from coli.engine import Engine
    from coli.vulkan import layer_plan

    e = Engine(glm_q32, quiet=True, silent=True, save_usage=False, ctx=32)
    try:
        m = e.model
        assert layer_plan.why_not_all(m) == ""
        assert [L.attn.indexer is not None for L in m.layers] == [True, True, False, True]
        assert layer_plan.plan(m, 1 << 40, 32, want=2)[0] == 3
        assert layer_plan.plan(m, 1 << 40, 32, want=3)[0] == 1
    finally:
        e.close()


def test_start_line_counts_the_moe_layers_experts_only(glm_q32):
    """--cpu-moe on GLM-5 (its first layer dense): the start line counts the routed experts of the MoE layers only,
    none of them on the device (a dense layer routes nothing; it was counted as E experts, all resident)."""
    e = device_engine(glm_q32, COLI_VK_LAYERS=-1, COLI_VK_CPU_MOE=-1, ctx=64)
    try:
        dl = e.model.device_layers
        n_moe = sum("tab" in d for d in dl.per)
        assert 0 < n_moe < len(dl.per)
        assert f"routed experts: 0 of {dl.E * n_moe} on the device" in dl.describe()
    finally:
        e.close()
