#version 460
// Tiled GEMM of the expert op and of the plain matmul, for groups of >= 16 rows (COLI_VK_TIER_GEMM_ROWS):
// a workgroup of 128 threads owns a BM=64-output x BN=32-row tile. Per 32-input step, threads 0..63
// decode one weight row's unit each into shared memory (64..127 decode up's rows in mode 1), every
// thread stages 8 inputs of one activation row beside them, then each thread runs a 4x4 block
// (outputs tm + 16 i, rows tn + 8 j) reading 4 inputs at a time as 16-byte loads. Each step sums into a
// fresh partial (blocked summation). Needs no subgroup operations.
#extension GL_GOOGLE_include_directive : require
#include "common.glsl"
#include "formats.glsl"

layout(local_size_x = 128) in;
#define BM 64u
#define BN 32u
#define ST 9u   // vec4 stride of a row in the tiles (8 + 1 pad: 16-byte reads without bank conflicts)

shared vec4 Wg[BM * ST];
shared vec4 Wu[BM * ST];
shared vec4 Xs[BN * ST];

void main() {
    uint item = work_index();
    if (item >= pc.nwork) return;
    uint wb = pc.work_off + item * 4u;
    uint g = TAB[wb], o0 = TAB[wb + 1u], n0 = TAB[wb + 2u];
    uint s0 = grp_begin(g), nr = grp_count(g);
    uint I = pc.I, O = pc.O, units = I / 32u;
    uint64_t rb = uint64_t(ROW_BYTES(I));
    uint t = gl_LocalInvocationID.x;
    uint tm = t & 15u, tn = t >> 4;
    // decoding role: threads 0..63 decode row o0+t of the first matrix, 64..127 of up (mode 1)
    uint dm = t & 63u;
    bool dec_first = t < 64u;
    bool dec_on = (o0 + dm < O) && (dec_first || MODE == 1u);
    uint64_t wrow = grp_addr(g, MODE == 1u ? (dec_first ? 0u : 1u) : 2u) + uint64_t(min(o0 + dm, O - 1u)) * rb;
    // staging role: thread t loads 8 inputs (2 vec4) of tile row t/4
    uint xn = t >> 2, xq = (t & 3u) * 2u;
    bool x_on = n0 + xn < nr;
    uint xbase = 0u;
    if (x_on) xbase = (MODE == 1u ? TAB[pc.row_off + s0 + n0 + xn] : s0 + n0 + xn) * (I / 4u);

    float acc[4][4], acc2[4][4];
    [[unroll]] for (uint i = 0u; i < 4u; i++) [[unroll]] for (uint j = 0u; j < 4u; j++) { acc[i][j] = 0.0; acc2[i][j] = 0.0; }

    for (uint u = 0u; u < units; u++) {
        vec4 w[8];
        if (dec_on) dec_unit(wrow, u, w);
        else { [[unroll]] for (uint k = 0u; k < 8u; k++) w[k] = vec4(0.0); }
        vec4 x0 = vec4(0.0), x1 = vec4(0.0);
        if (x_on) {
            x0 = MODE == 1u ? X4[xbase + u * 8u + xq] : H4[xbase + u * 8u + xq];
            x1 = MODE == 1u ? X4[xbase + u * 8u + xq + 1u] : H4[xbase + u * 8u + xq + 1u];
        }
        barrier();
        if (dec_first) { [[unroll]] for (uint k = 0u; k < 8u; k++) Wg[dm * ST + k] = w[k]; }
        else if (MODE == 1u) { [[unroll]] for (uint k = 0u; k < 8u; k++) Wu[dm * ST + k] = w[k]; }
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
            [[unroll]] for (uint j = 0u; j < 4u; j++) bx[j] = Xs[(tn + 8u * j) * ST + kq];
            [[unroll]] for (uint c = 0u; c < 4u; c++)
                [[unroll]] for (uint i = 0u; i < 4u; i++) [[unroll]] for (uint j = 0u; j < 4u; j++) {
                    p[i][j] = fma(a[i][c], bx[j][c], p[i][j]);
                    if (MODE == 1u) p2[i][j] = fma(a2[i][c], bx[j][c], p2[i][j]);
                }
        }
        [[unroll]] for (uint i = 0u; i < 4u; i++) [[unroll]] for (uint j = 0u; j < 4u; j++) { acc[i][j] += p[i][j]; if (MODE == 1u) acc2[i][j] += p2[i][j]; }
    }
    [[unroll]] for (uint i = 0u; i < 4u; i++) {
        uint o = o0 + tm + 16u * i;
        if (o >= O) continue;
        [[unroll]] for (uint j = 0u; j < 4u; j++) {
            uint n = n0 + tn + 8u * j;
            if (n >= nr) continue;
            if (MODE == 1u) H[(s0 + n) * O + o] = expert_act(g, o, acc[i][j], acc2[i][j]);
            else Y[TAB[pc.out_off + s0 + n] * O + o] = acc[i][j];
        }
    }
}
