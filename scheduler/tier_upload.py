"""The device expert tier's uploads: the uploader thread that writes promoted experts to the device and frees the
experts they evict, :meth:`TierUploads.settle` where finished uploads become resident, and the warm start that fills
the budget before the run (docs/tier.md "upload", "eviction", "failed upload", "warm start").

:class:`TierUploads` is a part of :class:`scheduler.tier.Tier` (a mixin, not used alone): its state is the tier's,
set by :meth:`TierUploads._init_uploads`. It reads the tier's ``device``, ``_dev_lock``, ``on``, ``trace`` and the
residency (``resident``, ``resident_bytes``, ``mask``, ``pending``, ``capacity``), which it writes only on the engine
thread, in :meth:`TierUploads.settle` and :meth:`TierUploads.warm_start`. The uploader thread touches only the job
queue, the upload counters and the lists :meth:`TierUploads.settle` takes, under ``_lock``; its jobs are staged by the
promotion (:meth:`scheduler.tier_residency.TierResidency.promote`).
"""
from __future__ import annotations

import os
import queue
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from scheduler.tier_policy import _env_int, warm_plan
from scheduler.trace import UPLOADER_TID, host_ns


def _expert_nbytes(arrays) -> int:
    return int(sum(np.asarray(raw).nbytes for (_t, raw, _s) in arrays))


@dataclass
class WarmStart:
    """What :meth:`Tier.warm_start` did: experts uploaded (``n``; ``n_history`` of them the history's),
    ``failed`` uploads, wall ``seconds``, and the status ``line``."""

    n: int
    n_history: int
    failed: int
    seconds: float
    line: str


@dataclass
class UploadJob:
    """One expert for the uploader thread (staged by :meth:`scheduler.tier_residency.TierResidency.promote`)."""

    layer: int
    expert: int
    arrays: tuple
    evict: object            # the evicted expert's handle, or None
    wait: list               # Events of the in-flight batches that read the evicted expert


class TierUploads:
    """The tier's uploads (see the module's docstring). ``env``: ``COLI_VK_TIER_SYNC`` (0), ``COLI_VK_TIER_FILL``
    (1), ``COLI_VK_TIER_WARM`` (1)."""

    def _init_uploads(self, env) -> None:
        """The uploads' state and counters; starts the uploader thread (last: it reads the rest of the tier)."""
        self.sync = _env_int(env, "COLI_VK_TIER_SYNC", 0) == 1
        self.fill = _env_int(env, "COLI_VK_TIER_FILL", 1) != 0
        self.warm = _env_int(env, "COLI_VK_TIER_WARM", 1) != 0
        self.uploads = 0
        self.warm_uploads = 0
        self.upload_bytes = 0
        self.failed = 0
        # uploader thread state (guarded by _lock)
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._q: queue.Queue = queue.Queue()
        self._staged = 0
        self._completed = 0
        self._done: list[tuple[int, int, object, int]] = []
        self._failed_keys: list[tuple[int, int, str]] = []
        self._fail_said: set[str] = set()      # the reasons of failed uploads already printed
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._uploader, name="coli-tier-uploader", daemon=True)
        self._thread.start()

    def settle(self) -> None:
        """Call at each layer step's start (no batch in flight): finished uploads become resident, failed
        ones shrink the planned residency. With ``COLI_VK_TIER_SYNC=1`` first waits for every upload staged
        so far (then residency follows the routing alone: reproducible). Decides the candidates that
        :meth:`note` recorded since the last call first."""
        self.promote_noted()
        with self._cond:
            if self.sync:
                if self._inflight:
                    raise RuntimeError("Tier.settle() with COLI_VK_TIER_SYNC=1 while a batch is in flight")
                target = self._staged
                self._cond.wait_for(lambda: self._completed >= target or self._stop.is_set())
            done, self._done = self._done, []
            failed, self._failed_keys = self._failed_keys, []
        for l, e, h, nb in done:
            self.pending.discard((l, e))
            if not self.on:
                continue
            if self._copies and not self._cpu_holds(l, e):
                self._ram_todo.append((l, e))
            self.resident[(l, e)] = h
            self.resident_bytes[(l, e)] = nb
            self.mask[l, e] = True
        for l, e, why in failed:
            self.pending.discard((l, e))
            self.capacity = max(0, self.capacity - 1)
            if why != "tier off" and why not in self._fail_said:     # each reason said once, never silent
                self._fail_said.add(why)
                self._say(f"[VK] tier {self.model}: upload of layer {l} expert {e} failed ({why}); "
                          f"budget now {self.capacity} experts")

    def _uploader(self) -> None:
        while True:
            job = self._q.get()
            if job is None:
                return
            try:
                for ev in job.wait:
                    while not ev.wait(0.05):
                        if self._stop.is_set():
                            break
                if job.evict is not None and self.on:
                    try:
                        with self._dev_lock:
                            self.device.free_expert(job.evict)
                    except Exception:
                        pass  # the device is gone: the next join reports it and turns the tier off
                if self._stop.is_set() or not self.on:
                    with self._cond:
                        self._failed_keys.append((job.layer, job.expert, "tier off"))
                    continue
                t0 = host_ns()
                nb = _expert_nbytes(job.arrays)
                try:
                    with self._dev_lock:
                        h = self.device.upload_expert(*job.arrays)
                except Exception as err:
                    with self._cond:
                        self.failed += 1
                        self._failed_keys.append((job.layer, job.expert, f"{type(err).__name__}: {err}"))
                    continue
                t1 = host_ns()
                self.trace.span(f"upload L{job.layer} E{job.expert}", "upload", t0, t1, tid=UPLOADER_TID,
                                args={"layer": job.layer, "expert": job.expert, "bytes": nb})
                with self._cond:
                    self.uploads += 1
                    self.upload_bytes += getattr(h, "uploaded", nb)    # zero-copy: mapped, nothing copied
                    self._done.append((job.layer, job.expert, h, nb))
            finally:
                with self._cond:
                    self._completed += 1
                    self._cond.notify_all()

    # ----- warm start
    def warm_start(self, read_expert, threads: int | None = None) -> WarmStart:
        """Fill the budget before the run: :func:`warm_plan` from the history, bytes read by
        ``read_expert(layer, e) -> (gate, up, down)`` on a thread pool (``threads``, default
        min(8, CPUs)), uploaded on this thread as they arrive. The first failed upload stops it and the
        planned residency shrinks to what is resident. Prints and returns the line
        ``[VK] tier <model>: warm start, N experts from the history in T s`` (``; F more to fill the room``
        before `` in`` when the fill added experts). ``COLI_VK_TIER_WARM=0``: nothing."""
        t0 = time.perf_counter()
        if not self.warm or not self.on or self.counts is None and not self.fill:
            return WarmStart(0, 0, 0, 0.0, "")
        counts = self.counts if self.counts is not None else np.zeros((self.L, self.E), dtype=np.int64)
        room = self.capacity - len(self.resident) - len(self.pending)
        plan, n_hist = warm_plan(counts, room, fill=self.fill, layers=self.moe_layers)
        plan = [k for k in plan if not self.mask[k] and k not in self.pending]
        threads = threads or max(1, min(8, os.cpu_count() or 1))
        n = failed = n_h = 0
        window = 2 * threads
        from coli.base.progress import bar  # drawn only when stderr is a terminal

        with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="coli-warm") as ex, \
                bar(total=len(plan), desc="warm start", unit=" experts") as pb:
            futs = []
            it = iter(plan)
            for k in it:
                futs.append((k, ex.submit(read_expert, *k)))
                if len(futs) >= window:
                    break
            i = 0
            while i < len(futs):
                k, f = futs[i]
                futs[i] = None
                i += 1
                arrays = f.result()
                pb.update(1)
                if failed == 0:
                    ts = host_ns()
                    try:
                        with self._dev_lock:
                            h = self.device.upload_expert(*arrays)
                    except Exception as err:
                        failed += 1
                        self.failed += 1
                        self.capacity = len(self.resident)
                        why = f"layer {k[0]} expert {k[1]}: {type(err).__name__}: {err}"
                    else:
                        nb = _expert_nbytes(arrays)
                        self.trace.span(f"upload L{k[0]} E{k[1]} (warm)", "upload", ts, host_ns(),
                                        args={"layer": k[0], "expert": k[1], "bytes": nb, "warm": True})
                        self.resident[k] = h
                        self.resident_bytes[k] = nb
                        self.mask[k] = True
                        if self._copies:        # read from the file, not the RAM cache: the CPU lacks it
                            self._ram_todo.append(k)
                        n += 1
                        n_h += int(counts[k] > 0)
                        with self._lock:
                            self.uploads += 1
                            self.upload_bytes += getattr(h, "uploaded", nb)
                        self.warm_uploads += 1
                if failed == 0:
                    nxt = next(it, None)
                    if nxt is not None:
                        futs.append((nxt, ex.submit(read_expert, *nxt)))
        dt = time.perf_counter() - t0
        extra = f"; {n - n_h} more to fill the room" if n > n_h else ""
        fail = f"; an upload failed ({why}), budget now {self.capacity} experts" if failed else ""
        line = f"[VK] tier {self.model}: warm start, {n_h} experts from the history{extra} in {dt:.1f} s{fail}"
        self._say(line)
        return WarmStart(n, n_h, failed, dt, line)

    def _shutdown(self, wait: bool) -> None:
        self._stop.set()
        with self._cond:
            self._cond.notify_all()
        self._q.put(None)
        if wait:
            self._thread.join()
