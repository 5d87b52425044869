"""Per-step trace: Chrome / Perfetto trace events (``--trace FILE.json``).

The file is a JSON array of complete events (the Chrome Trace Event Format, ``"ph": "X"``)::

    {"name": "expert 3", "cat": "cpu", "ph": "X", "ts": 1234.5, "dur": 87.0, "pid": 4242, "tid": 4243,
     "args": {"layer": 7, "rows": 1}}

``ts`` and ``dur`` are microseconds (float) on the host's monotonic clock (``time.perf_counter_ns``), counted
from the trace's start. Besides the ``X`` events the array holds ``"ph": "M"`` ``thread_name`` metadata events
so Perfetto names the lanes (ui.perfetto.dev or chrome://tracing open the file as is).

Categories (``cat``), one lane (``tid``) each for the device and the uploader, the host threads' native ids
for the rest:

======== ==========================================================================================
cpu      CPU expert work (a step's CPU pairs, the shared expert), recorded by the step
device   one device batch, placed by its own timestamps (see :class:`Calibration`)
disk     a disk read of one expert (the I/O pool)
upload   one expert written to the device (the tier's uploader thread)
join     the engine thread waiting in a batch's join
======== ==========================================================================================

Device time: a batch's timestamps are in the device's clock (nanoseconds, ``VkPhysicalDeviceLimits::
timestampPeriod`` applied). A :class:`Calibration` taken at the batch's submit pairs a host instant with a
device instant (``vkGetCalibratedTimestampsEXT``, or a timestamp the device wrote when the host read its
clock); ``host_us = host_at_calibration_us + (device_ns - device_at_calibration_ns) / 1000``. Without device
timestamps a batch is placed from its submit for its ``device_ms`` and its ``args`` say ``"placed": "submit"``.

Thread-safe: events are appended under a lock from any thread. :meth:`Trace.write` writes atomically (a
temp file in the same folder, then ``os.replace``), so a crash never leaves half a trace.
"""
from __future__ import annotations

from coli.base.paths import atomic_write_text

import json
import os
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

CATEGORIES = ("cpu", "device", "disk", "upload", "join")
DEVICE_TID = 1_000_001
UPLOADER_TID = 1_000_002


def host_ns() -> int:
    """The host clock the trace uses: ``time.perf_counter_ns()`` (monotonic, ns)."""
    return time.perf_counter_ns()


@dataclass(frozen=True)
class Calibration:
    """One host instant and the device instant taken with it (both ns), to place device timestamps.

    ``host_ns`` is on :func:`host_ns`'s clock; ``device_ns`` on the device's timestamp clock in ns.
    """

    host_ns: int
    device_ns: int

    def to_host_ns(self, device_ns: int) -> int:
        """A device timestamp (ns) on the host clock (ns)."""
        return self.host_ns + (int(device_ns) - self.device_ns)


class Trace:
    """Collects trace events in memory; ``enabled`` is False when no path was given (every call is then
    a cheap no-op, so the step can call it unconditionally).

    Times given to :meth:`span` are host ns (:func:`host_ns`); the file holds µs from the trace's start.
    """

    def __init__(self, path: str | os.PathLike | None = None):
        self.path = Path(path) if path else None
        self.enabled = self.path is not None
        self.t0_ns = host_ns()
        self.pid = os.getpid()
        self._events: list[dict] = []
        self._lock = threading.Lock()
        self._named: set[int] = set()
        if self.enabled:
            self._name_lane(DEVICE_TID, "device")
            self._name_lane(UPLOADER_TID, "uploader")

    def _name_lane(self, tid: int, name: str) -> None:
        self._events.append({"name": "thread_name", "ph": "M", "pid": self.pid, "tid": tid,
                             "args": {"name": name}})
        self._named.add(tid)

    def _tid(self) -> int:
        tid = threading.get_native_id()
        if tid not in self._named:
            self._name_lane(tid, threading.current_thread().name)
        return tid

    def span(self, name: str, cat: str, start_ns: int, end_ns: int, tid: int | None = None,
             args: dict | None = None) -> None:
        """Record one complete event from ``start_ns`` to ``end_ns`` (host ns); ``tid`` defaults to the
        calling thread. ``cat`` must be one of :data:`CATEGORIES` (ValueError otherwise)."""
        if not self.enabled:
            return
        if cat not in CATEGORIES:
            raise ValueError(f"trace category {cat!r} is not one of {CATEGORIES}")
        ev = {"name": name, "cat": cat, "ph": "X",
              "ts": (start_ns - self.t0_ns) / 1000.0, "dur": max(0, end_ns - start_ns) / 1000.0,
              "pid": self.pid, "tid": 0, "args": dict(args or {})}
        with self._lock:
            ev["tid"] = self._tid() if tid is None else tid
            self._events.append(ev)

    def complete(self, name: str, cat: str, t0_s: float, t1_s: float, **args) -> None:
        """:meth:`span` with ``time.perf_counter()`` seconds (the same clock as :func:`host_ns`)."""
        if self.enabled:
            self.span(name, cat, int(t0_s * 1e9), int(t1_s * 1e9), args=args)

    def hook_reads(self, cache) -> None:
        """Record every disk read of ``cache`` (scheduler/ram_cache.py's ``RAMCache``: its ``on_read(layer, e,
        t0_s, t1_s)`` hook, called from the I/O pool) as a ``disk`` event ``read L<layer> E<e>``. The step
        installs it when the run has a trace, so CPU-only runs record their reads too. No-op when disabled
        or when the cache already has a hook."""
        if self.enabled and cache is not None and getattr(cache, "on_read", None) is None:
            cache.on_read = lambda l, e, t0, t1: self.complete(f"read L{l} E{e}", "disk", t0, t1,
                                                               layer=l, expert=e)

    @contextmanager
    def region(self, name: str, cat: str, **args):
        """``with trace.region("expert 3", "cpu", layer=7): ...`` records the block's span."""
        if not self.enabled:
            yield
            return
        t = host_ns()
        try:
            yield
        finally:
            self.span(name, cat, t, host_ns(), args=args)

    def device_batch(self, name: str, submit_ns: int, device_ms: float, timestamps_ns=None,
                     calibration: Calibration | None = None, args: dict | None = None) -> None:
        """Place one device batch on the device lane.

        ``timestamps_ns``: ``(begin, end)`` device ns of the batch (its first and last timestamp) and
        ``calibration`` the pair taken at its submit: the span is placed by them. Otherwise the span starts
        at ``submit_ns`` and lasts ``device_ms`` (``args["placed"] = "submit"``).
        """
        if not self.enabled:
            return
        a = dict(args or {})
        a["device_ms"] = round(float(device_ms), 4)
        if timestamps_ns is not None and calibration is not None:
            b, e = timestamps_ns
            start, end = calibration.to_host_ns(b), calibration.to_host_ns(e)
            a["placed"] = "timestamps"
        else:
            start, end = submit_ns, submit_ns + int(float(device_ms) * 1e6)
            a["placed"] = "submit"
        self.span(name, "device", start, end, tid=DEVICE_TID, args=a)

    def events(self) -> list[dict]:
        """A copy of the events recorded so far."""
        with self._lock:
            return list(self._events)

    def write(self, path: str | os.PathLike | None = None) -> Path | None:
        """Write the events as a JSON array, atomically. Returns the path, or None when disabled."""
        p = Path(path) if path else self.path
        if p is None:
            return None
        evs = self.events()
        atomic_write_text(p, json.dumps(evs, separators=(",", ":")))
        return p


    def save(self) -> Path | None:
        """:meth:`write` to the path given at construction (the engine calls it at close)."""
        return self.write()


NULL_TRACE = Trace(None)


# ---------------------------------------------------------------------------------------------------------
# Summaries (`coli trace` prints these)

def union(intervals) -> list[tuple[float, float]]:
    """Merge ``[(start, end), ...]`` into disjoint sorted intervals (touching ones merge)."""
    out: list[list[float]] = []
    for s, e in sorted((float(s), float(e)) for s, e in intervals if e > s):
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return [(s, e) for s, e in out]


def measure(intervals) -> float:
    """Total length of the union of ``intervals``."""
    return sum(e - s for s, e in union(intervals))


def intersect(a, b) -> list[tuple[float, float]]:
    """The intersection of two interval sets (each merged first), as disjoint sorted intervals."""
    a, b = union(a), union(b)
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        s, e = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if e > s:
            out.append((s, e))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def summarize(events: list[dict]) -> dict:
    """Totals per category and the overlap of device and CPU time.

    Returns ``{"categories": {cat: {"count", "total_us", "busy_us"}}, "device_us", "cpu_us", "overlap_us",
    "hidden_pct", "join_overlap_us"}`` where ``device_us`` / ``cpu_us`` are the lengths of the unions of the
    ``device`` / ``cpu`` events (busy time, overlapping events counted once), ``overlap_us`` the length of
    their intersection and ``hidden_pct = 100 * overlap_us / device_us``: the share of device time during
    which the CPU was computing experts (the run line's "device time hidden"). ``join_overlap_us`` is the
    device time the engine spent waiting in joins. ``hidden_pct`` is None without device time.
    """
    xs = [e for e in events if e.get("ph") == "X"]
    cats: dict[str, dict] = {}
    spans: dict[str, list] = {}
    for e in xs:
        c = e.get("cat") or e.get("name")
        d = cats.setdefault(c, {"count": 0, "total_us": 0.0})
        d["count"] += 1
        d["total_us"] += float(e["dur"])
        spans.setdefault(c, []).append((float(e["ts"]), float(e["ts"]) + float(e["dur"])))
    for c, d in cats.items():
        d["busy_us"] = measure(spans[c])
    dev, cpu = spans.get("device", []), spans.get("cpu", [])
    dev_us, cpu_us = measure(dev), measure(cpu)
    ov = measure(intersect(dev, cpu))
    return {"categories": cats, "device_us": dev_us, "cpu_us": cpu_us, "overlap_us": ov,
            "hidden_pct": (100.0 * ov / dev_us) if dev_us > 0 else None,
            "join_overlap_us": measure(intersect(dev, spans.get("join", [])))}
