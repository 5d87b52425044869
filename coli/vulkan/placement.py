"""The placement gate of ``--gpu-layers -1`` on a MoE model whose layers do not all fit the device whole (docs/vulkan.md
"Whole layers or experts apart"): (a) the last layers whole on the device, the others on the CPU, or (b) every layer's
attention on the device with its routed experts apart, some resident and the rest joined from the CPU mid-layer; within
(b), which experts are resident. Decided by a cost model whose costs are measured by this device's own runs of each
placement (:class:`Runs`), and by the routing history (``scheduler.usage``'s counts) for what a token will route.

The model, in ms a decode token (everything that is the same in both arms, the head, the sampler, cancels out; the
intercepts ``h``, ``h2`` are fitted with the rest where the runs determine them):

* a layer whole on the device: ``w``; a layer on the CPU: ``c``;
* a layer with its experts apart (``DeviceLayers.resident``: a program cut there, the host joining every token): ``a``
  (the device's layer up to its route and the join: the host's wait, its signal, the device's restart), plus ``x``
  when some of its experts are resident (their segment, X_i), plus ``jc`` on the tokens whose route names an expert
  that is not resident (the CPU's compiled call: :func:`all_resident`), plus ``p`` a routed (row, expert) pair the CPU
  computes (:func:`cpu_pairs`);
* a layer with every expert resident has no cut: ``w``.

Serial, although the code lets X_i run beside the host's call (layer_join.py): on an H100 (semaphore way,
2026-12-07) a cut layer less its calls cost 0.416 ms where all 16 had resident experts and 0.270 ms where 1 of 9 had
(a max of the two parts would make both the same); ``a`` 0.223 and ``x`` 0.193 (about the X segment's own device time
by its timestamps) fit both. A way's own runs give its costs (:func:`fit`'s ``way``: a cut run records its way).

``jc`` and ``p`` come from the runs' compiled calls (``t = jc + p n`` fitted over the calls, n pairs each); ``h, w, a,
x`` from the device layers' time a token, less those; ``h2, c`` from the rest of the token (the CPU's layers, the
sampler). Least squares over the runs' placements (distinct (whole, cut, cut with resident experts, CPU) counts);
``x`` needs cut layers with and without resident experts (``--cpu-moe`` beside ``--tier-gb``), else it stays in ``a``
(None); another cost the runs do not determine leaves the gate undecided: whole layers, said on the start line.
"""
from __future__ import annotations

import json
import time
import math
from dataclasses import dataclass, field, fields
from pathlib import Path

import numpy as np

from coli.base import settings
from coli.base.errors import ColiError
from coli.base.paths import atomic_write_text, optional_cache_dir

#: placements a run can be recorded as (:class:`Runs`) and the gate's arms
ARMS = ("layers", "experts")


def _probs(counts) -> np.ndarray:
    """Routing probability of each expert from one layer's counts (int [E]); uniform when the history is empty."""
    c = np.asarray(counts, np.float64)
    s = c.sum()
    return c / s if s > 0 else np.full(len(c), 1.0 / len(c))


def all_resident(counts, resident, k: int) -> float:
    """Probability that a token's ``k`` routed experts (distinct) of a layer are all resident (bool [E] ``resident``),
    routing drawn from the history's ``counts`` (int [E]) without replacement, each draw removing the mean mass of
    the resident set: ``prod_{i<k} (M - i M/m) / (1 - i M/m)``, ``M`` the resident experts' share of the counts, ``m``
    their number. Exact for uniform routing (``C(m, k) / C(E, k)``) and 1 when the resident experts hold every count
    (a history of at most ``m`` distinct experts); 0 when ``m < k``."""
    r = np.asarray(resident, bool)
    m = int(r.sum())
    if m < k:
        return 0.0
    M = float(_probs(counts)[r].sum())
    if M >= 1.0 - 1e-12:
        return 1.0
    a = M / m
    return float(np.prod([(M - i * a) / (1.0 - i * a) for i in range(k)]))


def cpu_pairs(counts, resident, k: int) -> float:
    """Expected routed pairs a token of one layer leaves to the CPU: ``k`` times the history's share of the experts
    that are not resident (exact for uniform routing: ``k (E - m) / E``)."""
    return float(k * _probs(counts)[~np.asarray(resident, bool)].sum())


@dataclass
class Costs:
    """ms a decode token (the module's model); None: not determined by the runs. ``runs``: the runs they came from."""
    w: float | None = None
    a: float | None = None
    x: float | None = None
    c: float | None = None
    jc: float | None = None
    p: float | None = None
    h: float = 0.0
    h2: float = 0.0
    runs: int = 0
    note: str = ""

    def known(self, *names) -> bool:
        return all(getattr(self, n) is not None for n in names)

    def line(self) -> str:
        f = [(n, getattr(self, n)) for n in ("w", "a", "x", "jc", "p", "c")]
        txt = {"w": "whole device layer", "a": "cut layer (device part and join)", "x": "its resident experts",
               "jc": "CPU call", "p": "CPU pair", "c": "CPU layer"}
        return ", ".join(f"{txt[n]} {v:.3f} ms" for n, v in f if v is not None)


def layer_costs(costs: Costs, counts, k: int) -> np.ndarray:
    """ms a token of one layer on the device with its ``m`` hottest experts resident (by ``counts`` int [E]), for
    ``m`` = 0 .. E (f64 [E + 1]): ``w`` at ``m == E`` (no cut), else ``a + x [m > 0] + jc (1 - all_resident) + p
    cpu_pairs`` (:func:`all_resident`'s product, for every ``m`` at once)."""
    pr = np.sort(_probs(counts))[::-1]
    E = len(pr)
    m = np.arange(E + 1, dtype=np.float64)
    M = np.concatenate([[0.0], np.cumsum(pr)])
    mean = np.divide(M, m, out=np.zeros_like(M), where=m > 0)
    allr = np.ones(E + 1)
    for i in range(k):
        allr *= np.clip(M - i * mean, 0.0, None) / np.maximum(1.0 - i * mean, 1e-300)
    allr[m < k] = 0.0
    allr[M >= 1.0 - 1e-12] = 1.0
    out = costs.a + (costs.x or 0.0) * (m > 0) + costs.jc * (1.0 - allr) + costs.p * k * np.clip(1.0 - M, 0.0, None)
    out[E] = costs.w
    return out


def hottest_mask(counts, m: int) -> np.ndarray:
    """bool [E]: the ``m`` experts of highest count (ties: lower id first)."""
    c = np.asarray(counts, np.int64)
    order = np.lexsort((np.arange(len(c)), -c))
    mask = np.zeros(len(c), bool)
    mask[order[:max(0, int(m))]] = True
    return mask


def choose_resident(counts: np.ndarray, layers, cap: int, k: int, costs: Costs) -> dict:
    """The resident experts of ``layers`` (every one on the device, experts apart) that fit ``cap`` experts with the
    least predicted time a token: each layer's hottest experts (by ``counts`` int [L, E]), how many a layer gets by
    a greedy over :func:`layer_costs`: each step the extension of one layer (from its count m to any m' that fits the
    room left) that saves the most a expert. So a layer's hot set goes whole, or all its experts so its cut goes,
    before a spread over every layer that keeps every join (uniform routing: whole layers). Returns {layer: sorted
    expert ids}."""
    layers = list(layers)
    if not layers:
        return {}
    E = counts.shape[1]
    C = np.stack([layer_costs(costs, counts[il], k) for il in layers])       # [L, E + 1]
    m = np.zeros(len(layers), np.int64)
    left = int(cap)
    steps = np.arange(1, E + 1)
    while left > 0:
        to = m[:, None] + steps[None, :]                                      # [L, E] candidate counts
        ok = (to <= E) & (steps[None, :] <= left)
        gain = C[np.arange(len(layers)), m][:, None] - C[np.arange(len(layers))[:, None], np.minimum(to, E)]
        rate = np.where(ok, gain / steps[None, :], -np.inf)
        li, si = np.unravel_index(int(np.argmax(rate)), rate.shape)
        if not rate[li, si] > 0:
            break
        m[li] += si + 1
        left -= si + 1
    return {il: sorted(int(e) for e in np.flatnonzero(hottest_mask(counts[il], m[i]))) for i, il in enumerate(layers)}


def resident_sets(counts: np.ndarray, layers, cap: int, k: int, costs: Costs, spread) -> dict:
    """{layer: expert ids} resident of ``layers`` in ``cap`` experts: :func:`choose_resident` by the measured costs,
    or without them as the tier's warm start chooses, ``spread`` (``scheduler.tier_policy.warm_plan``, passed in:
    the scheduler sits above coli.vulkan): the history's hottest over all those layers first, then one unnamed
    expert a layer in turn."""
    layers = list(layers)
    if costs.known("w", "a", "jc", "p"):
        return choose_resident(counts, layers, cap, k, costs)
    c = np.zeros_like(counts)
    c[layers] = counts[layers]
    chosen, _ = spread(c, min(cap, counts.shape[1] * len(layers)), fill=True, layers=layers)
    res = {il: [] for il in layers}
    for il, e in chosen:
        res[il].append(e)
    return res


@dataclass
class Arm:
    """One arm's placement and prediction: ``first`` the first device layer; ``resident`` {layer: ids} (experts
    apart) or None (whole layers); ``ms`` predicted a token (None: the costs do not say); ``joins``, ``pairs``: the
    expected CPU calls and pairs a token; ``cut``: the layers with a program cut."""
    name: str
    first: int
    resident: dict | None = None
    ms: float | None = None
    joins: float = 0.0
    pairs: float = 0.0
    cut: int = 0

    def tps(self) -> str:
        return f"{1e3 / self.ms:.1f} tok/s" if self.ms else "no prediction"


@dataclass
class Decision:
    """The gate's choice (``arm``, one of ``arms``) and why (``why``, the start line's words); ``n`` the model's
    layers."""
    arm: Arm
    arms: list = field(default_factory=list)
    why: str = ""
    n: int = 0


def predict_layers(costs: Costs, n: int, first: int) -> float | None:
    """ms a token with layers ``first ..`` whole on the device and the others on the CPU."""
    if not costs.known("w", "c"):
        return None
    return costs.h + costs.h2 + costs.w * (n - first) + costs.c * first


def predict_experts(costs: Costs, counts: np.ndarray, n: int, first: int, moe, resident: dict, k: int, E: int) -> Arm:
    """Arm (b) with layers ``first ..`` on the device, ``resident`` {layer: ids} (a MoE layer absent: every expert
    resident), the layers before on the CPU: its expected joins and CPU pairs and (costs known) ms a token."""
    joins = pairs = 0.0
    cut = 0
    ms = costs.h + costs.h2 + (costs.c or 0.0) * first
    known = costs.known("w", "a", "jc", "p") and (first == 0 or costs.c is not None)
    for il in range(first, n):
        ids = resident.get(il) if il in moe else None
        if ids is None or len(ids) >= E:
            ms += costs.w or 0.0
            continue
        r = np.zeros(E, bool)
        r[list(ids)] = True
        q = 1.0 - all_resident(counts[il], r, k)
        n_cpu = cpu_pairs(counts[il], r, k)
        joins, pairs, cut = joins + q, pairs + n_cpu, cut + 1
        if known:
            ms += costs.a + (costs.x or 0.0) * bool(len(ids)) + costs.jc * q + costs.p * n_cpu
    return Arm("experts", first, resident, ms if known else None, joins, pairs, cut)


def decide(costs: Costs, counts: np.ndarray, n: int, moe, k: int, E: int, first_layers: int, first_apart: int,
           cap: int, spread, force: str = "auto") -> Decision:
    """The gate: arm (a) layers ``first_layers ..`` whole (``layer_plan.plan`` with the experts), arm (b) layers
    ``first_apart ..`` with ``cap`` experts resident (:func:`resident_sets`; ``spread`` its choice without the
    costs), the lower predicted ms wins; ``force``
    "layers" / "experts" (``COLI_VK_PLACEMENT``) takes that arm. Undecided (a cost the runs do not determine):
    whole layers."""
    res = resident_sets(counts, [il for il in range(first_apart, n) if il in moe], cap, k, costs, spread)
    a = Arm("layers", first_layers, None, predict_layers(costs, n, first_layers))
    b = predict_experts(costs, counts, n, first_apart, set(moe), res, k, E)
    if force in ARMS:
        pick, why = (a if force == "layers" else b), f"COLI_VK_PLACEMENT={force}"
    elif a.ms is None or b.ms is None:
        pick, why = a, f"whole layers: the costs are not measured yet ({costs.note or 'no run of each placement'})"
    else:
        pick = b if b.ms < a.ms else a
        why = f"the lower predicted time ({costs.runs} measured runs: {costs.line()})"
    return Decision(pick, [a, b], why, n)


# -- the measured runs ---------------------------------------------------------------------------------------------
@dataclass
class Run:
    """One run's decode tokens of device layers: the placement (``whole``, ``cut``, ``cpu`` layers; ``xcut`` of the cut
    ones with resident experts; ``way`` the cut layers' chain, ``layer_join.chain_way``, "" without a cut), its time a
    token in the device layers (``dl_ms``: submits, waits, joins) and the rest (``rest_ms``), and the CPU's compiled
    calls of joined experts: their count, pairs, seconds and sums for a line fit (``nn`` sum of n^2, ``nt`` of n t)."""
    whole: int
    cut: int
    cpu: int
    tokens: int
    dl_ms: float
    rest_ms: float
    calls: int = 0
    pairs: int = 0
    call_s: float = 0.0
    nn: float = 0.0
    nt: float = 0.0
    when: float = 0.0
    xcut: int = 0
    way: str = ""


#: a run's ``way``: none (no cut layer), or layer_join.chain_way's
RUN_WAYS = ("", "semaphore", "event", "split")


def _read_run(d) -> Run:
    """A run read back from a :class:`Runs` file (a dict of :class:`Run`'s fields): TypeError / ValueError unless
    each field is a number of its type (an int field an int), finite, the counts not negative and ``tokens`` > 0
    (what :meth:`Runs.add` keeps; :func:`fit` divides by ``tokens``)."""
    r = Run(**d)
    if r.way not in RUN_WAYS or (r.way == "") != (r.cut == 0) or not 0 <= r.xcut <= r.cut:
        raise ValueError(f"way {r.way!r}, xcut {r.xcut!r} of {r.cut!r} cut layers")
    for f in fields(Run):
        v = getattr(r, f.name)
        if f.type == "str":
            continue
        whole = f.type == "int"
        if isinstance(v, bool) or not isinstance(v, int if whole else (int, float)) or not math.isfinite(v):
            raise TypeError(f"{f.name}: {v!r}")
        if whole and v < 0:
            raise ValueError(f"{f.name}: {v!r}")
    if r.tokens <= 0:
        raise ValueError(f"tokens: {r.tokens}")
    return r


def _lsq(rows, ys, names):
    """Least squares ``ys ~ rows @ x``; {name: value} or None where the rows do not determine it (rank)."""
    X, y = np.asarray(rows, np.float64), np.asarray(ys, np.float64)
    if len(X) == 0:
        return {n: None for n in names}
    x, _, rank, _ = np.linalg.lstsq(X, y, rcond=None)
    if rank < X.shape[1]:
        return {n: None for n in names}
    return {n: float(v) for n, v in zip(names, x)}


def fit(runs: list[Run], way: str | None = None) -> Costs:
    """:class:`Costs` from ``runs`` (module docstring), of the cut runs only those of ``way`` (None: all): placements
    averaged first (the same (whole, cut, xcut, cpu) counts weigh as one); ``jc``, ``p`` from every run's calls
    together. The intercepts need one placement more than the costs they come with; with fewer they are 0 and the
    per-layer costs carry them (exact for the placements measured); ``x`` is None (carried by ``a``) where the runs do
    not tell it apart or it comes out negative."""
    if way is not None:
        runs = [r for r in runs if not r.cut or r.way == way]
    out = Costs(runs=len(runs))
    if not runs:
        out.note = "no run of device layers measured on this device and model"
        return out
    calls = sum(r.calls for r in runs)
    if calls:
        S1, Sn = calls, sum(r.pairs for r in runs)
        Snn, St, Snt = sum(r.nn for r in runs), sum(r.call_s for r in runs), sum(r.nt for r in runs)
        det = S1 * Snn - Sn * Sn
        if det > 1e-9 * max(1.0, S1 * Snn):
            out.p = 1e3 * (S1 * Snt - Sn * St) / det
            out.jc = 1e3 * (Snn * St - Sn * Snt) / det
        else:       # every call had the same pairs: the fixed cost and the pairs' together, a pair each
            out.jc, out.p = 0.0, 1e3 * St / max(Sn, 1)
        out.jc, out.p = max(out.jc, 0.0), max(out.p, 0.0)
    groups: dict = {}
    for r in runs:
        g = groups.setdefault((r.whole, r.cut, r.xcut, r.cpu), [0.0, 0.0, 0])
        dl = r.dl_ms - 1e3 * r.call_s / r.tokens     # the CPU's calls: jc and p
        g[0], g[1], g[2] = g[0] + dl * r.tokens, g[1] + r.rest_ms * r.tokens, g[2] + r.tokens
    keys = list(groups)
    dl = [groups[g][0] / groups[g][2] for g in keys]
    rest = [groups[g][1] / groups[g][2] for g in keys]
    # device layers: h + w whole + a cut + x xcut (each where the runs have it; x only where it is told apart from a)
    for names in (("w", "a", "x"), ("w", "a")):
        used = [i for i, nm in enumerate(names) if any(g[i] for g in keys)]
        nms = [names[i] for i in used]
        rows = [[g[i] for i in used] for g in keys]
        x = _lsq([[1.0] + r for r in rows], dl, ["h"] + nms) if len({tuple(r) for r in rows}) > len(nms) else None
        if x is None or any(v is None or v < 0 for v in x.values()):
            x = _lsq(rows, dl, nms)
            x["h"] = 0.0
        if all(v is not None for v in x.values()) and x.get("x", 0.0) >= 0:     # a negative x: noise, left in a
            break
    out.h = x.pop("h") or 0.0
    for nm, v in x.items():
        setattr(out, nm, v)
    cpu = [g[3] for g in keys]
    if any(cpu):
        y = _lsq([[1.0, c] for c in cpu], rest, ["h2", "c"]) if len(set(cpu)) > 1 else None
        if y is None or any(v is None or v < 0 for v in y.values()):
            y = {"h2": 0.0, "c": _lsq([[c] for c in cpu if c], [v for c, v in zip(cpu, rest) if c], ["c"])["c"]}
        out.h2, out.c = y["h2"] or 0.0, y["c"]
    miss = [txt for nm, txt in (("w", "layers whole on the device (--gpu-layers N)"),
                                ("a", "experts apart (--gpu-layers N --tier-gb G, --cpu-moe)"),
                                ("c", "layers on the CPU beside device layers (--gpu-layers N < the layers)"))
            if getattr(out, nm) is None]
    if out.p is None:
        miss.append("the CPU's experts joined")
    out.note = f"no run yet with {', '.join(miss)}" if miss else ""
    return out


#: the runs file's version (1: no ``xcut`` nor ``way``: started again)
VERSION = 2


class Runs:
    """The measured runs of one device and model shape: ``<folder>/<key>.json``, the folder ``COLI_VK_PLACEMENT_RUNS``
    of ``env`` (default ``<cache>/placement``; "off": none read or kept), the last :data:`KEEP` runs. A file that
    cannot be read, or holds anything but such runs (:func:`_read_run`), is started again (it holds measurements
    only)."""
    KEEP = 32

    def __init__(self, key: str, env=None):
        where = settings.get("COLI_VK_PLACEMENT_RUNS", env)
        if where == "off":
            d = None
        elif where:
            d = Path(where)
            try:
                d.mkdir(parents=True, exist_ok=True)
            except OSError as e:
                raise ColiError(f"COLI_VK_PLACEMENT_RUNS={where}: {e.strerror or e}") from None
        else:
            d = optional_cache_dir("placement", what="the placement gate's measured runs are not kept")
        safe = "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in key)[:180]
        self.path = d / f"{safe}.json" if d is not None else None
        self.runs: list[Run] = []
        if self.path is not None and self.path.exists():
            try:
                doc = json.loads(self.path.read_text("utf-8"))
                if doc["version"] != VERSION:   # version 1 kept no xcut nor way
                    raise ValueError(f"version {doc['version']!r}")
                self.runs = [_read_run(r) for r in doc["runs"]]
            except (ValueError, TypeError, KeyError, OSError):
                self.runs = []

    def add(self, run: Run) -> None:
        if run.tokens <= 0 or self.path is None:
            return
        run.when = time.time()
        self.runs = (self.runs + [run])[-self.KEEP:]
        doc = {"format": "coli_placement_runs", "version": VERSION, "runs": [r.__dict__ for r in self.runs]}
        try:
            atomic_write_text(self.path, json.dumps(doc))
        except OSError:
            pass    # measurements only: the next run measures again

    def costs(self, way: str | None = None) -> Costs:
        """The costs of this device and shape's runs (:func:`fit`), the cut layers' of ``way`` only where given."""
        return fit(self.runs, way)


def shape_key(m, device_name: str) -> str:
    """The runs' key: the device's name and what the costs depend on (layers, experts, top-k, widths, the expert
    tensors' format)."""
    a = m.args
    il = m.moe_layers[0] if m.moe_layers else 0
    t = m.t.get(f"blk.{il}.ffn_gate_exps.weight")
    fmt = t.type_name if t is not None else "dense"
    return f"{device_name}-L{len(m.layers)}-E{a.n_experts}-k{a.top_k}-d{a.d_model}-h{a.n_heads}-{fmt}"


class Calls:
    """The CPU's compiled calls of joined experts in a run (``RowJoin._cpu_ranks``): count, pairs, seconds and the
    sums of a line fit ``t = jc + p n`` (:func:`fit`), of the tokens :class:`TokenTimes` counted (a token's calls wait
    in ``_tok`` until it is counted or dropped)."""

    def __init__(self):
        self.n = self.pairs = 0
        self.s = self.nn = self.nt = 0.0
        self._tok = []

    def add(self, pairs: int, s: float) -> None:
        self._tok.append((pairs, s))

    def commit(self, keep: bool) -> None:
        for n, s in self._tok if keep else ():
            self.n += 1
            self.pairs += n
            self.s += s
            self.nn += n * n
            self.nt += n * s
        self._tok = []


class TokenTimes:
    """Wall seconds of consecutive decode tokens (positions p, p + 1) in the device layers (``dl_s``) and between
    them (``rest_s``: the CPU's layers, the sampler), ``tokens`` of them; a token after a prompt or a pause, or one
    during which a kernel compiled, is not counted (nor are its CPU calls, ``calls``)."""
    GAP_S = 1.0

    def __init__(self, calls: Calls):
        self.calls = calls
        self.tokens = 0
        self.dl_s = self.rest_s = 0.0
        self._end = None       # (position, perf_counter) at the last decode token's end

    def token(self, pos0: int, t_in: float, t_out: float, compiled: bool = False) -> None:
        e = self._end
        keep = e is not None and e[0] + 1 == pos0 and t_in - e[1] < self.GAP_S and not compiled
        if keep:
            self.tokens += 1
            self.dl_s += t_out - t_in
            self.rest_s += t_in - e[1]
        self.calls.commit(keep)
        self._end = (pos0, t_out)

    def run(self, whole: int, cut: int, cpu: int) -> Run:
        """This run as a :class:`Run` (``Runs.add``)."""
        n, c = max(self.tokens, 1), self.calls
        return Run(whole, cut, cpu, self.tokens, 1e3 * self.dl_s / n, 1e3 * self.rest_s / n, c.n, c.pairs, c.s, c.nn,
                   c.nt)
