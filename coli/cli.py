"""``coli run | perplexity | info | bench | plan | tune`` (argparse), one function per command.

User errors (``ColiError``) print one line ``coli: <message>`` on stderr and exit with code 2.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

from coli.errors import ColiError


def _engine_args(p: argparse.ArgumentParser, model_required=False):
    p.add_argument("-m", "--model", required=model_required, help="GGUF file or Hugging Face folder (default: the demo MoE, built on first use)")
    p.add_argument("-t", "--threads", type=int, default=None, help="CPU threads (default: physical cores available)")
    p.add_argument("--ctx", type=int, default=None, help="KV cache positions (default min(4096, trained context))")
    p.add_argument("--expert-cache", type=int, default=None, metavar="N",
                   help="RAM expert cache slots per MoE layer (default: all experts if they fit half the RAM)")
    p.add_argument("--usage", default=None, metavar="PATH", help="routing history file (default .coli_usage beside the model)")
    p.add_argument("--cpu-act", choices=["f32", "int8"], default=None,
                   help="activations of the CPU matmuls: f32, or int8 per 32 as llama.cpp (default: measured, see docs)")
    p.add_argument("--io-threads", type=int, default=None, help="background expert readers (default 4)")
    p.add_argument("--device", choices=["cpu", "vulkan"], default=None,
                   help="vulkan: experts on the GPU tier (also COLI_VULKAN=1)")
    p.add_argument("--balance", dest="balance", action="store_true", default=None,
                   help="open the best Vulkan device with the tier and the measured-time balancer")
    p.add_argument("--no-balance", dest="balance", action="store_false", help="tier without the balancer")
    p.add_argument("--trace", default=None, metavar="FILE.json", help="write Chrome/Perfetto trace events")


def _open_engine(a, quiet=False, save_usage=True):
    from coli.engine import Engine

    device = a.device
    if device is None and (a.balance or os.environ.get("COLI_VULKAN") == "1"):
        device = "vulkan"
    if a.balance and device == "cpu":
        raise ColiError("--balance needs the device: drop --device cpu")
    if a.model and not os.path.exists(a.model):
        raise ColiError(f"{a.model}: no such file")
    return Engine(a.model, threads=a.threads, ctx=a.ctx, expert_cache=a.expert_cache, usage=a.usage,
                  cpu_act=a.cpu_act, io_threads=4 if a.io_threads is None else a.io_threads, device=device,
                  balance=a.balance,
                  trace=a.trace, quiet=quiet, save_usage=save_usage)


def _apply_config(a) -> str:
    """Settings from ``coli tune --save``'s config file for those not given on the command line (threads,
    I/O threads, the threading layer); returns the start line's note naming the file ("" without one)."""
    from coli.tune import apply_layer, load_config

    cfg, path = load_config()
    if not cfg:
        return ""
    used = []
    if a.threads is None and "threads" in cfg:
        a.threads = cfg["threads"]
        used.append(f"threads {cfg['threads']}")
    if a.io_threads is None and "io_threads" in cfg:
        a.io_threads = cfg["io_threads"]
        used.append(f"I/O threads {cfg['io_threads']}")
    if "threading_layer" in cfg:
        apply_layer(cfg["threading_layer"])
        used.append(f"layer {cfg['threading_layer']}")
    return f" ({', '.join(used)} from {path})" if used else ""


def cmd_run(a) -> int:
    if a.prompt is not None and a.prompt_pos is not None:
        raise ColiError("prompt: given twice (positional and -p); give one")
    prompt = a.prompt if a.prompt is not None else a.prompt_pos
    if prompt is None or prompt == "":
        raise ColiError("prompt: empty (give a prompt: coli run \"Once upon a time\" or -p TEXT)")
    cfg_note = _apply_config(a)
    eng = _open_engine(a)
    try:
        ids = eng.prompt_ids(prompt, chat=a.chat)
        eng.check_fits(len(ids), a.n, a.temp, a.top_k, a.top_p)
        if not a.quiet:
            print(f"coli: {eng.path.name}: {eng.args.arch}, {eng.args.n_layers} layers"
                  + (f", {eng.args.n_experts} experts top-{eng.args.top_k}" if eng.args.n_experts else "")
                  + f", {eng.threads} threads" + cfg_note, file=sys.stderr)
        if not a.chat:
            sys.stdout.write(prompt)
            sys.stdout.flush()

        def emit(s):
            sys.stdout.write(s)
            sys.stdout.flush()

        r = eng.generate(ids=ids, max_tokens=a.n, temp=a.temp, top_k=a.top_k, top_p=a.top_p, seed=a.seed,
                         on_text=emit)
        sys.stdout.write("\n")
        print("coli: " + eng.stats_line(r.stats), file=sys.stderr)
    finally:
        eng.close()
    return 0


def cmd_perplexity(a) -> int:
    try:
        with open(a.file, encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        raise ColiError(f"{a.file}: {e.strerror or e}")
    except UnicodeDecodeError as e:
        raise ColiError(f"{a.file}: not UTF-8 text (byte {e.start})")
    if a.max_tokens is not None and a.max_tokens < 2:
        raise ColiError(f"--max-tokens: {a.max_tokens} (at least 2)")
    eng = _open_engine(a, quiet=True)
    try:
        ids = eng.tokenize(text)
        if a.max_tokens:
            ids = ids[: a.max_tokens]
        t0 = time.perf_counter()
        nll, n = eng.nll(ids)
        dt = time.perf_counter() - t0
        import math

        print(f"{a.file}: {n} tokens scored, NLL {nll:.4f} nats/token, perplexity {math.exp(nll):.4f} "
              f"({len(ids) / dt:.1f} tok/s)")
    finally:
        eng.close()
    return 0


def cmd_info(a) -> int:
    from coli.gguf_file import describe, open_gguf

    g = open_gguf(a.model_pos or a.model)
    print(describe(g))
    return 0


def cmd_bench(a) -> int:
    """``coli bench``: llama-bench's lists (-p, -n, -t), -r repetitions, -o md|json|csv|jsonl (coli/bench.py)."""
    from coli.bench import format_records, parse_int_list, run_bench

    if a.repetitions < 1:
        raise ColiError(f"-r: {a.repetitions} repetitions (at least 1)")
    pp = parse_int_list(a.n_prompt, "-p")
    tg = parse_int_list(a.n_gen, "-n")
    if not any(pp) and not any(tg):
        raise ColiError(f"-p {a.n_prompt} -n {a.n_gen}: token counts must be >= 0, not all 0")
    threads = parse_int_list(a.threads, "-t", minimum=1) if a.threads is not None else None
    fmt = "json" if a.json else a.output
    a.threads = max(threads) if threads else None
    eng = _open_engine(a, quiet=True, save_usage=False)  # a benchmark does not feed the routing history
    try:
        if threads is None:
            threads = [eng.threads]

        def progress(rec):
            if fmt == "md" and sys.stderr.isatty():
                print(f"coli bench: {rec['test']} at {rec['n_threads']} threads: {rec['avg_ts']:.2f} t/s",
                      file=sys.stderr)

        recs = run_bench(eng, n_prompt=pp, n_gen=tg, reps=a.repetitions, cold=a.cold, threads=threads,
                         bandwidth=a.bandwidth, on_test=progress)
    finally:
        eng.close()
    print(format_records(recs, fmt))
    return 0


def cmd_tune(a) -> int:
    from coli.tune import cmd_tune as tune

    return tune(a)


def cmd_plan(a) -> int:
    from coli.plan import cmd_plan as plan

    return plan(a)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="coli", description="Mixture-of-Experts inference: CPU kernels, a device expert tier, experts streamed from disk")
    sub = p.add_subparsers(dest="cmd", required=True)

    r = sub.add_parser("run", help="generate text")
    r.add_argument("prompt_pos", nargs="?", default=None, metavar="PROMPT")
    r.add_argument("-p", "--prompt", default=None)
    r.add_argument("-n", type=int, default=64, help="tokens to generate")
    r.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    r.add_argument("--temp", type=float, default=0.0, help="temperature (0 = greedy)")
    r.add_argument("--top-k", type=int, default=40)
    r.add_argument("--top-p", type=float, default=0.95)
    r.add_argument("--seed", type=int, default=None)
    r.add_argument("-q", "--quiet", action="store_true")
    _engine_args(r)
    r.set_defaults(func=cmd_run)

    q = sub.add_parser("perplexity", help="teacher-forced NLL and perplexity of a text file")
    q.add_argument("-f", "--file", required=True)
    q.add_argument("--max-tokens", type=int, default=None, metavar="N", help="score only the first N tokens")
    _engine_args(q)
    q.set_defaults(func=cmd_perplexity)

    i = sub.add_parser("info", help="architecture, tensors, types, sizes, experts")
    i.add_argument("model_pos", nargs="?", metavar="MODEL")
    i.add_argument("-m", "--model", default=None)
    i.set_defaults(func=cmd_info)

    b = sub.add_parser("bench", help="prefill ppN and decode tgN tok/s, llama-bench style", conflict_handler="resolve")
    b.add_argument("-p", "--n-prompt", default="128", help="prompt lengths: 128 or 64,512 or 0 (none)")
    b.add_argument("-n", "--n-gen", default="64", help="tokens generated: 64 or 16,64 or 0 (none)")
    b.add_argument("-r", "--repetitions", type=int, default=5)
    b.add_argument("-o", "--output", choices=["md", "json", "csv", "jsonl"], default="md",
                   help="md table, or records with llama-bench's field names plus coli's")
    b.add_argument("--json", action="store_true", help="same as -o json")
    b.add_argument("--bandwidth", action="store_true",
                   help="run a memory-read probe at each thread count; the table shows it beside the weight GB/s")
    b.add_argument("--cold", action="store_true", help="drop the model file's pages from the page cache before each run")
    _engine_args(b)
    b.add_argument("-t", "--threads", default=None, metavar="LIST",
                   help="Numba thread counts: 2, 1,2,4, 1-16, 1-16*2 (default: physical cores available)")
    b.set_defaults(func=cmd_bench)

    pl = sub.add_parser("plan", help="what a model takes here (RAM, KV cache, expert cache, device, disk), before loading it")
    pl.add_argument("-m", "--model", default=None, help="GGUF file (default: the demo MoE)")
    pl.add_argument("--device", choices=["cpu", "vulkan"], default=None, help="vulkan: read the device's heaps for the tier")
    pl.add_argument("--ctx", type=int, default=None, help="KV cache positions (default min(4096, trained context))")
    pl.add_argument("--expert-cache", type=int, default=None, metavar="N", help="RAM expert cache slots per MoE layer")
    pl.add_argument("--json", action="store_true", help="the plan as JSON (bytes)")
    pl.set_defaults(func=cmd_plan)

    tu = sub.add_parser("tune", help="sweep threads, I/O threads, threading layers (and the device): CSV, PNG, a recommendation")
    tu.add_argument("-m", "--model", default=None, help="GGUF file (default: the demo MoE)")
    tu.add_argument("--device", choices=["cpu", "vulkan"], default=None, help="vulkan: also sweep device on/off, balancer on/off")
    tu.add_argument("--out", default="coli-tune", metavar="DIR", help="folder for tune.csv and tune.png (default ./coli-tune)")
    tu.add_argument("--save", action="store_true", help="write the recommendation to ~/.config/coli/config.toml (coli run reads it)")
    tu.add_argument("--threads", default=None, metavar="LIST", help="Numba thread counts (default 1..physical cores, and the logical count)")
    tu.add_argument("--io-threads", default=None, metavar="LIST", help="I/O thread counts (default 1,4,8 when experts stream from disk, else 4)")
    tu.add_argument("--layers", default=None, metavar="LIST", help="threading layers: tbb,omp (default: each usable one)")
    tu.add_argument("--reps", type=int, default=3, help="runs a point (alternating)")
    tu.add_argument("-p", "--n-prompt", type=int, default=64, help="prompt tokens a run")
    tu.add_argument("-n", "--n-gen", type=int, default=16, help="decode tokens a run")
    tu.add_argument("--max-load", type=float, default=None, metavar="X",
                    help="no recommendation when the load average before the sweep is above X (default: half the CPUs)")
    tu.set_defaults(func=cmd_tune)
    return p


def main(argv=None) -> int:
    p = build_parser()
    a = p.parse_args(argv)
    if a.cmd == "info" and not (a.model_pos or a.model):
        p.error("info: give a MODEL")
    try:
        return a.func(a)
    except ColiError as e:
        print(f"coli: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        sys.stdout.write("\n")
        print("coli: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0


if __name__ == "__main__":
    raise SystemExit(main())
