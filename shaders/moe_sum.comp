#version 460
// moe_sum: the experts' outputs of R rows into the residual, in rank order (CPU: coli/models/blocks.py MoE):
//   h[r, i] += (sum_j yk[r * k + j, i]) (+ ysh[r, i])
// a0 yk f32 [R * k, D] (lmm.comp mode 2: each already scaled by its route weight), a1 h f32 [R, D],
// a2 ysh f32 [R, D] (the shared expert's output, also scaled; read when u2 = 1, a valid address always: a compiler
// may load before it branches); u0 D, u1 k, u2 1: add ysh. groups: (R, 1, 1).
#extension GL_GOOGLE_include_directive : require
#include "layer_common.glsl"

layout(local_size_x_id = 0) in;

void main() {
    uint D = pc.u[0], k = pc.u[1];
    uint r = gl_WorkGroupID.x, t = gl_LocalInvocationIndex, WG = gl_WorkGroupSize.x;
    F32 YK = F32(pc.a[0]);
    F32 H = F32(pc.a[1]);
    bool sh = pc.u[2] == 1u;
    for (uint i = t; i < D; i += WG) {
        float s = 0.0;
        for (uint j = 0u; j < k; j++) s += YK.v[(r * k + j) * D + i];
        if (sh) s += F32(pc.a[2]).v[r * D + i];
        H.v[r * D + i] += s;
    }
}
