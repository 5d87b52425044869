#version 460
// Tiled GEMM of the expert op and of the plain matmul, for groups of >= 16 rows (COLI_VK_TIER_GEMM_ROWS):
// a workgroup of 128 threads owns a BM=64-output x BN=32-row tile; per 32-input step, threads decode one
// weight row's unit each into shared memory (gate and up both in mode 1), all threads stage the
// activation rows beside them, then each thread runs a 4x4 block (4 consecutive outputs x 4 consecutive rows). Each step sums into a fresh partial
// (blocked summation). Needs no subgroup operations.
#extension GL_GOOGLE_include_directive : require
#include "common.glsl"
#include "formats.glsl"

layout(local_size_x = 128) in;
#define BM 64u
#define BN 32u

// k-major tiles as vec4, so a thread reads its 4 outputs (or 4 rows) of a k in one 16-byte load
shared vec4 Wg[32][BM / 4u];
shared vec4 Wu[32][BM / 4u];
shared vec4 Xs[32][BN / 4u];

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
        uint dq = dm >> 2, dc = dm & 3u, xnq = xn >> 2, xnc = xn & 3u;
        if (dec_first) { [[unroll]] for (uint k = 0u; k < 8u; k++) [[unroll]] for (uint c = 0u; c < 4u; c++) Wg[4u * k + c][dq][dc] = w[k][c]; }
        else if (MODE == 1u) { [[unroll]] for (uint k = 0u; k < 8u; k++) [[unroll]] for (uint c = 0u; c < 4u; c++) Wu[4u * k + c][dq][dc] = w[k][c]; }
        [[unroll]] for (uint c = 0u; c < 4u; c++) { Xs[4u * xq + c][xnq][xnc] = x0[c]; Xs[4u * xq + 4u + c][xnq][xnc] = x1[c]; }
        barrier();
        float p[4][4], p2[4][4];
        [[unroll]] for (uint i = 0u; i < 4u; i++) [[unroll]] for (uint j = 0u; j < 4u; j++) { p[i][j] = 0.0; p2[i][j] = 0.0; }
        for (uint k = 0u; k < 32u; k++) {
            vec4 a = Wg[k][tm], a2 = vec4(0.0), bx = Xs[k][tn];
            if (MODE == 1u) a2 = Wu[k][tm];
            [[unroll]] for (uint i = 0u; i < 4u; i++) [[unroll]] for (uint j = 0u; j < 4u; j++) {
                p[i][j] = fma(a[i], bx[j], p[i][j]);
                if (MODE == 1u) p2[i][j] = fma(a2[i], bx[j], p2[i][j]);
            }
        }
        [[unroll]] for (uint i = 0u; i < 4u; i++) [[unroll]] for (uint j = 0u; j < 4u; j++) { acc[i][j] += p[i][j]; if (MODE == 1u) acc2[i][j] += p2[i][j]; }
    }
    [[unroll]] for (uint i = 0u; i < 4u; i++) {
        uint o = o0 + 4u * tm + i;
        if (o >= O) continue;
        [[unroll]] for (uint j = 0u; j < 4u; j++) {
            uint n = n0 + 4u * tn + j;
            if (n >= nr) continue;
            if (MODE == 1u) H[(s0 + n) * O + o] = swiglu(acc[i][j], acc2[i][j]);
            else Y[TAB[pc.out_off + s0 + n] * O + o] = acc[i][j];
        }
    }
}
