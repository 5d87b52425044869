"""Trace events (scheduler/trace.py) and their summary (`coli trace`): valid Chrome-trace JSON,
atomic write, device placement by a calibration, and the hidden % on a hand-made trace."""
import json
import subprocess
import sys
import threading

import pytest

from conftest import FIXTURES, ROOT
from scheduler.trace import Calibration, Trace, intersect, measure, summarize, union


def ev(cat, ts, dur, name=None):
    return {"name": name or cat, "cat": cat, "ph": "X", "ts": ts, "dur": dur, "pid": 1, "tid": 1, "args": {}}


HAND = [
    ev("device", 0, 100), ev("device", 200, 100),          # device busy 200 us
    ev("cpu", 50, 100), ev("cpu", 100, 150),               # cpu busy [50, 250] (overlapping events)
    ev("join", 150, 50), ev("disk", 10, 20), ev("upload", 400, 10),
    {"name": "thread_name", "ph": "M", "pid": 1, "tid": 1, "args": {"name": "x"}},
]


def test_interval_algebra():
    assert union([(5, 6), (0, 2), (1, 3), (3, 4)]) == [(0, 4), (5, 6)]
    assert intersect([(0, 10)], [(2, 3), (5, 12)]) == [(2, 3), (5, 10)]
    assert measure([(0, 2), (1, 3)]) == 3


def test_summary_hidden_percent_on_hand_made_trace():
    s = summarize(HAND)
    assert s["device_us"] == 200 and s["cpu_us"] == 200
    assert s["overlap_us"] == 100                           # [50,100] + [200,250]
    assert s["hidden_pct"] == pytest.approx(50.0)
    assert s["join_overlap_us"] == 0                        # the join [150,200] falls in the device's gap
    assert s["categories"]["cpu"] == {"count": 2, "total_us": 250.0, "busy_us": 200.0}


def test_write_valid_json_atomically_and_thread_safe(tmp_path):
    p = tmp_path / "t.json"
    tr = Trace(p)

    def work(i):
        for j in range(50):
            tr.span(f"expert {j}", "cpu", tr.t0_ns + 1000 * j, tr.t0_ns + 1000 * j + 500, args={"layer": i})

    th = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    [t.start() for t in th]
    [t.join() for t in th]
    with tr.region("read", "disk", layer=1):
        pass
    cal = Calibration(host_ns=tr.t0_ns + 10_000, device_ns=5_000_000)
    tr.device_batch("batch", tr.t0_ns, 2.0, timestamps_ns=(5_001_000, 5_003_000), calibration=cal)
    tr.device_batch("batch2", tr.t0_ns + 50_000, 1.5)
    assert tr.write() == p
    assert [x.name for x in tmp_path.iterdir()] == ["t.json"]   # no temp file left
    evs = json.loads(p.read_text())
    xs = [e for e in evs if e["ph"] == "X"]
    assert len(xs) == 203
    for e in xs:
        assert set(e) >= {"name", "ph", "ts", "dur", "pid", "tid", "args"}
    dev = [e for e in xs if e["cat"] == "device"]
    assert dev[0]["ts"] == pytest.approx(11.0) and dev[0]["dur"] == pytest.approx(2.0)   # placed by timestamps
    assert dev[0]["args"]["placed"] == "timestamps"
    assert dev[1]["ts"] == pytest.approx(50.0) and dev[1]["dur"] == pytest.approx(1500.0)
    assert dev[1]["args"]["placed"] == "submit"
    with pytest.raises(ValueError):
        tr.span("x", "gpu", 0, 1)


def test_disabled_trace_is_a_noop(tmp_path):
    tr = Trace(None)
    tr.span("x", "cpu", 0, 1)
    assert tr.events() == [] and tr.write() is None


def test_coli_trace_summary(tmp_path):
    p = tmp_path / "hand.json"
    p.write_text(json.dumps(HAND))
    r = subprocess.run([sys.executable, "-m", "coli", "trace", str(p)], cwd=ROOT,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "50.0% of device time hidden" in r.stdout
    assert "overlap 0.100 ms" in r.stdout
    what = "coli trace reads the JSON array of events coli run --trace FILE.json writes"
    bad = tmp_path / "bad.json"
    for data, want in [(b"", f"empty (no trace events); {what}"), (b" \n", f"empty (no trace events); {what}"),
                       (b"{", f"not JSON (line 1, column 2); {what}"),
                       (b"hello, not a trace\n", f"not JSON (line 1, column 1); {what}"),
                       (b"\x89PNG\r\n", f"not JSON text (not UTF-8); {what}"),
                       (b'{"a": 1}', f"a JSON dict, not an array of events; {what}"),
                       (b"[1]", f"event 0: a JSON int, not an object; {what}"),
                       (json.dumps(HAND[:1] + [{"ph": "X", "ts": 1}]).encode(),
                        'event 1: a complete event ("ph": "X") needs numbers "ts" and "dur"')]:
        bad.write_bytes(data)
        r = subprocess.run([sys.executable, "-m", "coli", "trace", str(bad)], cwd=ROOT,
                           capture_output=True, text=True, timeout=60)
        assert (r.returncode, r.stdout, r.stderr) == (2, "", f"coli: {bad}: {want}\n")


def test_cpu_only_run_records_disk_reads(tmp_path):
    """--trace without a device: the RAM cache's disk reads are recorded (one "disk" event per expert load,
    the cache's own counter is the oracle)."""
    from coli.engine import Engine
    fix = FIXTURES / "oracles" / "olmoe.gguf"
    p = tmp_path / "cpu.json"
    eng = Engine(fix, threads=1, save_usage=False, quiet=True, usage=str(tmp_path / "none.coli_usage"),
                 trace=str(p))
    try:
        eng.generate(ids=[1, 2, 3, 4], max_tokens=4, temp=0.0)
        loads = eng.cache.loads
    finally:
        eng.close()
    evs = json.loads(p.read_text())
    disk = [e for e in evs if e.get("cat") == "disk"]
    assert eng.tier is None and loads > 0 and len(disk) == loads
    assert all(e["name"] == f"read L{e['args']['layer']} E{e['args']['expert']}" for e in disk)
