"""A decode row whose routed experts are partly on the CPU (coli/vulkan/device_layers.py ``resident``; docs/vulkan.md
"Experts on the CPU"): the token's program cut where the host joins, its segments in one submit with timeline
semaphores (``_run_chain``), one command buffer waiting on host-set events (``_run_event``) or a submit a segment
(``_run_split``); the CPU's ranks from the RAM expert cache;
the balancer's hand-off of resident ranks to the CPU (``--balance``: ``_hand``, ``_balance_after``).
"""
from __future__ import annotations

import time

import numpy as np

from coli.base import settings
from coli.base.errors import ColiError
from coli.base.progress import compile_seconds
from coli.vulkan.errors import DeviceLost


def chain_way(dev, env=None, balance: bool = False) -> str:
    """How a decode token whose routed experts are partly on the CPU runs (docs/vulkan.md "Experts on the CPU"), from
    ``COLI_VK_CHAIN`` of ``env`` (os.environ when None): "semaphore" (on: one submit a token, the host joining through
    timeline semaphores, :meth:`RowJoin._run_chain`), "event" (event: one command buffer whose layers wait for
    host-set events, :meth:`RowJoin._run_event`; with ``balance`` (--balance) "semaphore", which gives the balancer's
    route a value of its own before the resident ranks start), "split" (off: a submit a segment,
    :meth:`RowJoin._run_split`); auto: "semaphore" where the device has timeline semaphores (on an H100 it decodes
    1.05-1.33x a submit a segment), else "split". ColiError for another value (the setting's choices), or for on or
    event where the device has no timeline semaphores."""
    v = settings.get("COLI_VK_CHAIN", env)
    tl = bool(getattr(dev, "timeline", False))
    if v in ("on", "event") and not tl:
        raise ColiError(f"COLI_VK_CHAIN={v}: {getattr(dev, 'name', 'the device')} has no timeline semaphores; "
                        f"set auto or off")
    if not tl or v == "off":
        return "split"
    return "event" if v == "event" and not balance else "semaphore"


class Cut:
    """Where a program is cut for the host's experts (a decode token's: :meth:`RowJoin._split_ops`; a prompt chunk's:
    ``PromptJoin._prompt_split_ops``, coli/vulkan/layer_prompt_join.py): ``kind`` "cpu" (after the route of the
    ``j``-th device layer), "x" (after its resident ranks), "stream" (a prompt chunk's, before the ``j``-th layer's
    streamed experts' products) or "end"."""

    def __init__(self, j, kind: str):
        self.j, self.kind = j, kind


class RowJoin:
    """The host's join of :class:`DeviceLayers`' decode row: the program cut at each layer in ``resident``
    (:meth:`_record_split`: ``segs``, ``yk``, ``flags``, ``xroute``), run the way ``way`` says (:meth:`_run_token`);
    ``bal``: the balancer (``--balance``), or None."""

    def _run_token(self) -> None:
        """One decode token of the cut program, the way fixed at construction (``way``: :func:`chain_way`)."""
        if self.way == "semaphore":
            self._run_chain()
        elif self.way == "event":
            self._run_event()
        else:
            self._run_split()

    def _wait_flag(self, j: int, seq: int, t: float, sleep, what: str) -> float:
        """Wait until ``flags[j]`` reads ``seq`` (layer ``j``'s route is out this token): spin on it for ``spin_s``
        past ``t`` (no sleep and no wake-up when the device is quick: ``spun``), else ``sleep()`` (``slept``): the
        way's own wait, which returns once the route is out or raises DeviceLost. Returns the time after it for the
        join profile (its part "wait: flag", or ``what`` after a sleep), else ``t``."""
        flags, pc = self._flags_u32, time.perf_counter
        end = t + self.spin_s
        while flags[j] != seq and pc() < end:
            pass
        if flags[j] == seq:
            self.spun += 1
            what = "wait: flag"
        else:
            self.slept += 1
            sleep()
        return t if self.prof is None else self.prof.lap(what, t)

    def _split_ops(self, j: int, d: dict, rt: int, et: list) -> list:
        """The MoE part of device layer ``d`` (``j``-th here) whose experts are not all on the device, as ops with two
        cuts (:class:`Cut`): the shared expert into row k of the layer's ``yk`` (zeroed first), the FFN input and the
        route copied to the host, cut (the host reads them, starts the next segment and computes the CPU's ranks
        into their rows of ``yk``, host-visible); the resident ranks (``lmoe.comp`` skips ranks whose table entry is
        0), each rank's weighted output into its own row of ``yk``; cut; ``moe_sum.comp`` adds rows 0 .. k of ``yk``
        to the residual in rank order (the CPU path's order: docs/contracts.md "MoE step")."""
        from coli.vulkan.layers import Copy, Dispatch, f32_bits  # the Vulkan binding: only when a device runs

        D, k, F, R = self.D, self.k, self.F, self.K.rows
        yk = self.yk[j]
        ops = [Copy(self.zeros, yk, [(0, 0, 4 * D * (k + 1))], wait=False)]
        if "sh_tab" in d:
            sF, sr = d["sh_F"], d["sh_route"].addr
            if "sh_gate" in d:
                ops.append(Dispatch("lmv", (1,), [d["sh_gate"].addr, self.xn.addr, sr + 4], [1, D, 4],
                                    type_name="F32"))
            ops += [Dispatch("lmoe", (-(-sF // R), 1), [d["sh_tab"].addr, sr, self.xn.addr, self.hbuf.addr],
                             [sF, D, 1, 0, 0, f32_bits(d["sh_limit"])], type_name=d["sh_types"][0], mode=1),
                    Dispatch("lmoe", (-(-D // R),), [d["sh_tab"].addr, sr, self.hbuf.addr, yk.addr + 4 * D * k],
                             [D, sF, 1], type_name=d["sh_types"][1], mode=0)]
        ops += [Copy(self.xn, self.xnh, [(0, 4 * D * j, 4 * D)]),
                Copy(self.route, self.routehost, [(8 * k * j, 8 * k * j, 8 * k)], wait=False),
                Copy(self.params, self.flags, [(32, 4 * j, 4)]),     # the token's number, after the two above
                Cut(j, "cpu")]
        if self.bal is not None:     # the route as the host leaves it (ranks it takes point at an absent expert)
            rt = self.xroute.addr + 8 * k * j
        if self.resident[d["il"]].any():     # else no X segment: the host computes every rank
            ops.append(Dispatch("lmoe", (-(-F // R), k), [d["tab"].addr, rt, self.xn.addr, self.hbuf.addr],
                                [F, D, k], type_name=et[0], mode=1))
            # each rank's weighted down rows into its own row of yk: one dispatch, workgroup y = rank (u4 bit 1)
            ops.append(Dispatch("lmoe", (-(-D // R), k), [d["tab"].addr, rt, self.hbuf.addr, yk.addr],
                                [D, F, 1, k, 2], type_name=et[1], mode=0))
        ops += [Cut(j, "x"), Dispatch("moe_sum", (1,), [yk.addr, self.hs.addr, yk.addr], [D, k + 1, 0])]
        return ops

    def _record_split(self) -> None:
        """The decode token's program cut where the host joins (:meth:`_split_ops`), recorded for the way it runs
        (``way``, :func:`chain_way`, fixed here): "semaphore" and "split", ``segs`` [(kind, Recorded, j)], kind "S"
        (j: the layer whose route the host reads after it, None for the last) or "X" (layer j's resident ranks; None
        when that layer has none on the device), in one submit a token (:meth:`_run_chain`) or one submit a segment
        (:meth:`_run_split`); "event", one command buffer (:meth:`_event_prepare`) and no segments."""
        K, n = self.K, len(self.per)
        self.zeros = K.buffer(4 * self.D * (self.k + 1), host=False)
        K.upload(self.zeros, np.zeros(self.D * (self.k + 1), np.float32))
        # device-local host-visible memory, written and never read by the host (its rows are made in ``_yh``): on an
        # H100 the device did not see host writes made after the submit to host-cached memory, even behind
        # vkCmdWaitEvents from the host stage (the chain's logits 0.5-0.8 off; docs/vulkan.md "Experts on the CPU")
        self.yk = [K.buffer(4 * self.D * (self.k + 1), host=True) if d["il"] in self.resident else None
                   for d in self.per]
        self._yh = np.empty((self.k, self.D), np.float32)     # the CPU's ranks' rows of a layer, weighted, then copied
        self.xnh = K.buffer(4 * self.D * n, host=True, readback=True)
        # --balance: each layer's route for its resident ranks, written by the host before they start
        self.xroute = K.buffer(8 * self.k * n, host=True) if self.bal is not None else None
        self.flags = K.buffer(4 * n, host=True, readback=True)      # layer j's route is out: the token's number
        self.flags.u32(n)[:] = 0
        self._seq = 0           # the decode token's number (params word 8), copied into flags[j] by segment S_j
        self.spin_s = 0.002     # how long the host spins on a flag before it sleeps on the device's timeline
        self.spun = self.slept = 0
        self.way = chain_way(self.dev, getattr(self, "_env", None), self.bal is not None)
        self._erec = None       # "event": the token's command buffer and its events (_event_prepare)
        self._V = V = 2 if self.bal is not None else 1   # the host's timeline values a cut layer: (route,) rows in
        # "semaphore": host timeline offset -> the event the segment waiting for that value waits for too: the host's
        # writes since the submit, visible to it (Kernels.record ``after``); the last segment resets them all ("split"
        # needs none: what the host wrote before a submit is visible to it)
        self._ev = {}
        if self.way == "event":
            self._event_prepare()
        else:
            ops, cur, kind, ns, nx = self._ops(), [], "S", 0, 0
            for op in ops + [Cut(None, "end")]:
                if not isinstance(op, Cut):
                    cur.append(op)
                    continue
                j = None if op.kind == "end" else op.j
                v = V * ns if kind == "S" else (V * nx + 1 if V == 2 else 0)
                if v and cur and self.way == "semaphore":
                    self._ev[v] = K.host_event()
                rec = K.record(cur, timestamps=True, lead=bool(self.segs), after=self._ev.get(v),
                               resets=tuple(self._ev.values()) if op.kind == "end" else ()) if cur else None
                self.segs.append((kind, rec, j))
                ns, nx = (ns + 1, nx) if kind == "S" else (ns, nx + 1)
                kind, cur = ("X" if op.kind == "cpu" else "S"), []
        self.rec = None
        self._tl = 0            # the timeline semaphore's value after the last token
        self._chain = None      # the token's prepared submit (_chain_prepare)
        self._xrec = {}         # layer j -> its X segment (_chain_prepare)
        # views made once: each layer's route, FFN input and yk rows in host-visible memory, the params' words, the flags
        k, D = self.k, self.D
        rh = self.routehost.u32(2 * k * n)
        self._rv = [rh[2 * k * j:2 * k * (j + 1)] for j in range(n)]
        xh = self.xnh.f32(D * n)
        self._xv = [xh[D * j:D * (j + 1)].reshape(1, D) for j in range(n)]
        self._ykv = [y.f32((k + 1) * D).reshape(k + 1, D) if y is not None else None for y in self.yk]
        self._params_u32 = self.params.u32(16)
        if self.xroute is not None:
            xr = self.xroute.u32(2 * k * n)
            self._xrv = [xr[2 * k * j:2 * k * (j + 1)] for j in range(n)]
            for j in range(n):
                self._skip_route(j)
        self._flags_u32 = self.flags.u32(n)

    def _route(self, j: int):
        """Layer ``j``'s route as the device wrote it: ids int64 [k], weights f32 [k], and which ranks are resident."""
        k = self.k
        rr = self._rv[j]
        ids = rr[:k].astype(np.int64)
        return ids, rr[k:].view(np.float32).copy(), self.resident[self.per[j]["il"]][ids]

    def _cpu_ranks(self, j: int, ids, w, on_dev):
        """The CPU's ranks of layer ``j`` (the RAM expert cache, the CPU kernels, the engine's activations) into their
        rows of its ``yk``: ``w_r * expert_r(x)``, made in host memory (``_yh``: the compiled call writes there) and
        written weighted to ``yk`` (device memory the host writes, never reads: one pass when the ranks are one run
        of rows, else weighted in place first).
        When every one of those experts is in RAM (``MoEStep.row_experts_resident``) the RAM cache's bookkeeping of
        their uses is returned as ``(layer, ids)`` for :meth:`_note` once the device runs again; else None."""
        k, P = self.k, self.prof
        ranks = np.flatnonzero(~on_dev)
        n = len(ranks)
        self.dev_rows += k - n
        self.cpu_rows += n
        if not n:
            return None
        step = self.m.step
        c0 = step.row_call_s
        if P is not None:
            t0 = time.perf_counter()
        yk, hy = self._ykv[j], self._yh[:n]
        il = self.per[j]["il"]
        cpu_ids = ids[ranks]
        note = (il, cpu_ids)
        out = step.row_experts_resident(il, self._xv[j], cpu_ids, out=hy)
        if out is None:     # an expert not in RAM (read from the file as it lands), or no compiled row
            note = None
            out = step.row_experts(il, self._xv[j], cpu_ids.tolist(), out=hy)
        self.calls.add(n, step.row_call_s - c0)     # the placement gate's costs (coli/vulkan/placement.py)
        if P is not None:
            t1 = time.perf_counter()
            call = step.row_call_s - c0
            P.add("experts: compiled call", call)
            P.add("experts: lookups", t1 - t0 - call)
        r0 = int(ranks[0])
        if int(ranks[-1]) - r0 + 1 == n:    # one run of rows (every rank on the CPU, say): weighted into yk in one pass
            np.multiply(out, w[ranks, None], out=yk[r0:r0 + n])
        else:
            out *= w[ranks, None]
            yk[ranks] = out
        if P is not None:
            P.lap("rows out", t1)
        return note

    def _note(self, note, t: float) -> float:
        """The RAM cache's bookkeeping a :meth:`_cpu_ranks` left (``MoEStep.note_row``), if any; returns the time
        after it (``t``: before it, for the join profile)."""
        if note is None:
            return t
        self.m.step.note_row(*note)
        return time.perf_counter() if self.prof is None else self.prof.lap("experts: bookkeeping", t)

    def _run_split(self) -> None:
        """One decode token, a submit a segment: submit a segment and wait, read the layer's route and FFN input, start
        its resident ranks (when the token has some), compute the CPU's ranks meanwhile, submit the next segment (it
        waits for both)."""
        try:
            self._split_token()
        except BaseException:
            self._reset_events()    # the last segment, which resets them, did not run
            raise

    def _reset_events(self) -> None:
        """Unset every segment's event from the host (after a token that stopped before its last segment)."""
        for ev in self._ev.values():
            try:
                self.K.reset_event(ev)
            except Exception:  # noqa: BLE001 - a lost device: the caller's DeviceLost says so
                pass

    def _set_event(self, v: int) -> None:
        ev = self._ev.get(v)
        if ev is not None:
            self.K.set_event(ev)

    def _split_token(self) -> None:
        """:meth:`_run_split`'s token."""
        K, P, V = self.K, self.prof, self._V
        stamps = self._stamps_due()
        started, pend, ns, nx = None, None, 0, 0
        for kind, rec, j in self.segs:
            if kind == "S":
                if ns:      # the host's rows of the layer before (a submit makes them visible; the event is set too)
                    self._set_event(V * ns)
                ns += 1
                t0 = time.perf_counter()
                K.submit(rec)
                self.submit_s += time.perf_counter() - t0
                if P is not None:
                    P.lap("submit", t0)
                if stamps:
                    t0 = time.perf_counter()
                    self._gpu_add(K.gpu_ms(rec))
                    if P is not None:
                        P.lap("timestamps", t0)
                if started is not None:
                    if not K.wait(started):
                        self.dev._mark_lost("fence wait of the resident experts failed")
                        raise DeviceLost("fence wait of the resident experts failed")
                    if stamps:
                        self._gpu_add(K.gpu_ms(started))
                    started = None
                if j is not None:
                    t0 = time.perf_counter()
                    pend = (j,) + self._route(j)
                    if P is not None:
                        P.lap("route read", t0)
                continue
            j, ids, w, on_dev = pend
            nx += 1
            if self.bal is not None:
                ids, w, on_dev = self._hand(j, ids, w, on_dev)
            if rec is not None and on_dev.any():
                if V == 2:
                    self._set_event(V * (nx - 1) + 1)
                if not K.start(rec):
                    raise DeviceLost("the resident experts' command buffer still ran")
                self.dev.dispatches += rec.dispatches
                self.dev.layer_dispatches += rec.dispatches
                started = rec
            tc = time.perf_counter()
            note = self._cpu_ranks(j, ids, w, on_dev)
            if self.bal is not None:
                self._steps[-1][5] = time.perf_counter() - tc
            self._note(note, time.perf_counter())
        if stamps:
            self.gpu_tokens += 1
        if self.bal is not None:
            self._balance_after()

    def _hand(self, j: int, ids, w, on_dev):
        """--balance: which of layer ``j``'s resident ranks this decode row the device keeps
        (``Balancer.keep``: one row each; movable where the RAM expert cache holds the expert or has a free slot
        in the layer, as the tier's rule); the others go to the CPU. Writes the route the resident ranks read
        (``xroute``: a rank handed over points at an expert that is not resident, which ``lmoe.comp`` skips) and
        notes the step for :meth:`_balance_after`. Returns ``(ids, w, on_dev)`` with the handed ranks off the
        device."""
        il = self.per[j]["il"]
        cache = self.m.step.cache
        res = np.flatnonzero(on_dev)
        xr = self._xrv[j]
        xr[:] = self._rv[j]
        handed = 0
        if len(res):
            lru, slots = getattr(cache, "lru", None), getattr(cache, "slots", None)
            free = lru is not None and slots is not None and len(lru[il]) < slots
            movable = np.array([free or cache.in_ram(il, int(ids[r])) for r in res], bool)
            keep = self.bal.keep(np.ones(len(res), np.int64), movable)
            give = res[~keep]
            handed = len(give)
            if handed:
                xr[give] = int(np.flatnonzero(~self.resident[il])[0])
                on_dev = on_dev.copy()
                on_dev[give] = False
                self.handed += handed
        cold = sum(1 for e in ids[~on_dev] if not cache.in_ram(il, int(e)))
        self._steps.append([j, len(res) - handed, int((~on_dev).sum()), len(res), cold, 0.0])
        return ids, w, on_dev

    def _skip_route(self, j: int) -> None:
        """Layer ``j``'s ``xroute``: every rank at an expert that is not resident, weight 0 (its resident ranks' segment
        then does nothing): before the first token, and for the layers a failed token did not reach (their segments
        still run while the queue drains)."""
        il = self.per[j]["il"]
        if il in self.resident:
            xr = self._xrv[j]
            xr[:self.k] = int(np.flatnonzero(~self.resident[il])[0])
            xr[self.k:] = 0

    def _balance_after(self) -> None:
        """--balance, after a decode token: each balanced layer step's times to the balancer, in layer order (its
        resident ranks' device ms by their segment's timestamps; the CPU's ms by the host clock; the join's wait
        taken as the device's ms past the CPU's, both starting when the host wrote the route)."""
        from types import SimpleNamespace   # scheduler.balancer.StepTimes's fields (coli.vulkan imports no scheduler)

        for j, nd, nc, nres, cold, cpu_s in self._steps:
            rec = self._xrec.get(j) if self.way == "semaphore" else next(r for kind, r, jj in self.segs if kind == "X" and jj == j)
            dms = (self.K.gpu_ms(rec) or 0.0) if rec is not None and nd else 0.0
            cms = cpu_s * 1e3
            self.bal.update(SimpleNamespace(device_ms=dms, device_rows=nd, cpu_ms=cms, cpu_rows=nc,
                                      waited_ms=max(0.0, dms - cms), resident_rows=nres, cpu_cold=cold))
        self._steps.clear()

    def _stamps_due(self) -> bool:
        """Whether this token's segments' timestamps are read: every token with the join profile on, else one token in
        ``stamp_every`` (the closing line's device time a token comes from those). With ``--balance`` the balanced
        layers' resident-rank segments are read every token by :meth:`_balance_after` alone (the others' reads, about
        10 us each, would be the host's time for nothing)."""
        return self.K.dev.timestamps and (self.prof is not None or self.tokens % self.stamp_every == 0)

    def _chain_prepare(self) -> None:
        """The token's batches for :meth:`_run_chain`, their submit structures made once (``Kernels.prepare_batches``:
        the timeline values are offsets from the token's base, set in place each token)."""
        S = [(rec, j) for kind, rec, j in self.segs if kind == "S"]
        X = [rec for kind, rec, j in self.segs if kind == "X"]
        n = len(X)
        V = self._V
        batches = []
        for i, (rec, j) in enumerate(S):
            batches.append(([rec], V * i if i else 0, V * i + 1 if j is not None else 0))
            if i < n and X[i] is not None:     # with a balancer it waits for the host's route (value V i + 1)
                batches.append(([X[i]], V * i + 1 if V == 2 else 0, 0))
        self._chain = (self.K.prepare_batches(batches), [j for _, j in S[:n]], n,
                       [rec for rec, _ in S] + [x for x in X if x is not None])
        self._xrec = {j: X[i] for i, j in enumerate(self._chain[1])}

    def _host_wrote(self, base: int, v: int) -> None:
        """The host's writes for the segment that waits for value ``base + v`` of its timeline are done: set that
        segment's event (what the host wrote, visible to it), then signal the value (it may start)."""
        self._set_event(v)
        self.K.signal(base + v)

    def _drain(self, wait, submitted: bool) -> None:
        """After a token that failed mid-way (an error in the host's part: the RAM cache, an interrupt; the waits
        released): wait (``wait()``, False or DeviceLost when it fails) for the rest of its program to run, so that the
        next token's host writes (its input row, the params word its flags copy) do not meet this one still running and
        its next submit is not refused. Nothing when it was not submitted or the device is lost already."""
        if submitted and not self.dev.lost and not wait():
            self.dev._mark_lost("fence wait after a failed token failed")

    def _event_prepare(self) -> None:
        """The token's program as one command buffer for :meth:`_run_event` (``_erec``: the Recorded and {j: event}):
        the ops of :meth:`_ops` with each cut after a layer's route dropped (the host polls the layer's flag) and each
        cut before its ``moe_sum`` a :class:`~coli.vulkan.layers.HostWait` on an event of its own, which the end of the
        buffer resets."""
        from coli.vulkan.layers import HostWait  # the Vulkan binding: only when a device runs

        K, ops, evs = self.K, [], {}
        for op in self._ops():
            if isinstance(op, Cut):
                if op.kind == "x":
                    evs[op.j] = K.host_event()
                    ops.append(HostWait(evs[op.j]))
                continue
            ops.append(op)
        self._erec = (K.record(ops, timestamps=True, resets=tuple(evs.values())), evs)

    def _run_event(self) -> None:
        """One decode token as one command buffer (``COLI_VK_CHAIN=event``): the device writes layer i's route and
        flag and runs its resident ranks; the host spins on the flag (past ``spin_s``: short sleeps, checking the
        fence), reads the route, computes the CPU's ranks into ``yk`` and sets the layer's event, on which the
        device's ``moe_sum`` waits (no semaphore, no batch boundary). On any failure the host sets every event not yet
        set, so the buffer drains before the caller goes on. The timestamps (one token in ``stamp_every``) give the
        device's own time (``gpu_s``) and, apart, its waits for the host's events (``gpu_wait_s``)."""
        K, P, pc = self.K, self.prof, time.perf_counter
        rec, evs = self._erec
        self._seq = seq = (self._seq + 1) & 0xFFFFFFFF or 1
        self._params_u32[8] = seq
        flags = self._flags_u32
        limit = self.dev._timeout_ns / 1e9
        done, ended, started = set(), False, False
        k0 = compile_seconds()
        t0 = t = pc()

        def poll(j):     # past the spin: short sleeps, the buffer's fence checked, the device's timeout from t0
            while flags[j] != seq:
                if not K.running(rec) and flags[j] != seq:
                    raise DeviceLost(f"the device ended a token before layer {self.per[j]['il']}'s route")
                if pc() - t0 > limit:
                    self.dev._mark_lost("a layer's route flag timed out")
                    raise DeviceLost("a layer's route flag timed out")
                time.sleep(50e-6)

        try:
            if not K.start(rec):
                raise DeviceLost("the last token's command buffer still ran")
            started = True
            K.dev.dispatches += rec.dispatches
            K.dev.layer_dispatches += rec.dispatches
            t = pc() if P is None else P.lap("submit", t)
            for j, ev in evs.items():
                t = self._wait_flag(j, seq, t, lambda: poll(j), "wait: polled")
                r = self._route(j)
                if P is not None:
                    P.lap("route read", t)
                note = self._cpu_ranks(j, *r)
                t = pc()
                K.set_event(ev)
                done.add(j)
                t = pc() if P is None else P.lap("signal", t)
                if note is not None:    # the device runs the next layer meanwhile
                    t = self._note(note, t)
            if not K.wait(rec):
                self.dev._mark_lost("fence wait failed")
                raise DeviceLost("fence wait failed")
            ended = True
            if P is not None:
                P.lap("tail", t)
        finally:
            if not ended:
                try:
                    for j, ev in evs.items():
                        if j not in done:
                            K.set_event(ev)
                    self._drain(lambda: K.wait(rec), started)
                except Exception:  # noqa: BLE001 - a lost device: the caller's DeviceLost says so
                    pass
        self.submit_s += pc() - t0
        if self._stamps_due() and compile_seconds() == k0:    # a CPU kernel's compile: in the waits, not the token's
            t = pc()
            g = K.gpu_waits_ms(rec)     # the buffer's first to last timestamp holds its waits for the host's events
            if g is not None:
                self._gpu_add(g[0])
                self.gpu_wait_s += g[1] / 1e3
            self.gpu_tokens += 1
            if P is not None:
                P.lap("timestamps", t)

    def _run_chain(self) -> None:
        """One decode token in one submit (timeline semaphores, ``Kernels.submit_prepared``): segment S_i copies the
        token's number into ``flags[i]`` after layer i's route and signals value base + i + 1 of the device's
        timeline (the host spins on the flag for ``spin_s``, then sleeps on the value; ``spun`` / ``slept`` count
        which; then it reads the route and computes the CPU's ranks into ``yk``), X_i (layer i's resident ranks) runs
        beside the host, and
        S_i+1 waits for value base + i + 1 of the host's timeline, which the host signals once it wrote those rows.
        On any failure the host signals its last value, so the queue drains before the caller goes on. The segments'
        timestamps are read one token in ``stamp_every`` (every token with the join profile)."""
        K, P, pc = self.K, self.prof, time.perf_counter
        if self._chain is None:
            self._chain_prepare()
        prep, js, n, recs = self._chain
        base, V, bal = self._tl, self._V, self.bal
        top, done = base + V * n, base
        self._seq = seq = (self._seq + 1) & 0xFFFFFFFF or 1
        self._params_u32[8] = seq
        ended = submitted = False
        t0 = t = pc()
        try:
            K.submit_prepared(prep, base)
            submitted = True
            t = pc() if P is None else P.lap("submit", t)
            for i in range(n):
                j = js[i]
                # the flag S_i writes, else the device's timeline value S_i signals
                t = self._wait_flag(j, seq, t, lambda: K.wait_value(base + V * i + 1), "wait: semaphore")
                r = self._route(j)
                if P is not None:
                    P.lap("route read", t)
                if bal is not None:     # the resident ranks' route, then they start (value V i + 1)
                    r = self._hand(j, *r)
                    self._host_wrote(base, V * i + 1)
                    done = base + V * i + 1
                    tc = pc()
                note = self._cpu_ranks(j, *r)
                if bal is not None:
                    self._steps[-1][5] = pc() - tc
                t = pc()
                self._host_wrote(base, V * (i + 1))
                done = base + V * (i + 1)
                t = pc() if P is None else P.lap("signal", t)
                if note is not None:    # the device runs the next segment meanwhile
                    t = self._note(note, t)
            K.wait_batches()
            ended = True
            if P is not None:
                P.lap("tail", t)
        finally:
            self._tl = top
            if done < top:
                if bal is not None:     # the resident ranks not yet routed this token: nothing to run
                    for i in range(n):
                        if base + V * i + 1 > done:
                            self._skip_route(js[i])
                try:
                    for v, ev in self._ev.items():     # the segments left wait for these too
                        if base + v > done:
                            K.set_event(ev)
                    K.signal(top)
                except Exception:  # noqa: BLE001 - a lost device: the caller's DeviceLost says so
                    pass
            if not ended:
                try:
                    self._drain(lambda: K.wait_batches() or True, submitted)
                except Exception:  # noqa: BLE001 - a lost device: the caller's DeviceLost says so
                    pass
        self.submit_s += pc() - t0
        if self._stamps_due():
            t = pc()
            for rec in recs:
                self._gpu_add(K.gpu_ms(rec))
            self.gpu_tokens += 1
            if P is not None:
                P.lap("timestamps", t)
        if bal is not None:
            self._balance_after()
