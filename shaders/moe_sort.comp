#version 460
// moe_sort: the pairs (row, rank) of R routed rows grouped by expert, for lmm.comp's modes 1 and 2
// (coli/vulkan/layers.py; docs/vulkan.md "Device layers"). One workgroup.
//   a0 route uint [R][2k] (topk.comp's rows: ids [k], then the weights' float bits [k]), a1 offsets uint [E + 1],
//   a2 pairs uint [R * k]; u0 E (<= 512), u1 k, u2 R. groups: (1, 1, 1).
// Pair p = row * k + rank. Expert e's pairs go to pairs[off[e] .. off[e + 1]], off[0] = 0, off[E] = R * k: counted
// with shared atomics, then placed with them, so their order inside an expert's range varies from run to run; lmm
// gives each pair the same value wherever it sits (its sums do not depend on the tile row), so results do not.
#extension GL_GOOGLE_include_directive : require
#include "layer_common.glsl"

layout(local_size_x_id = 0) in;
#define MAXE 512u
shared uint CNT[MAXE + 1u];

void main() {
    uint E = min(pc.u[0], MAXE), k = pc.u[1], R = pc.u[2];
    uint t = gl_LocalInvocationIndex, WG = gl_WorkGroupSize.x;
    U32 ROUTE = U32(pc.a[0]);
    U32 OFF = U32(pc.a[1]);
    U32 PAIRS = U32(pc.a[2]);
    uint np = R * k;
    for (uint e = t; e < E; e += WG) CNT[e] = 0u;
    barrier();
    for (uint p = t; p < np; p += WG) atomicAdd(CNT[min(ROUTE.v[(p / k) * 2u * k + p % k], E - 1u)], 1u);
    barrier();
    if (t == 0u) {
        uint s = 0u;
        for (uint e = 0u; e < E; e++) {
            uint c = CNT[e];
            CNT[e] = s;
            OFF.v[e] = s;
            s += c;
        }
        OFF.v[E] = s;
    }
    barrier();
    for (uint p = t; p < np; p += WG) {
        uint slot = atomicAdd(CNT[min(ROUTE.v[(p / k) * 2u * k + p % k], E - 1u)], 1u);
        PAIRS.v[slot] = p;
    }
}
