"""Which routed experts of device layers stay resident while a run goes on (coli/vulkan/device_layers.py, layers
whose experts are placed apart: docs/vulkan.md "Experts on the CPU"): the expert tier's heat, LFRU rule and reuse
gate (``scheduler.tier_policy``) inside each layer. Pure policy: the caller swaps (``DeviceLayers.swap``)."""
from __future__ import annotations

import numpy as np

from scheduler.tier_policy import LFRU_FACTOR, LFRU_ADD, ReuseGate, halvings_due, history_heat


class LayerLFRU:
    """Heat +1 a routing (decode rows of the device layers), halved every 1024 tokens (``halvings_due``), seeded
    from the routing history (``history_heat``). After each token at most ``rate`` swaps: in each layer of
    ``resident`` ({layer: bool [E]}, the residency the swaps lead to: the caller updates it through this dict, whose
    arrays of the swapping layers become row views of the policy's own) that has a resident expert, the
    token's hottest routed expert not resident replaces the layer's coldest resident (ties: lowest id) when its heat
    is strictly greater than 1.25 x that one's + 4 (the tier's promotion rule) and, with ``reuse``
    (:class:`scheduler.tier_policy.ReuseGate`, the tier's ``COLI_VK_TIER_REUSE``), when the routings measured in this
    run (the heat without its history seed) say the newcomer's expected extra routings over the victim's in the next
    1024 tokens repay the upload: under uniform routing the measured spread is the sampling noise's and the swaps
    stop; under skewed routing the hot set comes in. ``counts``: int [L, E] or None. ``swaps`` counts the swaps
    returned, ``skipped_reuse`` those the gate refused."""

    def __init__(self, resident: dict, counts=None, rate: int = 1, reuse: ReuseGate | None = None):
        self.layers = sorted(il for il, m in resident.items() if m.any() and not m.all())
        E = len(next(iter(resident.values()))) if resident else 0
        L = len(self.layers)
        # the policy's layers stacked (a token's bookkeeping in a few whole-array operations: per-layer NumPy calls
        # cost 0.5-0.9 ms a token over 16 layers, on the decode's critical path); the dicts hold row views of them
        self._R = np.zeros((L, E), bool)
        self._H = np.zeros((L, E))
        self._M = np.zeros((L, E))     # the routings measured in this run, halved with the heat (the reuse gate's)
        hh = history_heat(counts) if counts is not None else None
        for i, il in enumerate(self.layers):
            self._R[i] = resident[il]
            if hh is not None:
                self._H[i] = hh[il]
        # the caller's dict from now on holds row views of the stacked residency (its updates land there)
        resident.update({il: self._R[i] for i, il in enumerate(self.layers)})
        self.resident = resident
        self.heat = {il: self._H[i] for i, il in enumerate(self.layers)}
        self.measured = {il: self._M[i] for i, il in enumerate(self.layers)}
        self._rows = np.arange(L)[:, None]
        self.rate = int(rate)
        self.reuse = reuse
        self.tokens = self.halvings = 0
        self.swaps = self.skipped_reuse = 0

    def token(self, ids: dict) -> list[tuple[int, int, int]]:
        """The routed ids of one decode token ({layer: int [k]}) -> swaps [(layer, expert in, expert out)]."""
        self.tokens += 1
        H, M, R = self._H, self._M, self._R
        n = halvings_due(self.tokens, self.halvings)
        if n:
            self.halvings += n
            H *= 0.5 ** n
            M *= 0.5 ** n
            if self.reuse is not None:
                self.reuse.halve(n)
        if self.reuse is not None:
            self.reuse.tokens(1)
        if not self.layers:
            return []
        # each layer's ids ascending: the first of equal heats below is the lowest id (the tie rule)
        I = np.sort(np.array([ids[il] for il in self.layers], np.int64), axis=1)
        rows = np.broadcast_to(self._rows, I.shape)
        np.add.at(H, (rows, I), 1.0)
        np.add.at(M, (rows, I), 1.0)
        # per layer: the hottest routed expert not resident (e_in) and the coldest resident (e_out, lowest id)
        hi = np.where(R[rows, I], -np.inf, H[rows, I])
        pick = np.argmax(hi, axis=1)
        h_in = hi[self._rows[:, 0], pick]
        e_out = np.argmin(np.where(R, H, np.inf), axis=1)
        h_out = H[self._rows[:, 0], e_out]
        ok = np.flatnonzero((h_in > -np.inf) & (h_in > LFRU_FACTOR * h_out + LFRU_ADD))
        out = []
        refreshed = False
        for pos in ok.tolist():
            if len(out) >= self.rate:
                break
            e_in, e_o = int(I[pos, pick[pos]]), int(e_out[pos])
            if self.reuse is not None:
                if not refreshed:      # the shrinkage once a token, at its first swap LFRU allows
                    self.reuse.refresh(M, range(len(self.layers)))
                    refreshed = True
                if not self.reuse.pays(pos, M[pos, e_in], pos, M[pos, e_o]):
                    self.skipped_reuse += 1
                    continue
            out.append((self.layers[pos], e_in, e_o))
        self.swaps += len(out)
        return out
