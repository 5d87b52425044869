"""One submit of several batches that the host joins mid-way (a decode token whose experts are partly on the CPU:
coli/vulkan/layer_join.py): two timeline semaphores (the host signals values the batches wait for; the batches
signal values the host waits for), events that carry the host's writes made after the submit to the segment that
reads them, and the submit structures made once (:class:`Prepared`). Mixed into ``layers.Kernels`` (its device,
fence and :class:`~coli.vulkan.layers.Recorded` command buffers); docs/vulkan.md "Experts on the CPU".
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .binding import _PSTAGE_COMPUTE, _PSTAGE_TRANSFER, _TIMEOUT, _chk, _s, ffi, lib, vk
from .errors import DeviceLost


@dataclass
class Prepared:
    """A submit of several batches made once (:meth:`Kernels.prepare_batches`): ``subs`` ``VkSubmitInfo[n]``, ``vals``
    uint64 (a view of the cffi array the batches' timeline values are read from) = base + ``offs``, the dispatches in
    it, and ``keep`` (the cffi objects the structures point to)."""

    subs: object
    n: int
    vals: np.ndarray
    offs: np.ndarray
    dispatches: int
    keep: list


class HostJoin:
    """``Kernels``' submits of several batches joined by the host through timeline semaphores and events."""

    def _timeline(self, which: int = 0):
        """Timeline semaphore ``which`` (``VkSemaphore[1]``, made at first use, value 0): 0 the host signals and
        batches wait for, 1 batches signal and the host waits for (two, so that a host that gives up can signal
        its last value at once without running ahead of values the device still signals)."""
        tl = getattr(self, "_tl", None)
        if tl is None:
            tl = self._tl = [None, None]
        if tl[which] is None:
            sti = _s("VkSemaphoreTypeCreateInfo")
            sti.sType = vk.VK_STRUCTURE_TYPE_SEMAPHORE_TYPE_CREATE_INFO
            sti.semaphoreType = vk.VK_SEMAPHORE_TYPE_TIMELINE
            sti.initialValue = 0
            sci = _s("VkSemaphoreCreateInfo")
            sci.sType = vk.VK_STRUCTURE_TYPE_SEMAPHORE_CREATE_INFO
            sci.pNext = sti
            sem = ffi.new("VkSemaphore[1]")
            _chk(lib.vkCreateSemaphore(self.dev._dev, sci, ffi.NULL, sem), "vkCreateSemaphore")
            tl[which] = sem
        return tl[which]

    def submit_batches(self, batches: list) -> None:
        """One ``vkQueueSubmit`` of ``batches`` [(recs, wait, signal)]: each batch's :class:`Recorded` command buffers,
        waiting (at its compute and transfer stages) for value ``wait`` of the host's timeline (0: none) and
        signalling value ``signal`` of the device's (0: none) when done; the last batch signals the fence
        :meth:`wait_batches` waits for. The host signals its values (:meth:`signal`) and waits for the device's
        (:meth:`wait_value`). DeviceLost when the submit fails. A submit repeated with values that move by a base
        each time: :meth:`prepare_batches` once, :meth:`submit_prepared` each time."""
        self.submit_prepared(self.prepare_batches(batches), 0)

    def prepare_batches(self, batches: list) -> "Prepared":
        """The cffi structures of a :meth:`submit_batches` of ``batches`` [(recs, wait, signal)] made once, the values
        ``wait`` / ``signal`` being offsets from the base each :meth:`submit_prepared` gives (0: none)."""
        sem, dsem = self._timeline(0), self._timeline(1)
        n = len(batches)
        subs = ffi.new("VkSubmitInfo[]", n)
        m = sum((1 if w else 0) + (1 if sg else 0) for _, w, sg in batches)
        vals = ffi.new("uint64_t[]", max(m, 1))
        keep, offs, at = [subs, vals], [], 0
        stage = ffi.new("VkPipelineStageFlags[1]", [_PSTAGE_COMPUTE | _PSTAGE_TRANSFER])
        keep.append(stage)
        for i, (recs, w, sg) in enumerate(batches):
            cbs = ffi.new("VkCommandBuffer[]", [r.arr[0] for r in recs])
            tsi = _s("VkTimelineSemaphoreSubmitInfo")
            tsi.sType = vk.VK_STRUCTURE_TYPE_TIMELINE_SEMAPHORE_SUBMIT_INFO
            sub = subs[i]
            sub.sType = vk.VK_STRUCTURE_TYPE_SUBMIT_INFO
            sub.pNext = tsi
            sub.commandBufferCount = len(recs)
            sub.pCommandBuffers = cbs
            keep += [cbs, tsi]
            if w:
                sub.waitSemaphoreCount, sub.pWaitSemaphores, sub.pWaitDstStageMask = 1, sem, stage
                tsi.waitSemaphoreValueCount, tsi.pWaitSemaphoreValues = 1, vals + at
                offs.append(int(w))
                at += 1
            if sg:
                sub.signalSemaphoreCount, sub.pSignalSemaphores = 1, dsem
                tsi.signalSemaphoreValueCount, tsi.pSignalSemaphoreValues = 1, vals + at
                offs.append(int(sg))
                at += 1
        view = np.frombuffer(ffi.buffer(vals, 8 * max(m, 1)), np.uint64)[:m]
        return Prepared(subs, n, view, np.array(offs, np.uint64), sum(r.dispatches for b in batches for r in b[0]),
                        keep)

    def submit_prepared(self, p: "Prepared", base: int) -> None:
        """Submit the batches of :meth:`prepare_batches` with their values ``base`` + offset (set in place)."""
        dev = self.dev
        np.add(p.offs, np.uint64(base), out=p.vals)
        dev.dispatches += p.dispatches
        dev.layer_dispatches += p.dispatches
        f = self._fence(self)
        _chk(lib.vkResetFences(dev._dev, 1, f), "vkResetFences")
        r = lib.vkQueueSubmit(dev._queue, p.n, p.subs, f[0])
        if r != 0:
            dev._mark_lost(f"vkQueueSubmit returned {r}")
            raise DeviceLost(f"vkQueueSubmit returned {r}")

    def wait_value(self, value: int) -> None:
        """Wait until the device has signalled ``value`` of its timeline (the device's timeout); DeviceLost
        otherwise."""
        wi = getattr(self, "_waitinfo", None)
        if wi is None:     # made once: a token waits up to once a layer
            wi = _s("VkSemaphoreWaitInfo")
            wi.sType = vk.VK_STRUCTURE_TYPE_SEMAPHORE_WAIT_INFO
            wi.semaphoreCount = 1
            wi.pSemaphores = self._timeline(1)
            v = ffi.new("uint64_t[1]")
            wi.pValues = v
            self._waitinfo, self._waitval = wi, v
        self._waitval[0] = int(value)
        r = lib.vkWaitSemaphores(self.dev._dev, wi, self.dev._timeout_ns)
        if r != 0:
            why = "semaphore wait timed out" if r == _TIMEOUT else f"vkWaitSemaphores returned {r}"
            self.dev._mark_lost(why)
            raise DeviceLost(why)

    def signal(self, value: int) -> None:
        """Signal ``value`` of the host's timeline (the batches waiting for it may start)."""
        si = getattr(self, "_siginfo", None)
        if si is None:     # made once: a token signals once a layer
            si = self._siginfo = _s("VkSemaphoreSignalInfo")
            si.sType = vk.VK_STRUCTURE_TYPE_SEMAPHORE_SIGNAL_INFO
            si.semaphore = self._timeline(0)[0]
        si.value = int(value)
        _chk(lib.vkSignalSemaphore(self.dev._dev, si), "vkSignalSemaphore")

    def host_event(self):
        """A new event (``VkEvent[1]``, unset) that the host sets (:meth:`set_event`) once it wrote what a recorded
        command buffer waiting for it (:meth:`record` ``after``) reads; a command buffer's ``resets`` unset it."""
        eci = _s("VkEventCreateInfo")
        eci.sType = vk.VK_STRUCTURE_TYPE_EVENT_CREATE_INFO
        ev = ffi.new("VkEvent[1]")
        _chk(lib.vkCreateEvent(self.dev._dev, eci, ffi.NULL, ev), "vkCreateEvent")
        self._events.append(ev)
        return ev

    def set_event(self, ev) -> None:
        """Set ``ev`` from the host (:meth:`host_event`)."""
        _chk(lib.vkSetEvent(self.dev._dev, ev[0]), "vkSetEvent")

    def reset_event(self, ev) -> None:
        """Unset ``ev`` from the host (no command buffer may be waiting for it)."""
        _chk(lib.vkResetEvent(self.dev._dev, ev[0]), "vkResetEvent")

    def wait_batches(self) -> None:
        """Wait for the fence of the last :meth:`submit_batches`; DeviceLost when the wait fails."""
        dev = self.dev
        r = lib.vkWaitForFences(dev._dev, 1, self._fence(self), 1, dev._timeout_ns)
        if r != 0:
            why = "fence wait timed out" if r == _TIMEOUT else f"vkWaitForFences returned {r}"
            dev._mark_lost(why)
            raise DeviceLost(why)
