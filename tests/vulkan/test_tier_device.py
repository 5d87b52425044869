"""The tier on a real device: Lavapipe through coli.vulkan.open_device, driven by coli.Engine on the MoE oracle
fixtures (tests/fixtures/oracles, F32 experts). Issue #4 "Correctness": 32 greedy tokens equal to the CPU-only
run and logits within 1e-4 of the largest at every position (f32 activations on both sides; int8 on both
sides with Q8_0 copies of the fixtures), with the
balancer on and off, with a budget of a few experts (evictions), after a warm start from a history, with the
device lost mid-run (COLI_VK_FAULT), both sides computing pairs in one step, and reproducible mode
(COLI_VK_TIER_SYNC=1, --no-balance) giving identical logits bytes. Skipped where no Vulkan device opens."""
import sys

import numpy as np
import pytest

from conftest import FIXTURES, ROOT

FIX = FIXTURES / "oracles"
PROMPT = [1, 2, 3, 4, 5, 6, 7]
N = 32


@pytest.fixture(scope="module")
def lavapipe():
    from tests.vk_util import HAVE_LOADER, open_test_device

    if not HAVE_LOADER:  # only a machine without the loader skips (tests/vk_util.py's rule)
        pytest.skip("libvulkan.so.1 not found (apt install libvulkan1 mesa-vulkan-drivers)")
    open_test_device().close()
    return True


def run(name, tmp_path, device=None, balance=None, usage=None, save_usage=False, record_steps=False):
    from coli.engine import Engine
    eng = Engine(FIX / f"{name}.gguf", threads=1, save_usage=save_usage, quiet=True, cpu_act="f32",
                 usage=str(usage or tmp_path / "none.coli_usage"), device=device, balance=balance)
    steps = []
    if record_steps:
        st, orig = eng.step, eng.step.run

        def rec(*a, **k):
            c0, d0 = st.stats.cpu_pairs, st.stats.device_pairs
            y = orig(*a, **k)
            steps.append((st.stats.cpu_pairs - c0, st.stats.device_pairs - d0))
            return y
        st.run = rec
    try:
        ids = list(eng.generate(ids=PROMPT, max_tokens=N, temp=0.0).ids)
        lg = eng.logits(PROMPT + ids[:-1])
        tier = eng.tier
        return ids, lg, tier, steps
    finally:
        eng.close()


def same(a, b):
    ids_a, lg_a = a[0], a[1]
    ids_b, lg_b = b[0], b[1]
    assert ids_a == ids_b
    for i in range(lg_b.shape[0]):
        assert np.abs(lg_a[i] - lg_b[i]).max() <= 1e-4 * np.abs(lg_b[i]).max(), f"position {i}"


@pytest.fixture(scope="module")
def cpu_runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("cpu")
    return {n: run(n, tmp) for n in ("olmoe", "qwen2moe")}


@pytest.mark.parametrize("name", ["olmoe", "qwen2moe"])
@pytest.mark.parametrize("balance", [False, True])
def test_tier_tokens_equal_cpu(lavapipe, cpu_runs, tmp_path, name, balance, capsys):
    r = run(name, tmp_path, device="vulkan", balance=balance)
    assert r[2] is not None and r[2].on and r[2].device_pairs > 0
    same(r, cpu_runs[name])
    err = capsys.readouterr().err
    assert f"[VK] tier {name}.gguf run: device " in err


def test_few_experts_evict_and_both_sides_share_steps(lavapipe, cpu_runs, tmp_path, monkeypatch):
    monkeypatch.setenv("COLI_VK_TIER_GB", repr(3 * 3 * 32 * 64 * 4 / 2**30))   # 3 experts of 24 KiB
    monkeypatch.setenv("COLI_VK_TIER_SYNC", "1")
    r = run("olmoe", tmp_path, device="vulkan", balance=False, record_steps=True)
    t = r[2]
    assert t.capacity == 3 and t.evictions > 0 and t.device_pairs > 0
    assert any(c > 0 and d > 0 for c, d in r[3])            # the device and the CPU in the same step
    same(r, cpu_runs["olmoe"])


def test_warm_start_from_history(lavapipe, cpu_runs, tmp_path, monkeypatch, capsys):
    hist = tmp_path / "h.coli_usage"
    run("olmoe", tmp_path, usage=hist, save_usage=True)      # a CPU run writes the history
    assert hist.exists()
    monkeypatch.setenv("COLI_VK_TIER_GB", repr(4 * 3 * 32 * 64 * 4 / 2**30))
    capsys.readouterr()
    r = run("olmoe", tmp_path, device="vulkan", balance=False, usage=hist)
    err = capsys.readouterr().err
    assert "[VK] tier olmoe.gguf: warm start, 4 experts from the history in " in err
    assert r[2].warm_uploads == 4
    same(r, cpu_runs["olmoe"])


def test_device_lost_mid_run_finishes_on_cpu(lavapipe, cpu_runs, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("COLI_VK_FAULT", "5")
    r = run("qwen2moe", tmp_path, device="vulkan", balance=False)
    err = capsys.readouterr().err
    assert not r[2].on and "[VK] tier qwen2moe.gguf: off, the device failed a join" in err
    same(r, cpu_runs["qwen2moe"])


def test_reproducible_mode_bitwise(lavapipe, tmp_path, monkeypatch):
    monkeypatch.setenv("COLI_VK_TIER_SYNC", "1")
    monkeypatch.setenv("COLI_VK_TIER_GB", repr(5 * 3 * 32 * 64 * 4 / 2**30))
    a = run("olmoe", tmp_path, device="vulkan", balance=False)
    b = run("olmoe", tmp_path, device="vulkan", balance=False)
    assert a[0] == b[0] and a[1].tobytes() == b[1].tobytes()


def test_trace_of_a_tier_run(lavapipe, tmp_path, monkeypatch):
    import json
    from coli.engine import Engine
    from scheduler.trace import summarize
    monkeypatch.setenv("COLI_VK_TIER_GB", repr(4 * 3 * 32 * 64 * 4 / 2**30))
    p = tmp_path / "run.json"
    eng = Engine(FIX / "olmoe.gguf", threads=1, save_usage=False, quiet=True, cpu_act="f32",
                 usage=str(tmp_path / "none.coli_usage"), device="vulkan", balance=False, trace=str(p))
    try:
        eng.generate(ids=PROMPT, max_tokens=8, temp=0.0)
        tier = eng.tier
    finally:
        eng.close()
    evs = json.loads(p.read_text())
    cats = {e.get("cat") for e in evs if e["ph"] == "X"}
    assert {"cpu", "device", "join", "upload", "disk"} <= cats
    dev = [e for e in evs if e.get("cat") == "device"]
    assert len(dev) == tier.batches
    assert sum(e["dur"] for e in dev) == pytest.approx(tier.device_ms * 1e3, rel=1e-3)
    s = summarize(evs)
    assert 0.0 <= s["hidden_pct"] <= 100.0


def quantized_copy(name, dest, qtype="Q8_0"):
    """The oracle fixture ``name`` with its routed experts (``ffn_*_exps``) quantized to ``qtype`` by
    gguf.quants (every other tensor and key as is): a MoE whose experts take the int8 path."""
    import gguf
    src = gguf.GGUFReader(FIX / f"{name}.gguf")
    arch = src.fields["general.architecture"].contents()
    w = gguf.GGUFWriter(str(dest), arch)
    for f in src.fields.values():
        if f.name.startswith("GGUF.") or f.name == "general.architecture":
            continue
        vt = gguf.GGUFValueType(f.types[0])
        sub = gguf.GGUFValueType(f.types[-1]) if vt == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(f.name, f.contents(), vt, sub_type=sub)
    qt = gguf.GGMLQuantizationType[qtype]
    for t in src.tensors:
        data = np.asarray(t.data)
        if "_exps." in t.name:
            w.add_tensor(t.name, gguf.quants.quantize(data.astype(np.float32), qt), raw_dtype=qt)
        else:
            w.add_tensor(t.name, data, raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dest


def run_q(path, tmp_path, act, device=None, balance=None):
    from coli.engine import Engine
    eng = Engine(path, threads=1, save_usage=False, quiet=True, cpu_act=act, usage=str(tmp_path / "none.coli_usage"),
                 device=device, balance=balance)
    try:
        ids = list(eng.generate(ids=PROMPT, max_tokens=N, temp=0.0).ids)
        lg = eng.logits(PROMPT + ids[:-1])
        return ids, lg, eng.tier, (eng.device.act if eng.device is not None else None)
    finally:
        eng.close()


@pytest.mark.parametrize("name", ["olmoe", "qwen2moe"])
def test_int8_tier_tokens_equal_cpu_int8(lavapipe, tmp_path, name):
    """Q8_0 experts, int8 activations on both sides (the CPU's default where it has VNNI): the tier's tokens
    (balanced and not) equal the CPU-only int8 run's, and its logits stay within 1e-4 of the largest (the
    sides differ in summation order, and a SwiGLU output at a rounding boundary can round to the next
    int8 code), closer to the int8 run's than the f32 run's are."""
    path = quantized_copy(name, tmp_path / f"{name}-q8.gguf")
    cpu8 = run_q(path, tmp_path, "int8")
    cpu32 = run_q(path, tmp_path, "f32")
    for balance in (False, True):
        ids, lg, tier, act = run_q(path, tmp_path, "int8", device="vulkan", balance=balance)
        assert act == "int8" and tier is not None and tier.on and tier.device_pairs > 0
        assert ids == cpu8[0]
        scale = np.abs(cpu8[1]).max(axis=1)
        err = (np.abs(lg - cpu8[1]).max(axis=1) / scale).max()
        err32 = (np.abs(cpu32[1] - cpu8[1]).max(axis=1) / scale).max()
        assert err <= 1e-4 and err < err32, (err, err32)


def test_tier_decode_rows_run_attention_and_router_in_one_region(lavapipe, tmp_path, monkeypatch):
    """With the tier on, a decode row of a MoE layer runs its attention, MoE norm and router in the compiled layer
    region (cpu_kernels/decode_moe.py), which stops before the experts for the step to place them: the region ran
    for every decode row's layer with the tier active, never took the experts itself (the device did: device pairs
    > 0), and the tokens equal the CPU-only int8 run's (the region's router is bit for bit the blocks' path)."""
    from cpu_kernels import decode as D
    from cpu_kernels import decode_moe

    if not D.available("int8", ()):
        pytest.skip("the compiled decode blocks need int8 activations with AVX-512 VNNI")
    path = quantized_copy("olmoe", tmp_path / "olmoe-q8.gguf")
    cpu8 = run_q(path, tmp_path, "int8")
    seen = {"router": 0, "whole": 0}
    call = decode_moe.MoELayerDecode.__call__

    def counted(self, h, kv, pos0):
        step = self.moe.m.step
        kind = "whole" if step.region_ok() else "router" if step.router_region_ok() else None
        ran = call(self, h, kv, pos0)
        if ran and kind:
            seen[kind] += 1
        return ran
    monkeypatch.setattr(decode_moe.MoELayerDecode, "__call__", counted)
    ids, lg, tier, act = run_q(path, tmp_path, "int8", device="vulkan", balance=False)
    assert act == "int8" and tier is not None and tier.on and tier.device_pairs > 0
    assert seen["router"] >= N - 1 and seen["whole"] == 0, seen
    assert ids == cpu8[0]


def test_device_run_keeps_the_cpus_default_act(lavapipe, tmp_path):
    import cpu_kernels
    from coli.engine import Engine
    eng = Engine(FIX / "olmoe.gguf", threads=1, save_usage=False, quiet=True, usage=str(tmp_path / "u"),
                 device="vulkan")
    try:
        assert eng.cpu_act == cpu_kernels.DEFAULT_ACT and eng.device.act == eng.cpu_act
    finally:
        eng.close()


def test_tier_odd_expert_sizes(lavapipe, tmp_path):
    """F32 experts whose row lengths are not multiples of 32 (d 40, expert FFN 52: scripts/make_synthetic_moe.py)
    run on the device, zero-padded at upload (docs/vulkan.md "Row lengths"): the resident handles are padded,
    the device computed pairs (dispatches > 0, no failed upload), and 16 greedy tokens equal the CPU-only run's
    with logits within 1e-4 of the largest at every position."""
    import subprocess

    from coli.engine import Engine
    path = tmp_path / "odd.gguf"
    subprocess.run([sys.executable, str(ROOT / "scripts" / "make_synthetic_moe.py"),
                    "-o", str(path), "--layers", "2", "--d", "40", "--heads", "2", "--experts", "4", "--top-k",
                    "2", "--expert-ff", "52", "--vocab", "256", "--type", "F32"],
                   check=True, capture_output=True, timeout=120)
    out = {}
    for device in (None, "vulkan"):
        eng = Engine(path, threads=1, save_usage=False, quiet=True, cpu_act="f32",
                     usage=str(tmp_path / "none.coli_usage"), device=device)
        try:
            ids = list(eng.generate(ids=PROMPT, max_tokens=16, temp=0.0).ids)
            out[device] = (ids, eng.logits(PROMPT + ids[:-1]))
            if device:
                tier = eng.tier
                assert tier is not None and tier.on and tier.failed == 0 and tier.device_pairs > 0
                assert eng.device.dispatches > 0
                h = next(iter(tier.resident.values()))
                assert (h.D, h.F, h.Dp, h.Fp) == (40, 52, 64, 64)
        finally:
            eng.close()
    same(out["vulkan"], out[None])


def test_zero_copy_equals_the_copied_mode(lavapipe, tmp_path, monkeypatch, capsys):
    """COLI_VK_ZERO_COPY=on against off on the OLMoE oracle, a 3-expert budget that evicts (LFRU alone, so that the
    RAM cache's experts are promoted): the same tokens and logits bit for bit (the same kernels read the same bytes),
    no byte uploaded, every matrix imported where the RAM cache's page-aligned read put it, the device's dispatches
    and pairs > 0, and each start line says which mode runs."""
    monkeypatch.setenv("COLI_VK_TIER_GB", repr(3 * 3 * 32 * 64 * 4 / 2**30))
    monkeypatch.setenv("COLI_VK_TIER_SYNC", "1")
    monkeypatch.setenv("COLI_VK_TIER_REUSE", "0")
    runs = {}
    for zc in ("off", "on"):
        monkeypatch.setenv("COLI_VK_ZERO_COPY", zc)
        capsys.readouterr()
        runs[zc] = run("olmoe", tmp_path, device="vulkan", balance=False)
        runs[zc] += (capsys.readouterr().err,)
    off, on = runs["off"], runs["on"]
    assert on[0] == off[0] and on[1].tobytes() == off[1].tobytes()
    t, d = on[2], on[2].device
    assert d.zero_copy and t.upload_bytes == 0 and t.evictions > 0 and t.uploads > t.warm_uploads
    assert d.imported_in_place == 3 * t.uploads and d.imported_copied == 0
    assert d.dispatches > 0 and t.device_pairs > 0 and d.imported_live == 0       # every import let go at close
    assert "experts mapped from RAM (zero-copy, COLI_VK_ZERO_COPY=on)" in on[4]
    assert off[2].upload_bytes > 0 and "experts copied to the device (COLI_VK_ZERO_COPY=off)" in off[4]
