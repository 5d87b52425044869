"""``coli tune``: sweep thread counts and the other run settings, plot them, recommend, save the choice.

The sweep (docs/tuning.md):

* Numba threads: 1 .. the physical cores available, and the logical count when it is larger
  (``--threads`` gives a list in ``coli bench``'s syntax instead);
* I/O threads (the RAM expert cache's disk readers): swept (1, 4, 8) only when some experts stream from
  disk (``coli.plan``), else the engine's 4;
* the Numba threading layer: each usable one (``tbb``, ``omp``) in a subprocess of its own, since the
  layer is fixed when a process first launches a parallel kernel;
* with a device (``--device vulkan``): device off and on, and on with the balancer off and on.

Each point runs ``--reps`` times (default 3) and the points alternate (every repetition visits every point,
in reverse order every other repetition) so drift and other load hit all points alike. One run is one
prompt of ``-p`` tokens and ``-n`` decode tokens (``coli.bench.run_bench`` with one repetition; every engine
warms up once first, and compile time is never counted).

Outputs in ``--out`` (default ``./coli-tune``): ``tune.csv`` (one row per run: :data:`CSV_FIELDS`) and
``tune.png`` (matplotlib, Agg: decode and prefill tok/s against threads, one line per configuration, the
mean with min-max bars), ``tune.json`` (each point's mean/min/max, the default point, the recommendation or
None on a busy machine, the load averages). The recommendation is the point with the best mean decode tok/s, printed with its
margin over the default point (the engine's defaults); when the 1-minute load average before the sweep is
above ``--max-load`` (default half the logical CPUs) the machine is busy and tune says so instead of
recommending. ``--save`` writes the recommendation to :func:`config_path` (``[run]`` table: ``threads``,
``io_threads``, ``threading_layer``), which ``coli run`` reads (:func:`load_config`).

Errors: ``ColiError`` naming the option or file.

Numba, cpu_kernels, the engine and matplotlib are imported inside the functions that use them: ``coli run`` reads
the saved config (``load_config``, ``apply_layer``) before Numba loads, so that its threading layer still applies,
and matplotlib loads only to draw the plot.
"""
from __future__ import annotations

import csv
import datetime as _dt
import json
import os
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

import numpy as np
import psutil

from coli.base import settings
from coli.base.errors import ColiError
from coli.base.paths import atomic_write_text
from coli.base.progress import bar
from coli.resolve import resolve
from coli.vulkan import device_flag

CSV_FIELDS = ["model", "layer", "threads", "io_threads", "device", "balance", "rep", "n_prompt", "n_gen",
              "prefill_tps", "decode_tps", "decode_weight_gbps", "load_avg"]
LAYERS = ("tbb", "omp")


# -- configuration file ------------------------------------------------------------------------------------
RUN_KEYS = ("threads", "io_threads", "threading_layer")  # the keys of the [run] table


def _abs_env(name: str) -> str | None:
    """An XDG base-directory variable when it is an absolute path (the XDG spec: a relative one is ignored)."""
    v = os.environ.get(name)
    return v if v and os.path.isabs(v) else None


def config_path() -> Path | None:
    """``$XDG_CONFIG_HOME/coli/config.toml`` or ``~/.config/coli/config.toml`` (None without a home folder:
    HOME unset and no passwd entry). The path is returned whether or not it can be written: a read-only or
    file ``HOME`` only has no config file to read (:func:`load_config`), and ``--save`` says it cannot write."""
    xdg = _abs_env("XDG_CONFIG_HOME")
    if xdg:
        return Path(xdg) / "coli" / "config.toml"
    try:
        home = Path.home()
    except (RuntimeError, KeyError, OSError):
        return None
    return home / ".config" / "coli" / "config.toml"


def load_config(path: Path | None = None) -> tuple[dict, Path | None]:
    """The ``[run]`` table of the config file and its path, or ``({}, None)`` when there is no file.
    ColiError naming the file for bad TOML, a bad value (``threads`` an int >= 1, ``io_threads`` an int in
    1..``coli.runtime.IO_THREADS_MAX``, ``threading_layer`` one of :data:`LAYERS`) or a key coli does not know
    (a misspelt key would otherwise be ignored without a word)."""
    from coli.runtime import IO_THREADS_MAX

    p = Path(path) if path is not None else config_path()
    try:
        if p is None or not p.is_file():
            return {}, None
    except OSError:  # HOME unreadable: no config to read
        return {}, None
    try:
        with open(p, "rb") as f:
            doc = tomllib.load(f)
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise ColiError(f"{p}: not a readable TOML file ({e})") from None
    unknown = [k for k in doc if k != "run"]
    if unknown:
        raise ColiError(f"{p}: unknown table or key '{unknown[0]}' (coli reads [run] only)")
    run = doc.get("run", {})
    if not isinstance(run, dict):
        raise ColiError(f"{p}: [run] must be a table")
    unknown = [k for k in run if k not in RUN_KEYS]
    if unknown:
        raise ColiError(f"{p}: unknown key run.{unknown[0]} (known: {', '.join(RUN_KEYS)})")
    for k, hi in (("threads", None), ("io_threads", IO_THREADS_MAX)):
        if k in run and (not isinstance(run[k], int) or isinstance(run[k], bool) or run[k] < 1
                         or (hi is not None and run[k] > hi)):
            raise ColiError(f"{p}: run.{k} = {run[k]!r} (an integer >= 1" + (f", at most {hi})" if hi else ")"))
    if "threading_layer" in run and run["threading_layer"] not in LAYERS:
        raise ColiError(f"{p}: run.threading_layer = {run['threading_layer']!r} ({' or '.join(LAYERS)})")
    return run, p


def save_config(rec: dict, note: str, path: Path | None = None) -> Path:
    """Write ``rec`` (``threads``, ``io_threads``, ``threading_layer``) as the ``[run]`` table, atomically.
    Refuses (ColiError) to overwrite a file that coli did not write (no ``# coli tune`` first line)."""
    p = Path(path) if path is not None else config_path()
    if p is None:
        raise ColiError("--save: no home folder for ~/.config/coli/config.toml (HOME unset); set XDG_CONFIG_HOME")
    if p.exists():
        with open(p, encoding="utf-8", errors="replace") as f:
            if not f.readline().startswith("# coli tune"):
                raise ColiError(f"{p}: exists and was not written by coli tune; not overwritten")
    lines = [f"# coli tune, {_dt.datetime.now().strftime('%Y-%m-%d %H:%M')}: {note}", "[run]",
             f"threads = {int(rec['threads'])}", f"io_threads = {int(rec['io_threads'])}",
             f'threading_layer = "{rec["layer"]}"', ""]

    try:
        p.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(p, "\n".join(lines))
    except OSError as e:
        raise ColiError(f"--save: {p}: {e.strerror or e} (set XDG_CONFIG_HOME to a writable folder)") from None
    return p


def apply_layer(layer: str | None) -> None:
    """Ask Numba for ``layer`` ("tbb" | "omp") before anything imports numba: "omp" is set in the environment
    (passive waiting) and numba imported first, so ``cpu_kernels`` keeps it; "tbb" is cpu_kernels' own first
    choice. No effect once numba is imported."""
    if layer != "omp" or "numba" in sys.modules:
        return
    os.environ["NUMBA_THREADING_LAYER"] = "omp"
    os.environ.setdefault("OMP_WAIT_POLICY", "passive")
    import numba  # noqa: F401


# -- the sweep -----------------------------------------------------------------------------------------------
def usable_layers() -> list[str]:
    """The threading layers a fresh process can launch (a subprocess tries each)."""
    out = []
    for layer in LAYERS:
        code = ("import sys; from coli.tune import apply_layer; apply_layer(sys.argv[1]); import cpu_kernels; "
                "print(cpu_kernels.threading_layer())")
        r = subprocess.run([sys.executable, "-c", code, layer], capture_output=True, text=True, timeout=300,
                           cwd=str(Path(__file__).resolve().parent.parent))
        if r.returncode == 0 and r.stdout.strip().splitlines()[-1:] == [layer]:
            out.append(layer)
    return out


def default_threads_list() -> list[int]:
    """1 .. physical cores available, then the logical count when larger."""
    import cpu_kernels

    phys = cpu_kernels.default_threads()
    try:
        logical = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        logical = psutil.cpu_count() or phys
    ts = list(range(1, phys + 1))
    if logical > phys:
        ts.append(logical)
    return ts


def _points(spec: dict) -> list[dict]:
    pts = []
    for io in spec["io_threads"]:
        for dev in spec["devices"]:
            bals = [None] if dev == "cpu" else spec["balances"]
            for bal in bals:
                for t in spec["threads"]:
                    pts.append(dict(threads=t, io_threads=io, device=dev, balance=bal))
    return pts


def worker(spec: dict, emit) -> None:
    """Run the sweep of one threading layer in this process (the parent sets the layer before numba is
    imported); ``emit(dict)`` gets one record a run (:data:`CSV_FIELDS`)."""
    from coli.bench import run_bench
    from coli.engine import Engine

    layer = spec["layer"]
    engines = {}
    ctx = max(spec["n_prompt"], spec["n_gen"]) + 2
    try:
        for pt in _points(spec):
            key = (pt["io_threads"], pt["device"])
            if key not in engines:
                dev, index = device_flag(pt["device"])  # "vulkan:N": the index as coli run passes it
                dev = None if dev == "cpu" else dev
                eng = Engine(spec["model"], threads=max(spec["threads"]), ctx=ctx, io_threads=pt["io_threads"],
                             device=dev, balance=True if dev else None, quiet=True, save_usage=False, cli_names=True,
                             env=settings.overlay(None, COLI_VK_DEV=index))
                if dev and eng.tier is None:
                    eng.close()
                    raise ColiError(f"--device {pt['device']}: no expert tier (a dense model runs on the CPU; "
                                    f"coli tune sweeps the tier's device)")
                engines[key] = eng
                run_bench(eng, n_prompt=spec["n_prompt"], n_gen=spec["n_gen"], reps=1, threads=[max(spec["threads"])],
                          warmup=False)  # the warm-up: compile, page cache, RAM cache
        pts = _points(spec)
        for rep in range(spec["reps"]):
            for pt in (pts if rep % 2 == 0 else pts[::-1]):
                eng = engines[(pt["io_threads"], pt["device"])]
                if eng.tier is not None:
                    eng.tier.balancer.enabled = bool(pt["balance"])
                recs = run_bench(eng, n_prompt=spec["n_prompt"], n_gen=spec["n_gen"], reps=1,
                                 threads=[pt["threads"]], warmup=False)
                pp, tg = recs[0], recs[1]
                emit(dict(model=Path(spec["model"]).name, layer=layer, threads=pt["threads"],
                          io_threads=pt["io_threads"], device=pt["device"],
                          balance="" if pt["balance"] is None else ("on" if pt["balance"] else "off"), rep=rep,
                          n_prompt=spec["n_prompt"], n_gen=spec["n_gen"], prefill_tps=round(pp["avg_ts"], 3),
                          decode_tps=round(tg["avg_ts"], 3), decode_weight_gbps=round(tg["weight_gbps"], 3),
                          load_avg=tg["load_avg"]))
    finally:
        for e in engines.values():
            e.close()


def _run_layer(spec: dict, on_record) -> None:
    """The worker for ``spec["layer"]`` in a subprocess; records arrive as JSON lines."""
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")

    with tempfile.TemporaryFile(mode="w+") as errf:  # a file, not a pipe: a chatty worker never blocks
        p = subprocess.Popen([sys.executable, "-m", "coli.tune", "--worker", json.dumps(spec)],
                             stdout=subprocess.PIPE, stderr=errf, text=True, env=env, cwd=root)
        try:
            for line in p.stdout:
                if line.startswith("{"):
                    on_record(json.loads(line))
            rc = p.wait()
        except BaseException:
            p.kill()
            p.wait()
            raise
        errf.seek(0)
        err = errf.read()
    if rc != 0:
        last = [l for l in err.strip().splitlines() if l.strip()][-1:] or [f"exit code {rc}"]
        why = last[0].removeprefix("coli: ")  # the worker's own error line: one prefix on the line
        raise ColiError(f"coli tune: the {spec['layer']} threading layer's run failed: {why}")


def summarize(rows: list[dict]) -> list[dict]:
    """One entry a point: its settings, n runs, mean/min/max of prefill and decode tok/s."""
    keys = ("layer", "threads", "io_threads", "device", "balance")
    groups: dict = {}
    for r in rows:
        groups.setdefault(tuple(r[k] for k in keys), []).append(r)
    out = []
    for k, rs in groups.items():
        d = np.array([float(r["decode_tps"]) for r in rs])
        p = np.array([float(r["prefill_tps"]) for r in rs])
        out.append(dict(zip(keys, k), runs=len(rs), decode_mean=float(d.mean()), decode_min=float(d.min()),
                        decode_max=float(d.max()), prefill_mean=float(p.mean()), prefill_min=float(p.min()),
                        prefill_max=float(p.max())))
    return out


def _n(k: int, what: str) -> str:
    """``1 thread``, ``2 threads``."""
    return f"{k} {what}{'' if k == 1 else 's'}"


def recommend(points: list[dict], default: dict) -> tuple[dict, dict | None, str]:
    """The point with the best mean decode tok/s, the default point (or None when the sweep missed it) and
    a sentence: the margin over the default, and whether the two overlap (min-max), i.e. within noise."""
    best = max(points, key=lambda p: (p["decode_mean"], p["prefill_mean"]))
    keys = ("layer", "threads", "io_threads", "device", "balance")
    dflt = next((p for p in points if all(p[k] == default[k] for k in keys)), None)
    what = (f"{_n(best['threads'], 'thread')}, {_n(best['io_threads'], 'I/O thread')}, {best['layer']}"
            + ("" if best["device"] == "cpu" else f", device {best['device']} balance {best['balance']}"))
    if dflt is None:
        return best, None, f"recommended: {what} (decode {best['decode_mean']:.2f} tok/s; the default was not swept)"
    margin = 100.0 * (best["decode_mean"] / dflt["decode_mean"] - 1.0) if dflt["decode_mean"] > 0 else 0.0
    s = (f"recommended: {what}: decode {best['decode_mean']:.2f} tok/s, {margin:+.1f}% over the default "
         f"({_n(dflt['threads'], 'thread')}: {dflt['decode_mean']:.2f} tok/s)")
    if best is dflt:
        s = f"recommended: the default ({what}): decode {best['decode_mean']:.2f} tok/s, best of the sweep"
    elif best["decode_min"] <= dflt["decode_max"]:
        s += "; the ranges overlap (within noise): the default is as good"
    return best, dflt, s


def plot(points: list[dict], path: Path | None, title: str = ""):
    """PNG of decode and prefill tok/s against threads: one line per configuration, mean with min-max bars, the
    y axes from 0, ``title`` (the model and the sweep) above both. ``path`` None: returns the matplotlib figure
    instead of writing it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    confs: dict = {}
    for p in points:
        label = f"{p['layer']}, io {p['io_threads']}" + ("" if p["device"] == "cpu" else f", {p['device']} balance {p['balance']}")
        confs.setdefault(label, []).append(p)
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, m in ((axes[0], "decode"), (axes[1], "prefill")):
        for label, ps in confs.items():
            ps = sorted(ps, key=lambda p: p["threads"])
            x = [p["threads"] for p in ps]
            y = [p[f"{m}_mean"] for p in ps]
            lo = [p[f"{m}_mean"] - p[f"{m}_min"] for p in ps]
            hi = [p[f"{m}_max"] - p[f"{m}_mean"] for p in ps]
            ax.errorbar(x, y, yerr=[lo, hi], marker="o", capsize=3, label=label)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_xlabel("Numba threads")
        ax.set_ylabel("tok/s")
        ax.set_ylim(bottom=0)  # from 0: a 2 % difference does not look like a 2x one
        ax.set_title(f"{m} tok/s (mean, min-max)")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    if path is None:  # the figure itself (tests read its titles and axes)
        return fig
    tmp = path.with_name(f".{path.name}.tmp")
    fig.savefig(tmp, format="png", dpi=100)
    plt.close(fig)
    os.replace(tmp, path)


def _check_out(out: Path) -> None:
    for name in ("tune.csv", "tune.png", "tune.json"):
        f = out / name
        if f.exists() and not f.is_file():
            raise ColiError(f"{f}: exists and is not a file")


def _check_device(flag: str, label: str) -> None:
    """``--device vulkan[:N]`` opened and closed before the sweep: one asked for and not had is one ColiError
    naming the flag, as ``coli run`` says it, not a failed sweep."""
    from coli.vulkan import VulkanError, open_device

    index = device_flag(flag)[1]
    try:
        open_device(label, quiet=True, required=True, device_index=index,
                    index_name=f"--device {flag}" if index is not None else None).close()
    except (VulkanError, ColiError) as e:
        why = str(e)
        raise ColiError(why if why.startswith(f"--device {flag}") else f"--device {flag}: {why}") from None


def cmd_tune(a) -> int:
    """``coli tune -m MODEL [--device cpu|vulkan|vulkan:N] [--out DIR] [--save] [--threads LIST] [--io-threads LIST]
    [--layers LIST] [--reps N] [-p N] [-n N] [--max-load X]``."""
    from coli.bench import parse_int_list

    device_flag(a.device)  # a bad --device before the model is fetched
    a.model = resolve(a.model or "demo", quiet=False)   # a path or a name -m takes (smollm2, demo, ...)
    if not os.path.isfile(a.model):
        raise ColiError(f"{a.model}: not a GGUF file (coli tune takes a .gguf file or a model name)")
    if a.reps < 1:
        raise ColiError(f"--reps: {a.reps} (at least 1)")
    if a.n_prompt < 1 or a.n_gen < 2:
        raise ColiError(f"-p {a.n_prompt} -n {a.n_gen}: need a prompt of >= 1 token and >= 2 decode tokens")
    import cpu_kernels  # before numba: it picks the threading layer
    import numba

    threads = parse_int_list(a.threads, "--threads", minimum=1) if a.threads else default_threads_list()
    pool = numba.config.NUMBA_NUM_THREADS
    if max(threads) > pool:
        raise ColiError(f"--threads: {max(threads)} is above Numba's pool of {pool} (NUMBA_NUM_THREADS)")
    from coli.plan import make_plan

    plan = make_plan(a.model)
    if a.io_threads:
        ios = parse_int_list(a.io_threads, "--io-threads", minimum=1)
        from coli.runtime import IO_THREADS_MAX

        if max(ios) > IO_THREADS_MAX:
            raise ColiError(f"--io-threads: {max(ios)} (1 to {IO_THREADS_MAX})")
    else:
        ios = [1, 4, 8] if plan["streams_from_disk"] else [4]
    if a.layers:
        layers = [s.strip() for s in a.layers.split(",")]
        bad = [l for l in layers if l not in LAYERS]
        if bad:
            raise ColiError(f"--layers: {bad[0]!r} ({' or '.join(LAYERS)})")
    else:
        layers = usable_layers()
        if not layers:
            raise ColiError("no Numba threading layer could start (tbb, omp)")
    devices = ["cpu"] + ([a.device] if device_flag(a.device)[0] == "vulkan" else [])  # "vulkan" or "vulkan:N"
    if len(devices) > 1 and not plan["moe_layers"]:  # the sweep's device points are the expert tier's
        raise ColiError(f"--device {a.device}: {Path(a.model).name} is a dense model: coli tune sweeps the device's "
                        f"expert tier (balance off and on), which only routed experts use; tune it without --device")
    if len(devices) > 1:
        _check_device(a.device, Path(a.model).name)
    balances = [False, True]
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    _check_out(out)
    default = dict(layer=layers[0] if "tbb" not in layers else "tbb", threads=cpu_kernels.default_threads(),
                   io_threads=4, device="cpu", balance="")
    load0 = os.getloadavg()[0]
    ncpu = os.cpu_count() or 1
    max_load = a.max_load if a.max_load is not None else ncpu / 2
    spec = dict(model=str(Path(a.model).resolve()), threads=threads, io_threads=ios, devices=devices,
                balances=balances, reps=a.reps, n_prompt=a.n_prompt, n_gen=a.n_gen)
    n_points = len(_points(spec)) * len(layers)
    print(f"coli tune: {Path(a.model).name}: {n_points} points x {a.reps} runs (threads {threads}, I/O threads "
          f"{ios}{'' if plan['streams_from_disk'] else ' (nothing streams from disk)'}, layers {layers}, "
          f"devices {devices}); load average {load0:.2f} on {ncpu} CPUs", file=sys.stderr)
    rows: list[dict] = []
    pbar = bar(total=n_points * a.reps, desc="tune points", unit=" runs")
    try:
        for layer in layers:
            pbar.set_description_str(f"tune points ({layer}: loading, warming up)")

            def got(rec):
                pbar.set_description_str(f"tune points ({rec['layer']})", refresh=False)
                rows.append(rec)
                pbar.update(1)
                pbar.set_postfix_str(f"{rec['layer']} t{rec['threads']}: {rec['decode_tps']:.1f} tok/s")

            _run_layer(dict(spec, layer=layer), got)
    finally:
        pbar.close()
    csv_path, png_path = out / "tune.csv", out / "tune.png"
    tmp = csv_path.with_name(".tune.csv.tmp")
    with open(tmp, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=CSV_FIELDS, lineterminator="\n")
        w.writeheader()
        for r in rows:
            w.writerow({k: r[k] for k in CSV_FIELDS})
    os.replace(tmp, csv_path)
    points = summarize(rows)
    load1 = max(r["load_avg"] for r in rows) if rows else load0
    plot(points, png_path, f"coli tune: {Path(a.model).name}, {a.reps} runs a point, -p {a.n_prompt} -n {a.n_gen}, "
                           f"load average {load0:.2f} before, {load1:.2f} at most, {ncpu} CPUs")
    for p in sorted(points, key=lambda p: -p["decode_mean"]):
        print(f"  {p['layer']:3} threads {p['threads']:>2} io {p['io_threads']:>2} {p['device']:6} {p['balance']:3}  "
              f"decode {p['decode_mean']:8.2f} [{p['decode_min']:.2f}, {p['decode_max']:.2f}]  "
              f"prefill {p['prefill_mean']:8.2f} [{p['prefill_min']:.2f}, {p['prefill_max']:.2f}] tok/s")
    best, dflt, sentence = recommend(points, default)
    busy = load0 > max_load
    summary = dict(model=str(a.model), points=points, default=dflt, load_before=load0, load_max=load1, cpus=ncpu,
                   max_load=max_load, busy=busy, recommended=None if busy else best,
                   sentence=None if busy else sentence)
    json_path = out / "tune.json"
    tmp = json_path.with_name(".tune.json.tmp")
    tmp.write_text(json.dumps(summary, indent=2), encoding="utf-8")
    os.replace(tmp, json_path)
    print(f"coli tune: wrote {csv_path} ({len(rows)} runs), {png_path} and {json_path}", file=sys.stderr)
    if busy:
        print(f"coli tune: the machine is busy (load average {load0:.2f} before the sweep on {ncpu} CPUs, above "
              f"--max-load {max_load:g}): no recommendation; run again when it is idle", file=sys.stderr)
        if a.save:
            raise ColiError(f"--save: not saved, the machine was busy (load average {load0:.2f})")
        return 0
    print(f"coli tune: {sentence} (load average {load0:.2f} before, {load1:.2f} at most during)")
    if a.save:
        note = f"{Path(a.model).name}: {sentence}"
        p = save_config(best, note)
        print(f"coli tune: saved to {p} (coli run reads it)", file=sys.stderr)
    return 0


def _worker_main(spec_json: str) -> int:
    spec = json.loads(spec_json)
    apply_layer(spec["layer"])
    import cpu_kernels

    got = cpu_kernels.threading_layer()
    if got != spec["layer"]:
        print(f"coli tune: asked for the {spec['layer']} threading layer, numba started {got}", file=sys.stderr)
        return 3

    def emit(rec):
        sys.stdout.write(json.dumps(rec) + "\n")
        sys.stdout.flush()

    try:
        worker(spec, emit)
    except ColiError as e:
        print(f"coli: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--worker":
        raise SystemExit(_worker_main(sys.argv[2]))
    raise SystemExit("usage: coli tune ... (python -m coli.tune --worker SPEC is internal)")
