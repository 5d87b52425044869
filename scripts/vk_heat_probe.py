#!/usr/bin/env python3
"""The clock holder's kernel alone (shaders/heat.comp, docs/vulkan.md "Clocks"): how long a heat spins at a
few caps when nothing stops it (device timestamps and wall time), and a heat on the second queue that the host
stops by writing its flag. usage: scripts/vk_heat_probe.py (needs a Vulkan device; on the H200 machine with the
set-up of scripts/h200_setup.sh)."""
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> int:
    from coli.vulkan import open_device
    from coli.vulkan import layers as L
    from coli.vulkan.device import lib

    dev = open_device("heat probe", budget=1 << 30, quiet=True)
    if dev is None:
        sys.exit("vk_heat_probe: no Vulkan device")
    print(dev.describe(), "| second queue:", dev._queue2 is not None)
    K = L.Kernels(dev)
    b = K.buffer(16, host=True)
    a = b.addr
    for cap in (1000, 10000, L.HEAT_ROUNDS):
        b.u32(4)[:] = [0, 1, 0, 0]
        rec = K.record([L.Dispatch("heat", (1,), [a, a + 4, a + 8], [cap], wait=False)], timestamps=True)
        t = time.perf_counter()
        K.submit(rec)
        w = time.perf_counter() - t
        g = K.gpu_ms(rec)
        print(f"cap {cap:7d} rounds: device {g if g is None else round(g, 3)} ms, wall {1e3 * w:.3f} ms, "
              f"out (rounds, seen) {list(map(int, b.u32(4)[2:]))}")
        K.free(rec)
    if dev._queue2 is not None:
        b.u32(4)[:] = [0, 1, 0, 0]
        rec = K.record([L.Dispatch("heat", (1,), [a, a + 4, a + 8], [L.HEAT_ROUNDS], wait=False)], timestamps=True)
        t = time.perf_counter()
        K.start(rec, dev._queue2)
        time.sleep(0.002)
        b.u32(1)[0] = 5          # the host stops it after 2 ms
        lib.vkDeviceWaitIdle(dev._dev)
        print(f"stopped by the host after 2 ms: wall {1e3 * (time.perf_counter() - t):.3f} ms, device "
              f"{K.gpu_ms(rec)} ms, out (rounds, seen) {list(map(int, b.u32(4)[2:]))}")
        K.free(rec)
    dev.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
