"""Where the host's time goes in a decode token of device layers (``COLI_VK_JOIN_PROFILE=1``): with experts
(partly) on the CPU, coli/vulkan/layer_join.py ``_run_chain`` / ``_run_event`` / ``_run_split`` (docs/vulkan.md "Experts on the
CPU"); with every expert on the device, the one submit and what the host does around it
(coli/vulkan/layer_decode.py ``DecodeRow.__call__``). The decode loop charges each stretch of the host's wall time to one part (:meth:`JoinProfile.lap`);
:meth:`JoinProfile.table` prints the parts per token. Off (no profile object), the loop times nothing."""
from __future__ import annotations

import time

#: the parts, in the order of a token (the table's rows)
PARTS = (
    ("submit", "the token's submit: timeline values set in place, vkQueueSubmit (a submit a segment: each submit "
               "and its fence wait)"),
    ("wait: flag", "spinning on a layer's flag until the device wrote it (the route is out)"),
    ("wait: semaphore", "a layer's spin that ran out, then vkWaitSemaphores on the device's timeline"),
    ("wait: polled", "COLI_VK_CHAIN=event: a layer's spin that ran out, then 50 us sleeps until the flag is up"),
    ("route read", "the layer's route (ids, weights) read from host-visible memory"),
    ("experts: lookups", "MoEStep.row_experts_resident less its compiled call: the RAM cache's table, the "
                         "descriptors gathered (else row_experts': RAM-cache lookups, descriptors; with f32 "
                         "activations, no compiled row: the whole CPU path)"),
    ("experts: compiled call", "the CPU experts' one compiled call (cpu_kernels.decode.experts_row)"),
    ("rows out", "the routing weights applied to the CPU's rows in the host-visible yk"),
    ("signal", "vkSignalSemaphore (COLI_VK_CHAIN=event: vkSetEvent): the layer's rows are in"),
    ("experts: bookkeeping", "the RAM cache's hits, LRU order and heat of the layer's CPU experts, after the signal "
                             "(the device runs meanwhile; MoEStep.note_row)"),
    ("tail", "after the last join: the device's last segment and the fence"),
    ("timestamps", "the segments' timestamps read back (vkGetQueryPoolResults)"),
    ("row out", "the last layer's row copied out (the K/V rows and DeltaNet states stay the device's until the "
                "CPU needs them)"),
    ("routing history", "the routes read back, counted in the routing history, the logits copied out"),
    ("expert swaps", "the on_token hook: the swaps whose copies finished land, the in-layer swap policy's token "
                     "(scheduler/layer_residency.py), a swap's copy started"),
    ("clock holder", "the clock holder's heat submitted for the gap to the next token (a discrete GPU)"),
    ("rest of the token", "the rest of DeviceLayers.__call__: K/V rows to the device, the input row, the "
                          "timers themselves"),
)


class JoinProfile:
    """Seconds and counts per part (:data:`PARTS`) over ``tokens`` decode tokens; ``gpu_s``: the device's own
    seconds by its timestamps over those tokens (0 without timestamps)."""

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        """Forget what was measured (after a warm-up)."""
        self.s = {p: 0.0 for p, _ in PARTS}
        self.n = {p: 0 for p, _ in PARTS}
        self.tokens = 0
        self.total_s = 0.0
        self.gpu_s = 0.0

    def snapshot(self) -> tuple:
        """What was measured so far, for :meth:`restore` (an untimed warm-up between them is forgotten)."""
        return dict(self.s), dict(self.n), self.tokens, self.total_s, self.gpu_s

    def restore(self, snap: tuple) -> None:
        """Back to a :meth:`snapshot`."""
        self.s, self.n = dict(snap[0]), dict(snap[1])
        self.tokens, self.total_s, self.gpu_s = snap[2:]

    def lap(self, part: str, t0: float) -> float:
        """Charge the time since ``t0`` (``time.perf_counter``) to ``part``; returns now."""
        now = time.perf_counter()
        self.s[part] += now - t0
        self.n[part] += 1
        return now

    def add(self, part: str, seconds: float) -> None:
        self.s[part] += seconds
        self.n[part] += 1

    def token(self, seconds: float) -> None:
        """One decode token ended; ``seconds`` its whole host time (``DeviceLayers.__call__``)."""
        self.tokens += 1
        self.total_s += seconds

    def table(self, title: str = "") -> str:
        """The parts per token: ms, calls, share of the token's host time (the parts add up to it: the last is what
        the others leave), what each is; then the token's host time and the device's own time."""
        T = max(self.tokens, 1)
        tot = self.total_s / T * 1e3
        rows = [f"join profile{': ' + title if title else ''} ({self.tokens} decode tokens; host ms a token)",
                "| part | ms/token | calls/token | % | what |", "|---|---|---|---|---|"]
        for p, what in PARTS:
            ms = self.s[p] / T * 1e3
            rows.append(f"| {p} | {ms:.3f} | {self.n[p] / T:.1f} | {100 * ms / tot if tot else 0:.1f} | {what} |")
        rows.append(f"| the token (DeviceLayers.__call__) | {tot:.3f} | 1 | 100 | |")
        if self.gpu_s:
            rows.append(f"| the device, by its timestamps | {self.gpu_s / T * 1e3:.3f} | | | segments' first to last "
                        f"timestamp, summed |")
        return "\n".join(rows)
