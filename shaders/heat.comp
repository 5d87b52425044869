#version 460
// The clock holder of the device layers (coli/vulkan/layers.py, docs/vulkan.md "Clocks"): one workgroup on a
// second queue that stays busy between decode tokens, so a discrete GPU that lowers its clock when idle keeps
// it while the CPU runs its layers. It spins until the word at a0 reaches the token number at a1 (the next
// token's command buffer copies that number into a0 with its first op) or for u0 rounds, whichever is first.
// a0 flag u32 (written by the layer work's first copy or by the host), a1 want u32 (written by the host before the
// submit), a2 out u32 [2]: the rounds spun, and 2 while it spins, then 1 when the flag ended it or 0 at the cap.
// u0 cap (rounds). groups: (1, 1, 1).
#extension GL_GOOGLE_include_directive : require
#include "layer_common.glsl"

layout(local_size_x_id = 0) in;
layout(buffer_reference, std430, buffer_reference_align = 4) coherent volatile buffer Flag { uint v[]; };

void main() {
    if (gl_LocalInvocationIndex != 0) return;
    Flag F = Flag(pc.a[0]);
    uint want = U32(pc.a[1]).v[0];
    uint cap = pc.u[0], i = 0u, seen = 0u;
    Flag O = Flag(pc.a[2]);     // coherent: the host may read the "spinning" mark while it runs
    O.v[1] = 2u;
    for (; i < cap; i++) {
        if (F.v[0] >= want) { seen = 1u; break; }
    }
    O.v[0] = i;
    O.v[1] = seen;
}
