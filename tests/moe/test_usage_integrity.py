"""The routing history is the user's data: a file coli did not write is never overwritten; concurrent runs
keep each other's counts (re-read under a lock, add only this run's); routing is committed per finished
step (exact invariant: sum(counts) == tokens x top-k x MoE layers)."""
from __future__ import annotations

import json
import multiprocessing as mp
import subprocess
import sys

import numpy as np
import pytest

from coli.base.errors import ColiError
from scheduler import usage as U

from conftest import ROOT


@pytest.fixture
def model(tmp_path):
    p = tmp_path / "m.gguf"
    p.write_bytes(b"GGUF" + bytes(60))
    return p


def test_usage_flag_on_a_text_file_is_refused(model, tmp_path):
    """The issue's example: ``--usage notes.txt`` is refused, the file keeps its bytes."""
    f = tmp_path / "notes.txt"
    f.write_text("my notes\n")
    with pytest.raises(ColiError, match=r"--usage .*notes.txt: not a coli routing history"):
        U.Usage.open(model, 2, 2, path=f)
    assert f.read_text() == "my notes\n"


@pytest.mark.parametrize("content", ['{"format": "other-app", "models": {}}', '{"format": "coli_usage", "version": 7, "models": {}}',
                                     "[1, 2, 3]", "\xff\xfe binary"])
def test_other_json_and_future_versions_are_refused(model, tmp_path, content):
    """Second case: JSON that is not ours (another app's, a later coli version's, a list, not UTF-8)."""
    f = tmp_path / "h.json"
    f.write_bytes(content.encode("latin-1"))
    with pytest.raises(ColiError, match="not a coli routing history"):
        U.Usage.open(model, 2, 2, path=f)
    assert f.read_bytes() == content.encode("latin-1")


def test_file_replaced_by_a_non_history_before_save_is_not_overwritten(model, tmp_path):
    p = tmp_path / "h.coli_usage"
    u = U.Usage.open(model, 2, 2, path=p)
    u.add(0, np.array([[0, 1]])); u.add_tokens(1)
    p.write_text("someone else's file")
    with pytest.raises(ColiError, match="not overwritten"):
        u.save()
    assert p.read_text() == "someone else's file"


def test_two_runs_at_once_keep_both_counts(model, tmp_path):
    """The issue's example, interleaved by hand: both load the same history, both save; the file holds the
    sum (the later save used to write its whole view and lose the earlier run's counts)."""
    p = tmp_path / "h.coli_usage"
    a = U.Usage.open(model, 2, 3, path=p)
    b = U.Usage.open(model, 2, 3, path=p)
    a.add(0, np.array([[0, 1]])); a.add(1, np.array([[2, 2]])); a.add_tokens(1)
    b.add(0, np.array([[1, 1], [1, 2]])); b.add_tokens(2)
    a.save()
    b.save()
    ent = json.loads(p.read_text())["models"]["m.gguf"]
    assert ent["tokens"] == 3 and ent["counts"] == [[1, 4, 1], [0, 0, 2]]
    a.add(0, np.array([[0, 0]])); a.add_tokens(1)
    a.save()  # a second save adds only what came since the first
    ent = json.loads(p.read_text())["models"]["m.gguf"]
    assert ent["tokens"] == 4 and ent["counts"] == [[3, 4, 1], [0, 0, 2]]


def _hammer(args):
    model, path, k, rounds = args
    for _ in range(rounds):
        u = U.Usage.open(model, 1, 4, path=path)
        u.add(0, np.array([[k, k]])); u.add_tokens(1)
        u.save()
    return rounds


def test_concurrent_processes_lose_nothing(model, tmp_path):
    """Second case, real processes: 4 writers x 15 load-add-save rounds; every count arrives."""
    p = tmp_path / "h.coli_usage"
    with mp.get_context("fork").Pool(4) as pool:
        done = pool.map(_hammer, [(model, p, k, 15) for k in range(4)])
    ent = json.loads(p.read_text())["models"]["m.gguf"]
    assert sum(done) == 60 and ent["tokens"] == 60 and ent["counts"] == [[30, 30, 30, 30]]


def test_staged_routing_without_a_finished_step_is_not_counted(model, tmp_path):
    p = tmp_path / "h.coli_usage"
    u = U.Usage.open(model, 2, 2, path=p)
    u.add(0, np.array([[0, 1]])); u.add(1, np.array([[1, 1]])); u.add_tokens(1)
    u.add(0, np.array([[1, 1]]))  # the next step stopped after layer 0
    u.save()
    ent = json.loads(p.read_text())["models"]["m.gguf"]
    assert ent["tokens"] == 1 and ent["counts"] == [[1, 1], [0, 2]]


def test_interrupted_token_leaves_no_half_counted_routing(demo_path, tmp_path):
    """Ctrl-C in the middle of a decode step (inside layer 14 of 30): the saved history still holds
    sum(counts) == tokens x top-k x MoE layers, exactly."""
    from coli.engine import Engine

    p = tmp_path / "h.coli_usage"
    eng = Engine(demo_path, usage=p, expert_cache=8, cpu_act="f32")
    calls = {"n": 0}
    run = eng.step.run
    n_moe = len(eng.model.moe_layers)

    def cut(layer, *a, **k):
        calls["n"] += 1
        if calls["n"] == 3 * n_moe + 14:  # prefill, 2 decode steps, then 14 layers into the next
            raise KeyboardInterrupt
        return run(layer, *a, **k)

    eng.step.run = cut
    with pytest.raises(KeyboardInterrupt):
        eng.generate("Once upon a time", max_tokens=10)
    eng.close()
    ent = json.loads(p.read_text())["models"][demo_path.name]
    assert ent["tokens"] > 0 and sum(map(sum, ent["counts"])) == ent["tokens"] * eng.args.top_k * n_moe


def test_cli_usage_on_a_text_file(demo_path, tmp_path):
    f = tmp_path / "notes.txt"
    f.write_text("keep me")
    r = subprocess.run([sys.executable, "-m", "coli", "run", "-m", str(demo_path), "-p", "hi", "-n", "2",
                        "--usage", str(f)], capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert r.returncode == 2 and "not a coli routing history" in r.stderr and "Traceback" not in r.stderr
    assert f.read_text() == "keep me"
