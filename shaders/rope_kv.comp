#version 460
// Rope on q and k of R rows at positions params[0] + r, k and v into the KV cache (CPU: cpu_kernels/rope.py):
// a0 qkv f32 [R, nq*hd + nkv*hd + nkv*hdv] (q heads, then k heads, then v heads), a1 q out f32 [R, nq, hd] (rotated
// q), a2 K cache [nkv, ctx, hd] and a3 V cache [nkv, ctx, hdv] of the types KT / VT (kv_types.glsl: f32, f16, bf16,
// q8_0; a 16-bit side's row written a pair of values an invocation, a q8_0 side's a block of 32), a4 cos f32 [ctx, n_rot/2],
// a5 sin f32 [ctx, n_rot/2], a6 params uint [..] (pos = params[0] + r), a7 kv_out f32 [nkv*hd + nkv*hdv] (the new
// rows: rotated k heads, then v heads; one row only) or 0 (none written)
// u0 nq, u1 nkv, u2 hd, u3 n_rot (even, <= hd), u4 ctx, u5 kind (0 NORM, 2 NEOX), u6 the value scale (float bits; 0:
// 1, MiMo-V2's attention.value_scale: v times it before it is stored), u7 hdv, V's head width (0: hd),
// u8/u9 and u10/u11 the q and k norms' weights' addresses (low, high word), u12 their eps (float bits), u13 the q/k
// RMSNorm before the rope (0 none; 1 heads: each head over its hd values by weights [hd]; 2 full: each head's values
// over its row's q (or k) part, nq*hd (nkv*hd) values, by weights [nq*hd] ([nkv*hd])): rmsnorm.comp's sum, rounding
// and workgroup reduction, so the values are the ones it would have written back into qkv (which stays as it was)
// groups: (nq + nkv, R, 1): workgroup (g, r), g < nq rotates q head g; g >= nq rotates k head g - nq into
// K[g - nq, pos, :] and kv_out[0], and copies v head g - nq into V[g - nq, pos, :] and kv_out[1].
// Pair i < n_rot/2 (c = cos[pos, i], s = sin[pos, i]): NORM (x[2i], x[2i+1]), NEOX (x[i], x[i + n_rot/2]),
// (a, b) -> (a c - b s, a s + b c); dimensions >= n_rot are copied. `precise`: no fused multiply-add, the CPU's
// rounding. kv_out keeps the f32 rows (the CPU converts them as its cache's type: the same bits as here).
#extension GL_GOOGLE_include_directive : require
#include "layer_common.glsl"
#include "kv_types.glsl"

layout(local_size_x_id = 0) in;
#include "layer_reduce.glsl"

// value i of the head at src, normed where nm != 0 (times inv and the norm's weight wo + i)
float normed(F32 QKV, uint src, uint i, uint nm, float inv, F32 NW, uint wo) {
    float x = QKV.v[src + i];
    return nm != 0u ? (x * inv) * NW.v[wo + i] : x;
}

// dimension d of the head at src (normed) rotated (the pair loop's y0 or y1, in the same operations) or copied
// (d >= n_rot)
float rotated(F32 QKV, F32 CS, F32 SN, uint src, uint pos, uint d, uint n_rot, bool neox, uint nm, float inv, F32 NW,
              uint wo) {
    if (d >= n_rot) return normed(QKV, src, d, nm, inv, NW, wo);
    uint half_ = n_rot / 2u;
    uint j = neox ? d % half_ : d / 2u;
    bool second = neox ? d >= half_ : (d & 1u) != 0u;
    uint i0 = neox ? j : 2u * j, i1 = neox ? j + half_ : 2u * j + 1u;
    float c = CS.v[pos * half_ + j], s = SN.v[pos * half_ + j];
    float a = normed(QKV, src, i0, nm, inv, NW, wo), b = normed(QKV, src, i1, nm, inv, NW, wo);
    precise float y0 = a * c - b * s;
    precise float y1 = a * s + b * c;
    return second ? y1 : y0;
}

void main() {
    uint nq = pc.u[0], nkv = pc.u[1], hd = pc.u[2], n_rot = pc.u[3], ctx = pc.u[4];
    bool neox = pc.u[5] == 2u;
    uint g = gl_WorkGroupID.x, r = gl_WorkGroupID.y, t = gl_LocalInvocationIndex, WG = gl_WorkGroupSize.x;
    F32 QKV = F32(pc.a[0]);
    uint pos = U32(pc.a[6]).v[0] + r;
    uint hdv = pc.u[7] == 0u ? hd : pc.u[7];
    float vsc = pc.u[6] == 0u ? 1.0 : pcf(6u);
    uint rq = r * ((nq + nkv) * hd + nkv * hdv);   // row r of qkv
    bool kvo = pc.a[7] != 0ul;
    uint half_ = n_rot / 2u;
    F32 CS = F32(pc.a[4]);
    F32 SN = F32(pc.a[5]);
    bool is_q = g < nq;
    bool dst32 = is_q || KT == 0u;        // element writes into DST: q, or an f32 K cache
    uint kh = g - nq;
    F32 DST = F32(is_q ? pc.a[1] : pc.a[2]);
    uint src = rq + (is_q ? g * hd : (nq + kh) * hd);
    uint dst = is_q ? (r * nq + g) * hd : (kh * ctx + pos) * hd;
    F32 KVO = F32(pc.a[7]);
    uint ko = kh * hd;
    // the q/k norm (u13; uniform in the workgroup, as wg_sum needs)
    uint nm = pc.u[13];
    float inv = 1.0;
    uint wo = 0u;
    F32 NW = F32(nm == 0u ? 0ul : packUint2x32(is_q ? uvec2(pc.u[8], pc.u[9]) : uvec2(pc.u[10], pc.u[11])));
    if (nm != 0u) {
        uint nn = nm == 1u ? hd : (is_q ? nq : nkv) * hd;
        uint nb = nm == 1u ? src : rq + (is_q ? 0u : nq * hd);
        wo = nm == 1u ? 0u : (is_q ? g : kh) * hd;
        float ss = 0.0;
        for (uint i = t; i < nn; i += WG) {
            float v = QKV.v[nb + i];
            ss += v * v;
        }
        ss = wg_sum(ss);
        inv = 1.0 / sqrt(ss / float(nn) + pcf(12u));
    }
    // n_rot/2 pairs, then hd - n_rot copied dimensions
    for (uint j = t; j < hd - half_; j += WG) {
        if (j < half_) {
            uint i0 = neox ? j : 2u * j, i1 = neox ? j + half_ : 2u * j + 1u;
            float c = CS.v[pos * half_ + j], s = SN.v[pos * half_ + j];
            float a = normed(QKV, src, i0, nm, inv, NW, wo), b = normed(QKV, src, i1, nm, inv, NW, wo);
            precise float y0 = a * c - b * s;
            precise float y1 = a * s + b * c;
            if (dst32) {
                DST.v[dst + i0] = y0;
                DST.v[dst + i1] = y1;
            }
            if (!is_q && kvo) {
                KVO.v[ko + i0] = y0;
                KVO.v[ko + i1] = y1;
            }
        } else {
            uint d = n_rot + (j - half_);
            float x = normed(QKV, src, d, nm, inv, NW, wo);
            if (dst32) DST.v[dst + d] = x;
            if (!is_q && kvo) KVO.v[ko + d] = x;
        }
    }
    if (!dst32 && KT == 3u) {   // a q8_0 K row: a block of 32 values an invocation (each computed as above)
        for (uint w = t; w < hd / 32u; w += WG) {
            float x[32];
            for (uint j = 0u; j < 32u; j++)
                x[j] = rotated(QKV, CS, SN, src, pos, 32u * w + j, n_rot, neox, nm, inv, NW, wo);
            kv_store_q8(pc.a[2], dst / 32u + w, x);
        }
    } else if (!dst32) {   // a 16-bit K row: values 2w and 2w + 1 an invocation (each computed as above, the same bits)
        for (uint w = t; w < hd / 2u; w += WG)
            kv_store2(pc.a[2], dst / 2u + w, rotated(QKV, CS, SN, src, pos, 2u * w, n_rot, neox, nm, inv, NW, wo),
                      rotated(QKV, CS, SN, src, pos, 2u * w + 1u, n_rot, neox, nm, inv, NW, wo), KT);
    }
    if (!is_q) {
        F32 V = F32(pc.a[3]);
        uint vs = rq + (nq + nkv) * hd + kh * hdv, vd = (kh * ctx + pos) * hdv;
        for (uint d = t; d < hdv; d += WG) {
            float x = QKV.v[vs + d] * vsc;
            if (VT == 0u) V.v[vd + d] = x;
            if (kvo) KVO.v[nkv * hd + kh * hdv + d] = x;
        }
        if (VT == 3u)    // a q8_0 V row: a block an invocation
            for (uint w = t; w < hdv / 32u; w += WG) {
                float x[32];
                for (uint j = 0u; j < 32u; j++) x[j] = QKV.v[vs + 32u * w + j] * vsc;
                kv_store_q8(pc.a[3], vd / 32u + w, x);
            }
        else if (VT != 0u)    // a 16-bit V row: a pair an invocation
            for (uint w = t; w < hdv / 2u; w += WG) kv_store2(pc.a[3], vd / 2u + w, QKV.v[vs + 2u * w] * vsc,
                                                             QKV.v[vs + 2u * w + 1u] * vsc, VT);
    }
}
