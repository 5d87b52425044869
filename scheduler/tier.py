"""The device expert tier: which routed experts live on the device (docs/tier.md).

Pure policy plus calls into a ``device`` with the contract's interface (docs/contracts.md "Device"):
``upload_expert(gate, up, down) -> handle``, ``free_expert(handle)``,
``submit_experts(x, pairs_rows, pairs_handles) -> Batch``, ``Batch.join() -> f32 [P, D]``, ``Batch.device_ms``.
The step API the MoE step (scheduler/step.py) calls is described in docs/tier.md. :class:`Tier` is made of
scheduler/tier_residency.py (heat, promotion), scheduler/tier_step.py (the step API) and scheduler/tier_upload.py
(the uploader thread, the warm start); the pure rules they apply are scheduler/tier_policy.py's.

Rules (docs/tier.md):
  - budget (:func:`budget_bytes`): discrete GPU: VK_EXT_memory_budget's free device-local bytes (the heap's
    size without the extension) less a 1 GiB reserve (``COLI_VK_TIER_RESERVE_GB``); a device sharing the
    CPU's RAM (integrated GPU, Lavapipe): a quarter of (available RAM − the RAM expert cache's configured
    size − the dense weights), less 2 GiB, never below 0; ``COLI_VK_TIER_GB`` overrides. Experts per budget
    = budget // expert bytes (the biggest expert of the model).
  - heat: +1 per routing (device-served routings too), halved at every 1024-token boundary (stepwise: at the
    first :meth:`Tier.begin_token` after each 1024 completed tokens); the history seeds each layer's hottest
    expert at 32 and the others in proportion (``32 · count / layer max``).
  - warm start (:func:`warm_plan`): the history's experts hottest first across all layers (ties: layer,
    then expert id) as many as the budget holds, then the room left filled one expert per layer in turn with
    experts the history never named (lowest id first); bytes read on a thread pool.
  - LFRU promotion (:meth:`Tier.note`): every expert the CPU computes is a candidate; promoted while there
    is room, or when its heat > 1.25 × the coldest resident's heat + 4 (the coldest is evicted); at most
    ``COLI_VK_TIER_RATE`` (16) promotions per token; bytes copied on the engine thread, written to the
    device by the uploader thread; a promoted expert serves from the next step (:meth:`Tier.settle`).
    Evicting an expert an in-flight batch reads waits for that batch's join; a failed upload shrinks the
    planned residency by one expert. ``COLI_VK_TIER_SYNC=1``: settle() waits for every staged upload.
  - reuse gate (:class:`scheduler.tier_policy.ReuseGate`, ``COLI_VK_TIER_REUSE=1``): an evicting promotion only
    when the newcomer's expected routings over its victim's in the next 1024 tokens (measured, shrunk by how much
    of the experts' spread the sampling noise explains) repay an upload (``COLI_VK_TIER_PAYBACK`` device hits).
"""
from __future__ import annotations

import os
import sys
import threading

import numpy as np

from scheduler.balancer import Balancer, DecodeGate
from scheduler.tier_policy import GiB, MiB, _env_int
from scheduler.tier_residency import TierResidency
from scheduler.tier_step import TierStep
from scheduler.tier_upload import TierUploads
from scheduler.trace import NULL_TRACE, Trace, host_ns


def _mib(n: int) -> str:
    x = n / MiB
    return f"{x:.1f}" if x >= 10 else f"{x:.2f}" if x >= 0.1 else f"{x:.3g}"


# ---------------------------------------------------------------------------------------------------------
# The tier

def _pool_stats(device) -> tuple[int | None, float | None]:
    """(blocks, frag) of the device's expert memory: ``device.memory_stats()`` (coli.vulkan's Device:
    ``{"blocks", "frag", ...}``), or a block allocator as ``expert_pool`` / ``pool`` / ``alloc`` (``.blocks``,
    ``.frag()``); (None, None) otherwise."""
    ms = getattr(device, "memory_stats", None)
    if callable(ms):
        try:
            m = ms()
            return int(m["blocks"]), float(m["frag"])
        except Exception:
            pass
    for name in ("expert_pool", "pool", "alloc", "allocator"):
        a = getattr(device, name, None)
        if a is not None and hasattr(a, "blocks") and hasattr(a, "frag"):
            try:
                f = a.frag() if callable(a.frag) else a.frag
                return len(a.blocks), float(f)
            except Exception:
                return None, None
    return None, None


class Tier(TierResidency, TierStep, TierUploads):
    """Residency of routed experts on one device. Engine-thread API (not thread-safe across engine
    threads): :meth:`begin_token`, :meth:`settle`, :meth:`split`, :meth:`issue`, :meth:`join`, :meth:`note`,
    :meth:`warm_start`, :meth:`off`, :meth:`close`; one uploader thread talks to the device besides.

    Made of three parts, each with its state: :class:`scheduler.tier_residency.TierResidency` (heat, promotion,
    the resident table), :class:`scheduler.tier_step.TierStep` (split, issue, join: what the MoE step calls) and
    :class:`scheduler.tier_upload.TierUploads` (the uploader thread, settle, the warm start). This class holds what
    they share: the device and its lock, the run's start (``begin_token``: the decode gate and the clock holder
    besides the parts' token work), the status lines, ``off`` and ``close``.

    ``device``: the contract's Device; ``model``: the name in the status lines; ``n_layers``, ``n_experts``:
    the model's expert grid; ``expert_bytes``: the biggest expert's bytes (gate + up + down);
    ``budget`` (bytes) and ``rule`` (words) from :func:`budget_bytes`; ``counts``: the history (int [L, E])
    or None; ``balancer``: a :class:`Balancer` (``Balancer(enabled=False)`` for ``--no-balance``);
    ``trace``: a :class:`scheduler.trace.Trace`; ``env``: ``COLI_VK_TIER_RATE`` (16), ``COLI_VK_TIER_SYNC``
    (0), ``COLI_VK_TIER_FILL`` (1), ``COLI_VK_TIER_WARM`` (1), ``COLI_VK_TIER_QUEUE_MAX`` (2 × rate);
    ``moe_layers``: the layers with experts (the warm start's fill takes only those; default all);
    ``auto_tokens``: :meth:`issue_step` calls :meth:`begin_token` itself when a step's layer is not above
    the previous step's (a new forward of ``x.shape[0]`` tokens); ``ram``: the RAM cache whose ``hits`` /
    ``loads`` the run line printed by :meth:`close` reports (None: :meth:`close` prints no run line).
    """

    def __init__(self, device, model: str, n_layers: int, n_experts: int, expert_bytes: int, budget: int,
                 rule: str, counts: np.ndarray | None = None, balancer: Balancer | None = None,
                 trace: Trace | None = None, device_name: str = "", own_queue: bool = False, env=None,
                 log=None, moe_layers=None, auto_tokens: bool = False, ram=None):
        env = os.environ if env is None else env
        if expert_bytes <= 0:
            raise ValueError(f"expert_bytes must be > 0, got {expert_bytes}")
        self.device = device
        self.model = model
        self.L, self.E = int(n_layers), int(n_experts)
        self.moe_layers = list(range(self.L)) if moe_layers is None else [int(l) for l in moe_layers]
        self.auto_tokens = auto_tokens
        self.ram = ram
        self.expert_bytes = int(expert_bytes)
        self.budget = int(budget)
        self.rule = rule
        self.balancer = balancer if balancer is not None else Balancer(enabled=True)
        # decode tokens with and without the device's round trips, compared by their times (balanced runs only)
        # (a tier without a RAM cache has no CPU copies to run a token on: no gate)
        self.gate = DecodeGate(enabled=self.balancer.enabled and ram is not None
                               and _env_int(env, "COLI_VK_DECODE_GATE", 1) != 0)
        self._dev_off = False          # this decode token keeps only the experts the CPU lacks on the device
        self._tok_t0: int | None = None   # host ns: this decode token's start, its last step's start
        self._tok_last: int | None = None
        # reasons this decode token gives the gate no sample (it measures neither side's steady state): its CPU
        # experts read from disk, and (a token without the device) batches it still needed for device-only experts
        self._tok_unsampled = 0
        self.trace = trace if trace is not None else NULL_TRACE
        self.device_name = device_name or getattr(device, "name", "") or "device"
        self.own_queue = own_queue
        self.log = log if log is not None else sys.stderr
        self.on = True
        self.off_reason: str | None = None
        self._closed_line = False
        self._env = env
        # a discrete GPU's clock holder (docs/vulkan.md "Clocks"): made at the first decode token of a tier that is
        # on; False where there is none
        self._clock = None

        self._init_residency(counts, env)
        self._init_step()

        # coli.vulkan's Device is not thread-safe (one queue, shared staging): every device call of the
        # engine thread and the uploader thread holds this lock (a join holds it while it waits, so an
        # upload waits for the join; uploads overlap the CPU's work between issue and join)
        self._dev_lock = threading.Lock()
        self._init_uploads(env)

    # ----- lines
    def start_line(self) -> str:
        """``[VK] tier <model>: on, <device>, budget B GiB = N experts of S MiB, <rule>, own queue|shared
        queue, up to R promotions per token, balanced against the CPU|not balanced`` (a budget of no expert says
        every routed expert runs on the CPU), then the device's expert
        placement when it says it (``experts mapped from RAM (zero-copy, ...)`` or ``experts copied to the device
        (...)``)."""
        return (f"[VK] tier {self.model}: on, {self.device_name}, budget {self.budget / GiB:.2f} GiB = "
                f"{self.budget_experts} experts of {_mib(self.expert_bytes)} MiB, {self.rule}, "
                f"{'own queue' if self.own_queue else 'shared queue'}, up to {self.rate} promotions per token, "
                + ("no expert fits: every routed expert runs on the CPU" if self.budget_experts == 0 else
                   'balanced against the CPU' if self.balancer.enabled else 'not balanced')
                + (f", {self.device.expert_mode()}" if hasattr(self.device, "expert_mode") else ""))

    def run_line(self, ram_hits: int, disk_loads: int, blocks: int | None = None,
                 frag: float | None = None) -> str:
        """The end-of-run line. ``ram_hits`` / ``disk_loads``: the RAM cache's counters
        for the CPU's pairs; ``blocks`` / ``frag``: the device's expert pool (memory blocks, ``1 - largest
        free extent / free bytes``) when the device reports them, else "n/a"."""
        P, D = self.routed_pairs, self.device_pairs
        pct = 100.0 * D / P if P else 0.0
        res_b = sum(self.resident_bytes.values())
        hidden = 100.0 * (self.device_ms - self.waited_ms) / self.device_ms if self.device_ms > 0 else 0.0
        bl = "n/a blocks" if blocks is None else f"{blocks} blocks"
        fr = "frag n/a" if frag is None else f"frag {frag:.2f}"
        return (f"[VK] tier {self.model} run: device {D} of {P} routed experts ({pct:.1f}%) | "
                f"CPU RAM hits {ram_hits}, disk loads {disk_loads} | "
                f"resident {len(self.resident)} (budget {self.capacity}, {res_b / GiB:.2f} GiB of "
                f"{self.budget / GiB:.2f} GiB, {bl}, {fr}) | "
                f"uploads {self.uploads} ({self.upload_bytes / GiB:.2f} GiB, {self.warm_uploads} warm), "
                f"evictions {self.evictions}{self._rounds()}, skipped {self.skipped_queue} queue + "
                f"{self.skipped_rate} rate + {self.skipped_yield} yield + {self.skipped_reuse} reuse, "
                f"failed {self.failed} | "
                f"device {self.device_ms:.1f} ms, CPU share {self.cpu_ms:.1f} ms, waited {self.waited_ms:.1f} ms "
                f"({hidden:.0f}% of device time hidden) | "
                + ("balance: none (no expert on the device)" if self.budget_experts == 0 else
                   f"balance: device share {self.balancer.share:.2f}, {self.handed_rows} rows handed to the CPU")
                + (f", {self.tokens_without} decode token{'s' if self.tokens_without != 1 else ''} without the device "
                   f"(the decode gate"
                   + self._gate_decisions() + ")" if self.tokens_without else "")
                + (f" | clock holder: {self._clock.runs} heats" if self._clock else ""))

    def _rounds(self) -> str:
        """The admission's judged rounds for the run line (nothing when none was judged)."""
        a = self.admission
        if a is None or not (a.rounds_paid or a.rounds_failed):
            return ""
        return f" (trial rounds: {a.rounds_paid} paid, {a.rounds_failed} not)"

    @property
    def tokens_without(self) -> int:
        """Decode tokens run without the device so far (the gate counts a token when the next one starts: the
        current one is added here)."""
        return self.gate.tokens_without + (1 if self._dev_off and self._tok_t0 is not None else 0)

    def _gate_decisions(self) -> str:
        """The decode gate's decisions for the run line: how many each way, the last one's medians."""
        ds = self.gate.decisions
        if not ds:
            return ": no decision"
        n_dev = sum(1 for d in ds if d[0])
        dev, on, off = ds[-1]
        return (f": {len(ds) - n_dev} decisions without, {n_dev} with; the last {'with' if dev else 'without'}, "
                f"token {on:.2f} ms with, {off:.2f} ms without")

    def _say(self, line: str) -> None:
        print(line, file=self.log, flush=True)

    # ----- tokens and heat
    def begin_token(self, n_tokens: int = 1) -> None:
        """Start a forward of ``n_tokens`` tokens: halve the heat once for each 1024-token boundary the
        completed tokens crossed, and give the forward ``rate × n_tokens`` promotions. With
        ``auto_tokens`` an explicit call is taken as the next forward's start (the forward's first
        :meth:`issue_step` then does not count it again)."""
        self._begin(n_tokens)
        self._explicit = True

    def _begin(self, n_tokens: int) -> None:
        self._begun = None
        self._token_reads(n_tokens)
        if n_tokens == 1:      # a decode token: the last one's time (its start to its last step's) to the gate
            if self._tok_t0 is not None and self._tok_last is not None:
                self.gate.token((self._tok_last - self._tok_t0) / 1e6 if self._tok_unsampled == 0 else None)
            self._dev_off = not self.gate.use_device
            if self.on and self._clock is not False:   # a token without the device too: the gate's next "with"
                self._hold_clock()                      # samples must not find the clock lowered
            self._tok_t0 = host_ns()       # the sample starts after the reads' bookkeeping
        else:                  # a prompt's forward: the device takes its resident experts, no sample
            self._dev_off = False
            self._tok_t0 = None
        # a token during which those reads run gives the gate no sample: they share the CPU's memory bandwidth with
        # its experts (on the H200 the gate's first samples, taken while they ran, chose the CPU against a faster tier)
        self._tok_last, self._tok_unsampled = None, int(bool(self._reads))
        self._token_heat(n_tokens)

    def _hold_clock(self) -> None:
        """Keep a discrete GPU busy through this decode token (its batches are short, with the CPU's work between:
        idle, the GPU lowers its clock), with or without the device (the decode gate compares both sides at the
        same clock). The heat runs to its cap (nothing stops it); a token whose last heat still runs submits none.
        Made under the device lock (it records and submits on the device's queue); a heat's submit on its own
        queue takes no lock (an upload may hold it for milliseconds). Any failure ends the holder (one line)."""
        try:
            if self._clock is None:
                from coli.vulkan.layers import ClockHolder  # the Vulkan binding: only when a device runs

                with self._dev_lock:
                    h = ClockHolder.for_device(self.device, getattr(self.device, "_layer_kernels", None), self._env)
                self._clock = h if h is not None else False
                if h is None:
                    return
            if self._clock.queue == self.device._queue:     # the device's own queue (tests): its lock
                with self._dev_lock:
                    self._clock.start()
            else:
                self._clock.start()
        except Exception as e:  # noqa: BLE001 - the tier runs on without it; say why
            self._say(f"[VK] tier {self.model}: no clock holder ({type(e).__name__}: {e})")
            if self._clock:
                with self._dev_lock:
                    try:
                        self._clock.close()
                    except Exception:  # noqa: BLE001 - a lost device: nothing more to free here
                        pass
            self._clock = False

    # ----- off / close
    def off(self, reason: str) -> None:
        """Turn the tier off (the device is lost or failed): one line, nothing more goes to the device,
        the run continues on the CPU. Idempotent."""
        if not self.on:
            return
        self.on = False
        self.off_reason = reason
        self._say(f"[VK] tier {self.model}: off, {reason}; the run goes on on the CPU")
        self.resident.clear()
        self.resident_bytes.clear()
        self.mask[:] = False
        self._candidates = {}
        for i in list(self._inflight):
            i.joined.set()
        self._inflight.clear()
        self._shutdown(wait=False)

    def close(self, free: bool = True) -> None:
        """End of run: stop the uploader (after the staged uploads), then free every resident expert when
        ``free`` and the tier is on. Call after the last join."""
        self._candidates = {}
        if self._clock:
            with self._dev_lock:
                self._clock.close()
        if self._thread.is_alive() and self.on:
            self._q.put(None)
            self._thread.join()
            self.settle()
        self._stop.set()
        if self.ram is not None and not self._closed_line:
            self._closed_line = True
            bl, fr = _pool_stats(self.device)
            self._say(self.run_line(getattr(self.ram, "hits", 0), getattr(self.ram, "loads", 0), bl, fr))
        if free and self.on:
            for h in self.resident.values():
                with self._dev_lock:
                    self.device.free_expert(h)
            self.resident.clear()
            self.resident_bytes.clear()
            self.mask[:] = False
