#version 460
// DeepSeek-V4's attention (CPU: cpu_kernels/dsv4.py attend; docs/families.md "DeepSeek-V4"): shared-KV MQA, one
// K=V head kv [hd] a position read by every query head; a query at position p = pos0 + t sees
//   the window: positions max(0, p - W + 1) .. p (those before pos0 from the ring win[j % W], this call's from kv),
//   on a compressed layer of ratio m the entries e < min((p + 1) / m, n_ent): all of them (HCA, u5 = 0) or the
//   indexer's picks sel[t, :] among them (CSA; -1 and not yet visible picks skipped),
//   one sink logit s_h a head in the softmax's max and denominator:
//   o_h = sum_j exp(a_j - M) k_j / (exp(s_h - M) + sum_j exp(a_j - M)), a_j = scale q_h . k_j, M = max(a, s_h),
// then the rope of the last 2 R2 dims of o_h rotated back by the query's angle (interleaved pairs; cos, -sin).
// mode 0 (u9), one workgroup a (head, row), groups (H, T, 1):
//   a0 q f32 [T, H, hd] (normed, roped; the output o overwrites it), a1 kv f32 [T, hd] this call's K=V rows
//   (roped), a2 win f32 [W, hd] the ring before this call, a3 params uint [..] (pos0 = params[0]), a4 ent f32
//   [n_ent, hd] the compressed entries (roped), a5 sel int [T, K] (u5 = K > 0), a6 rope table f32 [2, ctx, R2]
//   (cos rows, then sin rows), a7 sinks f32 [H]
//   u0 H, u1 hd (<= MAXD), u2 W, u3 ratio m (0: a sliding-only layer), u4 n_ent, u5 K, u6 scale (bits), u7 R2,
//   u8 ctx (rows of the rope table)
// mode 1, after mode 0, groups (ceil(hd / WG), T, 1): the ring write, win[p % W] = kv[t] for the last min(T, W) rows.
// mode 2, before mode 0, groups (nh, T, 1): a row's heads made ready in place (CPU deepseek4.Attention.__call__ and
//   indexer_picks: rms, rms_norm, rope_tail): a0 x f32 [T, nh, hd], a1 weight f32 [hd] (u2 bit 1), a3 params, a6 the
//   rope table; u0 nh, u1 hd, u2 flags (bit 0: unweighted RMSNorm of each head, q; bit 1: RMSNorm times a1, kv),
//   u6 eps (bits), u7 R2, u8 ctx; then the rope of the last 2 R2 dims at the row's position (a c - b s, b c + a s).
// Keys go in blocks of WG: an invocation a key's whole dot product (dimension order), the block's max and sum of
// exp as workgroup reductions (online softmax from the sink: its term exp(s_h - M) starts the sum at 1), then the
// invocations over the dimensions add the block's weighted rows in key order to the accumulator in shared memory.
// Sums are f32 (the CPU sums the denominator in f64).
#extension GL_GOOGLE_include_directive : require
#include "layer_common.glsl"

layout(local_size_x_id = 0) in;
#include "layer_reduce.glsl"

#define MAXD 512u
shared float QS[MAXD];
shared float OS[MAXD];
shared float P[gl_WorkGroupSize.x];
shared uint KR[gl_WorkGroupSize.x];   // the block's key rows: bit 31 set = a compressed entry, bit 30 = this call's kv

void main() {
    uint hd = pc.u[1], W = pc.u[2];
    uint t = gl_LocalInvocationIndex, WG = gl_WorkGroupSize.x;
    U32 PAR = U32(pc.a[3]);
    uint pos0 = PAR.v[0];
    F32 KV = F32(pc.a[1]);
    F32 WIN = F32(pc.a[2]);
    if (pc.u[9] == 1u) {                            // the ring write
        uint r = gl_WorkGroupID.y, d = gl_WorkGroupID.x * WG + t, T = gl_NumWorkGroups.y;
        if (d >= hd || r + W < T) return;           // only the last W rows land
        WIN.v[((pos0 + r) % W) * hd + d] = KV.v[r * hd + d];
        return;
    }
    if (pc.u[9] == 2u) {                            // norms and rope of q, kv or the indexer's q
        uint h = gl_WorkGroupID.x, r = gl_WorkGroupID.y, fl = pc.u[2], R2 = pc.u[7], ctx = pc.u[8];
        F32 X = F32(pc.a[0]);
        F32 NW = F32(pc.a[1]);
        F32 ROPE = F32(pc.a[6]);
        uint xb = (r * pc.u[0] + h) * hd, p = pos0 + r;
        float inv = 1.0;
        if ((fl & 3u) != 0u) {
            float ss = 0.0;
            for (uint d = t; d < hd; d += WG) { float v = X.v[xb + d]; ss += v * v; }
            ss = wg_sum(ss);
            inv = 1.0 / sqrt(ss / float(hd) + pcf(6u));
        }
        for (uint d = t; d < hd; d += WG) {
            float v = X.v[xb + d] * inv;
            OS[d] = (fl & 2u) != 0u ? v * NW.v[d] : v;
        }
        barrier();
        uint rb = hd - 2u * R2;
        for (uint d = t; d < hd; d += WG) {
            float o = OS[d];
            if (d >= rb) {
                uint i = (d - rb) >> 1;
                float c = ROPE.v[p * R2 + i], sn = ROPE.v[(ctx + p) * R2 + i];
                float a = OS[rb + 2u * i], b = OS[rb + 2u * i + 1u];
                o = ((d - rb) & 1u) == 0u ? a * c - b * sn : b * c + a * sn;
            }
            X.v[xb + d] = o;
        }
        return;
    }
    uint H = pc.u[0], ratio = pc.u[3], nent = pc.u[4], K = pc.u[5], R2 = pc.u[7], ctx = pc.u[8];
    float scale = pcf(6u);
    uint h = gl_WorkGroupID.x, r = gl_WorkGroupID.y;
    F32 Q = F32(pc.a[0]);
    F32 ENT = F32(pc.a[4]);
    U32 SEL = U32(pc.a[5]);
    F32 ROPE = F32(pc.a[6]);
    F32 SINK = F32(pc.a[7]);
    uint p = pos0 + r;
    uint j0 = p + 1u > W ? p + 1u - W : 0u;
    uint nw = p + 1u - j0;
    uint nv = ratio > 0u ? min((p + 1u) / ratio, nent) : 0u;
    uint n = nw + (K > 0u ? K : nv);
    uint qb = (r * H + h) * hd;
    for (uint d = t; d < hd; d += WG) { QS[d] = Q.v[qb + d] * scale; OS[d] = 0.0; }
    barrier();
    float m = SINK.v[h], l = 1.0;
    for (uint b0 = 0u; b0 < n; b0 += WG) {
        uint jj = b0 + t;
        float s = -1.0 / 0.0;
        uint kr = 0u;
        bool ok = false;
        if (jj < nw) {
            uint j = j0 + jj;
            kr = j >= pos0 ? ((j - pos0) | 0x40000000u) : j % W;
            ok = true;
        } else if (jj < n) {
            uint e = K > 0u ? SEL.v[r * K + (jj - nw)] : jj - nw;
            ok = e < nv;                            // -1 reads as 0xFFFFFFFF
            kr = e | 0x80000000u;
        }
        if (ok) {
            uint base = (kr & 0x3FFFFFFFu) * hd;
            float acc = 0.0;
            if ((kr & 0x80000000u) != 0u) {
                for (uint d = 0u; d < hd; d++) acc += QS[d] * ENT.v[base + d];
            } else if ((kr & 0x40000000u) != 0u) {
                for (uint d = 0u; d < hd; d++) acc += QS[d] * KV.v[base + d];
            } else {
                for (uint d = 0u; d < hd; d++) acc += QS[d] * WIN.v[base + d];
            }
            s = acc;
        }
        float mn = max(m, wg_max(s));
        float e = ok ? exp(s - mn) : 0.0;
        float c = exp(m - mn);
        l = l * c + wg_sum(e);
        m = mn;
        P[t] = e;
        KR[t] = ok ? kr : 0xFFFFFFFFu;
        barrier();
        uint nk = min(WG, n - b0);
        for (uint d = t; d < hd; d += WG) {
            float o = OS[d] * c;
            for (uint i = 0u; i < nk; i++) {
                uint k = KR[i];
                if (k == 0xFFFFFFFFu) continue;
                uint base = (k & 0x3FFFFFFFu) * hd + d;
                float v = (k & 0x80000000u) != 0u ? ENT.v[base] : (k & 0x40000000u) != 0u ? KV.v[base] : WIN.v[base];
                o += P[i] * v;
            }
            OS[d] = o;
        }
        barrier();
    }
    float inv = 1.0 / l;
    uint rb = hd - 2u * R2;
    for (uint d = t; d < hd; d += WG) {
        float o = OS[d] * inv;
        if (d >= rb) {                              // rope undone: (a, b) -> (a c + b s, b c - a s)
            uint i = (d - rb) >> 1;
            float c = ROPE.v[p * R2 + i], sn = ROPE.v[(ctx + p) * R2 + i];
            float a = OS[rb + 2u * i] * inv, b = OS[rb + 2u * i + 1u] * inv;
            o = ((d - rb) & 1u) == 0u ? a * c + b * sn : b * c - a * sn;
        }
        Q.v[qb + d] = o;
    }
}
