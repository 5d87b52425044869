#version 460
// attn_pre_cm: attn_pre.comp's causal attention of R query rows over the cached positions on the device's
// cooperative matrices (VK_KHR_cooperative_matrix, 16 x 16 x 16, float16 inputs, float32 accumulators): the prompt
// route "coopmat" (coli/vulkan/layers.py Kernels.attn_kernel, docs/vulkan.md "Prompt routes"), flash-attention 2
// style. Same addresses, push constants, window, sinks, K/V types (kv_types.glsl) and output as attn_pre.comp
// (its header says which is which); groups: (nq / G, ceil(R / PB), 1), PB = 64 / G (rounded down). Head dimensions that are a multiple of 16
// up to 128 (others take attn_pre.comp).
// A workgroup of 128 invocations owns 64 query rows: PB positions x G q heads of one KV head (GQA, specialization
// constant 5: a divisor of nq / nkv; row i: position i / G, head h0 + i % G; the last 64 - PB G rows unused), so a
// K/V tile is read once for the group; subgroup s owns RB blocks of 16 rows (4 subgroups of 32 one each, 2 of 64
// two each). The block's q rows are rounded to float16 once and kept as A matrices. Per
// tile of 32 keys: K and V rows rounded to float16 into shared memory; S = Q K^T (float32 sums) stored to shared
// memory; one invocation a row masks (causal, window), scales and takes the online softmax in float32 (running
// max m, sum l of the float16-rounded weights, rescale exp(m_old - m_new)), writing P = exp(s - m) as float16;
// then the row's rescale multiplies O's accumulators element by element (a 16 x 16 matrix of the rows' factors:
// elements of same-typed matrices match position for position) and O += P V. At the end O / l (with the sink in
// l) leaves through a per-subgroup 16 x 16 scratch. Tiles start at key 0 (or at the tile of the block's first
// row's first key under a window), as attn_pre.comp's, so a row's result does not depend on the chunk it came in.
// Rounding: q, K, V and the softmax weights to float16 (2^-11 relative each): an output differs from attn_pre.comp's
// by about 1e-3 of the largest (the backend-parity harness's attn rows bound it, TOL_ATTN_F16). Values beyond
// float16's range (65504) in q, K or V would overflow: the attention inputs of the models here are far below.
// Keys split over workgroups as attn_pre.comp's (attn_split.glsl: u9 NS, u10 CHK, a6 the parts, groups z = NS; its
// join pass combines a split row's parts): a split row's O leaves unscaled with its m and l.
#extension GL_GOOGLE_include_directive : require
#extension GL_KHR_cooperative_matrix : require
#extension GL_KHR_memory_scope_semantics : require
#extension GL_KHR_shader_subgroup_basic : require
#extension GL_EXT_shader_explicit_arithmetic_types_float16 : require
#include "layer_common.glsl"
#include "kv_types.glsl"
#include "attn_split.glsl"

layout(local_size_x = 128) in;
layout(constant_id = 2) const uint MODE = 0;   // unused
layout(constant_id = 4) const uint RB = 1;     // 16-row blocks a subgroup owns: 4 / (subgroups in 128)
layout(constant_id = 5) const uint G = 1u;     // q heads of one KV head a workgroup serves
#define BQ 64u      // query rows a workgroup
#define BK 32u      // keys a tile (BQ = 2 BK: the q staging fills KV exactly)
#define MAXD 128u   // the largest head dimension
#define ND (MAXD / 16u)
#define LDK 34u     // f16vec4 stride of a q / K / V row in KV: MAXD / 4 + 2 pad
#define PLD 10u     // f16vec4 stride of a row of P: BK / 4 + 2 pad
#define SLD 68u     // float stride of a key's column of S: BQ + 4 pad (invocation t reads row t: no bank conflicts)
#define NEG_INF (-1.0 / 0.0)
const uint PB = BQ / G;                        // positions of a block

shared f16vec4 KV[2u * BK * LDK];   // the q rows first (BQ rows); then a tile: K rows at 0, V rows at BK * LDK
shared float S[BK * SLD];           // scores (row r, key j at j SLD + r); then the rows' factors (16 a row: at 16 r)
                                    // and the output scratch
shared f16vec4 PS[BQ * PLD];        // the softmax weights, float16

#define ACC coopmat<float, gl_ScopeSubgroup, 16, 16, gl_MatrixUseAccumulator>
#define MATA coopmat<float16_t, gl_ScopeSubgroup, 16, 16, gl_MatrixUseA>
#define MATB coopmat<float16_t, gl_ScopeSubgroup, 16, 16, gl_MatrixUseB>

void main() {
    uint nq = pc.u[0], nkv = pc.u[1], hd = pc.u[2], ctx = pc.u[3], R = pc.u[5], W = pc.u[6];
    uint NS = pc.u[9], CHK = pc.u[10], z = gl_WorkGroupID.z;
    float scale = pcf(4u);
    uint h0 = gl_WorkGroupID.x * G, rb = gl_WorkGroupID.y * PB, t = gl_LocalInvocationIndex;   // row i: head h0 + i % G
    uint kvh = h0 / (nq / nkv);
    uint pos0 = U32(pc.a[3]).v[0];
    uint nrow = min(PB, R - rb);                  // positions; row i is on when i < PB G and i / G < nrow
    uint n = min(pos0 + rb + nrow, ctx);          // keys the block's last row sees
    uint jlo = (W > 0u && pos0 + rb + 1u > W) ? pos0 + rb + 1u - W : 0u;   // the block's first row's first key
    uint h4 = hd / 4u, nd = hd / 16u;
    F32x4 Q4 = F32x4(pc.a[0]);
    uint sg = gl_SubgroupID;

    // the block's q rows (zeros past R), float16, as A matrices: row block b, dimensions 16 dd .. 16 dd + 15
    for (uint i = t; i < BQ * h4; i += 128u) {
        uint r = i / h4, q = i - r * h4;
        bool on = r < PB * G && r / G < nrow;
        KV[r * LDK + q] = f16vec4(on ? Q4.v[((rb + r / G) * nq + h0 + r % G) * h4 + q] : vec4(0.0));
    }
    barrier();
    MATA qa[RB][ND];
    ACC o[RB][ND];
    [[unroll]] for (uint i = 0u; i < RB; i++) [[unroll]] for (uint dd = 0u; dd < ND; dd++) {
        o[i][dd] = ACC(0.0);
        if (dd < nd)
            coopMatLoad(qa[i][dd], KV, (sg * RB + i) * 16u * LDK + dd * 4u, LDK, gl_CooperativeMatrixLayoutRowMajor);
    }

    float m = NEG_INF, l = 0.0;                   // invocation t < BQ: row t's running max and sum
    uint p = pos0 + rb + t / G;                   // that row's position
    bool row_on = t < PB * G && t / G < nrow;
    uint kvb = kvh * ctx;
    for (uint pi = 0u; ; pi++) {   // this workgroup's parts of the keys (one part 0 .. n - 1 without a split)
    uvec2 pk = part_keys(pi, z, n, NS, CHK);
    if (pk.x >= pk.y) break;
    for (uint j0 = max(pk.x, (jlo / BK) * BK); j0 < pk.y; j0 += BK) {
        uint nk = min(BK, pk.y - j0);
        barrier();                                // the last tile's K, V, P and factors (and the q rows) are read
        for (uint i = t; i < BK * h4; i += 128u) {   // zeros past the block's keys: they meet zero weights
            uint j = i / h4, q = i - j * h4;
            bool on = j < nk;
            uint g = (kvb + j0 + j) * h4 + q;
            KV[j * LDK + q] = f16vec4(on ? kv_load4(pc.a[1], g, KT) : vec4(0.0));
            KV[(BK + j) * LDK + q] = f16vec4(on ? kv_load4(pc.a[2], g, VT) : vec4(0.0));
        }
        barrier();
        // S[r, j] = q_r . K_j: A = q block (16 rows x 16 dims), B = K^T (16 dims x 16 keys: K rows are columns)
        [[unroll]] for (uint i = 0u; i < RB; i++) {
            uint b = sg * RB + i;
            [[unroll]] for (uint kb = 0u; kb < BK / 16u; kb++) {
                ACC s = ACC(0.0);
                [[unroll]] for (uint dd = 0u; dd < ND; dd++) {
                    if (dd < nd) {
                        MATB kt;
                        coopMatLoad(kt, KV, kb * 16u * LDK + dd * 4u, LDK, gl_CooperativeMatrixLayoutColumnMajor);
                        s = coopMatMulAdd(qa[i][dd], kt, s);
                    }
                }
                coopMatStore(s, S, kb * 16u * SLD + b * 16u, SLD, gl_CooperativeMatrixLayoutColumnMajor);
            }
        }
        barrier();
        float al = 1.0;
        if (t < BQ) {   // row t's online softmax over the tile (masked keys: -inf, weight 0)
            float mt = NEG_INF;
            for (uint j = 0u; j < BK; j++) {
                uint key = j0 + j;
                bool on = j < nk && row_on && key <= p && (W == 0u || key + W > p);
                float s = on ? scale * S[j * SLD + t] : NEG_INF;
                S[j * SLD + t] = s;
                mt = max(mt, s);
            }
            float mn = max(m, mt);
            al = mn == NEG_INF ? 1.0 : exp(m - mn);
            float sum = 0.0;
            for (uint q = 0u; q < BK / 4u; q++) {
                vec4 e = vec4(0.0);
                if (mn != NEG_INF)
                    e = exp(vec4(S[4u * q * SLD + t], S[(4u * q + 1u) * SLD + t], S[(4u * q + 2u) * SLD + t],
                                 S[(4u * q + 3u) * SLD + t]) - mn);
                f16vec4 eh = f16vec4(e);
                PS[t * PLD + q] = eh;
                vec4 ef = vec4(eh);               // l sums the weights P V multiplies
                sum += ef.x + ef.y + ef.z + ef.w;
            }
            l = l * al + sum;
            m = mn;
        }
        barrier();                                // S is read: it takes the rows' factors
        if (t < BQ) for (uint c = 0u; c < 16u; c++) S[t * 16u + c] = al;
        barrier();
        // O = O * al (per row) + P V: A = P (16 rows x 16 keys), B = V (16 keys x 16 dims)
        [[unroll]] for (uint i = 0u; i < RB; i++) {
            uint b = sg * RB + i;
            ACC f;
            coopMatLoad(f, S, b * 256u, 16u, gl_CooperativeMatrixLayoutRowMajor);   // element (r, c) = al of row r
            [[unroll]] for (uint dd = 0u; dd < ND; dd++)
                if (dd < nd) for (int e = 0; e < f.length(); e++) o[i][dd][e] *= f[e];
            [[unroll]] for (uint kb = 0u; kb < BK / 16u; kb++) {
                MATA pa;
                coopMatLoad(pa, PS, b * 16u * PLD + kb * 4u, PLD, gl_CooperativeMatrixLayoutRowMajor);
                [[unroll]] for (uint dd = 0u; dd < ND; dd++) {
                    if (dd < nd) {
                        MATB vb;
                        coopMatLoad(vb, KV, (BK + kb * 16u) * LDK + dd * 4u, LDK, gl_CooperativeMatrixLayoutRowMajor);
                        o[i][dd] = coopMatMulAdd(pa, vb, o[i][dd]);
                    }
                }
            }
        }
    }
    }

    barrier();                                    // the last factors are read
    F32 Pt = F32(pc.a[6]);
    if (t < BQ && row_on && row_split(p, ctx, W, NS, CHK)) {   // this workgroup's part of a split row: m, l, O
        uint b = ((z * R + rb + t / G) * nq + h0 + t % G) * (hd + 2u);
        Pt.v[b] = m;
        Pt.v[b + 1u] = l;
        for (uint c = 0u; c < 16u; c++) S[t * 16u + c] = 1.0;
    } else if (t < BQ) {
        if (pc.u[7] != 0u && m != NEG_INF) {   // the sink: as attn_pre.comp (l in the frame of the larger max)
            float sk = F32(pc.a[5]).v[h0 + t % G];
            if (sk > m) {
                float c = exp(m - sk);
                l = (l * c + 1.0) / c;
            } else {
                l += exp(sk - m);
            }
        }
        float inv = l > 0.0 ? 1.0 / l : 0.0;      // l = 0: a row past R
        for (uint c = 0u; c < 16u; c++) S[t * 16u + c] = inv;
    }
    barrier();
    F32 O = F32(pc.a[4]);
    uint lane = gl_SubgroupInvocationID, nl = gl_SubgroupSize;
    uint scr = BQ * 16u + sg * 256u;              // this subgroup's 16 x 16 scratch, past the factors
    [[unroll]] for (uint i = 0u; i < RB; i++) {
        uint b = sg * RB + i;
        ACC f;
        coopMatLoad(f, S, b * 256u, 16u, gl_CooperativeMatrixLayoutRowMajor);       // element (r, c) = 1 / l of row r
        [[unroll]] for (uint dd = 0u; dd < ND; dd++) {
            if (dd < nd) {
                ACC c = o[i][dd];
                for (int e = 0; e < c.length(); e++) c[e] *= f[e];
                coopMatStore(c, S, scr, 16u, gl_CooperativeMatrixLayoutRowMajor);    // element (r, d) at r * 16 + d
                subgroupMemoryBarrierShared();
                subgroupBarrier();
                for (uint el = lane; el < 256u; el += nl) {
                    uint r = b * 16u + (el >> 4), pr = pos0 + rb + r / G;
                    if (r < PB * G && r / G < nrow && row_split(pr, ctx, W, NS, CHK))
                        Pt.v[((z * R + rb + r / G) * nq + h0 + r % G) * (hd + 2u) + 2u + dd * 16u + (el & 15u)] =
                            S[scr + el];
                    else if (r < PB * G && r / G < nrow && row_whole_here(pr, ctx, W, NS, CHK, z))
                        O.v[((rb + r / G) * nq + h0 + r % G) * hd + dd * 16u + (el & 15u)] = S[scr + el];
                }
                subgroupMemoryBarrierShared();
                subgroupBarrier();
            }
        }
    }
}
