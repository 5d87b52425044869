#version 460
// Multi-head latent attention (DeepSeek-V2/V3 MLA) in the absorbed form, for R rows at positions params[0] + t
// (CPU: coli/models/mla.py, cpu_kernels/mla.py; docs/vulkan.md "Device layers"). Four modes (u0), run in order:
// the projections (q or q_b(norm(q_a x)), kv_a x) and the output projection are lmv.comp / lmm.comp dispatches.
// Shapes: H heads, r = kv_lora_rank, dn nope dims, dr rope dims, dv value dims, W = r + dr; the layer's cache on
// the device is LAT f32 [ctx, W]: position p's normalized latent c_p (r) then its rotated rope key kr_p (dr).
// Common: a3 params uint [..] (pos0 = params[0]), u1 H, u2 r, u3 dn, u4 dr, u5 dv, u6 ctx, u7 scale (float bits),
// u8 eps (float bits), u9 flags (bit 0: rotate, NORM pairs (x[2i], x[2i+1]); bit 1: mode 0 writes the new cache
// row to a7 too: decode), u10 ldq (floats between q rows: H * (dn + dr)).
//  mode 0 (latent), groups (R, 1, 1): a1 kv f32 [R, W] (attn_kv_a_mqa's rows), a4 the kv_a norm f32 [r], a5 cos,
//    a6 sin f32 [ctx, dr / 2], a2 LAT: LAT[pos] = [RMSNorm(kv[:r]) * w, rope(kv[r:])]; a0 q f32 [R, ldq]: each
//    head's rope part q[h * (dn + dr) + dn ..] rotated in place; a7 f32 [W] the new row (flag bit 1).
//  mode 1 (absorb), groups (H, R, 1): a0 q, a4 attn_k_b f32 [H, r, dn], a5 qa f32 [R, H, W]:
//    qa[t, h, c] = sum_i k_b[h, c, i] q[t, h, i] (c < r), then the rotated rope part q[t, h, dn ..] (dr).
//  mode 2 (attend), groups (H, R, 1): a5 qa, a2 LAT, a6 ol f32 [R, H, r]: keys 0 .. pos0 + t,
//    s_j = scale * qa[t, h] . LAT[j], ol[t, h] = sum_j softmax(s)_j LAT[j][:r]; tiles of WG keys with a running max
//    (online softmax: each tile's sum rescaled by exp(old max - new max)).
//  mode 3 (values), groups (H, R, 1): a6 ol, a4 attn_v_b f32 [H, dv, r], a7 o f32 [R, H * dv]:
//    o[t, h * dv + v] = sum_c v_b[h, v, c] ol[t, h, c].
//    With flag bit 2 (a DSA layer, GLM-5): the keys are the indexer's choice, a1 SEL u32 [R, u12] (mode 6), the
//    first min(pos0 + t + 1, u12) of a row's entries (position order).
//  u11: floats of a LAT row (0: W); a DSA layer's rows hold the indexer's key ik (Di) after the rope key, at W.
// The DSA indexer (GLM-5; CPU: coli/models/glmdsa.py Indexer, cpu_kernels/mla.py dsa_topk), before modes 0-3:
//  mode 4 (index key), groups (R, 1, 1): a0 iq f32 [R, Hi * Di] (indexer.attn_q_b q_resid): each head's first dr
//    dims rotated in place; a1 the key row f32 [R, Di] (indexer.attn_k x), a4 k_norm weight then bias f32 [2 Di]:
//    LAT[pos][W ..] = rope(LayerNorm(k) (eps u8)); a7 f32 [LW] the decode row (flag bit 1: its ik part). u1 Hi,
//    u3 Di, u4 dr, a5 / a6 cos / sin as in mode 0.
//  mode 5 (index scores), groups (ceil(ctx / WG), R, 1): a0 iq, a4 w f32 [R, Hi] (indexer.proj x), a5 S f32
//    [R, ctx]: S[t, j] = sum_h (w[t, h] * u8) * relu(u7 * iq[t, h] . ik[j]) for keys j <= pos0 + t (u8: Hi^-1/2,
//    u7: Di^-1/2, as float bits), summed in the CPU's order (h, then d).
//  mode 6 (top-k), groups (R, 1, 1): a5 S, a1 SEL u32 [R, u12]: the u12 keys of the best scores, ties to the lower
//    position (the CPU's stable sort), all keys while there are at most u12; written in position order. The u12-th
//    best score by a radix select over the scores' order-preserving bits (32 counting passes), then one pass that
//    writes the keys above it and the first ones equal to it.
// The expanded form of a prompt chunk (coli/vulkan/layer_families.py MLAMixer: taken when it costs fewer
// multiply-adds than modes 1-3 for the chunk's rows), after mode 0, before attn_pre.comp over the expanded heads:
//  mode 7 (expand), groups (H, ceil(u6 / 32), 1): the per-head keys and values of positions 0 .. pos0 + u13 - 1
//    (u13: the chunk's rows; u6 the expanded buffers' positions, >= pos0 + u13) from the latent cache, HF's
//    DeepseekV2Attention form: a4 attn_k_b f32 [H, r, dn], a5 attn_v_b f32 [H, dv, r], a6 KX f32 [H, u6, dn + dr],
//    a7 VX f32 [H, u6, dv]: KX[h, j] = [sum_c k_b[h, c, :] LAT[j][c], LAT[j][r ..]] (the rope key, shared),
//    VX[h, j, v] = sum_c v_b[h, v, c] LAT[j][c]; a workgroup 32 positions of one head, the latent staged through
//    shared memory 32 channels at a time, an invocation one output column for the 32 positions (sums in c order).
// r <= MAXC * WG and W <= MAXW (DeepSeek-V2/V3: r 512, dr 64). `precise` rope: the CPU's rounding (no FMA).
#extension GL_GOOGLE_include_directive : require
#include "layer_common.glsl"

layout(local_size_x_id = 0) in;
#include "layer_reduce.glsl"

#define MAXW 1152u
#define MAXC 8u
shared float QS[MAXW];
shared float PS[gl_WorkGroupSize.x];
shared uint JS[gl_WorkGroupSize.x];
shared uint QC[gl_WorkGroupSize.x];

// a score's bits in an order that compares as the floats do (-0 as +0)
uint okey(float x) {
    uint u = floatBitsToUint(x == 0.0 ? 0.0 : x);
    return (u & 0x80000000u) != 0u ? ~u : (u | 0x80000000u);
}

void main() {
    uint mode = pc.u[0], H = pc.u[1], r = pc.u[2], dn = pc.u[3], dr = pc.u[4], dv = pc.u[5], ctx = pc.u[6];
    uint flags = pc.u[9], ldq = pc.u[10];
    uint W = r + dr, t = gl_LocalInvocationIndex, WG = gl_WorkGroupSize.x;
    uint LW = pc.u[11] != 0u ? pc.u[11] : W, KT = pc.u[12];
    uint pos0 = U32(pc.a[3]).v[0];
    F32 Q = F32(pc.a[0]);
    F32 LAT = F32(pc.a[2]);
    if (mode == 4u) {
        // H = Hi, dn = Di: the indexer's key row, LayerNorm with weight and bias, rope; the query's rope
        uint row = gl_WorkGroupID.x, pos = pos0 + row, Di = dn;
        F32 KR = F32(pc.a[1]);
        F32 NW = F32(pc.a[4]);
        F32 CS = F32(pc.a[5]);
        F32 SN = F32(pc.a[6]);
        F32 KVO = F32(pc.a[7]);
        bool rot = (flags & 1u) != 0u, out_ = (flags & 2u) != 0u;
        uint kb = row * Di, lb = pos * LW + W;
        float s = 0.0;
        for (uint i = t; i < Di; i += WG) s += KR.v[kb + i];
        float mean = wg_sum(s) / float(Di);
        s = 0.0;
        for (uint i = t; i < Di; i += WG) {
            float d = KR.v[kb + i] - mean;
            s += d * d;
        }
        float inv = 1.0 / sqrt(wg_sum(s) / float(Di) + pcf(8u));
        // adjacent pairs: the first dr / 2 rotated (NORM), the rest as they are; then each head's q pairs
        uint half_ = dr / 2u;
        for (uint i = t; i < Di / 2u; i += WG) {
            float a = (KR.v[kb + 2u * i] - mean) * inv * NW.v[2u * i] + NW.v[Di + 2u * i];
            float b = (KR.v[kb + 2u * i + 1u] - mean) * inv * NW.v[2u * i + 1u] + NW.v[Di + 2u * i + 1u];
            if (rot && i < half_) {
                float c = CS.v[pos * half_ + i], sn = SN.v[pos * half_ + i];
                precise float y0 = a * c - b * sn;
                precise float y1 = a * sn + b * c;
                a = y0;
                b = y1;
            }
            LAT.v[lb + 2u * i] = a;
            LAT.v[lb + 2u * i + 1u] = b;
            if (out_) {
                KVO.v[W + 2u * i] = a;
                KVO.v[W + 2u * i + 1u] = b;
            }
        }
        if (!rot) return;
        for (uint j = t; j < H * half_; j += WG) {
            uint i = j % half_, b0 = row * H * Di + (j / half_) * Di + 2u * i;
            float c = CS.v[pos * half_ + i], sn = SN.v[pos * half_ + i];
            float a = Q.v[b0], b = Q.v[b0 + 1u];
            precise float y0 = a * c - b * sn;
            precise float y1 = a * sn + b * c;
            Q.v[b0] = y0;
            Q.v[b0 + 1u] = y1;
        }
        return;
    }
    if (mode == 5u) {
        uint row = gl_WorkGroupID.y, j = gl_WorkGroupID.x * WG + t, Di = dn;
        uint n = min(pos0 + row + 1u, ctx);
        if (j >= n || n <= KT) return;
        F32 WH = F32(pc.a[4]);
        F32 S = F32(pc.a[5]);
        float scale = pcf(7u), hs = pcf(8u);
        uint qb = row * H * Di, kb = j * LW + W;
        float tot = 0.0;
        for (uint h = 0u; h < H; h++) {
            float s = 0.0;
            for (uint d = 0u; d < Di; d++) s += Q.v[qb + h * Di + d] * LAT.v[kb + d];
            s *= scale;
            if (s > 0.0) tot += (WH.v[row * H + h] * hs) * s;
        }
        S.v[row * ctx + j] = tot;
        return;
    }
    if (mode == 6u) {
        uint row = gl_WorkGroupID.x;
        uint n = min(pos0 + row + 1u, ctx);
        U32 SEL = U32(pc.a[1]);
        F32 S = F32(pc.a[5]);
        uint sb = row * KT;
        if (n <= KT) {
            for (uint j = t; j < n; j += WG) SEL.v[sb + j] = j;
            return;
        }
        uint per = (n + WG - 1u) / WG, a = min(t * per, n), e = min(a + per, n);
        uint prefix = 0u, want = KT;
        for (int b = 31; b >= 0; b--) {
            uint cand = prefix | (1u << uint(b)), hm = ~((1u << uint(b)) - 1u);
            uint c = 0u;
            for (uint j = a; j < e; j++) c += (okey(S.v[row * ctx + j]) & hm) == cand ? 1u : 0u;
            uint tot = uint(wg_sum(float(c)));     // exact: counts below 2^24
            if (tot >= want) prefix = cand; else want -= tot;
        }
        // prefix: the KT-th best key; want: how many keys equal to it are taken (the lowest positions)
        uint g = 0u, q = 0u;
        for (uint j = a; j < e; j++) {
            uint k = okey(S.v[row * ctx + j]);
            g += k > prefix ? 1u : 0u;
            q += k == prefix ? 1u : 0u;
        }
        JS[t] = g;
        QC[t] = q;
        barrier();
        uint gb = 0u, qb = 0u;
        for (uint i = 0u; i < t; i++) {
            gb += JS[i];
            qb += QC[i];
        }
        for (uint j = a; j < e; j++) {
            uint k = okey(S.v[row * ctx + j]);
            bool take = k > prefix || (k == prefix && qb < want);
            if (take) SEL.v[sb + gb + min(qb, want)] = j;
            gb += k > prefix ? 1u : 0u;
            qb += k == prefix ? 1u : 0u;
        }
        return;
    }
    if (mode == 7u) {
        uint h = gl_WorkGroupID.x, j0 = gl_WorkGroupID.y * 32u;
        uint n = min(pos0 + pc.u[13], ctx);
        if (j0 >= n) return;                       // uniform in the workgroup
        uint nk = min(32u, n - j0), O = dn + dv, KW = dn + dr;
        F32 KB = F32(pc.a[4]);
        F32 VB = F32(pc.a[5]);
        F32 KX = F32(pc.a[6]);
        F32 VX = F32(pc.a[7]);
        for (uint og = 0u; og < O; og += WG) {
            uint o = og + t;
            float acc[32];
            for (uint jj = 0u; jj < 32u; jj++) acc[jj] = 0.0;
            for (uint c0 = 0u; c0 < r; c0 += 32u) {
                barrier();                         // the last unit's reads before this one's writes
                for (uint i = t; i < 1024u; i += WG) {     // QS[cc * 32 + jj]: channel c0 + cc of position j0 + jj
                    uint jj = i / 32u, cc = i % 32u;
                    QS[cc * 32u + jj] = jj < nk && c0 + cc < r ? LAT.v[(j0 + jj) * LW + c0 + cc] : 0.0;
                }
                barrier();
                if (o < O) {
                    uint ce = min(32u, r - c0);
                    for (uint cc = 0u; cc < ce; cc++) {
                        uint c = c0 + cc;
                        float w = o < dn ? KB.v[(h * r + c) * dn + o] : VB.v[(h * dv + o - dn) * r + c];
                        for (uint jj = 0u; jj < 32u; jj++) acc[jj] += w * QS[cc * 32u + jj];
                    }
                }
            }
            if (o < O) {
                for (uint jj = 0u; jj < nk; jj++) {
                    uint j = j0 + jj;
                    if (o < dn) KX.v[(h * ctx + j) * KW + o] = acc[jj];
                    else VX.v[(h * ctx + j) * dv + o - dn] = acc[jj];
                }
            }
        }
        for (uint i = t; i < nk * dr; i += WG) {
            uint jj = i / dr, e = i % dr;
            KX.v[(h * ctx + j0 + jj) * KW + dn + e] = LAT.v[(j0 + jj) * LW + r + e];
        }
        return;
    }
    if (mode == 0u) {
        uint row = gl_WorkGroupID.x, pos = pos0 + row;
        F32 KV = F32(pc.a[1]);
        F32 NW = F32(pc.a[4]);
        F32 CS = F32(pc.a[5]);
        F32 SN = F32(pc.a[6]);
        F32 KVO = F32(pc.a[7]);
        bool rot = (flags & 1u) != 0u, out_ = (flags & 2u) != 0u;
        uint kb = row * W, lb = pos * LW;
        float s = 0.0;
        for (uint i = t; i < r; i += WG) {
            float v = KV.v[kb + i];
            s += v * v;
        }
        s = wg_sum(s);
        float inv = 1.0 / sqrt(s / float(r) + pcf(8u));
        for (uint i = t; i < r; i += WG) {
            float y = (KV.v[kb + i] * inv) * NW.v[i];
            LAT.v[lb + i] = y;
            if (out_) KVO.v[i] = y;
        }
        uint half_ = dr / 2u;
        // the shared rope key, then every head's rope part of q: one pair an invocation
        for (uint j = t; j < (H + 1u) * half_; j += WG) {
            uint g = j / half_, i = j % half_;
            float c = rot ? CS.v[pos * half_ + i] : 1.0, sn = rot ? SN.v[pos * half_ + i] : 0.0;
            if (g == 0u) {
                float a = KV.v[kb + r + 2u * i], b = KV.v[kb + r + 2u * i + 1u];
                precise float y0 = a * c - b * sn;
                precise float y1 = a * sn + b * c;
                LAT.v[lb + r + 2u * i] = y0;
                LAT.v[lb + r + 2u * i + 1u] = y1;
                if (out_) {
                    KVO.v[r + 2u * i] = y0;
                    KVO.v[r + 2u * i + 1u] = y1;
                }
            } else if (rot) {
                uint qb = row * ldq + (g - 1u) * (dn + dr) + dn + 2u * i;
                float a = Q.v[qb], b = Q.v[qb + 1u];
                precise float y0 = a * c - b * sn;
                precise float y1 = a * sn + b * c;
                Q.v[qb] = y0;
                Q.v[qb + 1u] = y1;
            }
        }
        return;
    }
    uint h = gl_WorkGroupID.x, row = gl_WorkGroupID.y;
    uint qa_b = (row * H + h) * W;
    if (mode == 1u) {
        F32 KB = F32(pc.a[4]);
        F32 QA = F32(pc.a[5]);
        uint qb = row * ldq + h * (dn + dr);
        for (uint i = t; i < dn; i += WG) QS[i] = Q.v[qb + i];
        barrier();
        for (uint c = t; c < r; c += WG) {
            uint kr = (h * r + c) * dn;
            float s = 0.0;
            for (uint i = 0u; i < dn; i++) s += KB.v[kr + i] * QS[i];
            QA.v[qa_b + c] = s;
        }
        for (uint i = t; i < dr; i += WG) QA.v[qa_b + r + i] = Q.v[qb + dn + i];
        return;
    }
    F32 OL = F32(pc.a[6]);
    uint ol_b = (row * H + h) * r;
    if (mode == 3u) {
        F32 VB = F32(pc.a[4]);
        F32 O = F32(pc.a[7]);
        for (uint c = t; c < r; c += WG) QS[c] = OL.v[ol_b + c];
        barrier();
        for (uint v = t; v < dv; v += WG) {
            uint vr = (h * dv + v) * r;
            float s = 0.0;
            for (uint c = 0u; c < r; c++) s += VB.v[vr + c] * QS[c];
            O.v[row * H * dv + h * dv + v] = s;
        }
        return;
    }
    // mode 2: the scores over keys 0 .. n - 1 in tiles of WG keys, a running max and sum
    F32 QA = F32(pc.a[5]);
    float scale = pcf(7u);
    uint n = min(pos0 + row + 1u, ctx);
    bool dsa = (flags & 4u) != 0u;
    U32 SEL = U32(pc.a[1]);
    if (dsa) n = min(n, KT);
    for (uint i = t; i < W; i += WG) QS[i] = QA.v[qa_b + i];
    barrier();
    float acc[MAXC];
    for (uint k = 0u; k < MAXC; k++) acc[k] = 0.0;
    float m = -1.0 / 0.0, l = 0.0;
    for (uint j0 = 0u; j0 < n; j0 += WG) {
        uint j = j0 + t;
        float s = -1.0 / 0.0;
        if (j < n) {
            uint key = dsa ? SEL.v[row * KT + j] : j;
            JS[t] = key;
            float d = 0.0;
            for (uint c = 0u; c < W; c++) d += QS[c] * LAT.v[key * LW + c];
            s = d * scale;
        }
        float mn = max(m, wg_max(s));
        float e = j < n ? exp(s - mn) : 0.0;
        PS[t] = e;
        float lt = wg_sum(e);          // its barriers make every PS entry visible
        float alpha = exp(m - mn);     // 0 at the first tile (m = -inf, mn finite)
        l = l * alpha + lt;
        uint nt = min(WG, n - j0);
        for (uint k = 0u; k < MAXC; k++) {
            uint c = t + k * WG;
            if (c >= r) break;
            float a = acc[k] * alpha;
            for (uint jj = 0u; jj < nt; jj++) a += PS[jj] * LAT.v[JS[jj] * LW + c];
            acc[k] = a;
        }
        m = mn;
        barrier();                     // every PS read before the next tile writes it
    }
    float il = 1.0 / l;
    for (uint k = 0u; k < MAXC; k++) {
        uint c = t + k * WG;
        if (c >= r) break;
        OL.v[ol_b + c] = acc[k] * il;
    }
}
