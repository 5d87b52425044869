#version 460
// Attention of one query row over the cached positions 0..pos, one workgroup per q head:
//   out[h] = sum_j softmax_j(scale * q[h] . K[kvh, j]) V[kvh, j],  kvh = h / (nq / nkv)
// a0 q f32 [nq, hd], a1 K cache [nkv, ctx, hd], a2 V cache [nkv, ctx, hdv] of the types KT / VT (kv_types.glsl:
// f32, f16 or bf16, converted to f32 as read), a3 params uint [..]
// (pos = params[0]; keys 0..pos inclusive), a4 out f32 [nq, hdv], a5 scratch f32 [nq, ctx] (the scores)
// u0 nq, u1 nkv, u2 hd (<= 256), u3 ctx, u4 scale (float bits), u5 CHK: keys a workgroup (0: all). groups: (nq, 1, 1)
// with CHK 0; else (nq, ceil(ctx / CHK), 1): workgroup (h, s) takes keys s * CHK .. (s + 1) * CHK - 1 of 0..pos
// (those past pos return at once) and, when pos + 1 > CHK, writes its part to a6 f32 [nq, ceil(ctx / CHK), hdv + 2]
// (its max m, its sum l of exp(score - m), the V rows' sum weighted by exp(score - m)) for attn_comb.comp to join;
// with pos + 1 <= CHK the one workgroup writes out[h] itself, as with CHK 0 (the same sums in the same order).
// u6 window W (0: none): the keys max(0, pos - W + 1) .. pos, the query's own position included (a part's range
// before the window's start returns at once; attn_comb.comp joins the parts from the window's). u7 1: a7 sinks f32
// [nq], one logit a head in the softmax's max and denominator only (gpt-oss; CPU cpu_kernels/attention.py
// _row_finish), here when this workgroup writes out itself, else in attn_comb.comp's join. u8 hdv, V's head width
// (<= hd; 0: hd; MiMo-V2's value_length). u9/u10 (low, high word): where not 0, the address of uint [nq] counters
// (all 0 between dispatches): the parts join here, not in attn_comb.comp: each part of head h counts itself in
// once written, and the last of them to finish joins them all into out[h] (attn_comb.comp's sums in its order, so
// the same values) and sets the counter back to 0 (one dispatch and no barrier for the join).
// u11 1 (with CHK > 0; flash-decoding's split at any context): the grid's y, NP = gl_NumWorkGroups.y parts, share
// the keys wlo..pos in runs of c = max(CHK, ceil((pos + 1 - wlo) / NP)) keys, part s the s-th run (a6 then
// [nq, NP, hdv + 2]; the parts join as above, from part 0): every part works at a short context too, where fixed
// runs of CHK keys leave all but the first idle. One run (pos + 1 - wlo <= c): the first part writes out[h] itself.
// Three passes. 1: invocations stride over the keys (key j by invocation j % WG), each a whole dot product,
// the score into the scratch row; the workgroup max. 2: each invocation turns its own scores into
// e = exp(s - max) and sums them; the workgroup sum. 3: chunks of 4 WG weights are staged in shared memory (each
// invocation stages the keys it wrote, so no invocation reads another's global writes); key groups of
// invocations run over the chunk's keys, the invocations of a group over the head dimensions (vec4 when
// hd % 4 == 0), and the groups' partial sums are added in group order. Any context length up to ctx; the
// result does not depend on the subgroup size except through the reductions' order.
// With hd % 4 == 0 K, with hdv % 4 == 0 V, is read as vec4: their addresses must be 16-byte aligned (8 for a
// 16-bit side). scale: 1/sqrt(hd) usually.
#extension GL_GOOGLE_include_directive : require
#include "layer_common.glsl"
#include "kv_types.glsl"

layout(local_size_x_id = 0) in;
#include "layer_reduce.glsl"

#define MAXNC 8u    // columns an invocation carries in pass 3 (C > WG only: scalar hd 256 at WG 32 takes 8)
shared vec4 Q4[64];
shared float SH[4u * gl_WorkGroupSize.x];
shared uint LAST_;
// the parts: written by one workgroup, read by another in the same dispatch (the join)
layout(buffer_reference, std430, buffer_reference_align = 4) coherent buffer F32C { float v[]; };
layout(buffer_reference, std430, buffer_reference_align = 4) coherent buffer U32C { uint v[]; };

void main() {
    uint nq = pc.u[0], nkv = pc.u[1], hd = pc.u[2], ctx = pc.u[3];
    float scale = pcf(4u);
    uint h = gl_WorkGroupID.x, t = gl_LocalInvocationIndex, WG = gl_WorkGroupSize.x;
    uint kvh = h / (nq / nkv);
    uint n = min(U32(pc.a[3]).v[0] + 1u, ctx);
    uint n0 = n;
    uint CHK = pc.u[5], W = pc.u[6];
    uint wlo = (W > 0u && n > W) ? n - W : 0u;           // a sliding window's first key
    bool even = CHK != 0u && pc.u[11] != 0u;              // u11: the keys in NP even runs
    uint NP = gl_NumWorkGroups.y;
    uint c = even ? max(CHK, (n - wlo + NP - 1u) / NP) : CHK;    // keys a part
    uint j1 = CHK == 0u ? wlo : even ? wlo + gl_WorkGroupID.y * c : max(gl_WorkGroupID.y * CHK, wlo);
    if (j1 >= n) return;                                  // uniform: past the position
    bool part = even ? n - wlo > c : CHK != 0u && n > CHK;
    if (part) n = min(n, even ? j1 + c : gl_WorkGroupID.y * CHK + CHK);
    if (j1 >= n) return;                                  // uniform: a range before the window
    bool v4 = (hd & 3u) == 0u;
    uint H4 = (hd + 3u) / 4u;
    uint hdv = pc.u[8] == 0u ? hd : pc.u[8];
    bool w4 = (hdv & 3u) == 0u;      // V read as vec4
    uint HV4 = (hdv + 3u) / 4u;
    F32 Q = F32(pc.a[0]);
    F32 S = F32(pc.a[5]);
    uint sb = h * ctx;                 // this head's scratch row
    uint kvb = kvh * ctx;              // this kv head's first cache row
    for (uint i = t; i < 4u * H4; i += WG) Q4[i >> 2][i & 3u] = i < hd ? Q.v[h * hd + i] : 0.0;
    barrier();

    // pass 1: scores and their max
    float m = -1.0 / 0.0;
    if (v4) {
        for (uint j = j1 + t; j < n; j += WG) {
            uint kb = (kvb + j) * H4;
            vec4 a = vec4(0.0);
            for (uint i = 0u; i < H4; i++) a += Q4[i] * kv_load4(pc.a[1], kb + i, KT);
            float s = scale * ((a.x + a.y) + (a.z + a.w));
            S.v[sb + j] = s;
            m = max(m, s);
        }
    } else {
        for (uint j = j1 + t; j < n; j += WG) {
            uint kb = (kvb + j) * hd;
            float a = 0.0;
            for (uint i = 0u; i < hd; i++) a += Q4[i >> 2][i & 3u] * kv_load(pc.a[1], kb + i, KT);
            float s = scale * a;
            S.v[sb + j] = s;
            m = max(m, s);
        }
    }
    m = wg_max(m);

    // pass 2: weights and their sum (each invocation rereads its own scores)
    float l = 0.0;
    for (uint j = j1 + t; j < n; j += WG) {
        float e = exp(S.v[sb + j] - m);
        S.v[sb + j] = e;
        l += e;
    }
    l = wg_sum(l);
    if (pc.u[7] != 0u && !part) {   // the sink: out = acc c / (l c + 1) when it is above the max (c = exp(m - sink))
        float sk = F32(pc.a[7]).v[h];
        if (sk > m) {
            float c = exp(m - sk);
            l = (l * c + 1.0) / c;
        } else {
            l += exp(sk - m);
        }
    }

    // pass 3: the weighted sum of V. C columns (vec4 or scalar); CW columns per key group, NG key groups,
    // NC columns per invocation (1 unless C > WG).
    uint C = w4 ? HV4 : hdv;
    uint CW = min(C, WG), NG = WG / CW, NC = (C + CW - 1u) / CW;
    uint kg = t / CW, c0 = t % CW;
    vec4 acc[MAXNC];
    [[unroll]] for (uint q = 0u; q < MAXNC; q++) acc[q] = vec4(0.0);
    uint CH = 4u * WG;
    for (uint j0 = j1; j0 < n; j0 += CH) {
        uint cl = min(CH, n - j0);
        barrier();
        for (uint jj = t; jj < cl; jj += WG) SH[jj] = S.v[sb + j0 + jj];
        barrier();
        if (kg < NG) {
            if (w4 && NC == 1u) {      // the usual case: one vec4 column
                for (uint jj = kg; jj < cl; jj += NG)
                    acc[0] += SH[jj] * kv_load4(pc.a[2], (kvb + j0 + jj) * HV4 + c0, VT);
            } else if (w4) {
                for (uint jj = kg; jj < cl; jj += NG) {
                    float w = SH[jj];
                    uint vb = (kvb + j0 + jj) * HV4 + c0;
                    [[unroll]] for (uint q = 0u; q < MAXNC; q++)
                        if (q < NC && c0 + q * CW < C) acc[q] += w * kv_load4(pc.a[2], vb + q * CW, VT);
                }
            } else {
                for (uint jj = kg; jj < cl; jj += NG) {
                    float w = SH[jj];
                    uint vb = (kvb + j0 + jj) * hdv + c0;
                    [[unroll]] for (uint q = 0u; q < MAXNC; q++)
                        if (q < NC && c0 + q * CW < C) acc[q].x += w * kv_load(pc.a[2], vb + q * CW, VT);
                }
            }
        }
    }
    // the output: out[h] normalized, or this workgroup's part (m, l, unnormalized sums) for the join
    F32C O = F32C(pc.a[part ? 6 : 4]);
    uint ob = h * hdv;
    if (part) {
        ob = (h * (even ? NP : (ctx + CHK - 1u) / CHK) + gl_WorkGroupID.y) * (hdv + 2u);
        if (t == 0u) { O.v[ob] = m; O.v[ob + 1u] = l; }
        ob += 2u;
        l = 1.0;
    }
    if (NG == 1u) {                    // one key group: every column's sum is whole
        [[unroll]] for (uint q = 0u; q < MAXNC; q++) {
            uint c = c0 + q * CW;
            if (q < NC && c < C && kg == 0u) {     // kg > 0: past the one group (CW < WG < 2 CW), no sums
                if (w4) {
                    vec4 r = acc[q] / l;
                    O.v[ob + 4u * c] = r.x;
                    O.v[ob + 4u * c + 1u] = r.y;
                    O.v[ob + 4u * c + 2u] = r.z;
                    O.v[ob + 4u * c + 3u] = r.w;
                } else {
                    O.v[ob + c] = acc[q].x / l;
                }
            }
        }
    } else {
        // NG > 1 (so NC == 1): the groups' partial sums through shared memory, added in group order
        barrier();
        if (kg < NG) {
            SH[4u * t] = acc[0].x;
            SH[4u * t + 1u] = acc[0].y;
            SH[4u * t + 2u] = acc[0].z;
            SH[4u * t + 3u] = acc[0].w;
        }
        barrier();
        if (t < C) {
            vec4 r = vec4(0.0);
            for (uint g = 0u; g < NG; g++) {
                uint i = 4u * (g * CW + t);
                r += vec4(SH[i], SH[i + 1u], SH[i + 2u], SH[i + 3u]);
            }
            r /= l;
            if (w4) {
                O.v[ob + 4u * t] = r.x;
                O.v[ob + 4u * t + 1u] = r.y;
                O.v[ob + 4u * t + 2u] = r.z;
                O.v[ob + 4u * t + 3u] = r.w;
            } else {
                O.v[ob + t] = r.x;
            }
        }
    }
    uint64_t ca = packUint2x32(uvec2(pc.u[9], pc.u[10]));
    if (!part || ca == 0ul) return;                       // uniform
    // the join: this part counts itself in once all its writes are done; the last of head h's parts joins them
    uint ns = even ? (n0 - wlo + c - 1u) / c : (n0 + CHK - 1u) / CHK;
    uint s0 = (W > 0u && n0 > W && !even) ? (n0 - W) / CHK : 0u;  // the part holding the window's first key
    memoryBarrierBuffer();
    barrier();
    if (t == 0u) LAST_ = atomicAdd(U32C(ca).v[h], 1u) + 1u == ns - s0 ? 1u : 0u;
    barrier();
    if (LAST_ == 0u) return;                               // uniform
    memoryBarrierBuffer();
    uint NS = even ? NP : (ctx + CHK - 1u) / CHK;
    uint pb = h * NS * (hdv + 2u);
    float M = -1.0 / 0.0;
    for (uint s = s0; s < ns; s++) M = max(M, O.v[pb + s * (hdv + 2u)]);
    bool sk = pc.u[7] != 0u;
    float sink = sk ? F32(pc.a[7]).v[h] : 0.0;
    if (sk) M = max(M, sink);
    float L = 0.0;
    for (uint s = s0; s < ns; s++) L += exp(O.v[pb + s * (hdv + 2u)] - M) * O.v[pb + s * (hdv + 2u) + 1u];
    if (sk) L += exp(sink - M);
    F32 OUT = F32(pc.a[4]);
    for (uint d = t; d < hdv; d += WG) {
        float o = 0.0;
        for (uint s = s0; s < ns; s++) {
            uint b = pb + s * (hdv + 2u);
            o += exp(O.v[b] - M) * O.v[b + 2u + d];
        }
        OUT.v[h * hdv + d] = o / L;
    }
    if (t == 0u) U32C(ca).v[h] = 0u;
}
