#version 460
// lmv: dense matrix-vector product of one activation row, y = W x (+ bias) (+ y), for the device layers
// (coli/vulkan/layers.py; docs/vulkan.md "Device layers"). Compiled once per GGUF type (-DFMT_<NAME>).
//   a0 W: address of weight row 0 (row o at a0 + o * ROW_BYTES(I)); a1 x f32 [I] (16-byte aligned);
//   a2 y f32 [O]; a3 bias f32 [O]
//   u0 O, u1 I (any width: x_unit.glsl), u2 flags: bit 0 accumulate (y[o] += r, else y[o] = r), bit 1 add bias,
//   bit 2 write sigmoid(r) (after the bias; not with bit 0: Qwen2-MoE's shared-expert gate)
//   groups: (ceil(O / ROWS), R, 1); y[o] = (W[o, :] . x) (+ bias[o]) (+ old y[o]); R > 1: R activation rows, x f32
//   [R, I] and y f32 [R, O] (workgroup y = row r: x and y moved on by r rows; the tails below need R = 1), each row
//   summed as a one-row dispatch at the same ROWS sums it (ROWS sets the subgroups an output row's units take:
//   the decode router at ROWS 1 and a prompt chunk's at 16 differ in the last bits)
//   a5..a7, u15: the RMSNorm of y [O] by the last workgroup (norm_tail.glsl; a5 0: none)
//   F32 only, u8 1: the router's top-k by the last workgroup (topk.comp's work on the logits y [O], E = O): a4 the
//   route uint [2 k], a6 the correction bias f32 [O] (flags bit 4), a7 a uint counter (0 between dispatches); u9..u14
//   topk.comp's u1..u6 (k, flags without the hash rule, groups, kept groups, group score, scale)
// Work layout (the same in lmoe.comp): a workgroup owns ROWS output rows, in sets of RPC = min(ROWS, RPS)
// rows. A subgroup carries a set at once: its lanes stride over the 32-weight units, each lane reads its x
// unit once and dots it with the decoded unit of every row of the set (no branch a row: every row's loads
// are in flight together; the one set that runs past O decodes its last row again), then subgroupAdd.
// When there are more subgroups than sets, the subgroups of a set split its units (as far as the units
// keep every lane busy) and add their sums through shared memory in subgroup order; with fewer, the sets
// take several passes. The mapping depends on ROWS, the workgroup and subgroup sizes and I only, so a
// row's result is the same in every dispatch. Correct at any subgroup size.
#extension GL_GOOGLE_include_directive : require
#include "layer_common.glsl"
#include "formats.glsl"
#include "x_unit.glsl"

layout(local_size_x_id = 0) in;
layout(constant_id = 1) const uint ROWS = 16;   // output rows a workgroup owns
layout(constant_id = 2) const uint MODE = 0;    // unused here
#define RPS 4u       // output rows a subgroup carries at most
const uint RPC = ROWS < RPS ? ROWS : RPS;   // rows a subgroup carries (a set)

shared float RED[gl_WorkGroupSize.x * RPS];     // one slot set a subgroup (subgroups of one included)
#include "layer_reduce.glsl"
#include "norm_tail.glsl"
#ifdef FMT_F32
#define TOPK_L F32C
#include "topk_row.glsl"
#endif

void main() {
    uint O = pc.u[0], I = pc.u[1], flags = pc.u[2];
    uint units = x_units(I);
    uint o0 = gl_WorkGroupID.x * ROWS;
    uint oend = min(o0 + ROWS, O);
    uint nsg = gl_NumSubgroups, sg = gl_SubgroupID, lane = gl_SubgroupInvocationID, sgs = gl_SubgroupSize;
    // sets of RPC rows (nset); subgroups a set (spg): as many as the spare subgroups allow and the units keep
    // busy; sets at once (cpass)
    uint nset = (ROWS + RPC - 1u) / RPC;
    uint spare = max(1u, nsg / nset);
    uint spg = clamp(min(spare, (units + sgs - 1u) / sgs), 1u, nsg);
    uint cpass = nsg / spg;
    uint passes = (nset + cpass - 1u) / cpass;    // the same for every subgroup
    uint part = sg % spg, setl = sg / spg;        // subgroups past cpass * spg only join the barriers
    uint64_t rb = uint64_t(x_row_bytes(I));
    uint r = gl_WorkGroupID.y;                     // the activation row
    uint64_t aY = pc.a[2] + 4ul * uint64_t(r) * uint64_t(O);
    uint64_t ax = pc.a[1] + 4ul * uint64_t(r) * uint64_t(I);
    bool xal = (ax & 15ul) == 0ul;                 // row r of a width not a multiple of 4: every unit float by float
    F32x4 X = F32x4(ax);
    for (uint ps = 0u; ps < passes; ps++) {
        uint ob = o0 + (ps * cpass + setl) * RPC;
        uint nrow = (setl < cpass && ob < oend) ? min(RPC, oend - ob) : 0u;   // uniform in the subgroup
        float acc[RPS];
        [[unroll]] for (uint i = 0u; i < RPC; i++) acc[i] = 0.0;
        if (nrow > 0u) {
            // a set past the end of W (the last of the dispatch) decodes its last row again: no branch a row
            uint64_t ra[RPS];
            [[unroll]] for (uint i = 0u; i < RPC; i++) ra[i] = pc.a[0] + uint64_t(min(ob + i, oend - 1u)) * rb;
            for (uint u = part * sgs + lane; u < units; u += spg * sgs) {
                vec4 xv[8];
                if (xal && u * 32u + 32u <= I) { [[unroll]] for (uint q = 0u; q < 8u; q++) xv[q] = X.v[u * 8u + q]; }
                else x_unit_any(pc.a[1], r * I, I, u, xv);     // the last, partial unit
                [[unroll]] for (uint i = 0u; i < RPC; i++) {
                    vec4 w[8];
                    dec_unit(ra[i], u, w);
                    float s = 0.0;
                    [[unroll]] for (uint q = 0u; q < 8u; q++) s += dot(w[q], xv[q]);
                    acc[i] += s;
                }
            }
            [[unroll]] for (uint i = 0u; i < RPC; i++) acc[i] = subgroupAdd(acc[i]);
        }
        if (spg > 1u) {                               // uniform in the workgroup
            if (nrow > 0u && subgroupElect()) {
                [[unroll]] for (uint i = 0u; i < RPC; i++) RED[sg * RPS + i] = acc[i];
            }
            barrier();
            if (part == 0u && nrow > 0u) {
                [[unroll]] for (uint i = 0u; i < RPC; i++) {
                    float t = 0.0;
                    for (uint p = 0u; p < spg; p++) t += RED[(sg + p) * RPS + i];
                    acc[i] = t;
                }
            }
            barrier();
        }
        if (part == 0u && nrow > 0u && subgroupElect()) {
            F32C Y = F32C(aY);
            [[unroll]] for (uint i = 0u; i < RPC; i++) {
                if (i < nrow) {
                    uint o = ob + i;
                    float r = acc[i];
                    if ((flags & 2u) != 0u) r += F32(pc.a[3]).v[o];
                    if ((flags & 4u) != 0u) r = 1.0 / (1.0 + exp(-r));
                    if ((flags & 1u) != 0u) r += Y.v[o];
                    Y.v[o] = r;
                }
            }
        }
    }
    norm_tail(pc.a[2], O);
#ifdef FMT_F32
    if (pc.u[8] != 0u) {    // uniform: the top-k tail (each workgroup counts itself in; the last one ranks)
        memoryBarrierBuffer();
        barrier();
        uint nwg = gl_NumWorkGroups.x * gl_NumWorkGroups.y * gl_NumWorkGroups.z;
        if (gl_LocalInvocationIndex == 0u) NT_LAST_ = atomicAdd(U32C(pc.a[7]).v[0], 1u) + 1u == nwg ? 1u : 0u;
        barrier();
        if (NT_LAST_ != 0u) {   // uniform
            memoryBarrierBuffer();
            topk_row(0u, uint64_t[5](pc.a[2], pc.a[4], pc.a[6], 0ul, 0ul),
                     uint[7](O, pc.u[9], pc.u[10], pc.u[11], pc.u[12], pc.u[13], pc.u[14]));
            if (gl_LocalInvocationIndex == 0u) U32C(pc.a[7]).v[0] = 0u;
        }
    }
#endif
}
