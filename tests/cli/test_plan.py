"""``coli plan`` against a real run: the plan's dense bytes, KV cache, RAM expert cache, device budget and
cold-cache disk bytes per token equal what the engine sets up and reads on the same model."""
from __future__ import annotations

import json
import subprocess
import sys

import gguf
import pytest

from coli.base.errors import ColiError
from coli.plan import make_plan
from tiny_moe import ROOT, build_tiny_moe
from vk_util import requires_vulkan


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny_moe(tmp_path_factory.mktemp("plan"))


def test_plan_sizes_from_the_header(tiny):
    p = make_plan(tiny, ctx=32)
    r = gguf.GGUFReader(tiny)  # oracle: gguf-py's reading of the same header
    exps = [t for t in r.tensors if "_exps" in t.name]
    assert p["expert_bytes_total"] == sum(int(t.n_bytes) for t in exps)
    assert p["dense_bytes"] == sum(int(t.n_bytes) for t in r.tensors if "_exps" not in t.name)
    assert p["expert_bytes_per_layer"] == [sum(int(t.n_bytes) for t in exps if t.name.startswith(f"blk.{l}."))
                                           for l in range(2)]
    assert p["expert_bytes"] * 4 == p["expert_bytes_per_layer"][0]
    assert (p["moe_layers"], p["n_experts"], p["top_k"], p["total_experts"]) == (2, 4, 2, 8)
    # cold decode token: top-2 of 4 experts in each of the 2 layers, all from disk
    assert p["cold_disk_bytes_per_token"] == 2 * 2 * p["expert_bytes"]


def test_plan_matches_a_real_run(tiny, tmp_path):
    from coli.engine import Engine

    p = make_plan(tiny, ctx=32, expert_cache=3)
    eng = Engine(tiny, ctx=32, expert_cache=3, usage=str(tmp_path / "usage"), save_usage=False)
    try:
        assert p["dense_bytes"] == eng.model.dense_bytes
        assert p["kv_cache_bytes"] == eng.model.new_cache(eng.ctx).nbytes()
        assert p["ram_cache_slots"] == eng.expert_slots == 3
        assert p["ram_cache_bytes"] == eng.ram_cache_bytes
        # an expert as the cache holds it: the plan's measure is what a load holds
        assert p["expert_held_bytes"] == eng.cache.source.held_nbytes(0) == eng.cache.source.load(0, 1).nbytes
        assert p["expert_held_ratio"] == round(p["expert_held_bytes"] / p["expert_bytes"], 3)
        assert p["streamed_experts"] == 2 * (4 - 3) and p["streams_from_disk"]
        # one token from an empty RAM cache: what the plan predicts is read from disk, byte for byte
        r = eng.generate(ids=[5], max_tokens=1)
        assert r.stats["disk_loads"] == 2 * 2
        assert r.stats["bytes_read"] == p["cold_disk_bytes_per_token"]
    finally:
        eng.close()
    dflt = make_plan(tiny)  # default: every expert fits half the RAM
    assert dflt["ram_cache_slots"] == 4 and not dflt["streams_from_disk"] and dflt["steady_disk_bytes_per_token"] == 0


def test_plan_device_budget_is_the_tiers_rule(tiny, monkeypatch):
    from coli.base import memory
    from scheduler.tier_policy import DeviceMemory, budget_bytes

    monkeypatch.setattr(memory, "RAM_RESERVE_SHARE", 0.0)   # the budget is the 16 GiB available, whatever the RAM
    GiB = 1 << 30
    dev = DeviceMemory("test iGPU", "integrated", 8 * GiB)
    p = make_plan(tiny, device="vulkan", device_info=dev, available=16 * GiB, env={})
    want, rule = budget_bytes(dev, p["ram_cache_bytes"], p["dense_bytes"], env={}, available=16 * GiB)
    assert p["device_budget_bytes"] == want and p["device_budget_rule"] == rule
    assert p["device_experts"] == min(8, want // p["expert_bytes"]) == 8
    # a budget of 3 experts: the RAM cache (3 slots a layer) and the device leave 8 - 6 - 3 < 0 to stream
    env = {"COLI_VK_TIER_GB": str(3 * p["expert_bytes"] / GiB)}
    p = make_plan(tiny, device="vulkan", device_info=dev, expert_cache=2, env=env)
    assert p["device_experts"] == 3 and p["streamed_experts"] == 8 - 4 - 3
    assert p["cold_disk_bytes_per_token_device"] == round(p["cold_disk_bytes_per_token"] * (1 - 3 / 8))


def test_plan_cli_table_json_and_errors(tiny, tmp_path):
    r = subprocess.run([sys.executable, "-m", "coli", "plan", "-m", str(tiny), "--ctx", "64", "--json"],
                       capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["kv_cache_bytes"] == 2 * 2 * 2 * 64 * 32 * 4
    r = subprocess.run([sys.executable, "-m", "coli", "plan", "-m", str(tiny)], capture_output=True, text=True,
                       cwd=ROOT, timeout=300)
    assert r.returncode == 0 and "| RAM expert cache" in r.stdout and "streams from disk" in r.stdout
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF\x03\x00\x00\x00")
    for args in (["-m", str(bad)], ["-m", str(tmp_path / "none.gguf")], ["-m", str(tiny), "--ctx", "-1"]):
        r = subprocess.run([sys.executable, "-m", "coli", "plan", *args], capture_output=True, text=True, cwd=ROOT,
                           timeout=300)
        assert r.returncode == 2 and r.stderr.startswith("coli: ") and "Traceback" not in r.stderr, r.stderr
    with pytest.raises(ColiError, match="--expert-cache"):
        make_plan(tiny, expert_cache=-1)
    # -m takes the names coli run takes (coli.resolve.resolve); an unknown one lists them
    from coli.fetch import model_path

    r = subprocess.run([sys.executable, "-m", "coli", "plan", "-m", "smollm2", "--json"], capture_output=True,
                       text=True, cwd=ROOT, timeout=300)
    assert r.returncode == 0 and json.loads(r.stdout)["path"] == str(model_path("smollm2")), r.stderr
    r = subprocess.run([sys.executable, "-m", "coli", "plan", "-m", "llama-9000"], capture_output=True, text=True,
                       cwd=ROOT, timeout=300)
    assert r.returncode == 2 and "llama-9000: no such file" in r.stderr and "smollm2" in r.stderr, r.stderr


@requires_vulkan
def test_plan_device_matches_the_engine_on_lavapipe(tiny, tmp_path, monkeypatch):
    """With the device: the plan's budget and expert count equal the tier the engine opens (same rule)."""
    from coli.engine import Engine

    p0 = make_plan(tiny, ctx=16)
    GiB = 1 << 30
    monkeypatch.setenv("COLI_VK_TIER_GB", repr(5 * p0["expert_bytes"] / GiB))  # room for 5 experts
    p = make_plan(tiny, device="vulkan", ctx=16, expert_cache=2)
    if p.get("device_budget_bytes") is None:
        pytest.fail("no Vulkan device opened for the plan (Lavapipe is expected here)")
    eng = Engine(tiny, ctx=16, expert_cache=2, device="vulkan", usage=str(tmp_path / "usage"), save_usage=False)
    try:
        assert eng.tier is not None
        assert p["device_budget_bytes"] == eng.tier.budget
        assert p["device_experts"] == min(8, eng.tier.budget_experts) == 5
        assert p["device"] == eng.tier.device_name
        assert p["streamed_experts"] == 0  # 2 x 2 RAM slots + 5 on the device cover the 8 experts
    finally:
        eng.close()


@requires_vulkan
def test_plan_device_index_as_coli_run_takes_it(tiny, capsys):
    """``coli plan --device vulkan:N`` takes the device number ``coli run`` takes (and the no-GPU line suggests):
    vulkan:0 is Lavapipe here, the same plan as --device vulkan; a device number there is not is one line naming
    the flag, exit 2; a malformed one too."""
    from coli.cli import main

    args = ["plan", "-m", str(tiny), "--ctx", "16", "--json"]
    assert main([*args, "--device", "vulkan"]) == 0
    want = json.loads(capsys.readouterr().out)
    assert main([*args, "--device", "vulkan:0"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["device"] == want["device"] is not None and got["device_budget_bytes"] == want["device_budget_bytes"]
    assert main([*args, "--device", "vulkan:7"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("coli: --device vulkan:7: no device 7"), err     # the flag named once
    assert main([*args, "--device", "vulkan:x"]) == 2
    assert "--device vulkan:x: N is a device number" in capsys.readouterr().err


def test_plan_under_a_memory_budget(tiny):
    """``COLI_MEM`` below what coli itself holds: the plan says the budget and its source, and that the engine would
    refuse the model (``dense_fits``) as the engine does."""
    p = make_plan(tiny, ctx=32, env={"COLI_MEM": "0.1"})
    assert p["budget_bytes"] == int(0.1 * (1 << 30)) and p["budget_source"] == "COLI_MEM=0.1"
    assert not p["dense_fits"] and not p["fits_ram"]
    with pytest.raises(ColiError, match="its dense weights .* need a memory budget of"):
        from coli.engine import Engine

        Engine(tiny, ctx=32, env={"COLI_MEM": "0.1"}, save_usage=False)


def test_plan_reads_a_hugging_face_folder_as_run_does(tmp_path):
    """``coli plan -m DIR`` takes the Hugging Face folder ``coli run -m DIR`` reads (it refused it: not a GGUF): the
    plan's dense bytes, KV cache, expert bytes and RAM expert cache equal what the engine sets up on the folder."""
    from conftest import FIXTURES
    from coli.engine import Engine

    folder = FIXTURES / "oracles" / "fp8_qwen3moe"
    p = make_plan(folder, ctx=32, expert_cache=3)
    with Engine(folder, ctx=32, expert_cache=3, usage=str(tmp_path / "usage"), save_usage=False) as eng:
        assert (p["arch"], p["moe_layers"], p["n_experts"]) == (eng.args.arch, len(eng.model.moe_layers),
                                                               eng.args.n_experts)
        assert p["dense_bytes"] == eng.model.dense_bytes
        assert p["kv_cache_bytes"] == eng.model.new_cache(eng.ctx).nbytes()
        assert p["ram_cache_slots"] == eng.expert_slots == 3 and p["ram_cache_bytes"] == eng.ram_cache_bytes
        assert p["expert_bytes"] == max(eng.cache.source.expert_nbytes(l) for l in eng.model.moe_layers)
    r = subprocess.run([sys.executable, "-m", "coli", "plan", "-m", str(folder), "--ctx", "32"], cwd=ROOT,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and f"| model " in r.stdout and "fp8_qwen3moe (qwen3moe, 2 layers" in r.stdout, r.stderr


def test_mla_prompt_scratch_is_counted_in_the_budget(tiny, tmp_path):
    """A model with MLA layers (the DeepSeek-V2 oracle) has its prompt chunks' expanded keys and values
    (``mla.expand_scratch_bytes`` at the run's context: its heads' share of ``EXPAND_BYTES``) counted in the plan's
    RAM need, beside coli, the dense part, the caches and the headroom, and in the engine's room (the same bytes);
    a model without MLA counts none."""
    from coli.engine import Engine
    from coli.gguf_file import open_gguf
    from coli.models import model_args
    from coli.models.mla import expand_scratch_bytes
    from coli.runtime import headroom
    from conftest import FIXTURES

    path = FIXTURES / "oracles" / "deepseek2_lite.gguf"
    _, a = model_args(open_gguf(path))
    want = expand_scratch_bytes(a.n_heads, a.nope, a.n_rot, a.v_dim, 64)
    assert want == min(a.n_heads * 4 * 64 * (a.nope + a.n_rot + a.v_dim + max(a.nope, a.v_dim)), 64 << 20) > 0
    p = make_plan(path, ctx=64)
    assert p["scratch_bytes"] == want
    assert p["ram_needed_bytes"] == (p["coli_bytes"] + p["dense_bytes"] + p["ram_cache_bytes"] - p["ram_cache_kv_bytes"]
                                     + p["kv_cache_bytes"] + want + headroom(p["budget_bytes"]))
    eng = Engine(path, ctx=64, usage=str(tmp_path / "usage"), save_usage=False)
    try:
        assert eng.scratch_bytes == want
    finally:
        eng.close()
    assert make_plan(tiny, ctx=64)["scratch_bytes"] == 0
