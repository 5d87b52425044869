"""scripts/bench/vs_llamacpp.py against stand-in llama-bench binaries (scripts with llama-bench's JSON output):
llama.cpp's dies of SIGILL in its prompt tests unless given --repack 0, as a GGML_NATIVE build does in AMX code
on some VMs; ik_llama.cpp's never gets that retry (its llama-bench has no --repack). Checked: the retry and the
note saying so, every prompt length run, the rotation of the three engines over the rounds, the table and the
JSON's ratios."""
import json
import os
import subprocess
import sys

from conftest import ROOT

FIX = ROOT / "tests" / "fixtures" / "oracles" / "olmoe.gguf"

FAKE = r'''#!/usr/bin/env python3
import json, os, signal, sys
a = sys.argv[1:]
ik = "ik" in os.path.basename(sys.argv[0])
open(os.environ["FAKE_LOG"], "a").write(("ik " if ik else "llama ") + " ".join(a) + "\n")
pp = a[a.index("-p") + 1] != "0"
if pp and not ik and "--repack" not in a:
    os.kill(os.getpid(), signal.SIGILL)
n = int(a[a.index("-p") + 1]) if pp else int(a[a.index("-n") + 1])
ts = (800.0 if ik else 400.0) + n if pp else (60.0 if ik else 50.0)
print(json.dumps([{"avg_ts": ts, "n_prompt": n if pp else 0, "n_gen": 0 if pp else n}]))
'''


def test_peers_prompt_lengths_sigill_retry_rotation_and_the_table(tmp_path):
    for name in ("llama-bench", "ik-llama-bench"):
        (tmp_path / name).write_text(FAKE)
        (tmp_path / name).chmod(0o755)
    out = tmp_path / "r.json"
    env = dict(os.environ, FAKE_LOG=str(tmp_path / "calls.log"))
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench" / "vs_llamacpp.py"), "-m", str(FIX), "-t", "1",
                        "-p", "8,16", "-n", "4", "-r", "1", "--rounds", "3", "--llama-bench",
                        str(tmp_path / "llama-bench"), "--ik-bench", str(tmp_path / "ik-llama-bench"),
                        "--json", str(out)], capture_output=True, text=True, env=env, timeout=1800)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "illegal instruction" in r.stderr and "--repack 0" in r.stderr
    calls = (tmp_path / "calls.log").read_text().splitlines()
    llama = [c for c in calls if c.startswith("llama ")]
    ik = [c for c in calls if c.startswith("ik ")]
    assert len(llama) == 3 * 5        # per round: pp8 (SIGILL), pp8 --repack 0, pp16 (SIGILL), pp16 --repack 0, tg4
    assert sum("--repack 0" in c for c in llama) == 3 * 2
    assert len(ik) == 3 * 3 and not any("--repack" in c for c in ik)   # pp8, pp16, tg4; never retried
    assert sum("-p 16 -n 0" in c for c in ik) == 3
    d = json.loads(out.read_text())
    rows = {x["test"]: x for x in d["rows"]}
    assert sorted(rows) == ["pp16", "pp8", "tg4"]
    assert rows["pp8"]["llama.cpp"] == 408.0 and rows["pp16"]["ik_llama.cpp"] == 816.0
    assert rows["tg4"]["llama.cpp"] == 50.0 and rows["tg4"]["ik_llama.cpp"] == 60.0
    for x in rows.values():
        assert x["coli"] > 0 and x["coli/ik_llama.cpp"] == x["coli"] / x["ik_llama.cpp"]
        assert x["coli/llama.cpp"] == x["coli"] / x["llama.cpp"]
    assert any("SIGILL" in n for n in rows["pp8"]["notes"])
    assert [x["engine"] for x in d["raw"]] == ["llama.cpp", "ik_llama.cpp", "coli", "ik_llama.cpp", "coli",
                                               "llama.cpp", "coli", "llama.cpp", "ik_llama.cpp"]   # rotating
    assert "| olmoe | 1 | pp16 |" in r.stdout and "SIGILL, rerun with --repack 0" in r.stdout
    assert "| coli / llama.cpp | coli / ik_llama.cpp |" in r.stdout


def test_n_0_runs_the_prompt_tests_only(tmp_path):
    (tmp_path / "ik-llama-bench").write_text(FAKE)
    (tmp_path / "ik-llama-bench").chmod(0o755)
    out = tmp_path / "r.json"
    env = dict(os.environ, FAKE_LOG=str(tmp_path / "calls.log"))
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench" / "vs_llamacpp.py"), "-m", str(FIX), "-t", "1",
                        "-p", "8", "-n", "0", "-r", "1", "--rounds", "1", "--peers", "ik_llama.cpp", "--ik-bench",
                        str(tmp_path / "ik-llama-bench"), "--json", str(out)],
                       capture_output=True, text=True, env=env, timeout=1800)
    assert r.returncode == 0, r.stderr[-2000:]
    assert (tmp_path / "calls.log").read_text().splitlines() == [
        f"ik -m {FIX} -t 1 -r 1 -o json -p 8 -n 0"]
    d = json.loads(out.read_text())
    assert [x["test"] for x in d["rows"]] == ["pp8"] and d["rows"][0]["ik_llama.cpp"] == 808.0
    coli = [x["run"] for x in d["raw"] if x["engine"] == "coli"][0]
    assert "-n 0" in coli["cmd"] and [k for k in coli if k.startswith(("pp", "tg"))] == ["pp8"]
