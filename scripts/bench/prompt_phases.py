"""Where a CPU prompt's time goes, chunk by chunk: each prompt step (``Engine.prompt_chunk()`` rows) of a prompt
of ``-p`` tokens timed whole and by phase, the phases being the Python entry points of the layers' work, each
around its compiled launches (``time.perf_counter``; the wrappers cost ~1 us a call):

  qkv      ``blocks.Attention.qkv`` (the layer input's q/k/v GEMMs; with the norm's quantization when it is there)
  attend   ``blocks.Attention.attend`` (the KV write and the attention kernel: the part that grows with position)
  out      ``blocks.Attention.out`` (the output projection)
  rope     ``blocks.Attention.rope`` and ``heads`` (q/k norms)
  norm     ``Model.norm_in`` (the pre-attention / dense FFN norm and its quantization)
  router   ``blocks.MoE.logits`` (the router GEMM; the top-k is in ``rest``)
  experts  ``scheduler.step.MoEStep._cpu_experts`` (the routed experts' GEMMs, the rows' quantization)
  combine  ``MoEStep.combine`` (the pairs' weighted sum)
  mlp      ``blocks.MLP.__call__`` (a dense layer's FFN)
  head     ``Model.embed`` + ``Model.head`` (the embedding rows; the output norm and the head GEMM of the last row)
  rest     the chunk's time outside these: the MoE norm, routing's top-k, residual adds, the host's Python

and the chunk's parallel launches (calls from Python of a ``parallel=True`` kernel: each wakes the thread pool,
~10 us at 16 threads, docs/cpu_kernels.md "Threading").

    python3 scripts/bench/prompt_phases.py -m MODEL -t 16 -p 128,512,2048 [-r 2] [--ubatch 256]

After one untimed chunk (the kernels load), prints, for each prompt length, the prompt's tok/s per rep (the load average beside), then the last rep's table:
one line per chunk (its first position, ms in all, ms per phase). A phase's ms that grows down the table grows
with position (attention does: its keys are the positions before). A GEMM phase's ms / chunk rows is its cost a
row. No wrapper changes what runs (the same kernels, the same bits)."""
import argparse
import collections
import contextlib
import functools
import sys
import time
from pathlib import Path

import numpy as np
from numba.extending import typeof_impl

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository, for `coli` and `scheduler`
import timing  # noqa: E402  (scripts/bench/timing.py: the script's own folder is first on sys.path)

PHASES = ("qkv", "attend", "out", "rope", "norm", "router", "experts", "combine", "mlp", "head")


def _wrap(owner, name, label, acc):
    """Replace ``owner.name`` by a timer around it adding to ``acc[label]`` (a staticmethod stays one); returns
    the function that puts back what ``owner`` held (its own attribute, or none: the inherited one)."""
    own = owner.__dict__.get(name)
    raw = own
    if raw is None:
        for k in owner.__mro__:
            if name in k.__dict__:
                raw = k.__dict__[name]
                break
    static = isinstance(raw, staticmethod)
    f = raw.__func__ if static else raw

    @functools.wraps(f)
    def g(*a, **kw):
        t = time.perf_counter()
        try:
            return f(*a, **kw)
        finally:
            acc[label] += time.perf_counter() - t

    setattr(owner, name, staticmethod(g) if static else g)
    return (lambda: setattr(owner, name, own)) if own is not None else (lambda: delattr(owner, name))


@contextlib.contextmanager
def instrument(model, acc):
    """Time the phases (module docstring) of ``model``'s layers into ``acc`` (a defaultdict(float)) while the block
    runs; the classes' methods are put back on leaving it."""
    from coli.models import blocks
    from scheduler import step

    undo = []
    try:
        for owner, name, label in ((blocks.Attention, "qkv", "qkv"), (blocks.Attention, "attend", "attend"),
                               (blocks.Attention, "out", "out"), (blocks.Attention, "rope", "rope"),
                               (blocks.Attention, "heads", "rope"), (blocks.MoE, "logits", "router"),
                               (step.MoEStep, "_cpu_experts", "experts"), (step.MoEStep, "combine", "combine"),
                               (blocks.MLP, "__call__", "mlp"), (type(model), "norm_in", "norm"),
                                   (type(model), "embed", "head"), (type(model), "head", "head")):
            undo.append(_wrap(owner, name, label, acc))
        yield
    finally:
        for f in reversed(undo):
            f()


class _Counted:
    """A parallel kernel's dispatcher that counts its calls into ``n[0]`` (attributes pass through)."""

    def __init__(self, d, n):
        self._d, self._n = d, n

    def __call__(self, *a, **kw):
        self._n[0] += 1
        return self._d(*a, **kw)

    def __getattr__(self, name):
        return getattr(self._d, name)


@typeof_impl.register(_Counted)
def _typeof_counted(val, c):
    """Numba types a counter as its kernel: a compiled function naming the global compiles (and calls the kernel
    itself, uncounted) while the counters are in place, as a cold cache or a new signature makes it do."""
    return typeof_impl(val._d, c)


@contextlib.contextmanager
def count_launches(n, prefixes=("cpu_kernels", "coli", "scheduler")):
    """Count every call from Python of a ``parallel=True`` kernel (a launch of the thread pool) into ``n[0]`` while
    the block runs: the globals of the modules named ``prefixes``... that hold one are replaced by a counter and
    put back on leaving it (calls from compiled code are not launches of their own; a kernel held only in a table
    or a closure is missed: a lower bound). Yields the number of kernels wrapped."""
    from numba.core.registry import CPUDispatcher

    done, undo = {}, []
    try:
        for name, mod in list(sys.modules.items()):
            if mod is None or not name.startswith(tuple(prefixes)):
                continue
            for k, v in list(vars(mod).items()):
                if isinstance(v, CPUDispatcher) and v.targetoptions.get("parallel"):
                    done.setdefault(id(v), _Counted(v, n))
                    undo.append((mod, k, v))
                    setattr(mod, k, done[id(v)])
        yield len(done)
    finally:
        for mod, k, v in undo:
            setattr(mod, k, v)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-m", "--model", required=True, help="a GGUF file or a model name coli takes")
    ap.add_argument("-t", "--threads", type=int, default=None, help="threads (default: coli's)")
    ap.add_argument("-p", "--prompts", default="128,512,2048", help="prompt lengths, comma-separated")
    ap.add_argument("-r", "--reps", type=int, default=2, help="runs of each prompt (the table shows the last)")
    ap.add_argument("--ubatch", type=int, default=None, help="rows of a prompt step (COLI_UBATCH; default coli's)")
    a = ap.parse_args(argv)
    lens = [int(x) for x in a.prompts.split(",")]
    from coli.engine import Engine

    env = None
    if a.ubatch is not None:
        import os

        env = dict(os.environ, COLI_UBATCH=str(a.ubatch))
    acc = collections.defaultdict(float)
    with (Engine(a.model, threads=a.threads, ctx=max(lens) + 1, quiet=True, save_usage=False, env=env) as eng,
          contextlib.ExitStack() as wrapped):
        m = eng.model
        wrapped.enter_context(instrument(m, acc))
        launches = [0]
        n_par = wrapped.enter_context(count_launches(launches))
        step = eng.prompt_chunk()
        print(f"# {Path(str(eng.path)).name}, {eng.threads} threads, prompt steps of {step} rows, {n_par} parallel "
              f"kernels counted, load {' '.join(timing.load())}")
        rng = np.random.default_rng(0)
        # loads the kernels (a whole step's rows: a step of fewer rows takes other paths, compiled in the timed run)
        m.forward(rng.integers(10, min(1000, m.args.vocab), min(step, max(lens))), eng._new_cache(step, step))
        for n in lens:
            for r in range(a.reps):
                ids = rng.integers(10, min(1000, m.args.vocab), n)
                kv = eng._new_cache(n, n)
                rows = []
                for s in range(0, n, step):
                    acc.clear()
                    launches[0] = 0
                    t = time.perf_counter()
                    m.forward(ids[s:s + step], kv)
                    rows.append((s, time.perf_counter() - t, dict(acc), launches[0]))
                tot = sum(x[1] for x in rows)
                print(f"prompt {n} run {r + 1}: {tot * 1e3:.0f} ms, {n / tot:.1f} tok/s, load {' '.join(timing.load())}")
            print("  pos0     ms " + " ".join(f"{k:>8}" for k in PHASES) + "     rest launches")
            for s, t, d, nl in rows:
                rest = t - sum(d.values())
                print(f"  {s:4d} {t * 1e3:6.1f} " + " ".join(f"{d.get(k, 0.0) * 1e3:8.1f}" for k in PHASES)
                      + f" {rest * 1e3:8.1f} {nl:8d}")
            tot_ph = {k: sum(d.get(k, 0.0) for _, _, d, _ in rows) for k in PHASES}
            tot = sum(x[1] for x in rows)
            print("  share  " + " ".join(f"{tot_ph[k] / tot:8.1%}" for k in PHASES)
                  + f" {1 - sum(tot_ph.values()) / tot:8.1%}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
