#version 460
// attn_pre: causal attention of R query rows (a prompt chunk at positions pos0 .. pos0 + R - 1) over the cached
// positions, one workgroup per (q head, row), online softmax over key tiles (CPU: coli/models/blocks.py attend):
//   out[r, h] = sum_{j <= pos0 + r} softmax_j(scale * q[r, h] . K[kvh, j]) V[kvh, j],  kvh = h / (nq / nkv)
// a0 q f32 [R, nq, hd], a1 K cache f32 [nkv, ctx, hd], a2 V cache f32 [nkv, ctx, hd], a3 params uint [..]
// (pos0 = params[0]), a4 out f32 [R, nq, hd]
// u0 nq, u1 nkv, u2 hd (<= 8 * WG, <= 256), u3 ctx, u4 scale (float bits). groups: (nq, R, 1).
// Key tiles of WG keys: each invocation one key's score (a whole dot product), the tile's max and the running max
// m, the running sum l and the output rescaled by exp(m_old - m_new), the tile's weights staged in shared memory,
// then invocation t sums weight x V for head dimensions t, t + WG, ... in key order. The tiles start at key 0 for
// every row, so a row's result does not depend on the chunk it came in.
#extension GL_GOOGLE_include_directive : require
#include "layer_common.glsl"

layout(local_size_x_id = 0) in;
#include "layer_reduce.glsl"

#define MAXNC 8u
shared float QS[256];
shared float PS[gl_WorkGroupSize.x];

void main() {
    uint nq = pc.u[0], nkv = pc.u[1], hd = pc.u[2], ctx = pc.u[3];
    float scale = pcf(4u);
    uint h = gl_WorkGroupID.x, r = gl_WorkGroupID.y, t = gl_LocalInvocationIndex, WG = gl_WorkGroupSize.x;
    uint kvh = h / (nq / nkv);
    uint n = min(U32(pc.a[3]).v[0] + r + 1u, ctx);
    F32 Q = F32(pc.a[0]);
    F32 K = F32(pc.a[1]);
    F32 V = F32(pc.a[2]);
    uint qb = (r * nq + h) * hd;
    for (uint i = t; i < hd; i += WG) QS[i] = Q.v[qb + i];
    barrier();
    uint kvb = kvh * ctx;
    float m = -1.0 / 0.0, l = 0.0;
    float acc[MAXNC];
    [[unroll]] for (uint c = 0u; c < MAXNC; c++) acc[c] = 0.0;
    for (uint j0 = 0u; j0 < n; j0 += WG) {
        uint j = j0 + t;
        float s = -1.0 / 0.0;
        if (j < n) {
            uint kb = (kvb + j) * hd;
            float a = 0.0;
            for (uint i = 0u; i < hd; i++) a += QS[i] * K.v[kb + i];
            s = scale * a;
        }
        float mn = max(m, wg_max(s));
        float alpha = exp(m - mn);
        float p = j < n ? exp(s - mn) : 0.0;
        l = l * alpha + wg_sum(p);
        PS[t] = p;
        barrier();
        uint cl = min(WG, n - j0);
        [[unroll]] for (uint c = 0u; c < MAXNC; c++) {
            uint d = t + c * WG;
            if (d < hd) {
                float a = acc[c] * alpha;
                for (uint jj = 0u; jj < cl; jj++) a += PS[jj] * V.v[(kvb + j0 + jj) * hd + d];
                acc[c] = a;
            }
        }
        barrier();
        m = mn;
    }
    F32 OUT = F32(pc.a[4]);
    [[unroll]] for (uint c = 0u; c < MAXNC; c++) {
        uint d = t + c * WG;
        if (d < hd) OUT.v[qb + d] = acc[c] / l;
    }
}
