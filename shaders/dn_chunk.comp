#version 460
// Gated DeltaNet's delta rule for a prompt chunk in the chunked (WY / UT transform) form (Qwen3-Next, Qwen3.5-MoE;
// coli/vulkan/layer_families.py DeltaNetMixer._dn_chunk_ops, docs/vulkan.md "Gated DeltaNet on the device").
// The same recurrence as shaders/deltanet.comp mode 1 (S *= exp(g); S += k (x) (v - S^T k) beta; o = S^T q), taken
// 64 rows (a block) at a time as flash-linear-attention's chunk_gated_delta_rule and HF transformers'
// torch_chunk_gated_delta_rule (transformers.models.qwen3_next.modeling_qwen3_next) do: with G the cumulative log
// decay inside the block, A = strictly lower (beta_i k_i.k_j exp(G_i - G_j)), T = (I + A)^-1 (16-row
// diagonal blocks by forward substitution, then the blocks below), W = T (beta k exp(G)), U = T (beta v); then, the blocks in order,
//   V' = U - W S;  O = (q exp(G)) S + tril(q k^T exp(G_i - G_j)) V';  S = S exp(G_last) + (k exp(G_last - G))^T V'.
// q, k are l2-normed (x / sqrt(sum x^2 + 1e-6)), q / sqrt(dk); beta = sigmoid(b), g = ssm_a softplus(a + dt).
// Scratch (a4 in modes 0 and 1), floats, for R rows and Hv heads: W [Hv, R, dk], U [Hv, R, dv], AQ [Hv, R, 64] (the
// block's tril(q k^T exp(G_i - G_j)) rows), F [Hv, R, 4] (fq exp(G_i) / sqrt(dk), fk exp(G_last - G_i), exp(G_last)).
// KDA (Kimi-Linear, flag bit 2; flash-linear-attention's chunk_kda): the decay one a key channel, g_i[d] =
// ssm_a softplus(f_i[d] + dt[d]), so G is cumulative a channel and each product over d takes its own factor:
// A = strictly lower (beta_i sum_d k_i[d] k_j[d] exp(G_i[d] - G_j[d])), the q k^T rows likewise (exponents <= 0,
// taken directly: no exp(-G) that could overflow), W = T (beta k exp(G)), O = (q exp(G_i)) S + .., S = exp(G_last) S
// + (k exp(G_last - G))^T V' with exp(G_last) a state row; its gate is sigmoid(z) (deltanet.comp's KDA flag).
// Scratch for KDA, after F: QG, KG [Hv, R, dk] (q fq exp(G), k fk exp(G_last - G): mode 1's per-channel factors).
// Words: u0 mode, u1 Hk, u2 Hv, u3 dk, u4 dv, u5 R, u6 eps (float bits), u7 flags (deltanet.comp's: bit 0 tiled
// value heads, bit 1 ssm_ba's order, bit 2 KDA: Hk = Hv, dk = dv, a1 rows Hv betas then Hv dk decay inputs f, a3 the
// dt bias f32 [Hv dk]), u8 BV (mode 1's state columns a workgroup: 16 or 8, BV dk <= 2048).
//  mode 0 (the blocks' UT transform, independent of the state), groups (Hv, ceil(R / 64)): a0 the conv rows f32
//    [R, C] (q heads, k heads, v heads; C = 2 Hk dk + Hv dv), a1 ba f32 [R, 2 Hv] (deltanet.comp mode 1's), a2 ssm_a
//    f32 [Hv], a3 dt bias f32 [Hv], a4 scratch: writes W, U, AQ, F of its block.
//  mode 1 (the blocks in order), groups (Hv, ceil(dv / BV)): a0 the conv rows, a4 scratch, a5 state f32 [Hv, dk, dv]
//    (read, then written after the last block), a6 out f32 [R, Hv dv] (o before the norm). The workgroup's BV state
//    columns stay in shared memory through the chunk.
//  mode 2 (the gated norm), groups ceil(R Hv / 8): a6 out f32 [R, Hv dv] in place, a7 z f32 [R, Hv dv] (attn_gate), a1
//    ssm_norm f32 [dv]: out = rmsnorm(o) * w * silu(z).
// Modes 0 and 2 need WG >= 256 (mode 0's 64 x 64 products: 16 an invocation).
#extension GL_GOOGLE_include_directive : require
#include "layer_common.glsl"

layout(local_size_x_id = 0) in;
#include "layer_reduce.glsl"

#define CH 64u          // rows of a block
#define TW 16u          // mode 0's dims of a key / query tile
#define BS 16u          // mode 0's rows of a diagonal block of the inverse (P, 3 BS^2 floats, fits KT)
#define TW1 32u         // mode 1's dims of a tile
#define MAXSL 4u        // mode 1's rows of a block an invocation owns (CH / (WG / BV): WG >= 256, BV <= 16)
// one shared array, carved per mode (mode 0: TS [CH][CH + 1], KT, QT [CH][TW + 1], G, BE, FK, FQ [CH];
// mode 1: SS [dk][BV], VN [CH][BV], WT, QT [CH][TW1 + 1], and the block's AQ rows [CH][CH + 1] over WT and QT;
// KDA: mode 0's GT [CH][TW + 1] (a key tile's cumulative log decays), mode 1's GLS [dk] (exp(G_last) a state row))
#define SM_N 7680u
shared float SM[SM_N];

float sigm(float x) {
    float e = exp(-abs(x));
    return x >= 0.0 ? 1.0 / (1.0 + e) : e / (1.0 + e);
}

// a row's log decay ssm_a softplus(x) (x = a + dt, or KDA's f + dt of a key channel)
float logdec(float a, float x) {
    return a * (x > 20.0 ? x : log(1.0 + exp(x)));
}

// KDA: the block's cumulative log decays of key channels d0 .. d0 + TW - 1 into SM[GT] [CH][TW + 1] (a row past the
// block's n: the last row's; a channel past dk: 0). Barriers inside: call from uniform control flow.
void kda_tile(F32 BA, F32 DT, float a, uint ldba, uint Hv, uint h, uint dk, uint r0, uint n, uint d0, uint GT) {
    uint t = gl_LocalInvocationIndex, WG = gl_WorkGroupSize.x;
    for (uint e = t; e < CH * TW; e += WG) {
        uint i = e / TW, d = e % TW;
        SM[GT + i * (TW + 1u) + d] = i < n && d0 + d < dk
            ? logdec(a, BA.v[(r0 + i) * ldba + Hv + h * dk + d0 + d] + DT.v[h * dk + d0 + d]) : 0.0;
    }
    barrier();
    if (t < TW) for (uint i = 1u; i < CH; i++) SM[GT + i * (TW + 1u) + t] += SM[GT + (i - 1u) * (TW + 1u) + t];
    barrier();
}

void main() {
    uint mode = pc.u[0], t = gl_LocalInvocationIndex, WG = gl_WorkGroupSize.x;
    uint Hk = pc.u[1], Hv = pc.u[2], dk = pc.u[3], dv = pc.u[4], R = pc.u[5], flags = pc.u[7];
    uint h = gl_WorkGroupID.x, rep = Hv / Hk;
    uint hk = (flags & 1u) != 0u ? h % Hk : h / rep;
    uint C = 2u * Hk * dk + Hv * dv;
    uint qo = hk * dk, ko = Hk * dk + hk * dk, vo = 2u * Hk * dk + h * dv;     // a row's q, k, v of head h
    uint oW = 0u, oU = Hv * R * dk, oA = oU + Hv * R * dv, oF = oA + Hv * R * CH;   // the scratch's parts
    uint oQ = oF + Hv * R * 4u, oK = oQ + Hv * R * dk;      // KDA's QG, KG
    bool kda = (flags & 4u) != 0u;
    uint ldba = kda ? Hv + Hv * dk : 2u * Hv;
    if (mode == 2u) {       // a subgroup a (row, head) pair, 8 pairs a workgroup: no barriers
        F32 O = F32(pc.a[6]);
        F32 Z = F32(pc.a[7]);
        F32 NW = F32(pc.a[1]);
        for (uint q = gl_SubgroupID; q < 8u; q += gl_NumSubgroups) {
            uint pr = gl_WorkGroupID.x * 8u + q;
            if (pr >= R * Hv) break;
            uint o0 = pr * dv;          // row pr / Hv, head pr % Hv: [R, Hv dv] is [R Hv, dv]
            float ss = 0.0;
            for (uint j = gl_SubgroupInvocationID; j < dv; j += gl_SubgroupSize) ss += O.v[o0 + j] * O.v[o0 + j];
            float inv = 1.0 / sqrt(subgroupAdd(ss) / float(dv) + pcf(6u));
            for (uint j = gl_SubgroupInvocationID; j < dv; j += gl_SubgroupSize) {
                float zz = Z.v[o0 + j];
                O.v[o0 + j] = NW.v[j] * (O.v[o0 + j] * inv) * (kda ? sigm(zz) : zz * sigm(zz));
            }
        }
        return;
    }
    F32 X = F32(pc.a[0]);
    F32 SC = F32(pc.a[4]);
    if (mode == 0u) {
        F32 BA = F32(pc.a[1]);
        F32 A = F32(pc.a[2]);
        F32 DT = F32(pc.a[3]);
        uint r0 = gl_WorkGroupID.y * CH, n = min(CH, R - r0);
        uint TS = 0u, KT = CH * (CH + 1u), QT = KT + CH * (TW + 1u), G = QT + CH * (TW + 1u);
        uint BE = G + CH, FK = BE + CH, FQ = FK + CH, GT = FQ + CH;
        uint ib = (flags & 2u) != 0u && !kda ? hk * 2u * rep + h % rep : h;
        uint ia = (flags & 2u) != 0u ? ib + rep : Hv + h;
        // each row's beta and log decay (rows past the chunk: zeros, so they add nothing; KDA: G = 0 here, its
        // decays a key channel in GT)
        for (uint i = t; i < CH; i += WG) {
            float be = 0.0, g = 0.0;
            if (i < n) {
                be = sigm(BA.v[(r0 + i) * ldba + ib]);
                if (!kda) g = logdec(A.v[h], BA.v[(r0 + i) * ldba + ia] + DT.v[h]);
            }
            SM[BE + i] = be;
            SM[G + i] = g;
        }
        barrier();
        if (t == 0u) for (uint i = 1u; i < n; i++) SM[G + i] += SM[G + i - 1u];     // G: cumulative, in row order
        // k_i.k_j and q_i.k_j of the block, a tile of TW dims at a time; invocation t owns entries t, t + WG, ..
        // (invocation t < CH sums row t's q.q and k.k on the way: the l2 norms)
        float akk[16], aqk[16], nq = 0.0, nk = 0.0;
        [[unroll]] for (uint s = 0u; s < 16u; s++) { akk[s] = 0.0; aqk[s] = 0.0; }
        for (uint d0 = 0u; d0 < dk; d0 += TW) {
            barrier();
            for (uint e = t; e < CH * TW; e += WG) {
                uint i = e / TW, d = e % TW;
                bool in_ = i < n && d0 + d < dk;
                uint x0 = (r0 + i) * C + d0 + d;
                SM[KT + i * (TW + 1u) + d] = in_ ? X.v[x0 + ko] : 0.0;
                SM[QT + i * (TW + 1u) + d] = in_ ? X.v[x0 + qo] : 0.0;
            }
            barrier();
            if (kda) kda_tile(BA, DT, A.v[h], ldba, Hv, h, dk, r0, n, d0, GT);
            if (t < CH) {
                for (uint d = 0u; d < TW; d++) {
                    float q = SM[QT + t * (TW + 1u) + d], k = SM[KT + t * (TW + 1u) + d];
                    nq += q * q;
                    nk += k * k;
                }
            }
            [[unroll]] for (uint s = 0u; s < 16u; s++) {
                uint e = t + s * WG;
                if (e < CH * CH) {
                    uint i = e / CH, j = e % CH;
                    float sk = 0.0, sq = 0.0;
                    // 4 dims a step, the steps not unrolled (fully unrolled, Lavapipe's compile passed its fence timeout)
                    [[dont_unroll]] for (uint d4 = 0u; d4 < TW; d4 += 4u) {
                        [[unroll]] for (uint u = 0u; u < 4u; u++) {
                            uint d = d4 + u;
                            float kj = SM[KT + j * (TW + 1u) + d];
                            if (kda)    // exp(G_i[d] - G_j[d]) a channel (j <= i: at most 1; the rest are not used)
                                kj *= j <= i ? exp(SM[GT + i * (TW + 1u) + d] - SM[GT + j * (TW + 1u) + d]) : 0.0;
                            sk += SM[KT + i * (TW + 1u) + d] * kj;
                            sq += SM[QT + i * (TW + 1u) + d] * kj;
                        }
                    }
                    akk[s] += sk;
                    aqk[s] += sq;
                }
            }
        }
        if (t < CH) {
            SM[FQ + t] = t < n ? 1.0 / sqrt(float(dk)) / sqrt(nq + 1e-6) : 0.0;
            SM[FK + t] = t < n ? 1.0 / sqrt(nk + 1e-6) : 0.0;
        }
        barrier();
        [[unroll]] for (uint s = 0u; s < 16u; s++) {
            uint e = t + s * WG;
            if (e < CH * CH) {
                uint i = e / CH, j = e % CH;
                float dec = j <= i ? exp(SM[G + i] - SM[G + j]) : 0.0;
                if (i < n) SC.v[oA + (h * R + r0 + i) * CH + j] = j <= i ? aqk[s] * SM[FQ + i] * SM[FK + j] * dec : 0.0;
                SM[TS + i * (CH + 1u) + j] = j < i ? -SM[BE + i] * akk[s] * SM[FK + i] * SM[FK + j] * dec : 0.0;
            }
        }
        barrier();
        // T = (I + A)^-1 = (I - L)^-1 (TS holds L = -A, strictly lower) in 16-row blocks (FLA's sub-chunks): the four
        // diagonal blocks at once by forward substitution, T[i, j] = L[i, j] + sum_{j < m < i} L[i, m] T[m, j] (HF's
        // loop, 15 steps, not 63), then a block row bi at a time T_{bi,j} = T_{bi,bi} sum_{j <= k < bi} L_{bi,k} T_{k,j}
        // (the row's L all read, into P at KT, before any of it is overwritten)
        uint db = t / BS, dc = t % BS, dr = BS * db;       // invocation t < CH: diagonal block db's column dc
        for (uint i = 1u; i < BS; i++) {
            float v = 0.0;
            if (t < CH && dc < i) {
                uint ri = TS + (dr + i) * (CH + 1u);
                v = SM[ri + dr + dc];
                for (uint m = dc + 1u; m < i; m++) v += SM[ri + dr + m] * SM[TS + (dr + m) * (CH + 1u) + dr + dc];
            }
            barrier();
            if (t < CH && dc < i) SM[TS + (dr + i) * (CH + 1u) + dr + dc] = v;
            barrier();
        }
        for (uint i = t; i < CH; i += WG) SM[TS + i * (CH + 1u) + i] = 1.0;
        barrier();
        for (uint bi = 1u; bi < CH / BS; bi++) {
            for (uint e = t; e < bi * BS * BS; e += WG) {       // P_j [BS][BS] for the blocks j < bi
                uint r = BS * bi + (e / BS) % BS, c = BS * (e / (BS * BS)) + e % BS;
                float v = 0.0;
                for (uint k = c - c % BS; k < BS * bi; k++) v += SM[TS + r * (CH + 1u) + k] * SM[TS + k * (CH + 1u) + c];
                SM[KT + e] = v;
            }
            barrier();
            for (uint e = t; e < bi * BS * BS; e += WG) {       // T_{bi,j} = T_{bi,bi} P_j (unit lower triangular)
                uint rr = (e / BS) % BS, r = BS * bi + rr, j = e / (BS * BS), c = e % BS;
                float v = 0.0;
                for (uint m = 0u; m <= rr; m++) v += SM[TS + r * (CH + 1u) + BS * bi + m] * SM[KT + j * BS * BS + m * BS + c];
                SM[TS + r * (CH + 1u) + BS * j + c] = v;
            }
            barrier();
        }
        // W = T (beta k exp(G) fk), U = T (beta v): a tile of TW columns at a time (KT holds the right side)
        for (uint part = 0u; part < 2u; part++) {
            uint width = part == 0u ? dk : dv, src = part == 0u ? ko : vo;
            uint dst = part == 0u ? oW + h * R * dk : oU + h * R * dv;
            for (uint d0 = 0u; d0 < width; d0 += TW) {
                barrier();
                if (kda && part == 0u) kda_tile(BA, DT, A.v[h], ldba, Hv, h, dk, r0, n, d0, GT);
                for (uint e = t; e < CH * TW; e += WG) {
                    uint j = e / TW, d = e % TW;
                    bool in_ = j < n && d0 + d < width;
                    float gj = kda && part == 0u ? SM[GT + j * (TW + 1u) + d] : 0.0;
                    float f = part == 0u ? SM[BE + j] * SM[FK + j] * exp(SM[G + j] + gj) : SM[BE + j];
                    SM[KT + j * (TW + 1u) + d] = in_ ? X.v[(r0 + j) * C + src + d0 + d] * f : 0.0;
                    if (kda && part == 0u && in_) {     // mode 1's q and k rows with their channels' factors
                        uint x0 = (r0 + j) * C + d0 + d, s0 = (h * R + r0 + j) * dk + d0 + d;
                        SC.v[oQ + s0] = X.v[x0 + qo] * SM[FQ + j] * exp(gj);
                        SC.v[oK + s0] = X.v[x0 + ko] * SM[FK + j] * exp(SM[GT + (n - 1u) * (TW + 1u) + d] - gj);
                    }
                }
                barrier();
                for (uint e = t; e < CH * TW; e += WG) {
                    uint i = e / TW, d = e % TW;
                    if (i < n && d0 + d < width) {
                        float s = 0.0;
                        for (uint j = 0u; j <= i; j++) s += SM[TS + i * (CH + 1u) + j] * SM[KT + j * (TW + 1u) + d];
                        SC.v[dst + (r0 + i) * width + d0 + d] = s;
                    }
                }
            }
        }
        float gl = SM[G + n - 1u];
        for (uint i = t; i < n; i += WG) {
            uint f0 = oF + (h * R + r0 + i) * 4u;
            SC.v[f0] = SM[FQ + i] * exp(SM[G + i]);
            SC.v[f0 + 1u] = SM[FK + i] * exp(gl - SM[G + i]);
            SC.v[f0 + 2u] = exp(gl);
            SC.v[f0 + 3u] = 0.0;
        }
        return;
    }
    // mode 1: invocation t owns state column jj = t % BV (of j0 + jj) and the block rows / state rows p, p + P, ..
    F32 ST = F32(pc.a[5]);
    F32 O = F32(pc.a[6]);
    uint BV = pc.u[8], P = WG / BV, jj = t % BV, p = t / BV, j0 = gl_WorkGroupID.y * BV;
    bool col = p < P && j0 + jj < dv;
    uint SS = 0u, VN = dk * BV, WT = VN + CH * BV, QT = WT + CH * (TW1 + 1u), AQ = WT;   // AQ [CH][CH + 1]: WT, QT
    uint GLS = QT + CH * (TW1 + 1u);
    F32 BA = F32(pc.a[1]);
    F32 A = F32(pc.a[2]);
    F32 DT = F32(pc.a[3]);
    uint s0 = h * dk * dv + j0 + jj;
    for (uint i = p; i < dk; i += P) if (t < P * BV) SM[SS + i * BV + jj] = col ? ST.v[s0 + i * dv] : 0.0;
    for (uint r0 = 0u; r0 < R; r0 += CH) {
        uint n = min(CH, R - r0);
        float aw[MAXSL], aq[MAXSL];
        [[unroll]] for (uint s = 0u; s < MAXSL; s++) { aw[s] = 0.0; aq[s] = 0.0; }
        // W S and (q exp(G)) S of the block's rows, a tile of TW1 state rows at a time
        for (uint i0 = 0u; i0 < dk; i0 += TW1) {
            barrier();
            for (uint e = t; e < CH * TW1; e += WG) {
                uint r = e / TW1, d = e % TW1;
                bool in_ = r < n && i0 + d < dk;
                SM[WT + r * (TW1 + 1u) + d] = in_ ? SC.v[oW + (h * R + r0 + r) * dk + i0 + d] : 0.0;
                float q = 0.0;      // if, not ?: (a select would read KDA's part, past a Gated DeltaNet scratch)
                if (in_) {
                    if (kda) q = SC.v[oQ + (h * R + r0 + r) * dk + i0 + d];
                    else q = X.v[(r0 + r) * C + qo + i0 + d] * SC.v[oF + (h * R + r0 + r) * 4u];
                }
                SM[QT + r * (TW1 + 1u) + d] = q;
            }
            barrier();
            uint m = min(TW1, dk - i0);
            for (uint d = 0u; d < m; d++) {
                float sv = SM[SS + (i0 + d) * BV + jj];
                [[unroll]] for (uint s = 0u; s < MAXSL; s++) {
                    uint r = p + P * s;
                    if (r < n) {
                        aw[s] += SM[WT + r * (TW1 + 1u) + d] * sv;
                        aq[s] += SM[QT + r * (TW1 + 1u) + d] * sv;
                    }
                }
            }
        }
        // V' = U - W S
        [[unroll]] for (uint s = 0u; s < MAXSL; s++) {
            uint r = p + P * s;
            if (r < n && t < P * BV)
                SM[VN + r * BV + jj] = col ? SC.v[oU + (h * R + r0 + r) * dv + j0 + jj] - aw[s] : 0.0;
        }
        barrier();
        // the block's AQ rows (their lower triangle) into shared memory, where WT / QT were (read before the barrier)
        for (uint e = t; e < n * CH; e += WG) {
            uint r = e / CH, m = e % CH;
            if (m <= r) SM[AQ + r * (CH + 1u) + m] = SC.v[oA + (h * R + r0) * CH + e];
        }
        // KDA: exp(G_last) of each state row, summed in row order as mode 0's G (GLS's last reads were before the
        // block's first barrier)
        if (kda) {
            for (uint i = t; i < dk; i += WG) {
                float c = 0.0;
                for (uint r = 0u; r < n; r++) c += logdec(A.v[h], BA.v[(r0 + r) * ldba + Hv + h * dk + i] + DT.v[h * dk + i]);
                SM[GLS + i] = exp(c);
            }
        }
        barrier();
        // O = (q exp(G)) S + AQ V'
        [[unroll]] for (uint s = 0u; s < MAXSL; s++) {
            uint r = p + P * s;
            if (r < n && col) {
                float o = aq[s];
                for (uint m = 0u; m <= r; m++) o += SM[AQ + r * (CH + 1u) + m] * SM[VN + m * BV + jj];
                O.v[(r0 + r) * Hv * dv + h * dv + j0 + jj] = o;
            }
        }
        // S = S exp(G_last) + (k exp(G_last - G))^T V': a tile of TW1 state rows at a time (QT holds the k tile)
        float gl = SC.v[oF + (h * R + r0) * 4u + 2u];
        for (uint i0 = 0u; i0 < dk; i0 += TW1) {
            barrier();
            for (uint e = t; e < CH * TW1; e += WG) {
                uint r = e / TW1, d = e % TW1;
                float k = 0.0;
                if (r < n && i0 + d < dk) {
                    if (kda) k = SC.v[oK + (h * R + r0 + r) * dk + i0 + d];
                    else k = X.v[(r0 + r) * C + ko + i0 + d] * SC.v[oF + (h * R + r0 + r) * 4u + 1u];
                }
                SM[QT + r * (TW1 + 1u) + d] = k;
            }
            barrier();
            if (t < P * BV) {
                for (uint d = p; d < TW1 && i0 + d < dk; d += P) {
                    float s = 0.0;
                    for (uint r = 0u; r < n; r++) s += SM[QT + r * (TW1 + 1u) + d] * SM[VN + r * BV + jj];
                    SM[SS + (i0 + d) * BV + jj] = SM[SS + (i0 + d) * BV + jj] * (kda ? SM[GLS + i0 + d] : gl) + s;
                }
            }
        }
    }
    barrier();
    for (uint i = p; i < dk; i += P) if (col) ST.v[s0 + i * dv] = SM[SS + i * BV + jj];
}
