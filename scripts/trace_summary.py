#!/usr/bin/env python3
"""Summarise a coli trace (``coli run --trace FILE.json``): totals per category, the overlap of device and
CPU time, and the % of device time hidden behind the CPU.

Usage: ``python scripts/trace_summary.py FILE.json [--json]``

Definitions (``scheduler.trace.summarize``): per category the number of events, the sum of their durations
and their busy time (the union of their intervals); ``overlap`` = length of (union of device events) ∩
(union of cpu events); ``hidden`` = overlap / device busy time.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from scheduler.trace import CATEGORIES, summarize  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trace", help="a trace JSON file written by --trace")
    ap.add_argument("--json", action="store_true", help="print the summary as JSON")
    a = ap.parse_args(argv)
    try:
        events = json.loads(Path(a.trace).read_text())
    except (OSError, ValueError) as e:
        print(f"trace_summary: {a.trace}: {e}", file=sys.stderr)
        return 2
    if not isinstance(events, list):
        print(f"trace_summary: {a.trace}: not a JSON array of trace events", file=sys.stderr)
        return 2
    s = summarize(events)
    if a.json:
        print(json.dumps(s, indent=1))
        return 0
    print(f"{'category':<10}{'events':>8}{'total ms':>12}{'busy ms':>12}")
    order = [c for c in CATEGORIES if c in s["categories"]] + sorted(set(s["categories"]) - set(CATEGORIES))
    for c in order:
        d = s["categories"][c]
        print(f"{c:<10}{d['count']:>8}{d['total_us'] / 1e3:>12.3f}{d['busy_us'] / 1e3:>12.3f}")
    print(f"device busy {s['device_us'] / 1e3:.3f} ms, CPU busy {s['cpu_us'] / 1e3:.3f} ms, "
          f"overlap {s['overlap_us'] / 1e3:.3f} ms, device time in joins {s['join_overlap_us'] / 1e3:.3f} ms")
    if s["hidden_pct"] is None:
        print("no device events: nothing to hide")
    else:
        print(f"{s['hidden_pct']:.1f}% of device time hidden behind CPU expert work")
    return 0


if __name__ == "__main__":
    sys.exit(main())
