"""scripts/bench_vs_llamacpp.py against a stand-in llama-bench (a script with llama-bench's JSON output that dies
of SIGILL in its prompt test unless given --repack 0, as a GGML_NATIVE build does in AMX code on some VMs):
the retry with --repack 0, the note saying so, the alternation, the table and the JSON's ratios."""
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FIX = ROOT / "tests" / "fixtures" / "oracles" / "olmoe.gguf"

FAKE = r'''#!/usr/bin/env python3
import json, os, signal, sys
a = sys.argv[1:]
open(os.environ["FAKE_LOG"], "a").write(" ".join(a) + "\n")
pp = a[a.index("-p") + 1] != "0"
if pp and "--repack" not in a:
    os.kill(os.getpid(), signal.SIGILL)
n = int(a[a.index("-p") + 1]) if pp else int(a[a.index("-n") + 1])
print(json.dumps([{"avg_ts": 400.0 if pp else 50.0, "n_prompt": n if pp else 0, "n_gen": 0 if pp else n}]))
'''


def test_sigill_rerun_with_repack_0_and_the_table(tmp_path):
    fake = tmp_path / "llama-bench"
    fake.write_text(FAKE)
    fake.chmod(0o755)
    out = tmp_path / "r.json"
    env = dict(os.environ, FAKE_LOG=str(tmp_path / "calls.log"))
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_vs_llamacpp.py"), "-m", str(FIX), "-t", "1",
                        "-p", "8", "-n", "4", "-r", "1", "--rounds", "2", "--llama-bench", str(fake),
                        "--json", str(out)], capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "illegal instruction" in r.stderr and "--repack 0" in r.stderr
    calls = (tmp_path / "calls.log").read_text().splitlines()
    assert len(calls) == 6                       # per round: pp (SIGILL), pp --repack 0, tg
    assert sum("--repack 0" in c for c in calls) == 2
    d = json.loads(out.read_text())
    row = d["rows"][0]
    assert row["llama_pp"] == 400.0 and row["llama_tg"] == 50.0
    assert row["coli_tg"] > 0 and row["ratio_tg"] == row["coli_tg"] / 50.0
    assert any("SIGILL" in n for n in row["notes"])
    assert [x["engine"] for x in d["raw"]] == ["llama.cpp", "coli", "coli", "llama.cpp"]   # alternating
    assert "| olmoe | 1 |" in r.stdout and "SIGILL, rerun with --repack 0" in r.stdout
