"""The device expert tier's pure policy: budget, heat, warm-start plan, eviction choice (the rules'
table is docs/tier.md).

No device, no threads, no clock: functions of their arguments (and, for :func:`budget_bytes`, of the
environment and the memory budget, ``coli.base.memory.budget``, when not given), like ``scheduler/balancer.py``. ``scheduler/tier.py``
(the residency and the step API) and ``coli.vulkan``'s ``Device`` (its upload guard) both use
:func:`budget_bytes`: the device budget has this one rule.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

from coli.base.memory import budget
from coli.base.settings import get


GiB = 1 << 30
MiB = 1 << 20
HEAT_HISTORY_TOP = 32.0       # a layer's hottest expert in the history starts at this heat
HEAT_HALF_TOKENS = 1024       # heat halves every 1024 tokens
LFRU_FACTOR = 1.25            # promote over the coldest when heat > 1.25 * coldest + 4
LFRU_ADD = 4.0
SHARED_KINDS = ("integrated", "cpu", "virtual", "other")


def _env_float(env, name: str, default: float | None) -> float | None:
    """``COLI_*`` number from ``env`` through coli.base.settings (one parser; ColiError naming the variable)."""
    v = get(name, env)
    return default if v is None else float(v)


def _env_int(env, name: str, default: int) -> int:
    v = get(name, env)
    return default if v is None else int(v)


# ---------------------------------------------------------------------------------------------------------
# Budget

@dataclass(frozen=True)
class DeviceMemory:
    """What the budget rule reads from the device.

    ``kind``: "discrete" | "integrated" | "cpu" (Lavapipe) | "virtual" | "other" (VkPhysicalDeviceType);
    ``heap_bytes``: size of the device-local heap the experts go to; ``budget_free``: that heap's
    ``heapBudget - heapUsage`` from VK_EXT_memory_budget, or None without the extension.
    """

    name: str
    kind: str
    heap_bytes: int
    budget_free: int | None = None

    @classmethod
    def of(cls, dev) -> "DeviceMemory":
        """From a DeviceMemory; from coli.vulkan's ``Device`` (``name``, ``type_name``, ``heaps`` [(bytes,
        device_local)], optional ``budget_free``: the biggest device-local heap); or from a mapping / object
        with ``name``, ``kind`` (or ``device_type``), ``heap_bytes``, optional ``budget_free``.
        ValueError naming what is missing."""
        if isinstance(dev, cls):
            return dev
        get = dev.get if isinstance(dev, dict) else (lambda k, d=None: getattr(dev, k, d))
        heaps = get("heaps")
        if heaps and get("type_name") is not None:
            dl = [int(sz) for sz, local in heaps if local] or [int(sz) for sz, _ in heaps]
            kind, heap = get("type_name"), max(dl)
        else:
            kind = get("kind") or get("device_type")
            heap = get("heap_bytes")
        if kind is None or heap is None:
            raise ValueError("device memory info needs 'kind' (or 'device_type' / 'type_name') and "
                             "'heap_bytes' (or 'heaps')")
        kind = str(kind).lower().replace("vk_physical_device_type_", "").replace("_gpu", "")
        free = get("budget_free")
        return cls(str(get("name", "") or ""), kind, int(heap), None if free is None else int(free))


def budget_bytes(device_info, ram_cache_bytes: int, dense_bytes: int, env=None,
                 available: int | None = None) -> tuple[int, str]:
    """The tier's budget in bytes and the words of the rule that set it (for the start line).

    ``device_info``: :class:`DeviceMemory` (or what :meth:`DeviceMemory.of` takes); ``ram_cache_bytes``:
    the RAM expert cache's configured size (slots × layers × expert bytes); ``dense_bytes``: the dense
    weights' bytes (on the CPU in coli, so they count against RAM on a shared-RAM device only);
    ``env``: the environment (``os.environ``); ``available``: memory the process may still take (when None: what
    the memory budget, ``coli.base.memory.budget``, leaves: the smallest of the cgroup's limit, ``COLI_MEM`` and the
    RAM available, less what the process holds). ColiError on a malformed ``COLI_VK_TIER_GB`` / ``COLI_VK_TIER_RESERVE_GB``.
    """
    env = os.environ if env is None else env
    d = DeviceMemory.of(device_info)
    gb = _env_float(env, "COLI_VK_TIER_GB", None)
    if gb is not None:
        b = int(gb * GiB)
        words = f"COLI_VK_TIER_GB={env['COLI_VK_TIER_GB']}"
        if d.heap_bytes and b > d.heap_bytes:
            b = d.heap_bytes
            words += f" (capped at the device's {d.heap_bytes / GiB:.2f} GiB heap)"
        return b, words
    if d.kind == "discrete":
        reserve = int(_env_float(env, "COLI_VK_TIER_RESERVE_GB", 1.0) * GiB)
        if d.budget_free is not None:
            free, what = d.budget_free, f"VK_EXT_memory_budget's {d.budget_free / GiB:.2f} GiB free"
        else:
            free, what = d.heap_bytes, f"the {d.heap_bytes / GiB:.2f} GiB heap (no VK_EXT_memory_budget)"
        return max(0, free - reserve), f"discrete: {what} less a {reserve / GiB:g} GiB reserve"
    if available is None:
        b = budget(env)
        available = max(0, b.bytes - b.rss)
    left = int(available) - int(ram_cache_bytes) - int(dense_bytes)
    b = max(0, left // 4 - 2 * GiB)
    # one level of brackets in the line that prints it: the sum after a colon, not in nested parentheses
    words = (f"shared RAM: a quarter of what the expert cache leaves, less 2 GiB: ({available / GiB:.2f} GiB "
             f"available - {ram_cache_bytes / GiB:.2f} GiB cache - {dense_bytes / GiB:.2f} GiB dense) / 4 - 2 GiB")
    if d.heap_bytes and b > d.heap_bytes:
        b = d.heap_bytes
        words += f", capped at the device's {d.heap_bytes / GiB:.2f} GiB heap"
    return b, words


# ---------------------------------------------------------------------------------------------------------
# History -> heat, warm-start plan

def history_heat(counts: np.ndarray) -> np.ndarray:
    """Initial heat from the history: float64 [L, E], each layer's hottest expert at 32, the others
    ``32 · count / that layer's max`` (zeros for a layer the history never routed)."""
    c = np.asarray(counts, dtype=np.float64)
    if c.ndim != 2:
        raise ValueError(f"history counts must be [layers, experts], got shape {c.shape}")
    m = c.max(axis=1, keepdims=True)
    return np.where(m > 0, HEAT_HISTORY_TOP * c / np.where(m > 0, m, 1.0), 0.0)


def warm_plan(counts: np.ndarray, capacity: int, fill: bool = True,
              layers=None) -> tuple[list[tuple[int, int]], int]:
    """The warm start's experts, in upload order, and how many of them come from the history.

    ``counts``: int [L, E] routing counts (scheduler/usage.py's ``Usage.counts``); ``capacity``: experts
    the budget holds. First every expert with a count > 0, highest count first (ties: lower layer, then
    lower expert id), up to ``capacity``; then, when ``fill``, the room left with experts the history
    never named, one expert per layer in turn (layer 0's lowest unnamed id, layer 1's, ..., then each
    layer's second, ...). (``COLI_VK_TIER_FILL``).
    """
    c = np.asarray(counts, dtype=np.int64)
    L, E = c.shape
    lay, exp = np.nonzero(c > 0)
    order = np.lexsort((exp, lay, -c[lay, exp]))
    named = [(int(lay[i]), int(exp[i])) for i in order[:max(0, capacity)]]
    plan = list(named)
    if fill and len(plan) < capacity:
        fl = list(range(L)) if layers is None else sorted(int(l) for l in layers)
        unnamed = {l: np.flatnonzero(c[l] == 0) for l in fl}
        for i in range(E):
            for l in fl:
                if len(plan) >= capacity:
                    break
                if i < len(unnamed[l]):
                    plan.append((l, int(unnamed[l][i])))
            if len(plan) >= capacity:
                break
    return plan, len(named)


def halvings_due(tokens_done: int, halvings: int) -> int:
    """Heat halvings owed at the start of a forward: the 1024-token boundaries ``tokens_done`` (tokens of the
    completed forwards) crossed beyond the ``halvings`` already applied (stepwise decay).
    The heat is then multiplied by ``0.5 ** n``; a forward that crossed several boundaries halves once per
    boundary."""
    return max(0, int(tokens_done) // HEAT_HALF_TOKENS - int(halvings))


def lfru_victim(heat: np.ndarray, mask: np.ndarray, key: tuple[int, int]) -> tuple[int, int] | None:
    """The LFRU eviction choice for a candidate when the budget is full.

    ``heat``: float64 [L, E]; ``mask``: bool [L, E], True where resident; ``key``: the candidate (layer,
    expert). Returns the coldest resident (ties: lowest (layer, expert)) when the candidate's heat is
    strictly greater than 1.25 × its heat + 4, else None (no promotion). None as well when nothing is
    resident."""
    if not mask.any():
        return None
    masked = np.where(mask, heat, np.inf)
    v = np.unravel_index(int(np.argmin(masked)), masked.shape)     # ties: lowest (layer, expert)
    if not heat[key] > LFRU_FACTOR * heat[v] + LFRU_ADD:
        return None
    return int(v[0]), int(v[1])


# ---------------------------------------------------------------------------------------------------------
# The reuse gate: an evicting promotion only when its expected extra routings repay the upload

REUSE_Z = 2.0              # standard errors of the dispersion estimate the signal must clear (a one-sided 2 %)


class ReuseGate:
    """Whether an evicting promotion pays: the expected extra device hits of the newcomer over its victim in the next
    ``horizon`` tokens >= ``payback`` (the upload's cost in device hits, ``COLI_VK_TIER_PAYBACK``).

    The admission test is TinyLFU's (Einziger, Friedman, Manes, "TinyLFU: A Highly Efficient Cache Admission
    Policy", ACM Transactions on Storage 13(4), 2017: admit a candidate only when its frequency exceeds the
    victim's), with the frequencies shrunk by empirical Bayes (Efron and Morris, "Stein's Estimation Rule and Its
    Competitors - An Empirical Bayes Approach", JASA 68(341), 1973), so that a difference sampling noise explains
    counts for nothing. Each expert's measured routings ``r`` (the heat without its history seed: +1 a routing,
    halved with it) over the tokens' weights ``S1 = sum w``, ``S2 = sum w^2`` (1 a token, halved with the heat) are,
    were every expert of a layer routed alike at the layer's rate ``p = m / S1`` (``m`` the layer's mean), binomial
    sums of variance ``N = m (1 - p) S2 / S1``. The spread across experts, ``T = mean (r - m)^2`` over the MoE
    layers, estimates ``N + sigma^2`` (sigma^2: the spread of the true rates); ``sigma^2 = max(0, T - N (1 + z
    sqrt(2 / n)))`` (``n`` experts, ``z`` = :data:`REUSE_Z`: the noise estimate's upper bound) and each rate is shrunk
    to ``m + B (r - m)``, ``B = sigma^2 / (sigma^2 + N)``. The gain of ``c`` over ``v`` is ``(m_c - m_v + B ((r_c -
    m_c) - (r_v - m_v)) - z B sqrt((r_c + r_v) S2 / S1)) / S1 * horizon``: the shrunk difference less ``z`` standard
    errors of the pair's own counts, so that two experts of one popularity class (two cold ones under a skewed
    routing: ``B`` near 1 there) do not swap on their noise either. Under uniform routing ``B`` is 0 (no swap pays, uploads stop after the
    warm start); under a skewed routing ``B`` nears 1 and a hot newcomer gains its extra routings (the hot set
    fills). Pure bookkeeping: the tier feeds tokens, halvings and its heat."""

    def __init__(self, payback: float = 4.0, horizon: int = HEAT_HALF_TOKENS, z: float = REUSE_Z):
        self.payback, self.horizon, self.z = float(payback), int(horizon), float(z)
        self.s1 = 0.0
        self.s2 = 0.0
        self.B = 0.0
        self.mean: np.ndarray | None = None    # float [L]: each layer's mean measured routings at the last refresh

    def tokens(self, n: int) -> None:
        """A forward of ``n`` tokens starts (each token weighs 1 until the next halving)."""
        self.s1 += n
        self.s2 += n

    def halve(self, n: int) -> None:
        """The heat halved ``n`` times: the weights too."""
        self.s1 *= 0.5 ** n
        self.s2 *= 0.25 ** n

    def refresh(self, recent: np.ndarray, layers) -> float:
        """Shrinkage factor ``B`` from ``recent`` (float [L, E], the heat without its seed) over the MoE ``layers``;
        returns it. B = 0 before any token."""
        self.mean = recent.mean(axis=1)
        self.B = 0.0
        if self.s1 <= 0 or not len(layers):
            return 0.0
        r = recent[list(layers)]
        m = r.mean(axis=1, keepdims=True)
        p = np.clip(m / self.s1, 0.0, 1.0)
        noise = float((m * (1.0 - p)).mean()) * self.s2 / self.s1
        spread = float(((r - m) ** 2).mean())
        sig = spread - noise * (1.0 + self.z * np.sqrt(2.0 / r.size))
        if sig > 0 and noise >= 0:
            self.B = sig / (sig + noise)
        return self.B

    def gain(self, new_layer: int, r_new: float, old_layer: int, r_old: float) -> float:
        """Expected device hits the newcomer (its layer, its measured routings ``r_new``) brings over the victim
        (``old_layer``, ``r_old``) in the next ``horizon`` tokens, by the last :meth:`refresh`'s ``B``."""
        if self.s1 <= 0 or self.mean is None:
            return 0.0
        mc, mv = float(self.mean[new_layer]), float(self.mean[old_layer])
        d = mc - mv + self.B * ((float(r_new) - mc) - (float(r_old) - mv))
        # less z standard errors of the pair's own difference (each count's binomial variance ~ r S2 / S1)
        d -= self.z * self.B * np.sqrt(max(0.0, float(r_new) + float(r_old)) * self.s2 / self.s1)
        return d / self.s1 * self.horizon

    def pays(self, new_layer: int, r_new: float, old_layer: int, r_old: float) -> bool:
        """:meth:`gain` >= ``payback``."""
        return self.gain(new_layer, r_new, old_layer, r_old) >= self.payback


# ---------------------------------------------------------------------------------------------------------
# Admission: evicting promotions as trials judged by their yield

TRIAL_TOKENS = 32          # a trial is judged on the routings of the 32 tokens after it was staged
TRIAL_MIN = 4              # a round after a failed one: 4 trials (the mean of fewer is noise)
TRIAL_PAYBACK = 4.0        # device hits over the victim's, per trial, that repay an upload (COLI_VK_TIER_PAYBACK)


@dataclass
class Trial:
    """One evicting promotion: ``new`` replaced ``old`` (both (layer, expert)) at ``token`` (tokens begun); their
    routing counts then (``n_new``, ``n_old``)."""

    new: tuple
    old: tuple
    token: int
    n_new: int
    n_old: int


class Admission:
    """Whether an evicting promotion (the budget full, LFRU found a victim) may be staged now, from the measured
    yield of earlier ones (docs/tier.md "Admission by yield"). Pure bookkeeping: no device, no clock; tokens are
    the tier's tokens begun, routings its cumulative int [L, E] counts.

    Evicting promotions come in rounds. A round opens at the first evicting promotion asked for at or after
    ``open_at`` and stages at most ``size`` trials during ``window`` tokens. Each trial's gain is the routings of
    the newcomer minus those of the expert it evicted over the ``window`` tokens after it was staged (the device
    hits it served against those the victim would have served). When the last trial's window has passed the round
    is judged: its mean gain >= ``payback`` pays (the next round opens at once with twice the trials, at most
    ``cap``); otherwise the next round has ``TRIAL_MIN`` trials and opens ``backoff`` tokens later (``window`` after
    a round that paid, doubling per failed round up to ``backoff_max``). Under uniform routing a newcomer is routed
    as often as its victim, the rounds fail and uploads fall to ``TRIAL_MIN`` per ``backoff_max`` tokens; under
    skewed routing a hot newcomer displacing a cold victim gains its extra routings and the hot set fills."""

    def __init__(self, first: int, payback: float = TRIAL_PAYBACK, window: int = TRIAL_TOKENS, cap: int = 1 << 30,
                 backoff_max: int = HEAT_HALF_TOKENS):
        self.size = max(1, int(first))
        self.payback, self.window, self.cap, self.backoff_max = float(payback), int(window), max(1, int(cap)), int(backoff_max)
        self.open_at = 0
        self.backoff = self.window
        self.trials: list[Trial] = []      # the open round's trials (empty: no round open)
        self.until = 0                     # the open round stages while tokens < until
        self.rounds_paid = 0
        self.rounds_failed = 0
        self.last_gain: float | None = None   # the last judged round's mean gain per trial

    def allows(self, tokens: int) -> bool:
        """True when an evicting promotion may be staged at ``tokens`` (tokens begun)."""
        if not self.trials:
            return tokens >= self.open_at
        return len(self.trials) < self.size and tokens < self.until

    def staged(self, tokens: int, new: tuple, old: tuple, routings: np.ndarray) -> None:
        """Record a staged evicting promotion (:meth:`allows` said yes)."""
        if not self.trials:
            self.until = tokens + self.window
        self.trials.append(Trial(new, old, tokens, int(routings[new]), int(routings[old])))

    def judge(self, done: int, routings: np.ndarray) -> bool | None:
        """At a forward's start, ``done`` tokens completed: judge the open round when its staging has closed and its
        last trial's window has passed. Returns True (paid), False (did not) or None (nothing judged)."""
        if not self.trials:
            return None
        if len(self.trials) < self.size and done < self.until:
            return None
        if done < self.trials[-1].token + self.window:
            return None
        gain = sum((int(routings[t.new]) - t.n_new) - (int(routings[t.old]) - t.n_old) for t in self.trials)
        self.last_gain = gain / len(self.trials)
        self.trials = []
        if self.last_gain >= self.payback:
            self.rounds_paid += 1
            self.size = min(2 * self.size, self.cap)
            self.backoff = self.window
            self.open_at = done
            return True
        self.rounds_failed += 1
        self.size = TRIAL_MIN
        self.open_at = done + self.backoff
        self.backoff = min(2 * self.backoff, self.backoff_max)
        return False
