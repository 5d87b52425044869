"""Which routed experts of device layers stay resident while a run goes on (coli/vulkan/device_layers.py, layers
whose experts are placed apart: docs/vulkan.md "Experts on the CPU"): the expert tier's heat, LFRU rule and reuse
gate (``scheduler.tier_policy``) inside each layer. Pure policy: the caller swaps (``DeviceLayers.swap``)."""
from __future__ import annotations

import numpy as np

from scheduler.tier_policy import LFRU_FACTOR, LFRU_ADD, ReuseGate, halvings_due, history_heat


class LayerLFRU:
    """Heat +1 a routing (decode rows of the device layers), halved every 1024 tokens (``halvings_due``), seeded
    from the routing history (``history_heat``). After each token at most ``rate`` swaps: in each layer of
    ``resident`` ({layer: bool [E]}, the residency the swaps lead to: the caller updates it) that has a resident expert, the
    token's hottest routed expert not resident replaces the layer's coldest resident (ties: lowest id) when its heat
    is strictly greater than 1.25 x that one's + 4 (the tier's promotion rule) and, with ``reuse``
    (:class:`scheduler.tier_policy.ReuseGate`, the tier's ``COLI_VK_TIER_REUSE``), when the routings measured in this
    run (the heat without its history seed) say the newcomer's expected extra routings over the victim's in the next
    1024 tokens repay the upload: under uniform routing the measured spread is the sampling noise's and the swaps
    stop; under skewed routing the hot set comes in. ``counts``: int [L, E] or None. ``swaps`` counts the swaps
    returned, ``skipped_reuse`` those the gate refused."""

    def __init__(self, resident: dict, counts=None, rate: int = 1, reuse: ReuseGate | None = None):
        self.resident = resident
        self.layers = sorted(il for il, m in resident.items() if m.any() and not m.all())
        E = len(next(iter(resident.values()))) if resident else 0
        hh = history_heat(counts) if counts is not None else None
        self.heat = {il: (hh[il].copy() if hh is not None else np.zeros(E)) for il in self.layers}
        # the routings measured in this run, halved with the heat (the reuse gate's counts: no history in them)
        self.measured = {il: np.zeros(E) for il in self.layers}
        self.rate = int(rate)
        self.reuse = reuse
        self.tokens = self.halvings = 0
        self.swaps = self.skipped_reuse = 0

    def token(self, ids: dict) -> list[tuple[int, int, int]]:
        """The routed ids of one decode token ({layer: int [k]}) -> swaps [(layer, expert in, expert out)]."""
        self.tokens += 1
        n = halvings_due(self.tokens, self.halvings)
        if n:
            self.halvings += n
            for il in self.layers:
                self.heat[il] *= 0.5 ** n
                self.measured[il] *= 0.5 ** n
            if self.reuse is not None:
                self.reuse.halve(n)
        for il in self.layers:
            np.add.at(self.heat[il], ids[il], 1.0)
            np.add.at(self.measured[il], ids[il], 1.0)
        if self.reuse is not None:
            self.reuse.tokens(1)
        refreshed = False
        out = []
        for pos, il in enumerate(self.layers):
            if len(out) >= self.rate:
                break
            h, m = self.heat[il], self.resident[il]
            cand = [int(e) for e in ids[il] if not m[e]]
            if not cand:
                continue
            e_in = max(cand, key=lambda e: (h[e], -e))
            cold = np.where(m, h, np.inf)
            e_out = int(np.argmin(cold))
            if not h[e_in] > LFRU_FACTOR * h[e_out] + LFRU_ADD:
                continue
            if self.reuse is not None:
                if not refreshed:      # the shrinkage once a token, at its first swap LFRU allows
                    self.reuse.refresh(np.stack([self.measured[l] for l in self.layers]), range(len(self.layers)))
                    refreshed = True
                r = self.measured[il]
                if not self.reuse.pays(pos, r[e_in], pos, r[e_out]):
                    self.skipped_reuse += 1
                    continue
            out.append((il, e_in, e_out))
        self.swaps += len(out)
        return out
