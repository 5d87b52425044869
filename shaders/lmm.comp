#version 460
// lmm: tiled matrix product of R activation rows for the device layers' prompt chunks (coli/vulkan/layers.py;
// docs/vulkan.md "Device layers"). Compiled once per GGUF type (-DFMT_<NAME>); MODE (specialization constant 2):
// MODE 0, dense: y[r, o] = W[o, :] . x[r, :] (+ bias[o]) (sigmoid) (+ y[r, o]).
//   a0 W (row o at a0 + o * ROW_BYTES(I)), a1 x f32 [R, I], a2 y f32 [R, ldy], a3 bias f32 [O]
//   u0 O, u1 I (any width: x_unit.glsl), u2 flags (bit 0 accumulate, bit 1 bias, bit 2 sigmoid after the bias), u3 R, u4 ldy (0: O)
//   groups (ceil(O / BM), ceil(R / BN), 1)
// MODE 1, the routed experts' gate and up with SwiGLU, rows grouped by expert (moe_sort.comp):
//   h[p, o] = silu(Wg[e][o, :] . x[p / k, :]) * (Wu[e][o, :] . x[p / k, :]) for each pair p = row * k + rank
//   routed to expert e
//   a0 expert table uint64 [E][3] (gate, up, down row-0 addresses), a1 x f32 [R, I], a2 h f32 [R * k, O],
//   a3 route uint [R][2k] (ids, then weights' float bits), a4 pairs uint [R * k] (grouped by expert),
//   a5 offsets uint [E + 1] (expert e's pairs are pairs[off[e] .. off[e + 1]])
//   u0 O (F), u1 I (D), u3 R, u5 k; groups (ceil(O / BM), ceil(R / BN), E): tiles past an expert's pairs return.
//   u6 = 1: one expert (E = 1) and every row its pair p = row (the shared expert; k = 1; a4 and a5 unread but
//   valid addresses: a compiler may load before it branches); u7 the activation (0 SiLU, 1 the tanh GELU, 2
//   gpt-oss's: act.glsl), u9 its clamp (float bits, 0 none); u8 bit 0: the expert's gate and up biases a6 / a7
//   f32 [E, O] added before the activation
// MODE 2, the experts' down, each pair's output scaled by its route weight: yk[p, o] = w_p (Wd[e][o, :] . h[p, :])
//   a0 table, a1 h f32 [R * k, I], a2 yk f32 [R * k, O], a3 route, a4 pairs, a5 offsets; u0 O (D), u1 I (F), u3 R,
//   u5 k; groups as mode 1; u8 bit 0: the expert's down bias a6 f32 [E, O] added before the weight.
// A workgroup of 4 BN invocations owns a BM = 64-output x BN-row tile (BN 32 or 64, specialization constant 3). Per 32-input unit, invocations 0..63
// decode one weight row's unit each into shared memory (64..127 decode up's rows in mode 1), every invocation
// stages 8 inputs of one activation row, then each runs a 4 x 4 block (outputs tm + 16 i, rows tn + BN/4 j). Each
// unit's products sum into a fresh partial added to the total (blocked summation), so an output's value depends
// only on its row and weights, not on the other rows of the chunk. No subgroup operations.
#extension GL_GOOGLE_include_directive : require
#include "layer_common.glsl"
#include "formats.glsl"
#include "act.glsl"
#include "x_unit.glsl"

layout(local_size_x_id = 0) in;             // 4 BN
layout(constant_id = 2) const uint MODE = 0;
layout(constant_id = 3) const uint BN = 32u;   // rows of a tile: 32 or 64
#define BM 64u
#define ST 9u   // vec4 stride of a row in the tiles (8 + 1 pad)

shared vec4 Wg[BM * ST];
shared vec4 Wu[BM * ST];
shared vec4 Xs[BN * ST];

void main() {
    uint O = pc.u[0], I = pc.u[1], flags = pc.u[2], R = pc.u[3], k = pc.u[5];
    uint units = x_units(I);
    uint64_t rb = uint64_t(x_row_bytes(I));
    uint o0 = gl_WorkGroupID.x * BM, n0 = gl_WorkGroupID.y * BN;
    uint t = gl_LocalInvocationID.x;
    uint beg = 0u, cnt = R;
    uint64_t wbase = pc.a[0], wbase2 = 0ul;
    U32 PAIRS = U32(pc.a[4]);
    bool ident = pc.u[6] == 1u;
    if (MODE != 0u) {
        uint e = gl_WorkGroupID.z;
        if (!ident) {
            U32 OFF = U32(pc.a[5]);
            beg = OFF.v[e];
            cnt = OFF.v[e + 1u] - beg;
        }
        if (n0 >= cnt) return;                    // uniform in the workgroup
        U64 TAB = U64(pc.a[0]);
        wbase = TAB.v[e * 3u + (MODE == 1u ? 0u : 2u)];
        wbase2 = TAB.v[e * 3u + 1u];
    } else if (n0 >= R) {
        return;
    }
    uint tm = t & 15u, tn = t >> 4;
    uint dm = t & 63u;
    bool dec_first = t < 64u;
    bool dec_on = (o0 + dm < O) && (dec_first || (MODE == 1u && t < 128u));
    uint64_t wrow = (dec_first ? wbase : wbase2) + uint64_t(min(o0 + dm, O - 1u)) * rb;
    // staging: invocation t loads 8 inputs (2 vec4) of tile row t / 4
    uint xn = t >> 2, xq = (t & 3u) * 2u;
    bool x_on = n0 + xn < cnt;
    uint xbase = 0u;
    if (x_on) {
        uint xr = MODE == 0u || ident ? n0 + xn : PAIRS.v[beg + n0 + xn];
        if (MODE == 1u) xr /= k;
        xbase = xr * I;     // floats
    }
    bool xany = (I & 31u) != 0u;    // a row of any width: one float at a time (uniform)
    F32x4 X = F32x4(pc.a[1]);

    float acc[4][4], acc2[4][4];
    [[unroll]] for (uint i = 0u; i < 4u; i++) [[unroll]] for (uint j = 0u; j < 4u; j++) { acc[i][j] = 0.0; acc2[i][j] = 0.0; }

    for (uint u = 0u; u < units; u++) {
        vec4 w[8];
        if (dec_on) dec_unit(wrow, u, w);
        else { [[unroll]] for (uint q = 0u; q < 8u; q++) w[q] = vec4(0.0); }
        vec4 x0 = vec4(0.0), x1 = vec4(0.0);
        if (x_on && !xany) {
            x0 = X.v[xbase / 4u + u * 8u + xq];
            x1 = X.v[xbase / 4u + u * 8u + xq + 1u];
        } else if (x_on) {
            F32 XS = F32(pc.a[1]);
            [[unroll]] for (uint c = 0u; c < 4u; c++) {
                uint i = u * 32u + xq * 4u + c;
                x0[c] = i < I ? XS.v[xbase + i] : 0.0;
                x1[c] = i + 4u < I ? XS.v[xbase + i + 4u] : 0.0;
            }
        }
        barrier();
        if (dec_first) { [[unroll]] for (uint q = 0u; q < 8u; q++) Wg[dm * ST + q] = w[q]; }
        else if (MODE == 1u && t < 128u) { [[unroll]] for (uint q = 0u; q < 8u; q++) Wu[dm * ST + q] = w[q]; }
        Xs[xn * ST + xq] = x0;
        Xs[xn * ST + xq + 1u] = x1;
        barrier();
        float p[4][4], p2[4][4];
        [[unroll]] for (uint i = 0u; i < 4u; i++) [[unroll]] for (uint j = 0u; j < 4u; j++) { p[i][j] = 0.0; p2[i][j] = 0.0; }
        for (uint kq = 0u; kq < 8u; kq++) {
            vec4 a[4], a2[4], bx[4];
            [[unroll]] for (uint i = 0u; i < 4u; i++) {
                a[i] = Wg[(tm + 16u * i) * ST + kq];
                a2[i] = MODE == 1u ? Wu[(tm + 16u * i) * ST + kq] : vec4(0.0);
            }
            [[unroll]] for (uint j = 0u; j < 4u; j++) bx[j] = Xs[(tn + (BN / 4u) * j) * ST + kq];
            [[unroll]] for (uint c = 0u; c < 4u; c++)
                [[unroll]] for (uint i = 0u; i < 4u; i++) [[unroll]] for (uint j = 0u; j < 4u; j++) {
                    p[i][j] = fma(a[i][c], bx[j][c], p[i][j]);
                    if (MODE == 1u) p2[i][j] = fma(a2[i][c], bx[j][c], p2[i][j]);
                }
        }
        [[unroll]] for (uint i = 0u; i < 4u; i++) [[unroll]] for (uint j = 0u; j < 4u; j++) {
            acc[i][j] += p[i][j];
            if (MODE == 1u) acc2[i][j] += p2[i][j];
        }
    }
    F32 Y = F32(pc.a[2]);
    U32 ROUTE = U32(pc.a[3]);
    uint ldy = MODE == 0u ? (pc.u[4] == 0u ? O : pc.u[4]) : O;
    [[unroll]] for (uint j = 0u; j < 4u; j++) {
        uint n = n0 + tn + (BN / 4u) * j;
        if (n >= cnt) continue;
        uint orow = n;
        float rw = 1.0;
        if (MODE != 0u) {
            orow = ident ? n : PAIRS.v[beg + n];
            if (MODE == 2u) rw = uintBitsToFloat(ROUTE.v[(orow / k) * 2u * k + k + orow % k]);
        }
        [[unroll]] for (uint i = 0u; i < 4u; i++) {
            uint o = o0 + tm + 16u * i;
            if (o >= O) continue;
            float r = acc[i][j];
            uint yi = orow * ldy + o;
            if (MODE == 0u) {
                if ((flags & 2u) != 0u) r += F32(pc.a[3]).v[o];
                if ((flags & 4u) != 0u) r = 1.0 / (1.0 + exp(-r));
                if ((flags & 1u) != 0u) r += Y.v[yi];
            } else if (MODE == 1u) {
                float uu = acc2[i][j];
                if ((pc.u[8] & 1u) != 0u) {
                    r += F32(pc.a[6]).v[gl_WorkGroupID.z * O + o];
                    uu += F32(pc.a[7]).v[gl_WorkGroupID.z * O + o];
                }
                r = glu(r, uu, pc.u[7], pcf(9u));
            } else {
                if ((pc.u[8] & 1u) != 0u) r += F32(pc.a[6]).v[gl_WorkGroupID.z * O + o];
                r = rw * r;
            }
            Y.v[yi] = r;
        }
    }
}
