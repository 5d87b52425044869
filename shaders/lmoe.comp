#version 460
// lmoe: the routed experts of one activation row, for the device layers (coli/vulkan/layers.py; docs/vulkan.md
// "Device layers"). Compiled once per GGUF type (-DFMT_<NAME>); MODE (specialization constant 2) picks the pass.
//   a0 expert table: uint64 [E][3], the (gate, up, down) row-0 addresses of each expert of the layer
//   a1 route: uint [2k], expert ids [k], then their weights as float bits [k] (rank order, j = 0 first)
// MODE 1, gate/up and SwiGLU: a2 x f32 [D], a3 h f32 [k, F]; u0 F, u1 D, u2 k; groups (ceil(F / ROWS), k, 1).
//   h[j, o] = silu(g) * u, g = Wg[id_j][o, :] . x, u = Wu[id_j][o, :] . x, silu(g) = g / (1 + exp(-g)).
// MODE 0, down and the weighted combine into the residual: a2 h f32 [k, F], a3 y f32 [D]; u0 D, u1 F, u2 k;
//   groups (ceil(D / ROWS), 1, 1). y[o] += sum_j w_j (Wd[id_j][o, :] . h[j, :]), the sum made in a float
//   (each lane keeps sum_j w_j * its part of the dot products, then one subgroupAdd), added to y[o] once.
// Inputs (x, h) must be 16-byte aligned. Work layout as lmv.comp: a workgroup owns ROWS output rows, a
// subgroup carries up to RPS rows at once and its lanes stride over 32-weight units (mode 0: over the k * F/32
// units of all the row's experts, so small F still fills the subgroup); with fewer row sets than subgroups
// the subgroups of a set split the units and add their sums through shared memory. Any subgroup size.
#extension GL_GOOGLE_include_directive : require
#include "layer_common.glsl"
#include "formats.glsl"

layout(local_size_x_id = 0) in;
layout(constant_id = 1) const uint ROWS = 16;   // output rows a workgroup owns
layout(constant_id = 2) const uint MODE = 1;    // 1: gate/up + SwiGLU; 0: down + combine
#define RPS 4u       // output rows a subgroup carries at once
#define MAXSG 64u    // subgroups a workgroup can have (256 lanes of subgroups of 4)
#define MAXK 64u     // experts a row (mode 0)

shared float RED[MAXSG * RPS * 2u];
shared uint64_t EA[MAXK];   // mode 0: down row-0 address of rank j
shared float EW[MAXK];      // mode 0: weight of rank j

void main() {
    uint O = pc.u[0], I = pc.u[1], k = pc.u[2];
    uint units = I / 32u;
    uint64_t rb = uint64_t(ROW_BYTES(I));
    U64 TABLE = U64(pc.a[0]);
    U32 ROUTE = U32(pc.a[1]);
    F32x4 X = F32x4(pc.a[2]);    // mode 1: x [D]; mode 0: h [k, F]
    F32 Y = F32(pc.a[3]);        // mode 1: h [k, F]; mode 0: y [D]
    uint64_t wg = 0ul, wu = 0ul;
    uint j1 = gl_WorkGroupID.y;
    if (MODE == 1u) {
        uint e = ROUTE.v[j1];
        wg = TABLE.v[e * 3u];
        wu = TABLE.v[e * 3u + 1u];
    } else {
        for (uint t = gl_LocalInvocationIndex; t < k; t += gl_WorkGroupSize.x) {
            EA[t] = TABLE.v[ROUTE.v[t] * 3u + 2u];
            EW[t] = uintBitsToFloat(ROUTE.v[k + t]);
        }
        barrier();
    }
    uint o0 = gl_WorkGroupID.x * ROWS;
    uint oend = min(o0 + ROWS, O);
    uint nsg = gl_NumSubgroups, sg = gl_SubgroupID, lane = gl_SubgroupInvocationID, sgs = gl_SubgroupSize;
    uint rpe = clamp((ROWS + nsg - 1u) / nsg, 1u, RPS);
    uint nset = (ROWS + rpe - 1u) / rpe;
    uint spg = max(1u, nsg / nset);
    uint cpass = nsg / spg;
    uint passes = (nset + cpass - 1u) / cpass;
    uint part = sg % spg, setl = sg / spg;
    uint total = MODE == 1u ? units : k * units;   // units a row's lanes stride over
    uint step = spg * sgs;
    for (uint ps = 0u; ps < passes; ps++) {
        uint ob = o0 + (ps * cpass + setl) * rpe;
        uint nrow = (setl < cpass && ob < oend) ? min(rpe, oend - ob) : 0u;   // uniform in the subgroup
        float acc[RPS], acc2[RPS];
        [[unroll]] for (uint i = 0u; i < RPS; i++) { acc[i] = 0.0; acc2[i] = 0.0; }
        if (nrow > 0u) {
            uint t = part * sgs + lane;
            uint j = 0u, u = t;                 // mode 0: unit t is unit u of rank j
            if (MODE == 0u) { j = t / units; u = t - j * units; }
            for (; t < total; t += step) {
                vec4 xv[8];                     // x unit u (mode 1) or h[j] unit u = flat unit t (mode 0)
                [[unroll]] for (uint q = 0u; q < 8u; q++) xv[q] = X.v[t * 8u + q];
                if (MODE == 1u) {
                    [[unroll]] for (uint i = 0u; i < RPS; i++) {
                        if (i < nrow) {
                            vec4 w[8], w2[8];
                            uint64_t ro = uint64_t(ob + i) * rb;
                            dec_unit(wg + ro, u, w);
                            dec_unit(wu + ro, u, w2);
                            float s = 0.0, s2 = 0.0;
                            [[unroll]] for (uint q = 0u; q < 8u; q++) {
                                s += dot(w[q], xv[q]);
                                s2 += dot(w2[q], xv[q]);
                            }
                            acc[i] += s;
                            acc2[i] += s2;
                        }
                    }
                    u += step;
                } else {
                    uint64_t ea = EA[j];
                    float ew = EW[j];
                    [[unroll]] for (uint i = 0u; i < RPS; i++) {
                        if (i < nrow) {
                            vec4 w[8];
                            dec_unit(ea + uint64_t(ob + i) * rb, u, w);
                            float s = 0.0;
                            [[unroll]] for (uint q = 0u; q < 8u; q++) s += dot(w[q], xv[q]);
                            acc[i] += ew * s;
                        }
                    }
                    u += step;
                    while (u >= units) { u -= units; j++; }
                }
            }
            [[unroll]] for (uint i = 0u; i < RPS; i++) {
                if (i < nrow) {
                    acc[i] = subgroupAdd(acc[i]);
                    if (MODE == 1u) acc2[i] = subgroupAdd(acc2[i]);
                }
            }
        }
        if (spg > 1u) {                               // uniform in the workgroup (then passes == 1)
            if (nrow > 0u && subgroupElect()) {
                [[unroll]] for (uint i = 0u; i < RPS; i++) {
                    RED[(sg * RPS + i) * 2u] = acc[i];
                    RED[(sg * RPS + i) * 2u + 1u] = acc2[i];
                }
            }
            barrier();
            if (part == 0u && nrow > 0u) {
                [[unroll]] for (uint i = 0u; i < RPS; i++) {
                    float a = 0.0, b = 0.0;
                    for (uint p = 0u; p < spg; p++) {
                        a += RED[((sg + p) * RPS + i) * 2u];
                        b += RED[((sg + p) * RPS + i) * 2u + 1u];
                    }
                    acc[i] = a;
                    acc2[i] = b;
                }
            }
        }
        if (part == 0u && nrow > 0u && subgroupElect()) {
            [[unroll]] for (uint i = 0u; i < RPS; i++) {
                if (i < nrow) {
                    uint o = ob + i;
                    if (MODE == 1u) {
                        float g = acc[i];
                        Y.v[j1 * O + o] = g / (1.0 + exp(-g)) * acc2[i];
                    } else {
                        Y.v[o] += acc[i];
                    }
                }
            }
        }
    }
}
