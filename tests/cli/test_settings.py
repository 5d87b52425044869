"""coli/base/settings.py: every COLI_* variable the code names is declared there and documented, none is read
from os.environ anywhere else, one parser with one error style naming the variable, and the flags pass their
values down (the environment untouched)."""
from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from conftest import ROOT

from coli.base import settings
from coli.base.errors import ColiError

CODE = [p for d in ("coli", "scheduler", "cpu_kernels", "tests", "scripts") for p in (ROOT / d).rglob("*.py")]


def test_every_variable_declared_and_documented():
    """The COLI_* names in the source (grep) are exactly the declared ones; docs/settings.md holds the
    generated table as it is now."""
    found = set()
    for p in CODE:
        found |= set(re.findall(r"\bCOLI_[A-Z0-9_]*[A-Z0-9]\b", p.read_text(encoding="utf-8")))
    found -= {"COLI_FIELDS"}  # a list in coli/bench.py, not a variable
    assert found == set(settings.BY_NAME)
    doc = (ROOT / "docs" / "settings.md").read_text(encoding="utf-8")
    assert settings.markdown_table() in doc


def test_read_only_through_settings():
    """No module of the package reads a COLI_* variable from os.environ itself (tests set them; scripts/
    print them in their logs)."""
    pat = re.compile(r"environ(\.get)?[\[(]\s*['\"]COLI_|getenv\(\s*['\"]COLI_")
    offenders = [str(p.relative_to(ROOT)) for p in CODE
                 if p.relative_to(ROOT).parts[0] in ("coli", "scheduler", "cpu_kernels") and p.name != "settings.py"
                 and pat.search(p.read_text(encoding="utf-8"))]
    assert offenders == []


@pytest.mark.parametrize("raw,want", [("1", True), ("0", False), ("yes", True), ("OFF", False), (" true ", True)])
def test_bool(raw, want):
    assert settings.get("COLI_VK_TIER_SYNC", {"COLI_VK_TIER_SYNC": raw}) is want


def test_defaults_numbers_and_errors():
    """Unset or empty: the default; numbers parsed; a bad or out-of-range value is one ColiError naming the
    variable and its value (a digit separator or another script's digits too: COLI_MEM=1_0 ran with 10 GiB)."""
    assert settings.get("COLI_VK_TIER_RATE", {}) == 16
    assert settings.get("COLI_VK_TIER_RATE", {"COLI_VK_TIER_RATE": ""}) == 16
    assert settings.get("COLI_VK_TIER_RATE", {"COLI_VK_TIER_RATE": "4"}) == 4
    assert settings.get("COLI_VK_TIER_GB", {"COLI_VK_TIER_GB": "1.5"}) == 1.5
    assert settings.get("COLI_VK_TIER_GB", {}) is None
    for name, raw, why in (("COLI_VK_TIER_RATE", "x", "not an integer"), ("COLI_VK_TIER_RATE", "-1", "out of range"),
                           ("COLI_VK_TIER_GB", "lots", "not a number"), ("COLI_VK_TIER_GB", "nan", "not finite"),
                           ("COLI_VK_TIER_SYNC", "2", "not a yes/no value"), ("COLI_VK_DEV", "-2", "out of range"),
                           # Python's int() / float() read these as 16, 10 and 10: not what a user meant, nor C's
                           ("COLI_VK_TIER_RATE", "1_6", "not an integer"), ("COLI_MEM", "1_0", "not a number"),
                           ("COLI_MEM", "\u0661\u0660", "not a number")):
        with pytest.raises(ColiError, match=rf"^{name}='{re.escape(raw)}': {why} \("):
            settings.get(name, {name: raw})


def test_tier_and_device_readers_use_the_one_parser():
    """The tier's budget rule and the device's knobs go through settings (same message)."""
    from scheduler.tier_policy import DeviceMemory, budget_bytes

    with pytest.raises(ColiError, match=r"^COLI_VK_TIER_GB='lots': not a number \(a number >= 0, GiB"):
        budget_bytes(DeviceMemory("d", "discrete", 2 << 30), 0, 0, env={"COLI_VK_TIER_GB": "lots"})


def test_overlay_flags_leave_environment_alone():
    """overlay: flags on top of the environment (checked), os.environ itself unchanged."""
    before = dict(os.environ)
    env = settings.overlay(None, COLI_VK_DEV=1, COLI_VK_TIER_GB=0.5, COLI_VK_TIER_SYNC=True, COLI_VK_TIER_RATE=None)
    assert settings.get("COLI_VK_DEV", env) == 1 and settings.get("COLI_VK_TIER_GB", env) == 0.5
    assert settings.get("COLI_VK_TIER_SYNC", env) is True
    assert dict(os.environ) == before
    with pytest.raises(ColiError, match="^COLI_VK_TIER_GB="):
        settings.overlay({}, COLI_VK_TIER_GB=-1)


def test_cli_bad_variable_is_one_error():
    """A malformed variable stops any command before work: one line naming it, status 2."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), COLI_VK_TIER_RATE="many")
    r = subprocess.run([sys.executable, "-m", "coli", "models"], capture_output=True, text=True, env=env, cwd=ROOT,
                       timeout=120)
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.startswith("coli: COLI_VK_TIER_RATE='many': not an integer") and r.stderr.count("\n") == 1


@pytest.mark.parametrize("name,raw,values", [("COLI_VK_ZERO_COPY", "yes", "auto, on or off"),
                                             ("COLI_VK_PROMPT_TILE", "48", "32 or 64, rows"),
                                             ("COLI_CACHE_TYPE_K", "q4_0", "f32, f16, bf16 or q8_0")])
def test_a_value_not_among_the_few_a_variable_takes_is_one_error_before_work(name, raw, values):
    """A variable that takes a few values (text or numbers): another is refused with the others, before any work,
    even where nothing reads it (no device here); before, `coli run` ran on and only a device (or a model's load)
    found it."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), **{name: raw})
    r = subprocess.run([sys.executable, "-m", "coli", "models"], capture_output=True, text=True, env=env, cwd=ROOT,
                       timeout=120)
    assert (r.returncode, r.stdout) == (2, ""), r.stdout
    assert r.stderr == f"coli: {name}={raw!r}: not one of its values ({values}; docs/settings.md)\n", r.stderr
    last = settings.BY_NAME[name].choices[-1]
    assert settings.get(name, {name: str(last).upper()}) == last  # text in any case


def test_device_flags_parsed(capsys):
    """--device vulkan:N, --tier-gb and --reproducible are checked before a model loads."""
    from coli.cli import main

    for argv, msg in ((["--device", "vulkan:x"], "--device vulkan:x: N is a device number"),
                      (["--tier-gb", "-1"], "--tier-gb: -1.0"),
                      (["--reproducible", "--balance"], "--reproducible runs without the balancer"),
                      (["--device", "gpu"], "--device: 'gpu'")):
        assert main(["run", "-m", "smollm2", "-p", "x", *argv]) == 2
        assert msg in capsys.readouterr().err


def test_tier_flags_open_the_device(capsys, monkeypatch):
    """--balance, --no-balance, --reproducible and --tier-gb each open the device tier (as --device vulkan does), with
    their balancer setting; with --device cpu each is an error naming the flag, before a model loads (a --tier-gb
    without the device was ignored without a word)."""
    import coli.engine
    from coli.cli import main

    for flag in ("--balance", "--no-balance", "--reproducible", "--tier-gb 1"):
        assert main(["run", "-m", "smollm2", "-p", "x", "--device", "cpu", *flag.split()]) == 2
        assert f"{flag.split()[0]} needs the device: drop --device cpu" in capsys.readouterr().err
    seen = []

    class Opened(Exception):
        pass

    def fake_engine(path, **kw):
        seen.append((kw["device"], kw["balance"]))
        raise Opened

    monkeypatch.setattr(coli.engine, "Engine", fake_engine)
    for flag in ("--balance", "--no-balance", "--reproducible", "--tier-gb 1"):
        with pytest.raises(Opened):
            main(["run", "-m", "smollm2", "-p", "x", *flag.split()])
    assert seen == [("vulkan", True), ("vulkan", False), ("vulkan", False), ("vulkan", None)]


def test_flags_reach_the_tier(tmp_path):
    """On the device (Lavapipe here): --tier-gb sets the tier's budget, --reproducible its sync and no balancer,
    passed down through Engine(env=...), not through os.environ; the device did the work."""
    from tiny_moe import build_tiny_moe

    from coli.engine import Engine

    path = build_tiny_moe(tmp_path)
    gb = 0.0001
    env = settings.overlay(None, COLI_VK_TIER_GB=gb, COLI_VK_TIER_SYNC=True)
    with Engine(path, device="vulkan", balance=False, env=env, save_usage=False, ctx=32) as eng:
        if eng.tier is None:
            pytest.skip("no Vulkan device opens here")
        assert eng.tier.budget == int(gb * (1 << 30)) and eng.tier.sync
        assert not eng.tier.balancer.enabled
        eng.generate(ids=[1, 2, 3], max_tokens=4, stop_at_eos=False)
        assert eng.device.dispatches > 0
    assert "COLI_VK_TIER_GB" not in os.environ


def test_an_unknown_coli_variable_is_one_warning_naming_the_closest(capsys, monkeypatch):
    """A COLI_* name coli does not read (a typo) was ignored in silence: now one warning line naming it and the
    closest declared name (difflib), once per process, and the command runs (exit 0)."""
    from coli.cli import main

    typo, far = "COLI_" + "MEMORY", "COLI_" + "ZZZZZZZZZZZZZ"   # spelled apart: not names the first test finds
    monkeypatch.setattr(settings, "_warned", set())
    for name in (typo, far, "coli_ubatch"):
        monkeypatch.setenv(name, "4")
    for _ in range(2):
        assert main(["models"]) == 0
    err = [l for l in capsys.readouterr().err.splitlines() if "warning" in l]
    tail = "; ignored (docs/settings.md)"
    assert err == [f"coli: warning: {typo} is not a variable coli reads (did you mean COLI_MEM?){tail}",
                   f"coli: warning: {far} is not a variable coli reads{tail}",
                   f"coli: warning: coli_ubatch is not a variable coli reads (did you mean COLI_UBATCH?){tail}"]


def test_a_variable_that_takes_a_few_values_is_checked_by_settings_alone():
    """The readers of a variable with ``choices`` (the device layers' prompt route, tile, DeltaNet form and columns,
    zero-copy, placement) each refused a value outside them with words of their own, after settings had refused it
    already: dead code. None is left in coli/ or scheduler/ (cpu_kernels/: an edit there recompiles every kernel)."""
    raises = re.compile(r'ColiError\(f"(COLI_[A-Z0-9_]+)=\{[^}]*\}: ([^"(]*)')
    dead = []
    for p in CODE:
        if p.relative_to(ROOT).parts[0] in ("coli", "scheduler") and p.name != "settings.py":
            for name, words in raises.findall(p.read_text(encoding="utf-8")):
                choices = settings.BY_NAME[name].choices
                if choices and all(re.search(rf"\b{re.escape(str(c))}\b", words) for c in choices):
                    dead.append(f"{p.relative_to(ROOT)}: {name}")
    assert dead == []
