"""``coli run | perplexity | info | bench`` (argparse), one function per command.

User errors (``ColiError``) print one line ``coli: <message>`` on stderr and exit with code 2. Ctrl-C exits 130
and SIGTERM 143, both after the stats line and the routing history's save; a closed or broken stdout ends
the run quietly (exit 0).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

from coli.errors import ColiError


def _engine_args(p: argparse.ArgumentParser, model_required=False):
    p.add_argument("-m", "--model", required=model_required, help="GGUF file (default: the demo MoE, built on first use)")
    p.add_argument("-t", "--threads", type=int, default=None, help="CPU threads (default: physical cores available)")
    p.add_argument("--ctx", type=int, default=None, help="KV cache positions (default min(4096, trained context))")
    p.add_argument("--expert-cache", type=int, default=None, metavar="N",
                   help="RAM expert cache slots per MoE layer (default: all experts if they fit half the RAM)")
    p.add_argument("--usage", default=None, metavar="PATH", help="routing history file (default .coli_usage beside the model)")
    p.add_argument("--cpu-act", choices=["f32", "int8"], default=None,
                   help="activations of the CPU matmuls: f32, or int8 per 32 as llama.cpp (default: measured, see docs)")
    p.add_argument("--io-threads", type=int, default=4, help="background expert readers")
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
                  cpu_act=a.cpu_act, io_threads=a.io_threads, device=device,
                  balance=a.balance,
                  trace=a.trace, quiet=quiet, save_usage=save_usage)


def cmd_run(a) -> int:
    if a.prompt is not None and a.prompt_pos is not None:
        raise ColiError("prompt: given twice (positional and -p); give one")
    prompt = a.prompt if a.prompt is not None else a.prompt_pos
    if prompt is None or prompt == "":
        raise ColiError("prompt: empty (give a prompt: coli run \"Once upon a time\" or -p TEXT)")
    eng = _open_engine(a)
    try:
        ids = eng.prompt_ids(prompt, chat=a.chat)
        eng.check_fits(len(ids), a.n, a.temp, a.top_k, a.top_p)
        if not a.quiet:
            print(f"coli: {eng.path.name}: {eng.args.arch}, {eng.args.n_layers} layers"
                  + (f", {eng.args.n_experts} experts top-{eng.args.top_k}" if eng.args.n_experts else "")
                  + f", {eng.threads} threads, {eng.activations()}", file=sys.stderr)
        if not a.chat:
            sys.stdout.write(prompt)
            sys.stdout.flush()

        def emit(s):
            sys.stdout.write(s)
            sys.stdout.flush()

        try:
            r = eng.generate(ids=ids, max_tokens=a.n, temp=a.temp, top_k=a.top_k, top_p=a.top_p, seed=a.seed,
                             on_text=emit)
        except KeyboardInterrupt:  # Ctrl-C or SIGTERM: the stats of what was generated, then main's exit code
            _say("\n", sys.stdout)
            _say("coli: " + eng.stats_line(eng.last_stats) + "\n", sys.stderr)
            raise
        sys.stdout.write("\n")
        print("coli: " + eng.stats_line(r.stats), file=sys.stderr)
    finally:
        _close(eng)
    return 0


def cmd_perplexity(a) -> int:
    """llama-perplexity's convention (``Engine.perplexity``): chunks of ``--ctx`` tokens with BOS at each
    start where the model wants one, the second half of each scored; ``--all-tokens`` scores every token.
    Progress per chunk on stderr (``[i]ppl,`` with the running estimate, as llama-perplexity prints it);
    the result on stdout."""
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

        def progress(i, n, ppl):
            end = "\n" if i == n else ""
            sys.stderr.write(f"[{i}]{ppl:.4f}," + end)
            sys.stderr.flush()

        if not a.quiet:
            way = "every token" if a.all_tokens else f"second half of each chunk, as llama-perplexity"
            print(f"coli: {eng.path.name}: {len(ids)} tokens, chunks of {eng.ctx} ({way})", file=sys.stderr)
        r = eng.perplexity(ids, all_tokens=a.all_tokens, on_chunk=None if a.quiet else progress)
        dt = time.perf_counter() - t0
        print(f"{a.file}: {r.n} tokens scored in {r.chunks} chunks of {r.ctx}"
              f"{' (all tokens)' if r.all_tokens else ''}, NLL {r.nll:.4f} nats/token, "
              f"perplexity {r.ppl:.4f} +/- {r.ppl_err:.4f} ({len(ids) / dt:.1f} tok/s)")
    finally:
        _close(eng)
    return 0


def cmd_info(a) -> int:
    from coli.gguf_file import describe, open_gguf

    g = open_gguf(a.model_pos or a.model)
    print(describe(g))
    return 0


def cmd_bench(a) -> int:
    from coli.bench import run_bench

    if a.repetitions < 1:
        raise ColiError(f"-r: {a.repetitions} repetitions (at least 1)")
    if a.n_prompt < 0 or a.n_gen < 0 or a.n_prompt + a.n_gen == 0:
        raise ColiError(f"-p {a.n_prompt} -n {a.n_gen}: token counts must be >= 0, not both 0")

    eng = _open_engine(a, quiet=True, save_usage=False)  # a benchmark does not feed the routing history
    try:
        recs = run_bench(eng, n_prompt=a.n_prompt, n_gen=a.n_gen, reps=a.repetitions, cold=a.cold)
    finally:
        _close(eng)
    if a.json:
        print(json.dumps(recs, indent=2))
    else:
        print(f"| model | threads | test | t/s |\n|---|---|---|---|")
        for r in recs:
            print(f"| {r['model_filename']} | {r['n_threads']} | {r['test']} | {r['avg_ts']:.2f} ± {r['stddev_ts']:.2f} |")
    return 0


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

    q = sub.add_parser("perplexity", help="perplexity of a text file, as llama-perplexity computes it")
    q.add_argument("-f", "--file", required=True)
    q.add_argument("--max-tokens", type=int, default=None, metavar="N", help="score only the first N tokens")
    q.add_argument("--all-tokens", action="store_true",
                   help="score every token (default: the second half of each --ctx chunk, as llama-perplexity)")
    q.add_argument("-q", "--quiet", action="store_true", help="no progress lines")
    _engine_args(q)
    q.set_defaults(func=cmd_perplexity)

    i = sub.add_parser("info", help="architecture, tensors, types, sizes, experts")
    i.add_argument("model_pos", nargs="?", metavar="MODEL")
    i.add_argument("-m", "--model", default=None)
    i.set_defaults(func=cmd_info)

    b = sub.add_parser("bench", help="prefill ppN and decode tgN tok/s, llama-bench style")
    b.add_argument("-p", "--n-prompt", type=int, default=128)
    b.add_argument("-n", "--n-gen", type=int, default=64)
    b.add_argument("-r", "--repetitions", type=int, default=5)
    b.add_argument("--json", action="store_true", help="records with llama-bench's field names")
    b.add_argument("--cold", action="store_true", help="drop the model file's pages from the page cache before each run")
    _engine_args(b)
    b.set_defaults(func=cmd_bench)
    return p


class Terminated(KeyboardInterrupt):
    """SIGTERM (docker stop, systemd): handled as Ctrl-C is, then exit code 143 (128 + 15)."""


def _on_sigterm(signum, frame):
    raise Terminated()


def _say(text: str, stream) -> None:
    """Write to a stream that may be closed or gone (no error: there is nowhere to report one)."""
    try:
        stream.write(text)
        stream.flush()
    except (OSError, ValueError, AttributeError):
        pass


def _close(eng) -> None:
    """``eng.close()`` (saves the routing history) with SIGINT and SIGTERM held back until it is done, so a
    second Ctrl-C or a repeated SIGTERM cannot cut the save short."""
    import signal

    sigs = {signal.SIGINT, signal.SIGTERM}
    try:
        old = signal.pthread_sigmask(signal.SIG_BLOCK, sigs)
    except (AttributeError, OSError, ValueError):
        old = None
    try:
        eng.close()
    finally:
        if old is not None:
            signal.pthread_sigmask(signal.SIG_SETMASK, old)


class _ClosedStdout:
    """Stands for a closed stdout (``coli run ... >&-``: ``sys.stdout`` is None): writing raises
    BrokenPipeError, so the run ends as it does when the reader of a pipe goes away."""

    def write(self, s):
        raise BrokenPipeError(32, "stdout is closed")

    def flush(self):
        pass


def _devnull_stdout() -> None:
    """Point fd 1 at /dev/null so the interpreter's last flush does not fail again after a broken pipe."""
    try:
        fd = os.open(os.devnull, os.O_WRONLY)
        os.dup2(fd, 1)
        os.close(fd)
    except OSError:
        pass


def main(argv=None) -> int:
    import signal

    if sys.stdout is None:
        sys.stdout = _ClosedStdout()
    if sys.stderr is None:  # 2>&-: notes go nowhere rather than into stdout (print(file=None) means stdout)
        sys.stderr = open(os.devnull, "w")
    try:
        signal.signal(signal.SIGTERM, _on_sigterm)
    except ValueError:  # not the main thread (main() called from a library): leave signals alone
        pass
    p = build_parser()
    a = p.parse_args(argv)
    if a.cmd == "info" and not (a.model_pos or a.model):
        p.error("info: give a MODEL")
    try:
        return a.func(a)
    except ColiError as e:
        print(f"coli: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt as e:
        term = isinstance(e, Terminated)
        _say(f"coli: {'terminated (SIGTERM)' if term else 'interrupted'}\n", sys.stderr)
        return 143 if term else 130
    except BrokenPipeError:
        _devnull_stdout()
        return 0


if __name__ == "__main__":
    raise SystemExit(main())
