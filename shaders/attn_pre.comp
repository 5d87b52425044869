#version 460
// attn_pre: causal attention of R query rows (a prompt chunk at positions pos0 .. pos0 + R - 1) over the cached
// positions (CPU: coli/models/blocks.py attend), flash-attention style: one workgroup per (G q heads of a KV head,
// block of rows), keys in tiles of BK with an online softmax per row:
//   out[r, h] = sum_{j <= pos0 + r} softmax_j(scale * q[r, h] . K[kvh, j]) V[kvh, j],  kvh = h / (nq / nkv)
// a0 q f32 [R, nq, hd], a1 K cache [nkv, ctx, hd], a2 V cache [nkv, ctx, hdv] of the types KT / VT (kv_types.glsl:
// f32, f16 or bf16, converted to f32 as a tile is loaded), a3 params uint [..]
// (pos0 = params[0]), a4 out f32 [R, nq, hdv]
// u0 nq, u1 nkv, u2 hd (<= MAXD), u3 ctx, u4 scale (float bits), u5 R, u6 window W (0: none; else row p sees keys
// p - W + 1 .. p), u7 1: a5 sinks f32 [nq], one logit a head in the softmax's max and denominator only (gpt-oss;
// CPU cpu_kernels/attention.py _row_finish), u8 hdv, V's head width (<= hd; 0: hd; MiMo-V2's value_length). groups: (nq / G, ceil(R / PB), NS), PB = BQ / G (rounded down).
// Specialization constants: 3 BQ, the query rows of a workgroup (8, 16 or 32: each K/V tile read from memory once
// serves them all), 4 MAXD, the largest head dimension (128 or 256; BQ x MAXD floats of shared memory), 5 G, the q
// heads of one KV head a workgroup serves (GQA: a divisor of nq / nkv, at most BQ; 1: one q head): its BQ rows are
// PB positions x G heads (row i: position i / G, head i % G; the last BQ - PB G rows unused), so each K/V tile is
// read once for the group.
// Per tile: the K tile into shared memory, one invocation a (row, key) score (a whole dot product, in dimension
// order; BQ / 8 of them each), each row's running max m, sum l and rescale exp(m_old - m_new) by one invocation, the
// V tile into the same shared memory, then each invocation adds weight x V for its row and dimensions in key order.
// Tiles start at key 0 for every row, so a row's result does not depend on the chunk it came in (nor on BQ or G;
// with a window the block starts at the tile of its first row's first key: the tiles before it are masked for every
// row of the block and would change nothing). A fixed workgroup of 128.
// Keys split over workgroups (attn_split.glsl; groups (nq / G, ceil(R / PB), NS)): u9 NS, u10 CHK, a6 the parts;
// u11 = 1: the join pass instead, groups (R, 1, 1): each split row's parts combined in z order,
//   M = max_z m_z, out = sum_z exp(m_z - M) o_z / sum_z exp(m_z - M) l_z (the sink as below, in M's frame).
#extension GL_GOOGLE_include_directive : require
#include "layer_common.glsl"
#include "kv_types.glsl"
#include "attn_split.glsl"

layout(local_size_x = 128) in;
layout(constant_id = 2) const uint MODE = 0;    // unused
layout(constant_id = 3) const uint BQ = 8u;
layout(constant_id = 4) const uint MAXD = 256u;
layout(constant_id = 5) const uint G = 1u;
#define BK 16u
const uint TPR = 128u / BQ;                    // invocations a row in the V pass
const uint MAXC = MAXD / TPR;                  // dimensions an invocation carries
const uint PB = BQ / G;                        // positions of a block
shared float QS[BQ * MAXD];
shared float KV[BK * (MAXD + 1u)];    // a tile of K, then of V; rows padded by one (no bank conflicts)
shared float P[BQ * BK];
shared float M[BQ], L[BQ], A[BQ];

// the sink in the softmax's denominator l (max mo): l c + 1 in the frame of the sink when it is above the max
float with_sink(float l, float mo, uint h) {
    float sk = F32(pc.a[5]).v[h];
    if (sk > mo) {
        float c = exp(mo - sk);
        return (l * c + 1.0) / c;
    }
    return l + exp(sk - mo);
}

// the join pass: row gl_WorkGroupID.x's parts, when its keys span more than one part
void join(uint nq, uint hdv, uint ctx, uint R) {
    uint r = gl_WorkGroupID.x, NS = pc.u[9], CHK = pc.u[10], W = pc.u[6];
    uint p = U32(pc.a[3]).v[0] + r;
    if (!row_split(p, ctx, W, NS, CHK)) return;
    F32 P = F32(pc.a[6]);
    F32 O = F32(pc.a[4]);
    uint st = hdv + 2u, zs = R * nq * st;
    for (uint i = gl_LocalInvocationIndex; i < nq * hdv; i += 128u) {
        uint h = i / hdv, d = i - h * hdv, b = (r * nq + h) * st;
        float M = -1.0 / 0.0;
        for (uint z = 0u; z < NS; z++) M = max(M, P.v[z * zs + b]);
        float l = 0.0, o = 0.0;
        for (uint z = 0u; z < NS; z++) {
            float e = exp(P.v[z * zs + b] - M);   // a part without the row's keys: m = -inf, l = o = 0
            l += e * P.v[z * zs + b + 1u];
            o += e * P.v[z * zs + b + 2u + d];
        }
        if (pc.u[7] != 0u) l = with_sink(l, M, h);
        O.v[(r * nq + h) * hdv + d] = o / l;
    }
}

void main() {
    uint nq = pc.u[0], nkv = pc.u[1], hd = pc.u[2], ctx = pc.u[3], R = pc.u[5];
    uint hdv = pc.u[8] == 0u ? hd : pc.u[8];
    if (pc.u[11] != 0u) {
        join(nq, hdv, ctx, R);
        return;
    }
    uint NS = pc.u[9], CHK = pc.u[10], z = gl_WorkGroupID.z;
    float scale = pcf(4u);
    uint h0 = gl_WorkGroupID.x * G, rb = gl_WorkGroupID.y * PB, t = gl_LocalInvocationIndex;   // row i: head h0 + i % G
    uint kvh = h0 / (nq / nkv);
    uint pos0 = U32(pc.a[3]).v[0];
    uint nrow = min(PB, R - rb);                  // positions; row i is on when i / G < nrow (and i < PB G)
    uint n = min(pos0 + rb + nrow, ctx);          // keys the block's last row sees
    uint W = pc.u[6];
    uint jlo = (W > 0u && pos0 + rb + 1u > W) ? pos0 + rb + 1u - W : 0u;   // the block's first row's first key
    F32 Q = F32(pc.a[0]);
    uint st = hd + 1u;
    for (uint i = t; i < BQ * hd; i += 128u) {
        uint r = i / hd, d = i - r * hd;
        QS[r * MAXD + d] = r < PB * G && r / G < nrow ? Q.v[((rb + r / G) * nq + h0 + r % G) * hd + d] : 0.0;
    }
    if (t < BQ) { M[t] = -1.0 / 0.0; L[t] = 0.0; }
    uint vr = t / TPR, vc = t % TPR;              // V pass: row vr, dimensions vc + TPR * c
    float acc[MAXC];
    [[unroll]] for (uint c = 0u; c < MAXC; c++) acc[c] = 0.0;
    uint kvb = kvh * ctx;
    for (uint pi = 0u; ; pi++) {   // this workgroup's parts of the keys (one part 0 .. n - 1 without a split)
    uvec2 pk = part_keys(pi, z, n, NS, CHK);
    if (pk.x >= pk.y) break;
    for (uint j0 = max(pk.x, (jlo / BK) * BK); j0 < pk.y; j0 += BK) {
        uint nk = min(BK, pk.y - j0);
        barrier();
        for (uint i = t; i < nk * hd; i += 128u) {
            uint j = i / hd, d = i - j * hd;
            KV[j * st + d] = kv_load(pc.a[1], (kvb + j0 + j) * hd + d, KT);
        }
        barrier();
        [[unroll]] for (uint q = 0u; q < BQ / 8u; q++) {   // scores: invocation t -> rows t / BK + 8 q, key t % BK
            uint r = t / BK + 8u * q, j = t % BK, pr = pos0 + rb + r / G;   // pr: the row's position
            float s = -1.0 / 0.0;
            if (j < nk && r < PB * G && r / G < nrow && j0 + j <= pr && (W == 0u || j0 + j + W > pr)) {
                float a = 0.0;
                for (uint d = 0u; d < hd; d++) a += QS[r * MAXD + d] * KV[j * st + d];
                s = scale * a;
            }
            P[r * BK + j] = s;
        }
        barrier();
        if (t < BQ) {   // the row's online softmax
            float mt = -1.0 / 0.0;
            for (uint j = 0u; j < BK; j++) mt = max(mt, P[t * BK + j]);
            float mo = M[t], mn = max(mo, mt);
            float al = mn == -1.0 / 0.0 ? 1.0 : exp(mo - mn);
            float s = 0.0;
            for (uint j = 0u; j < BK; j++) {
                float e = mn == -1.0 / 0.0 ? 0.0 : exp(P[t * BK + j] - mn);
                P[t * BK + j] = e;
                s += e;
            }
            L[t] = L[t] * al + s;
            M[t] = mn;
            A[t] = al;
        }
        for (uint i = t; i < nk * hdv; i += 128u) {   // the V tile over the K tile (the scores are all made)
            uint j = i / hdv, d = i - j * hdv;
            KV[j * st + d] = kv_load(pc.a[2], (kvb + j0 + j) * hdv + d, VT);
        }
        barrier();
        float al = A[vr];
        [[unroll]] for (uint c = 0u; c < MAXC; c++) {
            uint d = vc + TPR * c;
            if (d < hdv) {
                float a = acc[c] * al;
                for (uint j = 0u; j < nk; j++) a += P[vr * BK + j] * KV[j * st + d];
                acc[c] = a;
            }
        }
    }
    }
    barrier();   // M, L: a split workgroup with no keys in its parts ran no tile (no barrier) since t < BQ set them
    uint h = h0 + vr % G, pr = pos0 + rb + vr / G;
    if (vr < PB * G && vr / G < nrow && row_split(pr, ctx, W, NS, CHK)) {   // this workgroup's part of the row
        F32 Pt = F32(pc.a[6]);
        uint b = ((z * R + rb + vr / G) * nq + h) * (hdv + 2u);
        if (vc == 0u) {
            Pt.v[b] = M[vr];
            Pt.v[b + 1u] = L[vr];
        }
        [[unroll]] for (uint c = 0u; c < MAXC; c++) {
            uint d = vc + TPR * c;
            if (d < hdv) Pt.v[b + 2u + d] = acc[c];
        }
    } else if (vr < PB * G && vr / G < nrow && row_whole_here(pr, ctx, W, NS, CHK, z)) {
        F32 O = F32(pc.a[4]);
        float l = L[vr];
        if (pc.u[7] != 0u) l = with_sink(l, M[vr], h);   // the sink: out = acc c / (l c + 1) above the max
        [[unroll]] for (uint c = 0u; c < MAXC; c++) {
            uint d = vc + TPR * c;
            if (d < hdv) O.v[((rb + vr / G) * nq + h) * hdv + d] = acc[c] / l;
        }
    }
}
