"""Prompt chunks of device layers whose routed experts stay (partly) on the CPU (coli/vulkan/device_layers.py
``_run_prompt_split``; --cpu-moe, --n-cpu-moe, --gpu-layers with --tier-gb; docs/vulkan.md "Experts on the CPU"): the
device runs the chunk's attention, router, shared expert and resident experts, the CPU the other (row, rank) pairs
grouped by expert from the RAM expert cache, summed in rank order on the device. Every prompt row's logits equal the
CPU-only f32 run's within the device layers' tolerance, and both sides did work (prompt rows on the device, CPU
expert pairs). The MoE oracles' prompts, with the decode rows after them: tests/vulkan/test_device_chain.py."""
from __future__ import annotations

import numpy as np
import pytest

from tests.vk_util import IDS, device_engine, lose_device_on_call, rel_err, requires_vulkan, tier_gb

pytestmark = requires_vulkan


def _part_resident_env(m, n_res: int) -> dict:
    """--n-cpu-moe 1 with a --tier-gb holding the 4 layers without experts and ``n_res`` of layers 1-3's experts."""
    return dict(COLI_VK_LAYERS=-1, COLI_VK_CPU_MOE=1, COLI_VK_TIER_GB=tier_gb(m, n_res))


def _prompt(e, ids, rows):
    """Every row's logits of ``ids`` as one prompt, in chunks of ``rows`` rows on the device layers."""
    dl = e.model.device_layers
    if dl is not None:
        dl.prompt_rows = rows
    c = e.model.new_cache(64, 64)
    return e.model.forward(ids, c, all_logits=True), c


@pytest.mark.parametrize("placement", ["cpu-moe", "part"])
def test_prompt_rows_on_the_device_with_cpu_experts(device_moe, moe_cpu, placement):
    """A 12-row prompt in chunks of 5 (a chunk boundary inside it), with every expert on the CPU and with 9 of 24
    resident: each row's logits within 1e-5 of the CPU-only f32 run's, every prompt row through the device's layers,
    each side's pairs counted (their sum every routed pair of the prompt), a decode row after it agrees too."""
    m = moe_cpu.model
    env = dict(COLI_VK_CPU_MOE=-1) if placement == "cpu-moe" else _part_resident_env(m, 9)
    dev = device_engine(device_moe, **env)
    try:
        dl = dev.model.device_layers
        assert dl is not None and dl.first == 0 and sorted(dl.resident) == [0, 1, 2, 3]
        assert any(mk.any() for mk in dl.resident.values()) == (placement == "part")
        d0, c0 = dev.device.layer_dispatches, dev.model.step.stats.cpu_pairs
        ref, cc = _prompt(moe_cpu, IDS, 5)
        got, c = _prompt(dev, IDS, 5)
        assert got.shape == ref.shape == (len(IDS), m.args.vocab)
        assert rel_err(got, ref) < 1e-5, rel_err(got, ref)
        assert (dl.prompt_tokens, dl.prompt_chunks) == (len(IDS), 3)
        assert dev.device.layer_dispatches - d0 >= 3 * 4 * 6          # each chunk's layers ran their kernels
        n_cpu = dev.model.step.stats.cpu_pairs - c0
        assert n_cpu == dl.p_cpu_rows > 0
        assert dl.p_cpu_rows + dl.p_dev_rows == len(IDS) * 4 * dl.k
        assert (dl.p_dev_rows > 0) == (placement == "part")
        last = dev.model.forward([7], c)
        assert rel_err(last, moe_cpu.model.forward([7], cc)) < 1e-5
    finally:
        dev.close()


def test_prompt_placement_is_reported(device_moe, moe_cpu):
    """The run's stats and coli bench's pp record say the prompt rows ran on the device, and count both sides'
    expert pairs."""
    from coli.bench import run_bench

    dev = device_engine(device_moe, **_part_resident_env(moe_cpu.model, 9))
    try:
        r = dev.generate(ids=IDS[:9], max_tokens=2, temp=0.0, stop_at_eos=False)
        assert r.stats["device_prompt_rows"] == 9
        assert r.stats["device_expert_rows"] > 0 and r.stats["cpu_expert_rows"] > 0
        assert "prompt rows on the device: 9 of 9" in dev.stats_line(r.stats)
        recs = run_bench(dev, n_prompt=8, n_gen=0, reps=1, warmup=False)
        assert recs[0]["test"] == "pp8" and recs[0]["device_rows"] == 8 and recs[0]["cpu_rows"] == 0
        assert recs[0]["device_expert_rows"] + recs[0]["cpu_expert_rows"] == 8 * 4 * dev.model.device_layers.k
        assert recs[0]["device_expert_rows"] > 0 and recs[0]["cpu_expert_rows"] > 0
    finally:
        dev.close()


def test_device_lost_in_a_prompt_chunk(device_moe, moe_cpu, monkeypatch):
    """The device fails at the third segment of a prompt chunk (after layer 0's CPU pairs were computed): one line,
    the layers back on the CPU, the K/V rows only the device held computed again, every row's logits the CPU's
    bits."""
    dev = device_engine(device_moe, COLI_VK_CPU_MOE=-1)
    try:
        dl = dev.model.device_layers
        cc = moe_cpu.model.new_cache(64, 64)
        ref = np.concatenate([moe_cpu.model.forward(IDS[:4], cc, all_logits=True),
                              moe_cpu.model.forward(IDS[4:8], cc, all_logits=True)])
        calls = lose_device_on_call(monkeypatch, dl.K, "submit", 8,     # the second chunk's third segment
                                    lambda rec: any(isinstance(v, list) and any(rec is r for _, r, _ in v)
                                                    for v in dl._precs.values()))
        c = dev.model.new_cache(64, 64)
        dl.prompt_rows = 4
        got = np.concatenate([dev.model.forward(IDS[:4], c, all_logits=True),
                              dev.model.forward(IDS[4:8], c, all_logits=True)])
        assert len(calls) == 8 and dev.model.device_layers is None
        assert rel_err(got[:4], ref[:4]) < 1e-5
        assert np.array_equal(got[4:], ref[4:])      # the failed chunk's rows on the CPU: its bits
    finally:
        dev.close()


@pytest.mark.parametrize("placement", ["cpu-moe", "part"])
def test_streamed_prompt_experts(device_moe, moe_cpu, placement):
    """COLI_VK_PROMPT_EXPERTS=stream: each chunk copies every cut layer's non-resident experts into a stream slot
    (two, alternating) and runs every pair on the device: the 12 rows' logits within 1e-5 of the CPU-only f32 run's,
    no CPU expert pair, the streamed bytes those experts' a chunk; auto streams the chunks of at least
    COLI_VK_STREAM_ROWS rows only (the last, shorter one: the CPU's pairs)."""
    m = moe_cpu.model
    env = dict(COLI_VK_CPU_MOE=-1) if placement == "cpu-moe" else _part_resident_env(m, 9)
    ref, _ = _prompt(moe_cpu, IDS, 5)
    dev = device_engine(device_moe, COLI_VK_PROMPT_EXPERTS="stream", **env)
    try:
        dl = dev.model.device_layers
        c0 = dev.model.step.stats.cpu_pairs
        got, c = _prompt(dev, IDS, 5)
        assert rel_err(got, ref) < 1e-5, rel_err(got, ref)
        assert dev.model.step.stats.cpu_pairs == c0 and dl.p_cpu_rows == 0
        assert dl.p_dev_rows == len(IDS) * 4 * dl.k and dl.stream_chunks == dl.prompt_chunks == 3
        one = sum(-(-int(x.shape[1]) // 256) * 256 for x in dl._expert_parts(0))     # an expert's gate, up, down
        away = sum(int((~mk).sum()) for mk in dl.resident.values())
        assert away == (32 if placement == "cpu-moe" else 23)
        assert dl.streamed_bytes == 3 * away * one
    finally:
        dev.close()
    dev = device_engine(device_moe, COLI_VK_PROMPT_EXPERTS="auto", COLI_VK_STREAM_ROWS=5, **env)
    try:
        dl = dev.model.device_layers
        got, _ = _prompt(dev, IDS, 5)
        assert rel_err(got, ref) < 1e-5, rel_err(got, ref)
        assert dl.stream_chunks == 2 and dl.p_cpu_rows > 0
        assert dl.p_cpu_rows + dl.p_dev_rows == len(IDS) * 4 * dl.k
        from coli.bench import run_bench

        b0, dl.prompt_rows = dl.streamed_bytes, 512
        rec = run_bench(dev, n_prompt=8, n_gen=0, reps=1, warmup=False)[0]     # one chunk of 8 rows: streamed
        assert rec["device_streamed_bytes"] == dl.streamed_bytes - b0 == away * one
        assert rec["cpu_expert_rows"] == 0 and rec["device_expert_rows"] == 8 * 4 * dl.k
    finally:
        dev.close()


def test_prompt_experts_setting_refused(device_moe):
    """COLI_VK_PROMPT_EXPERTS other than cpu, stream or auto: one ColiError naming the variable."""
    from coli.base.errors import ColiError

    with pytest.raises(ColiError, match="^COLI_VK_PROMPT_EXPERTS='gpu': not one of its values"):
        device_engine(device_moe, COLI_VK_CPU_MOE=-1, COLI_VK_PROMPT_EXPERTS="gpu")


def test_prompt_experts_default_follows_the_device(device_moe, monkeypatch):
    """COLI_VK_PROMPT_EXPERTS unset: cpu on a device that reads the CPU's RAM (Lavapipe is type cpu: its chunks' pairs
    stay the CPU's), auto on a discrete GPU (its own memory: streaming pays from COLI_VK_STREAM_ROWS rows); a value
    set wins on either."""
    monkeypatch.delenv("COLI_VK_PROMPT_EXPERTS", raising=False)
    dev = device_engine(device_moe, COLI_VK_CPU_MOE=-1)
    try:
        dl = dev.model.device_layers
        assert dl.prompt_experts == ("cpu" if dl.dev.type_name == "cpu" else "auto")
        monkeypatch.setattr(dl.dev, "type_name", "discrete")
        dl._settings()
        assert dl.prompt_experts == "auto"
        monkeypatch.setenv("COLI_VK_PROMPT_EXPERTS", "cpu")
        if dl._env is not None:
            monkeypatch.setattr(dl, "_env", dict(dl._env, COLI_VK_PROMPT_EXPERTS="cpu"))
        dl._settings()
        assert dl.prompt_experts == "cpu"
    finally:
        dev.close()
