#version 460
// moe_sort: the pairs (row, rank) of R routed rows grouped by expert, for lmm.comp's modes 1 and 2
// (coli/vulkan/layers.py; docs/vulkan.md "Device layers"). One workgroup.
//   a0 route uint [R][2k] (topk.comp's rows: ids [k], then the weights' float bits [k]), a1 offsets uint [E + 1],
//   a2 pairs uint [R * k]; u0 E (<= 512), u1 k, u2 R. groups: (1, 1, 1).
// Pair p = row * k + rank. Expert e's pairs go to pairs[off[e] .. off[e + 1]] in increasing p (each expert is
// counted and filled by one invocation scanning every pair in order), off[0] = 0, off[E] = R * k.
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
    for (uint e = t; e < E; e += WG) {
        uint c = 0u;
        for (uint p = 0u; p < np; p++) c += ROUTE.v[(p / k) * 2u * k + p % k] == e ? 1u : 0u;
        CNT[e] = c;
    }
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
    for (uint e = t; e < E; e += WG) {
        uint o = CNT[e];
        for (uint p = 0u; p < np; p++)
            if (ROUTE.v[(p / k) * 2u * k + p % k] == e) PAIRS.v[o++] = p;
    }
}
