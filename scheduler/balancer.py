"""The balancer: measured times -> the device's share of a step's resident rows (docs/balancer.md).

Each MoE layer step the tier sends the (row, expert) pairs whose expert is resident to the device and the
CPU computes the rest. When the join keeps waiting (the device is the slower side: an integrated GPU, or
Lavapipe sharing the CPU's cores) the balancer lowers the device's *share*: the fraction of the step's
resident rows the device keeps. Resident experts that the CPU also holds in RAM ("movable") beyond that
share go to the CPU; an expert only the device holds stays there (the CPU would read it from disk). When
the device finishes first the share goes back up, to 1.0 at most.

What it measures, per step that issued a batch (:class:`StepTimes`):
  - ``device_ms``: the batch's device time (device timestamps), for ``device_rows`` pairs;
  - ``cpu_ms``: the engine thread's time between issue and the start of the join (the CPU pairs, the shared
    expert, disk waits), for ``cpu_rows`` pairs;
  - ``waited_ms``: the join's wait (used while the CPU's cost is still unknown);
  - ``resident_rows``: the step's pairs whose expert was resident, before the share was applied.

Model: per-row costs ``a`` (device, ms/row) and ``b`` (CPU, ms/row), each an exponential moving average
(``alpha``, default 0.3) of the step's ``device_ms / device_rows`` and ``cpu_ms / cpu_rows``. With ``N``
pairs in a step, the device finishing ``d`` of them at ``d·a`` and the CPU the others at ``(N-d)·b``, both
sides finish together at ``d* = N·b / (a + b)``; the target share is ``s* = d* / resident_rows``, clamped
to ``[floor, 1]`` (floor 0.05: the device keeps a few rows so its cost stays measured). The share moves
a fraction ``gain`` (0.5) of the way to ``s*`` each step: with steady costs the error halves every step;
in a step whose join waited more than ``wait_tol`` (10%) of the device time it never goes up (the device
was the slower side whatever the estimates say), and in a step where the CPU's time plus one more row
(``cpu_ms + b``) reaches the device's time it never goes down (handing the CPU a row would make it the
longer side). Measured on the H200, where a batch's time is mostly fixed latency so the per-row model asked
for fractions of a row: before this rule the balanced run was 16% (25% resident) and 14% (50%) below the
tier without it.
Before any CPU row was measured (share 1, every pair resident) there is no ``b``: then each step whose
join waited more than ``wait_tol`` (10%) of the device time lowers the share by ``probe`` (0.1), which
gives the CPU rows to measure.

Deterministic: the share is a pure function of the sequence of :class:`StepTimes` (no clock, no RNG).
``enabled=False`` (``--no-balance``): the share stays 1.0 and updates only count steps.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class StepTimes:
    """One step's measurements (milliseconds, pair counts). See the module docstring."""

    device_ms: float
    device_rows: int
    cpu_ms: float
    cpu_rows: int
    waited_ms: float
    resident_rows: int
    cpu_cold: int = 0      # CPU experts of the step that were not in RAM at the split (disk reads)


class Balancer:
    """The device-share controller.

    ``share``: float in ``[floor, 1]``, the fraction of a step's resident rows the device keeps.
    ``a_ms``, ``b_ms``: the smoothed device / CPU cost per row (ms) or None before a measurement.
    """

    def __init__(self, enabled: bool = True, floor: float = 0.05, alpha: float = 0.3, gain: float = 0.5,
                 probe: float = 0.1, wait_tol: float = 0.1, measure_every: int = 16):
        if not 0.0 < floor <= 1.0:
            raise ValueError(f"balancer floor {floor} is not in (0, 1]")
        self.enabled = enabled
        self.floor = floor
        self.alpha = alpha
        self.gain = gain
        self.probe = probe
        self.wait_tol = wait_tol
        self.measure_every = int(measure_every)
        self.max_period = 1024
        self.period = self.measure_every     # steps between the device's measurement rows at a low share
        self._zero_calls = 0
        self._full_calls = 0
        self.share = 1.0
        self.a_ms: float | None = None
        self.b_ms: float | None = None
        self.target: float | None = None
        self._b_cold = False
        self.steps = 0
        # the last step's join waited longer than one CPU row costs (before a CPU row was measured: more than
        # wait_tol of the device time): only then can a row handed to the CPU shorten the step
        self.cpu_room = False

    def _ema(self, old: float | None, x: float) -> float:
        return x if old is None else old + self.alpha * (x - old)

    def update(self, t: StepTimes) -> float:
        """Take one step's measurements; return the new share."""
        self.steps += 1
        if t.device_rows > 0 and t.device_ms > 0:
            self.a_ms = self._ema(self.a_ms, t.device_ms / t.device_rows)
        if t.cpu_rows > 0 and t.cpu_ms > 0:
            # the rows the balancer moves are RAM-held experts: a step whose CPU side read experts from
            # disk measures the CPU's cost only until a step without disk reads replaces it
            if t.cpu_cold == 0:
                self.b_ms = t.cpu_ms / t.cpu_rows if self._b_cold else self._ema(self.b_ms, t.cpu_ms / t.cpu_rows)
                self._b_cold = False
            elif self.b_ms is None or self._b_cold:
                self.b_ms = self._ema(self.b_ms, t.cpu_ms / t.cpu_rows)
                self._b_cold = True
        waited_dev = t.device_ms > 0 and t.waited_ms > self.wait_tol * t.device_ms
        # a CPU cost measured with disk reads is no measurement of the rows the balancer moves: until a step
        # without disk reads replaces it, the rules before a measurement hold (else a first cold step, ms of
        # disk read per row, would keep the CPU from ever getting a row to measure again)
        b = None if self._b_cold else self.b_ms
        self.cpu_room = t.device_rows > 0 and waited_dev and (b is None or t.waited_ms > b)
        if not self.enabled:
            return self.share
        if b is None or self.a_ms is None:
            if self.cpu_room:
                self.share = max(self.floor, self.share - self.probe)
            return self.share
        n = t.device_rows + t.cpu_rows
        if t.resident_rows <= 0 or n <= 0:
            return self.share
        d_star = n * self.b_ms / (self.a_ms + self.b_ms)
        self.target = min(1.0, max(self.floor, d_star / t.resident_rows))
        # a device far slower than the CPU (the target at the floor): its measurement rows cost more than
        # they tell, so they come half as often each time (up to one in 1024 steps); back to 16 otherwise
        self.period = min(self.max_period, 2 * self.period) if self.target <= self.floor else self.measure_every
        new = self.share + self.gain * (self.target - self.share)
        if self.cpu_room:
            new = min(new, self.share)      # the join waited more than a CPU row: the device was the slower side
        elif t.device_rows > 0:
            # the join waited less than one CPU row costs (or not at all): one more row would make the CPU
            # the longer side, or it already is: never lower (the CPU gets rows only while the
            # join keeps waiting on the device). The wait is host time, so it includes the batch's submit and
            # fence latency, which the device's timestamps do not: a discrete GPU's batch is mostly that
            # latency, so its per-row cost looks tiny and the equal-finish point asks for a fraction of a row,
            # which rounds to a whole CPU row that costs more than the device's step.
            new = max(new, self.share)
        self.share = min(1.0, max(self.floor, new))
        return self.share

    def device_rows(self, resident_rows: int) -> int:
        """How many of ``resident_rows`` the device keeps at the current share: ``share · rows`` rounded
        half up (0 to ``resident_rows``)."""
        if not self.enabled or resident_rows <= 0:
            return max(0, int(resident_rows))
        return min(int(resident_rows), int(math.floor(self.share * resident_rows + 0.5)))

    def keep(self, rows: np.ndarray, movable: np.ndarray) -> np.ndarray:
        """Which of a step's resident experts the device keeps.

        ``rows``: int [n] the step's rows per resident expert; ``movable``: bool [n], True where the CPU also
        holds the expert in RAM. Returns bool [n]: every non-movable expert is kept; movable ones are kept,
        most rows first (ties: lower position first), while the kept rows are below
        ``device_rows(rows.sum())``; the others go to the CPU. While the controller's target sits at the
        floor (the device loses even there) the device keeps no movable row. When that is 0 rows (a small step at a low
        share), every ``period``-th such call keeps 1 row anyway (``period`` starts at ``measure_every``, 16,
        and doubles, up to 1024, at each update whose target sits at the floor), so the device's cost stays
        measured without the device taking a row (and its batch latency) every step; symmetrically, when
        the share (below 1) rounds to every row, every 16th such call hands the CPU the movable expert with
        the fewest rows, so a stale CPU cost is measured again.
        """
        rows = np.asarray(rows, dtype=np.int64)
        movable = np.asarray(movable, dtype=bool)
        keep = ~movable
        if not self.enabled or self.share >= 1.0 or not movable.any():
            return np.ones(len(rows), dtype=bool)
        total = int(rows.sum())
        want = self.device_rows(total)
        if self.target is not None and self.target <= self.floor:
            want = 0      # the device loses even at the floor: it only gets the measurement rows
        if want == 0:
            self._zero_calls += 1
            if self._zero_calls >= self.period:
                self._zero_calls = 0
                want = 1
        elif want >= total and self.cpu_room:
            self._full_calls += 1
            if self._full_calls % self.measure_every == 0:
                # the CPU would get none of these rows: every measure_every-th time it takes the smallest
                # movable expert, so its cost is measured again (a first cold measurement can't stick)
                want = total - int(rows[movable].min())
        have = int(rows[keep].sum())
        idx = np.flatnonzero(movable)
        order = idx[np.lexsort((idx, -rows[idx]))]
        for i in order:
            if have >= want:
                break
            keep[i] = True
            have += int(rows[i])
        return keep


class DecodeGate:
    """Whether a decode token sends its movable experts to the device at all, by measured token times
    (docs/balancer.md "The decode gate").

    The per-step :class:`Balancer` weighs the device's batch time (its timestamps) against the CPU's cost per
    row. A decode step with a device batch also pays host time those timestamps do not show: the submit, the
    fence wait's wake-up, the join (on the H200 at 16 threads ~0.7 ms a layer, more than the CPU needs for the
    layer's 8 experts). So the gate compares whole tokens: it alternates tokens with the device (``True``) and
    without it (``False``: the tier keeps only the experts the CPU does not hold in RAM) until each side has
    ``window`` samples, then keeps the faster side for ``hold`` tokens, the device unless going without it is
    faster by more than ``margin`` (a fraction of the device's median). A decision that repeats doubles the
    hold, up to ``max_hold`` tokens (the losing side then costs about ``window / hold`` of the tokens); a change
    brings it back to ``hold``. A measurement that has not got its samples after ``4 · window`` tokens (samples
    dropped: tokens that read experts from disk) ends without a decision: the device for ``hold`` tokens.

    :meth:`token` takes each decode token's milliseconds (None: a sample to drop, e.g. a token whose CPU side
    read experts from disk) and returns whether the next token uses the device. ``enabled=False``: always
    True. Deterministic: a pure function of the sequence of samples (no clock).
    """

    def __init__(self, enabled: bool = True, window: int = 8, hold: int = 64, max_hold: int = 4096,
                 margin: float = 0.03):
        if window < 1 or hold < 1 or max_hold < hold or not 0.0 <= margin < 1.0:
            raise ValueError(f"decode gate: window {window}, hold {hold}, max_hold {max_hold}, margin {margin}")
        self.enabled = enabled
        self.window, self.hold0, self.max_hold, self.margin = int(window), int(hold), int(max_hold), float(margin)
        self.hold = self.hold0
        self.use_device = True            # the current token's side
        self.decided: bool | None = None  # the last decision (None before the first)
        self._measuring = True
        self._left = 0                     # tokens left in the hold
        self._on: list[float] = []
        self._off: list[float] = []
        self._n = 0                        # tokens of the current measurement
        self.tokens_without = 0            # decode tokens that ran without the device (measured or held)
        self.decisions: list[tuple[bool, float, float]] = []   # (device, median with, median without)

    def token(self, ms: float | None) -> bool:
        """The last decode token took ``ms`` milliseconds on the side :attr:`use_device` said (None: drop the
        sample). Returns the side of the next token."""
        if not self.enabled:
            return True
        if not self.use_device:
            self.tokens_without += 1
        if self._measuring:
            self._n += 1
            if ms is not None and ms > 0:
                (self._on if self.use_device else self._off).append(float(ms))
            if self._n >= 4 * self.window and (len(self._on) < self.window or len(self._off) < self.window):
                self._measuring, self._left, self._n = False, self.hold0, 0    # no evidence: the device
                self._on, self._off = [], []
                self.use_device = True
            elif len(self._on) >= self.window and len(self._off) >= self.window:
                on, off = float(np.median(self._on)), float(np.median(self._off))
                dev = not off < (1.0 - self.margin) * on
                self.hold = min(self.max_hold, 2 * self.hold) if dev == self.decided else self.hold0
                self.decided = dev
                self.decisions.append((dev, on, off))
                self._measuring, self._left, self._n = False, self.hold, 0
                self._on, self._off = [], []
                self.use_device = dev
            elif len(self._on) >= self.window or len(self._off) >= self.window:
                self.use_device = len(self._on) < self.window      # the side still short of samples
            else:
                self.use_device = not self.use_device               # alternate: drift hits both sides alike
            return self.use_device
        self._left -= 1
        if self._left <= 0:
            self._measuring = True
            self.use_device = not self.decided      # the losing side first: its sample is the one that is stale
        return self.use_device


# ---------------------------------------------------------------------------------------------------------
# Simulation (docs/balancer.md's plot and the convergence test): a deterministic model of a run.

def simulate(phases, steps_per_phase: int = 150, rows: int = 32, resident: float = 0.75, movable: float = 0.8,
             cpu_fixed_ms: float = 0.2, dev_fixed_ms: float = 0.05, noise: float = 0.1, seed: int = 0,
             enabled: bool = True, **balancer_kw):
    """Simulate a run of MoE steps against a :class:`Balancer`.

    ``phases``: list of ``(device_ms_per_row, cpu_ms_per_row)``, each run for ``steps_per_phase`` steps.
    Each step has ``rows`` pairs, ``resident`` of them resident (``movable`` of those also in the CPU's RAM);
    the device takes ``dev_fixed_ms + d·a`` and the CPU ``cpu_fixed_ms + (rows - d)·b`` (each times a
    uniform factor in ``1 ± noise``, NumPy ``default_rng(seed)``); waited = device − CPU when positive.
    Returns a dict of NumPy arrays per step: ``share``, ``target`` (the equal-finish share of the true
    costs, clamped to [floor, 1]), ``step_ms`` (max of the two sides), ``best_ms`` (the best split's
    time with the true costs), ``device_ms``, ``cpu_ms``, ``waited_ms``.
    """
    rng = np.random.default_rng(seed)
    bal = Balancer(enabled=enabled, **balancer_kw)
    n_res = int(round(rows * resident))
    n_mov = int(round(n_res * movable))
    out = {k: [] for k in ("share", "target", "step_ms", "best_ms", "device_ms", "cpu_ms", "waited_ms")}
    for a, b in phases:
        for _ in range(steps_per_phase):
            # the split the tier makes at the current share (each expert one row: a decode-like step)
            r = np.ones(n_res, dtype=np.int64)
            mov = np.zeros(n_res, dtype=bool)
            mov[:n_mov] = True
            keep = bal.keep(r, mov)
            d = int(r[keep].sum())
            c = rows - d
            fd, fc = rng.uniform(1 - noise, 1 + noise, 2)
            dev = (dev_fixed_ms + d * a) * fd
            cpu = (cpu_fixed_ms + c * b) * fc
            waited = max(0.0, dev - cpu)
            # the best split with the true costs (the device must keep the non-movable rows)
            best = min(max(dev_fixed_ms + dd * a, cpu_fixed_ms + (rows - dd) * b)
                       for dd in range(n_res - n_mov, n_res + 1))
            tgt = min(1.0, max(bal.floor, rows * b / (a + b) / n_res))
            out["share"].append(bal.share)
            out["target"].append(tgt)
            out["step_ms"].append(max(dev, cpu))
            out["best_ms"].append(best)
            out["device_ms"].append(dev)
            out["cpu_ms"].append(cpu)
            out["waited_ms"].append(waited)
            bal.update(StepTimes(dev, d, cpu, c, waited, n_res))
    return {k: np.asarray(v) for k, v in out.items()}


def _plot(path: str) -> None:  # pragma: no cover - docs helper
    import matplotlib  # heavy and only for the plot
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    phases = [(0.9, 0.3), (0.03, 0.3)]  # a slow iGPU (3x the CPU's ms per row), then a fast dGPU
    on = simulate(phases)
    off = simulate(phases, enabled=False)
    x = np.arange(len(on["share"]))
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    ax1.plot(x, on["share"], label="device share (balancer)")
    ax1.plot(x, on["target"], "--", label="equal-finish share (true costs)")
    ax1.axhline(0.05, color="gray", lw=0.8, ls=":", label="floor 0.05")
    ax1.set_ylabel("device share of resident rows")
    ax1.set_ylim(0, 1.05)
    ax1.legend(loc="center right", fontsize=8)
    ax1.set_title("SIMULATION (scheduler.balancer.simulate): 32 pairs/step, 24 resident, 19 in RAM too;\n"
                  "steps 0-149 iGPU 0.9 ms/row vs CPU 0.3; steps 150-299 dGPU 0.03 ms/row", fontsize=9)
    ax2.plot(x, off["step_ms"], label="step time, share fixed at 1 (--no-balance)", alpha=0.7)
    ax2.plot(x, on["step_ms"], label="step time, balancer", alpha=0.9)
    ax2.plot(x, on["best_ms"], "k:", label="best split (true costs)")
    ax2.set_ylabel("step ms")
    ax2.set_xlabel("MoE step")
    ax2.legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":  # python -m scheduler.balancer docs/balancer_share.png
    import sys
    _plot(sys.argv[1] if len(sys.argv) > 1 else "docs/balancer_share.png")
