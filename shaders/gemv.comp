#version 460
// Per-row GEMV of the expert op and of the plain matmul (coli/vulkan/device.py): a subgroup owns one
// output row at a time, its lanes stride over the row's 32-element units and keep one accumulator per
// activation row (up to MAXR rows share each decoded weight; the host cuts a
// group of up to 15 rows into chunks of MAXR, all through this one pipeline), then subgroupAdd. A row's result does not
// depend on how many rows share the dispatch: each row has its own accumulator and the same order.
// Correct at any subgroup size (loops over gl_NumSubgroups / gl_SubgroupSize).
#extension GL_GOOGLE_include_directive : require
#include "common.glsl"
#include "formats.glsl"

layout(local_size_x_id = 0) in;
layout(constant_id = 1) const uint ROWS_PER_WG = 4;   // output rows a workgroup owns
#define MAXR 4      // rows a GEMV group holds; the host splits larger groups into chunks of MAXR

void main() {
    uint item = work_index();
    if (item >= pc.nwork) return;
    uint wb = pc.work_off + item * 4u;
    uint g = TAB[wb], o0 = TAB[wb + 1u];
    uint s0 = grp_begin(g), nr = grp_count(g);
    uint I = pc.I, O = pc.O, units = I / 32u;
    uint64_t rb = uint64_t(ROW_BYTES(I));
    uint64_t wa = grp_addr(g, MODE == 1u ? 0u : 2u);
    uint64_t wu = grp_addr(g, 1u);
    uint xrow[MAXR];
    [[unroll]] for (uint r = 0u; r < MAXR; r++)
        xrow[r] = r < nr ? (MODE == 1u ? TAB[pc.row_off + s0 + r] : s0 + r) * (I / 4u) : 0u;
    uint oend = min(o0 + ROWS_PER_WG, O);
    for (uint o = o0 + gl_SubgroupID; o < oend; o += gl_NumSubgroups) {
        float acc[MAXR], acc2[MAXR];
        [[unroll]] for (uint r = 0u; r < MAXR; r++) { acc[r] = 0.0; acc2[r] = 0.0; }
        for (uint u = gl_SubgroupInvocationID; u < units; u += gl_SubgroupSize) {
            vec4 w[8], w2[8];
            dec_unit(wa + uint64_t(o) * rb, u, w);
            if (MODE == 1u) dec_unit(wu + uint64_t(o) * rb, u, w2);
            [[unroll]] for (uint r = 0u; r < MAXR; r++) {
                if (r < nr) {
                    float s = 0.0, s2 = 0.0;
                    uint xb = xrow[r] + u * 8u;
                    [[unroll]] for (uint k = 0u; k < 8u; k++) {
                        vec4 xv = MODE == 1u ? X4[xb + k] : H4[xb + k];
                        s += dot(w[k], xv);
                        if (MODE == 1u) s2 += dot(w2[k], xv);
                    }
                    acc[r] += s;
                    acc2[r] += s2;
                }
            }
        }
        [[unroll]] for (uint r = 0u; r < MAXR; r++) {
            if (r < nr) {
                float t = subgroupAdd(acc[r]);
                if (MODE == 1u) {
                    float t2 = subgroupAdd(acc2[r]);
                    if (subgroupElect()) H[(s0 + r) * O + o] = swiglu(t, t2);
                } else {
                    if (subgroupElect()) Y[TAB[pc.out_off + s0 + r] * O + o] = t;
                }
            }
        }
    }
}
