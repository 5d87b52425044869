#!/usr/bin/env python3
"""Concurrent requests on one engine: aggregate decode tok/s of 1, 2, 4 (and 8) streams decoded together, the
expert bytes a token costs on a MoE, and the same through ``coli serve`` (4 slots) over HTTP.

    .venv/bin/python scripts/bench/serve.py [--models smollm2,demo] [--threads 2] [--tokens 32] [--http [--ttft-only]]

Part 1, in process (``coli.slots.Batcher``, no HTTP): for k streams, k requests with distinct prompts (ignoring
the end-of-generation token) start together; once every prompt is read, the decode steps are timed: aggregate
tok/s = tokens generated in them / their seconds; one stream's figure is k = 1 (one at a time gives k times
its time for k times its tokens). On a MoE, each step's distinct routed experts per layer (the bytes an expert
step reads: the expert's file bytes) are counted: expert bytes a token = those bytes / tokens.

Part 2 (``--http``), the reference of the concurrency target (what a user of the server sees): ``coli serve``
in a subprocess, with its default slots (4, sharing the context's positions in paged KV cells) or
``--serve-args`` (``"--parallel 4"``: 4 slots of a whole context each, as before the paged cells); 1, 2 and 4 clients stream ``--tokens`` tokens each at once (distinct prompts), in
alternating rounds with the load average printed per round: aggregate decode tok/s = the tokens after each
stream's first token / (the last stream's last token - the first stream's first token), the median of the
rounds, 4 clients over 1 (``x_4_vs_1_decode``); end to end (prompts and HTTP included) against the 4 requests
one after the other. Then a 16-token request sent 0.3 s after a ~2,000-token prompt: its time to first token,
and whether it came while the long prompt was still being read (before the long request's first token);
``--ttft-only``: only this, ``--rounds`` times. Prints the load average before each part (the machine is shared: docs/benchmarks.md).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

TOPICS = ["the sea", "a mountain village", "the history of bread", "a clockmaker", "winter birds", "the moon",
          "an old library", "a river journey", "the first computers", "a lighthouse keeper", "desert plants",
          "a chess game"]


def prompts(k: int, round_: int) -> list:
    return [f"Write a long story ({round_}.{i}) about {TOPICS[(round_ * 5 + i) % len(TOPICS)]}:" for i in range(k)]


def model_file(name: str) -> Path:
    from coli.resolve import resolve

    return Path(resolve(name, quiet=True))


def in_process(name: str, threads: int, n_tok: int, ks, rounds: int = 3) -> list:
    import numpy as np

    from coli.engine import Engine
    from coli.slots import Batcher

    out = []
    with Engine(model_file(name), threads=threads, ctx=512, save_usage=False, quiet=True) as eng:
        moe = eng.usage is not None
        seen = {"bytes": 0}
        if moe:  # every routing (a step's rows, or a decode row's compiled region) goes through usage.add
            src = eng.cache.source
            add = eng.usage.add

            def counting(layer, ids):
                seen["bytes"] += int(np.unique(np.asarray(ids)).size) * src.expert_nbytes(layer)
                return add(layer, ids)

            eng.usage.add = counting
        # warm up each stream count (one stream's decode row runs the one-row path, several the several-row
        # call): kernels compiled and the experts in the RAM cache before anything is timed
        for k in ks:
            Batcher(eng, k).run([_seq(eng, p, 4) for p in prompts(k, 99)])
        for r, k in enumerate(ks * rounds):
            b = Batcher(eng, k)
            seqs = [_seq(eng, p, n_tok) for p in prompts(k, r)]
            for s in seqs:
                b.start(s)
            while any(s.pending for s in seqs):
                b.step()
            n0 = sum(len(s.out) for s in seqs)
            seen["bytes"] = 0
            t0 = time.perf_counter()
            while any(not s.done for s in seqs):
                b.step()
            dt = time.perf_counter() - t0
            n = sum(len(s.out) for s in seqs) - n0
            row = dict(model=name, streams=k, tokens=n, seconds=round(dt, 3), tok_s=round(n / dt, 2),
                       batched=b.batched, load=round(os.getloadavg()[0], 1))
            if moe:
                row["expert_MiB_per_token"] = round(seen["bytes"] / n / 2**20, 3)
            out.append(row)
            print(json.dumps(row), flush=True)
        best = {}
        for row in out:  # the best of the rounds per stream count (the machine is shared)
            if row["streams"] not in best or row["tok_s"] > best[row["streams"]]["tok_s"]:
                best[row["streams"]] = row
        out = [best[k] for k in ks]
        base = best[ks[0]]["tok_s"]
        for row in out:
            row["x_one_stream"] = round(row["tok_s"] / base, 2)
            print(f"{name}: {row['streams']} streams {row['tok_s']} tok/s ({row['x_one_stream']}x one stream)"
                  + (f", {row['expert_MiB_per_token']} MiB of experts a token" if moe else ""), flush=True)
    return out


def _seq(eng, text, n):
    from coli.sampling import Sampler, SamplingParams
    from coli.slots import Sequence

    ids = eng.tokenize(text)
    s = Sampler(SamplingParams(temp=0.0), ctx=eng.ctx)
    s.accept_many(ids)
    return Sequence(eng, ids, n, s, stop_at_eos=False)


def over_http(name: str, threads: int, n_tok: int, rounds: int = 3, serve_args: str = "",
              ttft_only: bool = False) -> dict:
    """``coli serve`` (its default 4 slots, or ``serve_args``) in a subprocess. The reference of the concurrency target: 1, 2 and 4 clients
    streaming at once, rounds alternating (1, 4, 2, then 2, 4, 1, ...), the load average printed with each;
    aggregate decode tok/s = the tokens after each stream's first / (the last stream's last token - the first
    stream's first token); the median of the rounds, and the 4-client figure over the 1-client one
    (``x_4_vs_1_decode``). Then the 4 requests one after the other, and the short request beside a long prompt
    (``ttft_only``: only that, ``rounds`` times, the load printed with each)."""
    import statistics

    import httpx

    env = dict(os.environ, PYTHONPATH=str(ROOT))
    p = subprocess.Popen([sys.executable, "-m", "coli", "serve", "-m", str(model_file(name)), "--port", "0", "-q",
                          *serve_args.split(), "--ctx", "2400", "-t", str(threads)], cwd=ROOT, env=env,
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    base = None
    for line in p.stderr:
        m = re.search(r"serving \S+ on (http://\S+)/v1", line)
        if m:
            base = m.group(1)
            break
    threading.Thread(target=lambda: [None for _ in p.stderr], daemon=True).start()
    res = {"model": name, "serve_args": serve_args}
    try:
        def ask(prompt, n, got, i, t_sent=None):
            """Stream one completion; got[i] = dict(n tokens, t0 sent, first / last token times, prompt tokens)."""
            t0 = time.perf_counter()
            first = last = None
            n_out = n_in = 0
            with httpx.stream("POST", base + "/v1/completions", timeout=600,
                              json={"prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True,
                                    "stream": True, "stream_options": {"include_usage": True}}) as r:
                for line in r.iter_lines():
                    if not line.startswith("data: {"):
                        continue
                    d = json.loads(line[6:])
                    if d["choices"] and d["choices"][0]["text"]:
                        last = time.perf_counter()
                        first = first or last
                    if d.get("usage"):
                        n_out = d["usage"]["completion_tokens"]
                        n_in = d["usage"]["prompt_tokens"]
            got[i] = dict(n=n_out, t0=t0, first=first, last=last, end=time.perf_counter(), prompt=n_in)

        def clients(k, tag):
            got = [None] * k
            ts = [threading.Thread(target=ask, args=(q, n_tok, got, i)) for i, q in enumerate(prompts(k, tag))]
            load = os.getloadavg()[0]
            t0 = time.perf_counter()
            for t in ts:
                t.start()
            for t in ts:
                t.join()
            dt = time.perf_counter() - t0
            dec = sum(g["n"] - 1 for g in got) / (max(g["last"] for g in got) - min(g["first"] for g in got))
            e2e = sum(g["n"] for g in got) / dt
            print(json.dumps(dict(model=name, http_clients=k, decode_tok_s=round(dec, 2),
                                  end_to_end_tok_s=round(e2e, 2), load=round(load, 1))), flush=True)
            return dec, e2e

        while httpx.get(base + "/health", timeout=60).status_code == 503:  # the server's warm-up runs
            time.sleep(0.2)
        ask("Hello", 4, [None], 0)  # warm up
        dec = {1: [], 2: [], 4: []}
        e2e = {1: [], 2: [], 4: []}
        for r in range(0 if ttft_only else rounds):
            for k in ((1, 4, 2) if r % 2 == 0 else (2, 4, 1)):
                d, e = clients(k, 10 + 3 * r + k)
                dec[k].append(d)
                e2e[k].append(e)
        for k in () if ttft_only else (1, 2, 4):
            res[f"decode_{k}_clients_tok_s"] = round(statistics.median(dec[k]), 2)
            res[f"end_to_end_{k}_clients_tok_s"] = round(statistics.median(e2e[k]), 2)
        if not ttft_only:
            res["x_4_vs_1_decode"] = round(res["decode_4_clients_tok_s"] / res["decode_1_clients_tok_s"], 2)
            res["x_4_vs_1_decode_per_round"] = [round(b / a, 2) for a, b in zip(dec[1], dec[4])]
            got = [None] * 4
            t0 = time.perf_counter()
            for i, q in enumerate(prompts(4, 40)):
                ask(q, n_tok, got, i)
            res["one_at_a_time_4_tok_s"] = round(sum(g["n"] for g in got) / (time.perf_counter() - t0), 2)
            res["x_4_clients_vs_one_at_a_time"] = round(res["end_to_end_4_clients_tok_s"] /
                                                        res["one_at_a_time_4_tok_s"], 2)
        for r in range(rounds if ttft_only else 1):
            long = " ".join(f"item {i} is {TOPICS[(i + r) % len(TOPICS)]}." for i in range(210))  # ~2,000 tokens
            got = [None, None]
            load = os.getloadavg()[0]
            tl = threading.Thread(target=ask, args=(long, 4, got, 0))
            tl.start()
            time.sleep(0.3)
            ask("Say one word about " + TOPICS[3 + r % 5] + " now.", 16, got, 1)
            tl.join()
            lg, sh = got
            res["long_prompt_tokens"] = lg["prompt"]
            res["short_ttft_s_beside_long_prompt"] = round(sh["first"] - sh["t0"], 3)
            res["long_request_s"] = round(lg["end"] - lg["t0"], 3)
            # the short request's first token came while the long prompt was still being read (its first later)
            res["short_first_while_long_prompt_read"] = sh["first"] < lg["first"]
            print(json.dumps(dict(model=name, round=r, short_ttft_s=res["short_ttft_s_beside_long_prompt"],
                                  long_request_s=res["long_request_s"], long_prompt_tokens=lg["prompt"],
                                  while_long_prompt_read=res["short_first_while_long_prompt_read"],
                                  load=round(load, 1))), flush=True)
    finally:
        p.terminate()
        p.wait(60)
    print(json.dumps(res), flush=True)
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="smollm2,demo")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--streams", default="1,2,4,8")
    ap.add_argument("--rounds", type=int, default=3,
                    help="each stream count this many times (in process: the best kept; over HTTP: the median)")
    ap.add_argument("--no-in-process", action="store_true", help="only the HTTP part (with --http)")
    ap.add_argument("--http", action="store_true", help="also through coli serve (4 slots)")
    ap.add_argument("--ttft-only", action="store_true",
                    help="over HTTP, only the short request beside a ~2,000-token prompt, --rounds times")
    ap.add_argument("--serve-args", default="", help="coli serve's flags for --http (default: none, its 4 paged "
                    "slots; '--parallel 4': a whole context a slot)")
    ap.add_argument("--json", default=None, help="write the records here")
    a = ap.parse_args()
    ks = [int(x) for x in a.streams.split(",")]
    recs = []
    for name in a.models.split(","):
        print(f"# {name}: load average {os.getloadavg()[0]:.1f}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
              flush=True)
        if not a.no_in_process:
            recs += in_process(name, a.threads, a.tokens, ks, a.rounds)
        if a.http:
            print(f"# {name} over HTTP: load average {os.getloadavg()[0]:.1f}", flush=True)
            recs.append(over_http(name, a.threads, a.tokens, a.rounds, a.serve_args, a.ttft_only))
    if a.json:
        Path(a.json).write_text(json.dumps(recs, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
