#version 460
// lmv: dense matrix-vector product of one activation row, y = W x (+ bias) (+ y), for the device layers
// (coli/vulkan/layers.py; docs/vulkan.md "Device layers"). Compiled once per GGUF type (-DFMT_<NAME>).
//   a0 W: address of weight row 0 (row o at a0 + o * ROW_BYTES(I)); a1 x f32 [I] (16-byte aligned);
//   a2 y f32 [O]; a3 bias f32 [O]
//   u0 O, u1 I (a multiple of 32), u2 flags: bit 0 accumulate (y[o] += r, else y[o] = r), bit 1 add bias
//   groups: (ceil(O / ROWS), 1, 1)
// A workgroup owns ROWS output rows. A subgroup carries up to RPS rows at once (the weight unit of each is
// decoded and dotted with the same x unit, read once); lanes stride over the 32-weight units of the rows,
// then subgroupAdd. When the workgroup has more subgroups than row sets (ROWS < subgroups * RPS), the
// subgroups of a row set split its units between them and add their sums through shared memory, in
// subgroup order, so every lane of the workgroup works. Correct at any subgroup size.
#extension GL_GOOGLE_include_directive : require
#include "layer_common.glsl"
#include "formats.glsl"

layout(local_size_x_id = 0) in;
layout(constant_id = 1) const uint ROWS = 16;   // output rows a workgroup owns
layout(constant_id = 2) const uint MODE = 0;    // unused here
#define RPS 4u       // output rows a subgroup carries at once
#define MAXSG 64u    // subgroups a workgroup can have (256 lanes of subgroups of 4)

shared float RED[MAXSG * RPS];

void main() {
    uint O = pc.u[0], I = pc.u[1], flags = pc.u[2];
    uint units = I / 32u;
    uint64_t rb = uint64_t(ROW_BYTES(I));
    uint64_t wa = pc.a[0];
    F32x4 X = F32x4(pc.a[1]);
    F32 Y = F32(pc.a[2]);
    uint o0 = gl_WorkGroupID.x * ROWS;
    uint oend = min(o0 + ROWS, O);
    uint nsg = gl_NumSubgroups, sg = gl_SubgroupID, lane = gl_SubgroupInvocationID, sgs = gl_SubgroupSize;
    // rows a subgroup carries at once (rpe), row sets of the workgroup (nset), subgroups a set (spg)
    uint rpe = clamp((ROWS + nsg - 1u) / nsg, 1u, RPS);
    uint nset = (ROWS + rpe - 1u) / rpe;
    uint spg = max(1u, nsg / nset);
    uint cpass = nsg / spg;                       // row sets worked on at once
    uint passes = (nset + cpass - 1u) / cpass;    // the same for every subgroup
    uint part = sg % spg, setl = sg / spg;        // subgroups past cpass * spg only join the barriers
    for (uint ps = 0u; ps < passes; ps++) {
        uint ob = o0 + (ps * cpass + setl) * rpe;
        uint nrow = (setl < cpass && ob < oend) ? min(rpe, oend - ob) : 0u;   // uniform in the subgroup
        float acc[RPS];
        [[unroll]] for (uint i = 0u; i < RPS; i++) acc[i] = 0.0;
        if (nrow > 0u) {
            for (uint u = part * sgs + lane; u < units; u += spg * sgs) {
                vec4 xv[8];
                [[unroll]] for (uint k = 0u; k < 8u; k++) xv[k] = X.v[u * 8u + k];
                [[unroll]] for (uint i = 0u; i < RPS; i++) {
                    if (i < nrow) {
                        vec4 w[8];
                        dec_unit(wa + uint64_t(ob + i) * rb, u, w);
                        float s = 0.0;
                        [[unroll]] for (uint k = 0u; k < 8u; k++) s += dot(w[k], xv[k]);
                        acc[i] += s;
                    }
                }
            }
            [[unroll]] for (uint i = 0u; i < RPS; i++) if (i < nrow) acc[i] = subgroupAdd(acc[i]);
        }
        if (spg > 1u) {                               // uniform in the workgroup (then passes == 1)
            if (nrow > 0u && subgroupElect()) {
                [[unroll]] for (uint i = 0u; i < RPS; i++) RED[sg * RPS + i] = acc[i];
            }
            barrier();
            if (part == 0u && nrow > 0u) {
                [[unroll]] for (uint i = 0u; i < RPS; i++) {
                    float t = 0.0;
                    for (uint p = 0u; p < spg; p++) t += RED[(sg + p) * RPS + i];
                    acc[i] = t;
                }
            }
        }
        if (part == 0u && nrow > 0u && subgroupElect()) {
            [[unroll]] for (uint i = 0u; i < RPS; i++) {
                if (i < nrow) {
                    uint o = ob + i;
                    float r = acc[i];
                    if ((flags & 2u) != 0u) r += F32(pc.a[3]).v[o];
                    if ((flags & 1u) != 0u) r += Y.v[o];
                    Y.v[o] = r;
                }
            }
        }
    }
}
