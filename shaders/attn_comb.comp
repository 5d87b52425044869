#version 460
// attn_comb: the parts of attn_dec.comp's split over key ranges (CHK keys a workgroup) joined, one workgroup a q head:
//   M = max_s m_s, out[h, d] = sum_s exp(m_s - M) o_s[d] / sum_s exp(m_s - M) l_s, in s order
// (flash-decoding's join; the parts are each range's max m_s, sum l_s and weighted V sum o_s).
// a0 parts f32 [nq, ceil(ctx / CHK), hd + 2] (m, l, o[hd]), a1 params uint [..] (pos = params[0]), a2 out f32 [nq, hd]
// u0 nq, u2 hd (V's head width: attn_dec.comp's hdv), u3 ctx, u5 CHK, u6 window W (0: none; the parts from the one holding key pos - W + 1 on), u7 1: a3
// sinks f32 [nq], one logit a head joining M and the denominator (gpt-oss). groups: (nq, 1, 1). With pos + 1 <= CHK
// attn_dec.comp wrote out itself: returns.
#extension GL_GOOGLE_include_directive : require
#include "layer_common.glsl"

layout(local_size_x_id = 0) in;

void main() {
    uint hd = pc.u[2], ctx = pc.u[3], CHK = pc.u[5];
    uint n = min(U32(pc.a[1]).v[0] + 1u, ctx);
    if (CHK == 0u || n <= CHK) return;
    uint h = gl_WorkGroupID.x, t = gl_LocalInvocationIndex, WG = gl_WorkGroupSize.x;
    uint ns = (n + CHK - 1u) / CHK, NS = (ctx + CHK - 1u) / CHK;
    uint W = pc.u[6];
    uint s0 = (W > 0u && n > W) ? (n - W) / CHK : 0u;     // the part holding the window's first key
    F32 P = F32(pc.a[0]);
    F32 O = F32(pc.a[2]);
    uint pb = h * NS * (hd + 2u);
    float M = -1.0 / 0.0;
    for (uint s = s0; s < ns; s++) M = max(M, P.v[pb + s * (hd + 2u)]);
    bool sk = pc.u[7] != 0u;
    float sink = sk ? F32(pc.a[3]).v[h] : 0.0;
    if (sk) M = max(M, sink);
    float L = 0.0;
    for (uint s = s0; s < ns; s++) L += exp(P.v[pb + s * (hd + 2u)] - M) * P.v[pb + s * (hd + 2u) + 1u];
    if (sk) L += exp(sink - M);
    for (uint d = t; d < hd; d += WG) {
        float o = 0.0;
        for (uint s = s0; s < ns; s++) {
            uint b = pb + s * (hd + 2u);
            o += exp(P.v[b] - M) * P.v[b + 2u + d];
        }
        O.v[h * hd + d] = o / L;
    }
}
