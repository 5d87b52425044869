"""Which routed experts of device layers stay resident while a run goes on (coli/vulkan/device_layers.py, layers
whose experts are placed apart: docs/vulkan.md "Experts on the CPU"): the expert tier's heat and LFRU rule
(``scheduler.tier_policy``) inside each layer. Pure policy: the caller swaps (``DeviceLayers.swap``)."""
from __future__ import annotations

import numpy as np

from scheduler.tier_policy import LFRU_FACTOR, LFRU_ADD, halvings_due, history_heat


class LayerLFRU:
    """Heat +1 a routing (decode rows of the device layers), halved every 1024 tokens (``halvings_due``), seeded
    from the routing history (``history_heat``). After each token at most ``rate`` swaps: in each layer of
    ``resident`` ({layer: bool [E]}, the masks the device layers hold and update) that has a resident expert, the
    token's hottest routed expert not resident replaces the layer's coldest resident (ties: lowest id) when its heat
    is strictly greater than 1.25 x that one's + 4 (the tier's promotion rule). ``counts``: int [L, E] or None."""

    def __init__(self, resident: dict, counts=None, rate: int = 1):
        self.resident = resident
        self.layers = sorted(il for il, m in resident.items() if m.any() and not m.all())
        E = len(next(iter(resident.values()))) if resident else 0
        hh = history_heat(counts) if counts is not None else None
        self.heat = {il: (hh[il].copy() if hh is not None else np.zeros(E)) for il in self.layers}
        self.rate = int(rate)
        self.tokens = self.halvings = 0

    def token(self, ids: dict) -> list[tuple[int, int, int]]:
        """The routed ids of one decode token ({layer: int [k]}) -> swaps [(layer, expert in, expert out)]."""
        self.tokens += 1
        n = halvings_due(self.tokens, self.halvings)
        if n:
            self.halvings += n
            for h in self.heat.values():
                h *= 0.5 ** n
        for il, h in self.heat.items():
            np.add.at(h, ids[il], 1.0)
        out = []
        for il in self.layers:
            if len(out) >= self.rate:
                break
            h, m = self.heat[il], self.resident[il]
            cand = [int(e) for e in ids[il] if not m[e]]
            if not cand:
                continue
            e_in = max(cand, key=lambda e: (h[e], -e))
            cold = np.where(m, h, np.inf)
            e_out = int(np.argmin(cold))
            if h[e_in] > LFRU_FACTOR * h[e_out] + LFRU_ADD:
                out.append((il, e_in, e_out))
        return out
