#version 460
// DeepSeek-V4's hyper-connections (mHC) over hc residual streams (CPU: coli/models/deepseek4.py HyperConnection).
// a0 S f32 [T, hc, D] (the streams), u0 D, u1 hc (<= 8), u2 mode. groups: below.
// mode 0, a site's weights (hc_attn_* / hc_ffn_*), one workgroup a row t, groups (T, 1, 1):
//   m = RMS(S[t] flat [hc D]) @ fn^T  (n = (2 + hc) hc outputs; unweighted RMSNorm, eps u3)
//   pre = sigmoid(m[:hc] s0 + b) + e,  post = 2 sigmoid(m[hc:2hc] s1 + b),
//   comb = softmax_k(m[2hc:] s2 + b)[j, k] + e, then column-, row-, column-normalised (Sinkhorn-Knopp, u5 steps
//   in all, each sum + e as the CPU's); x[t] = sum_j pre_j S[t, j]
//   a1 fn f32 [n, hc D], a2 base f32 [n], a3 scale f32 [3], a4 x f32 [T, D], a5 post and comb f32 [T, hc + hc hc]
//   (post[k], then comb[j, k] row-major), u3 RMS eps (bits), u4 e (bits), u5 Sinkhorn steps (>= 1)
// mode 1, the head's (output_hc_*: pre only, n = hc, a3 scale f32 [1]): x[t] as mode 0; a5 unused.
// mode 2, the mix after a block, groups (ceil(D / WG), T, 1): S'[t, k] = post[k] y[t] + sum_j comb[j, k] S[t, j]
//   a4 y f32 [T, D] (the block's output), a5 post and comb as mode 0 wrote them, a6 S' f32 [T, hc, D] (may be
//   a0: each invocation reads its column of every stream before it writes).
// The RMS sum of squares and the dot products are f32 workgroup sums (the CPU's RMS is f64, its product f32 BLAS);
// the gates and Sinkhorn run on one invocation in the CPU's order.
#extension GL_GOOGLE_include_directive : require
#include "layer_common.glsl"

layout(local_size_x_id = 0) in;
#include "layer_reduce.glsl"

#define MAXHC 8u
shared float MIX[(2u + MAXHC) * MAXHC];
shared float PRE[MAXHC];

float sigm(float v) { return 1.0 / (1.0 + exp(-v)); }

void main() {
    uint D = pc.u[0], hc = pc.u[1], mode = pc.u[2];
    uint t = gl_LocalInvocationIndex, WG = gl_WorkGroupSize.x;
    F32 S = F32(pc.a[0]);
    if (mode == 2u) {
        uint d = gl_WorkGroupID.x * WG + t, r = gl_WorkGroupID.y;
        if (d >= D) return;
        F32 Y = F32(pc.a[4]);
        F32 PC_ = F32(pc.a[5]);
        F32 O = F32(pc.a[6]);
        uint pb = r * (hc + hc * hc), sb = r * hc * D + d;
        float s[MAXHC];
        for (uint j = 0u; j < hc; j++) s[j] = S.v[sb + j * D];
        float y = Y.v[r * D + d];
        for (uint k = 0u; k < hc; k++) {
            float acc = 0.0;
            for (uint j = 0u; j < hc; j++) acc += PC_.v[pb + hc + j * hc + k] * s[j];
            O.v[sb + k * D] = PC_.v[pb + k] * y + acc;
        }
        return;
    }
    uint r = gl_WorkGroupID.x, N = hc * D, base = r * N;
    bool head = mode == 1u;
    uint n = head ? hc : (2u + hc) * hc;
    F32 FN = F32(pc.a[1]);
    F32 B = F32(pc.a[2]);
    F32 SC = F32(pc.a[3]);
    float ss = 0.0;
    for (uint i = t; i < N; i += WG) { float v = S.v[base + i]; ss += v * v; }
    ss = wg_sum(ss);
    float inv = 1.0 / sqrt(ss / float(N) + pcf(3u));
    for (uint o = 0u; o < n; o++) {
        float acc = 0.0;
        for (uint i = t; i < N; i += WG) acc += (S.v[base + i] * inv) * FN.v[o * N + i];
        acc = wg_sum(acc);
        if (t == 0u) MIX[o] = acc;
    }
    barrier();
    if (t == 0u) {
        float e = pcf(4u);
        for (uint j = 0u; j < hc; j++) PRE[j] = sigm(MIX[j] * SC.v[0] + B.v[j]) + e;
        if (!head) {
            F32 PO = F32(pc.a[5]);
            uint pb = r * (hc + hc * hc);
            for (uint k = 0u; k < hc; k++) PO.v[pb + k] = 2.0 * sigm(MIX[hc + k] * SC.v[1] + B.v[hc + k]);
            float c[MAXHC * MAXHC];
            for (uint j = 0u; j < hc; j++) {        // row softmax (over k) + e
                float mx = -1.0 / 0.0;
                for (uint k = 0u; k < hc; k++) {
                    c[j * hc + k] = MIX[2u * hc + j * hc + k] * SC.v[2] + B.v[2u * hc + j * hc + k];
                    mx = max(mx, c[j * hc + k]);
                }
                float sum = 0.0;
                for (uint k = 0u; k < hc; k++) { c[j * hc + k] = exp(c[j * hc + k] - mx); sum += c[j * hc + k]; }
                for (uint k = 0u; k < hc; k++) c[j * hc + k] = c[j * hc + k] / sum + e;
            }
            uint steps = max(pc.u[5], 1u);
            for (uint it = 0u; it < steps; it++) {
                if (it > 0u) {                       // rows (over k)
                    for (uint j = 0u; j < hc; j++) {
                        float sum = 0.0;
                        for (uint k = 0u; k < hc; k++) sum += c[j * hc + k];
                        for (uint k = 0u; k < hc; k++) c[j * hc + k] = c[j * hc + k] / (sum + e);
                    }
                }
                for (uint k = 0u; k < hc; k++) {     // columns (over j)
                    float sum = 0.0;
                    for (uint j = 0u; j < hc; j++) sum += c[j * hc + k];
                    for (uint j = 0u; j < hc; j++) c[j * hc + k] = c[j * hc + k] / (sum + e);
                }
            }
            for (uint i = 0u; i < hc * hc; i++) PO.v[pb + hc + i] = c[i];
        }
    }
    barrier();
    F32 X = F32(pc.a[4]);
    for (uint d = t; d < D; d += WG) {
        float acc = 0.0;
        for (uint j = 0u; j < hc; j++) acc += PRE[j] * S.v[base + j * D + d];
        X.v[r * D + d] = acc;
    }
}
