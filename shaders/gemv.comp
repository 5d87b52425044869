#version 460
// Per-row GEMV of the expert op and of the plain matmul (coli/vulkan/device.py), for groups of up to 15
// rows (the host cuts a group into chunks of MAXR rows, all through this one pipeline).
// A workgroup owns ROWS_PER_WG output rows of one group; each subgroup carries RPS output rows at once.
// The group's activation rows are staged in shared memory CH units (of 32 inputs) at a time, so the
// workgroup reads them once for all its output rows; lanes stride over the units of a chunk, decode the
// weight unit once and apply it to every activation row (one accumulator per row), then subgroupAdd.
// A row's result does not depend on how many rows share the dispatch: each row has its own accumulator
// and the same order of sums. Correct at any subgroup size: subgroups loop until the workgroup's rows
// are done, lanes loop over units.
#extension GL_GOOGLE_include_directive : require
#include "common.glsl"
#include "formats.glsl"

layout(local_size_x_id = 0) in;
layout(constant_id = 1) const uint ROWS_PER_WG = 16;   // output rows a workgroup owns
layout(constant_id = 3) const uint CH = 32;            // units of the activation rows staged at a time
#define MAXR 4      // activation rows a GEMV group holds
#define RPS 4       // output rows a subgroup carries at once
#define XST 9u      // vec4 stride of a staged unit (8 + 1 pad: no bank conflicts on 16-byte reads)

shared vec4 XS[MAXR * CH * XST];

void main() {
    uint item = work_index();
    if (item >= pc.nwork) return;   // whole workgroups only
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
    uint nsg = gl_NumSubgroups, lane = gl_SubgroupInvocationID;
    uint oend = min(o0 + ROWS_PER_WG, O);
    uint passes = (ROWS_PER_WG + nsg * RPS - 1u) / (nsg * RPS);   // the same for every subgroup
    uint nthreads = gl_WorkGroupSize.x;
    for (uint ps = 0u; ps < passes; ps++) {
        uint ob = o0 + (ps * nsg + gl_SubgroupID) * RPS;
        float acc[RPS][MAXR], acc2[RPS][MAXR];
        [[unroll]] for (uint i = 0u; i < RPS; i++) [[unroll]] for (uint r = 0u; r < MAXR; r++) { acc[i][r] = 0.0; acc2[i][r] = 0.0; }
        for (uint c0 = 0u; c0 < units; c0 += CH) {
            uint cn = min(CH, units - c0);
            barrier();
            for (uint t = gl_LocalInvocationIndex; t < nr * cn * 8u; t += nthreads) {
                uint r = t / (cn * 8u), rem = t - r * cn * 8u;
                uint src = xrow[0];
                [[unroll]] for (uint q = 1u; q < MAXR; q++) if (r == q) src = xrow[q];
                src += c0 * 8u + rem;
                XS[(r * CH + rem / 8u) * XST + (rem & 7u)] = MODE == 1u ? X4[src] : H4[src];
            }
            barrier();
            for (uint uu = lane; uu < cn; uu += gl_SubgroupSize) {
                uint u = c0 + uu;
                [[unroll]] for (uint i = 0u; i < RPS; i++) {
                    uint o = ob + i;
                    if (o < oend) {
                        vec4 w[8], w2[8];
                        dec_unit(wa + uint64_t(o) * rb, u, w);
                        if (MODE == 1u) dec_unit(wu + uint64_t(o) * rb, u, w2);
                        [[unroll]] for (uint r = 0u; r < MAXR; r++) {
                            if (r < nr) {
                                float s = 0.0, s2 = 0.0;
                                uint xb = (r * CH + uu) * XST;
                                [[unroll]] for (uint k = 0u; k < 8u; k++) {
                                    vec4 xv = XS[xb + k];
                                    s += dot(w[k], xv);
                                    if (MODE == 1u) s2 += dot(w2[k], xv);
                                }
                                acc[i][r] += s;
                                acc2[i][r] += s2;
                            }
                        }
                    }
                }
            }
        }
        [[unroll]] for (uint i = 0u; i < RPS; i++) {
            uint o = ob + i;
            if (o < oend) {
                [[unroll]] for (uint r = 0u; r < MAXR; r++) {
                    if (r < nr) {
                        float t = subgroupAdd(acc[i][r]);
                        if (MODE == 1u) {
                            float t2 = subgroupAdd(acc2[i][r]);
                            if (subgroupElect()) H[(s0 + r) * O + o] = expert_act(g, o, t, t2);
                        } else {
                            if (subgroupElect()) Y[TAB[pc.out_off + s0 + r] * O + o] = t;
                        }
                    }
                }
            }
        }
    }
}
