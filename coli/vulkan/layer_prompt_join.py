"""A prompt chunk's routed experts that are not on the device (coli/vulkan/device_layers.py ``resident``;
docs/vulkan.md "Experts on the CPU"): computed by the CPU, the chunk's program cut at each such layer and the
CPU's pairs grouped by expert (``_run_prompt_split``), or, with ``COLI_VK_PROMPT_EXPERTS=stream``, copied to
the device while the layer before computes (``_run_prompt_stream``).
"""
from __future__ import annotations

import sys
import time

import numpy as np

from coli.vulkan.errors import DeviceLost, VulkanError
from coli.vulkan.layer_join import Cut


class PromptJoin:
    """A prompt chunk's experts that are not on the device, for :class:`DeviceLayers`: :meth:`_prompt_mode` picks
    "whole", "cpu" (:meth:`_run_prompt_split`) or "stream" (:meth:`_run_prompt_stream`; ``_slots``: the two
    stream slots, ``_ptab``: each cut layer's chunk table)."""

    def _prompt_split_ops(self, j: int, d: dict, R: int, rt: int, et: list) -> list:
        """The experts of a prompt chunk's layer ``d`` (``j``-th here) whose routed experts are not all on the device,
        as ops with two cuts (:class:`Cut`): the shared expert (into ``p_ysh``), the FFN input rows and the layer's
        route copied to the host, cut (the host groups the pairs by expert: the resident ones' offsets and pairs into
        ``p_offh`` / ``p_pairsh``, the others' ``w * expert(x)`` computed by the CPU into their rows of ``p_yk``,
        host-visible); the resident pairs' gate/up and down (``lmm.comp`` modes 1 and 2 over the host's grouping: an
        expert with no pair there has no tile), cut; ``moe_sum.comp`` adds each row's k ranks (and the shared expert)
        to the residual in rank order, as for a layer whose experts are all here."""
        from coli.vulkan.layers import Copy, Dispatch  # the Vulkan binding: only when a device runs

        D, k, F, E, BM = self.D, self.k, self.F, self.E, 64
        gr = -(-R // self.K.tile)
        xn = self.p_xn.addr
        ops = self._prompt_shared(d, R) if "sh_tab" in d else []
        ops += [Copy(self.p_xn, self.p_xnh, [(0, 0, 4 * R * D)]),
                Copy(self.p_route, self.p_routeh, [(8 * k * R * j, 8 * k * R * j, 8 * k * R)], wait=False),
                Cut(j, "cpu")]
        if self.resident[d["il"]].any():     # else no X segment: the host computes every pair
            off, pairs = self.p_offh.addr, self.p_pairsh.addr
            ops += [Dispatch("lmm", (-(-F // BM), gr, E), [d["tab"].addr, xn, self.p_h.addr, rt, pairs, off, xn, xn],
                             [F, D, 0, R, 0, k, 0, d["eact"], 0, 0], type_name=et[0], mode=1),
                    Dispatch("lmm", (-(-D // BM), gr, E), [d["tab"].addr, self.p_h.addr, self.p_yk.addr, rt, pairs,
                                                           off, xn], [D, F, 0, R, 0, k, 0, 0, 0],
                             type_name=et[1], mode=2)]
        ysh = self.p_ysh.addr if "sh_tab" in d else 0
        return ops + [Cut(j, "x"), Dispatch("moe_sum", (R,), [self.p_yk.addr, self.p_hs.addr, ysh or self.p_yk.addr],
                                             [D, k, int(bool(ysh))])]

    def _prompt_segments(self, ops: list) -> list:
        """A prompt chunk's ops cut where the host joins (:meth:`_prompt_split_ops`: kinds "S" and "X") or streams a
        layer's experts (kind "G", the segment before layer j's expert products), recorded: [(kind, Recorded or None,
        j)] as :meth:`_record_split`'s ``segs``."""
        segs, cur, kind = [], [], "S"
        for op in ops + [Cut(None, "end")]:
            if not isinstance(op, Cut):
                cur.append(op)
                continue
            rec = self.K.record(cur, timestamps=True, lead=bool(segs)) if cur else None
            segs.append(("G" if op.kind == "stream" or kind == "G" else kind, rec, None if op.kind == "end" else op.j))
            kind, cur = ("X" if op.kind == "cpu" else "G" if op.kind == "stream" else "S"), []
        return segs

    def _prompt_mode(self, R: int) -> str:
        """How a prompt chunk of ``R`` rows runs: "whole" (every expert here), "cpu" (the CPU computes the pairs of
        the experts that are not here: :meth:`_run_prompt_split`) or "stream" (they are copied to the device:
        :meth:`_run_prompt_stream`): ``COLI_VK_PROMPT_EXPERTS`` cpu / stream, or auto: stream from
        ``COLI_VK_STREAM_ROWS`` rows. "cpu" when the stream slots could not be made (said once)."""
        if not self.resident:
            return "whole"
        mode = self.prompt_experts
        if mode == "auto":
            mode = "stream" if R >= self.stream_rows else "cpu"
        return "stream" if mode == "stream" and self._stream_slots() else "cpu"

    def _expert_parts(self, il: int) -> list:
        """Layer ``il``'s routed experts as uint8 [E, bytes of one expert] views of the file's gate, up and down."""
        E, t = self.E, self.m.t
        return [np.ascontiguousarray(np.asarray(t[f"blk.{il}.{n}.weight"].raw).reshape(E, -1)).view(np.uint8)
                for n in ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")]

    def _stream_slots(self) -> bool:
        """The two stream slots (host-visible device memory, device-local where the device has it: each holds one
        layer's experts that are not resident, 256-byte aligned) and each cut layer's chunk table, made once; False
        (and one ``[VK]`` line; the chunks' experts then run on the CPU) when the device cannot hold them."""
        if self._slots is not None:
            return bool(self._slots)
        il = next(iter(self.resident))
        each = sum(-(-int(x.shape[1]) // 256) * 256 for x in self._expert_parts(il))
        most = max(int((~mk).sum()) for mk in self.resident.values())
        try:
            self._slots = [self.K.buffer(max(1, most) * each, host=True) for _ in range(2)]
            self._ptab = {j: self.K.buffer(8 * 3 * self.E, host=True) for j, d in enumerate(self.per)
                          if d["il"] in self.resident}
        except (VulkanError, MemoryError) as e:
            for b in (self._slots or []) + list(self._ptab.values()):
                self.K.drop(b)
            self._slots, self._ptab = [], {}
            self.prompt_experts = "cpu"
            print(f"[VK] device layers: no room to stream experts for prompts ({2 * most * each / 2**30:.2f} GiB: "
                  f"{type(e).__name__}: {e}); the CPU computes them", file=sys.stderr)
            return False
        return True

    def _stream_layer(self, j: int, slot: int) -> None:
        """Copy device layer ``j``'s experts that are not resident into stream slot ``slot`` and write its chunk
        table: the resident experts' addresses, and the slot's for the others."""
        d, sl = self.per[j], self._slots[slot]
        il = d["il"]
        tab = d["tab_np"].copy()
        t0 = time.perf_counter()
        parts, off, jobs = self._expert_parts(il), 0, []
        for e in np.flatnonzero(~self.resident[il]):
            for c, x in enumerate(parts):
                n = x.shape[1]
                jobs.append((off, x[e]))
                tab[e, c] = sl.addr + off
                off += -(-n // 256) * 256

        def put(job):
            o, src = job
            sl.view[o:o + len(src)] = src       # NumPy's copy lets go of the GIL: the copies run side by side
        list(self._copier().map(put, jobs))
        self._ptab[j].view[:tab.nbytes] = tab.reshape(-1).view(np.uint8)
        self.stream_s += time.perf_counter() - t0
        self.streamed_bytes += off

    def _run_prompt_stream(self, segs: list) -> None:
        """One prompt chunk whose experts that are not resident are streamed (segments G_0 .. G_n, G_i ending before
        the i-th cut layer's expert products): that layer's experts are copied into slot i % 2 while G_i runs, before
        G_i+1 (which reads them) is submitted; a slot is written again only after the segment that last read it was
        waited for. Every pair of the chunk on the device. Raises DeviceLost when a submit or a fence wait fails."""
        K, n = self.K, len(segs) - 1

        def start(rec):
            if not K.start(rec):
                raise DeviceLost("a prompt segment's command buffer still ran")
            self.dev.dispatches += rec.dispatches
            self.dev.layer_dispatches += rec.dispatches

        def wait(rec):
            if not K.wait(rec):
                self.dev._mark_lost("fence wait of a prompt segment failed")
                raise DeviceLost("fence wait of a prompt segment failed")

        self._stream_layer(segs[0][2], 0)
        start(segs[0][1])
        try:
            for i in range(n):
                start(segs[i + 1][1])            # layer j_i's experts (slot i % 2) .. layer j_i+1's route
                if i + 1 < n:
                    wait(segs[i][1])             # it read slot (i + 1) % 2 (layer j_i-1's experts)
                    self._stream_layer(segs[i + 1][2], (i + 1) % 2)
        finally:
            for _, rec, _ in segs:
                if rec.fence is not None and not K.wait(rec):
                    self.dev._mark_lost("fence wait of a prompt segment failed")
                    raise DeviceLost("fence wait of a prompt segment failed")
        self.stream_chunks += 1

    def _prompt_group(self, j: int, R: int):
        """Layer ``j``'s pairs of a prompt chunk of ``R`` rows, once its route is out (``p_routeh``): the resident
        experts' pairs grouped for the X segment (``p_offh``: offsets [E + 1], ``p_pairsh``: pair ids r*k+rank, an
        expert's ascending); returns (the device's pair count, the CPU's pairs {expert: int64 pair ids}, the route
        uint32 [R, 2k])."""
        k, E = self.k, self.E
        rr = self.p_routeh.u32(2 * k * R * len(self.per)).reshape(len(self.per), R, 2 * k)[j]
        # the pairs grouped by expert, experts ascending, each one's pairs ascending (scheduler.step.group_pairs's
        # order; coli.vulkan imports no scheduler)
        flat = rr[:, :k].reshape(-1).astype(np.int64)
        order = np.argsort(flat, kind="stable")
        experts, starts = np.unique(flat[order], return_index=True)
        groups = {int(e): order[a:b] for e, a, b in zip(experts, starts, np.append(starts[1:], len(flat)))}
        res = self.resident[self.per[j]["il"]]
        on = [e for e in groups if res[e]]
        cnt = np.zeros(E + 1, np.uint32)
        for e in on:
            cnt[e + 1] = len(groups[e])
        self.p_offh.u32(E + 1)[:] = np.cumsum(cnt, dtype=np.uint32)
        n_dev = int(cnt.sum())
        if n_dev:
            self.p_pairsh.u32(n_dev)[:] = np.concatenate([groups[e] for e in on]).astype(np.uint32)
        self.p_dev_rows += n_dev
        return n_dev, {e: g for e, g in groups.items() if not res[e]}, rr

    def _prompt_cpu(self, j: int, R: int, cpu: dict, rr: np.ndarray) -> None:
        """The CPU's pairs ``cpu`` of layer ``j``'s prompt chunk (``MoEStep.pair_experts``: the RAM expert cache, the
        engine's activations) into their rows of ``p_yk``: ``w * expert(x)``, rounded to f32 as the CPU's combine
        and ``lmm.comp``'s mode 2 round it."""
        if not cpu:
            return
        k, D = self.k, self.D
        x = self.p_xnh.f32(R * D).reshape(R, D)
        out = np.empty((R * k, D), np.float32)
        self.m.step.pair_experts(self.per[j]["il"], x, cpu, k, out)
        p = np.concatenate(list(cpu.values()))
        w = rr[:, k:].view(np.float32).reshape(-1)
        self.p_yk.f32(R * k * D).reshape(R * k, D)[p] = w[p, None] * out[p]
        self.p_cpu_rows += len(p)

    def _run_prompt_split(self, segs: list, R: int) -> None:
        """One prompt chunk with experts on the CPU, a submit a segment: S_j submitted and waited for, the resident
        pairs' grouping written, X_j (those pairs) started, the CPU's pairs computed meanwhile, S_j+1 submitted (its
        first op waits for X_j), X_j's fence waited."""
        K, started, pend = self.K, None, None
        for kind, rec, j in segs:
            if kind == "S":
                K.submit(rec)
                if started is not None:
                    if not K.wait(started):
                        self.dev._mark_lost("fence wait of the resident experts failed")
                        raise DeviceLost("fence wait of the resident experts failed")
                    started = None
                pend = j
                continue
            n_dev, cpu, rr = self._prompt_group(pend, R)
            if rec is not None and n_dev:
                if not K.start(rec):
                    raise DeviceLost("the resident experts' command buffer still ran")
                self.dev.dispatches += rec.dispatches
                self.dev.layer_dispatches += rec.dispatches
                started = rec
            self._prompt_cpu(pend, R, cpu, rr)
