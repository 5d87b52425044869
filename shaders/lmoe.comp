#version 460
// lmoe: the routed experts of one activation row, for the device layers (coli/vulkan/layers.py; docs/vulkan.md
// "Device layers"). Compiled once per GGUF type (-DFMT_<NAME>); MODE (specialization constant 2) picks the pass.
//   a0 expert table: uint64 [E][3], the (gate, up, down) row-0 addresses of each expert of the layer
//   a1 route: uint [2k], expert ids [k], then their weights as float bits [k] (rank order, j = 0 first)
// MODE 1, gate/up and SwiGLU: a2 x f32 [D], a3 h f32 [k, F]; u0 F, u1 D, u2 k, u3 act (0 SiLU, 1 the tanh GELU,
//   2 gpt-oss's: act.glsl), u4 bit 0: add the expert's gate and up biases a4 / a5 f32 [E, F] before the
//   activation, u5 the activation's clamp (float bits; 0 none); groups (ceil(F / ROWS), k, 1).
//   h[j, o] = act(g) * u, g = Wg[id_j][o, :] . x, u = Wu[id_j][o, :] . x, silu(g) = g / (1 + exp(-g)).
// MODE 0, down and the weighted combine into the residual: a2 h f32 [k, F], a3 y f32 [D]; u0 D, u1 F, u2 k,
//   u4 bit 0: each rank's down bias a4 f32 [E, D] too (y[o] += sum_j w_j bias[id_j, o] besides s; ranks on the
//   device only); u4 bit 1, ranks apart: workgroup y = rank r runs with the route, h and y moved on by r words,
//   r rows of F and r rows of D (one dispatch for what k dispatches of k = 1 did; groups (ceil(D / ROWS), k, 1))
//   (k <= MAXK); groups (ceil(D / ROWS), 1, 1). y[o] += s, s = sum_j w_j (Wd[id_j][o, :] . h[j, :]) made in a
//   float (each lane sums w_j times its units' dot products over all ranks, then one subgroupAdd; the
//   subgroups that split a row add in subgroup order) and added to y[o] once. a5..a7, u15: the RMSNorm of y [D]
//   by the last workgroup (norm_tail.glsl; a5 0: none).
// A rank whose expert's table entry is 0 (not on the device: its rows come from the CPU, docs/vulkan.md "Experts on
// the CPU") is skipped: mode 1 writes no h for it, mode 0 adds nothing for it. u3 (mode 0): where the weights start
// in the route, in words (0: at k); a device layer with CPU experts passes k = 1, the route at rank j and u3 = K so
// that each rank's weighted output goes to its own row (summed in rank order by moe_sum.comp).
// x and h must be 16-byte aligned. Work layout as in lmv.comp (a workgroup owns ROWS rows, a subgroup a set of
// RPC rows without a branch a row, lanes stride over units, spare subgroups split a set's units); in mode 0
// the lanes stride over the k * F/32 units of all ranks of a row at once (h [k, F] is contiguous: flat unit t
// is unit t % (F/32) of rank t / (F/32)), so a small F still fills the subgroup. Any subgroup size.
#extension GL_GOOGLE_include_directive : require
#include "layer_common.glsl"
#include "formats.glsl"
#include "x_unit.glsl"
#include "act.glsl"

layout(local_size_x_id = 0) in;
layout(constant_id = 1) const uint ROWS = 16;   // output rows a workgroup owns
layout(constant_id = 2) const uint MODE = 1;    // 1: gate/up + SwiGLU; 0: down + combine
#define RPS 4u       // output rows a subgroup carries at most
const uint RPC = ROWS < RPS ? ROWS : RPS;   // rows a subgroup carries (a set)
#define MAXK 64u     // ranks a row (mode 0)

shared float RED[gl_WorkGroupSize.x * RPS * 2u];   // per subgroup and row: two sums (gate, up)
shared uint64_t EA[MAXK];   // mode 0: down row-0 address of rank j
shared float EW[MAXK];      // mode 0: weight of rank j
shared uint EI[MAXK];       // mode 0: expert of rank j
#include "layer_reduce.glsl"
#include "norm_tail.glsl"

void main() {
    uint O = pc.u[0], I = pc.u[1], k = pc.u[2];
    uint units = x_units(I);     // mode 1: x of any width (x_unit.glsl); mode 0: h's F, a multiple of 32
    U64 TABLE = U64(pc.a[0]);
    // ranks apart (mode 0, u4 bit 1): this workgroup's rank r alone, its route word, h row and y row
    uint rr = (MODE == 0u && (pc.u[4] & 2u) != 0u) ? gl_WorkGroupID.y : 0u;
    uint64_t aY = pc.a[3] + 4ul * uint64_t(rr) * uint64_t(O);
    U32 ROUTE = U32(pc.a[1] + 4ul * uint64_t(rr));
    uint64_t wg = 0ul, wu = 0ul;
    uint64_t wfb = 0ul;     // mode 0: the first device rank's down rows, read (times weight 0) for a CPU rank's
    uint j1 = gl_WorkGroupID.y;
    if (MODE == 1u) {
        uint e = ROUTE.v[j1];
        wg = TABLE.v[e * 3u];
        wu = TABLE.v[e * 3u + 1u];
        if (wg == 0ul) return;    // the whole workgroup: a CPU rank (before any barrier)
    } else {
        uint wo = pc.u[3] == 0u ? k : pc.u[3];
        for (uint t = gl_LocalInvocationIndex; t < k; t += gl_WorkGroupSize.x) {
            EA[t] = TABLE.v[ROUTE.v[t] * 3u + 2u];
            EI[t] = ROUTE.v[t];
            EW[t] = uintBitsToFloat(ROUTE.v[wo + t]);
        }
        barrier();
        bool none = true;
        for (uint t = 0u; t < k; t++) {
            if (none && EA[t] != 0ul) wfb = EA[t];
            none = none && EA[t] == 0ul;
        }
        // every rank a CPU rank: its rows are the host's, written while this runs (no read-modify-write of them)
        if (none) { norm_tail(aY, O); return; }
    }
    uint total = MODE == 1u ? units : k * units;   // units a row's lanes stride over
    uint o0 = gl_WorkGroupID.x * ROWS;
    uint oend = min(o0 + ROWS, O);
    uint nsg = gl_NumSubgroups, sg = gl_SubgroupID, lane = gl_SubgroupInvocationID, sgs = gl_SubgroupSize;
    uint nset = (ROWS + RPC - 1u) / RPC;
    uint spare = max(1u, nsg / nset);
    uint spg = clamp(min(spare, (total + sgs - 1u) / sgs), 1u, nsg);
    uint cpass = nsg / spg;
    uint passes = (nset + cpass - 1u) / cpass;    // the same for every subgroup
    uint part = sg % spg, setl = sg / spg;        // subgroups past cpass * spg only join the barriers
    uint64_t rb = uint64_t(x_row_bytes(I));
    F32x4 X = F32x4(pc.a[2] + 4ul * uint64_t(rr) * uint64_t(I));   // mode 1: x [D]; mode 0: h [k, F]
    for (uint ps = 0u; ps < passes; ps++) {
        uint ob = o0 + (ps * cpass + setl) * RPC;
        uint nrow = (setl < cpass && ob < oend) ? min(RPC, oend - ob) : 0u;   // uniform in the subgroup
        float acc[RPS], acc2[RPS];
        [[unroll]] for (uint i = 0u; i < RPC; i++) { acc[i] = 0.0; acc2[i] = 0.0; }
        if (nrow > 0u) {
            // a set past the end of the matrix (the last of the dispatch) decodes its last row again
            uint64_t ro[RPS];
            [[unroll]] for (uint i = 0u; i < RPC; i++) ro[i] = uint64_t(min(ob + i, oend - 1u)) * rb;
            uint t = part * sgs + lane, step = spg * sgs;
            if (MODE == 1u) {
                for (; t < total; t += step) {
                    vec4 xv[8];
                    if (t * 32u + 32u <= I) { [[unroll]] for (uint q = 0u; q < 8u; q++) xv[q] = X.v[t * 8u + q]; }
                    else x_unit_any(pc.a[2], 0u, I, t, xv);     // the last, partial unit
                    [[unroll]] for (uint i = 0u; i < RPC; i++) {
                        vec4 w[8], w2[8];
                        dec_unit(wg + ro[i], t, w);
                        dec_unit(wu + ro[i], t, w2);
                        float s = 0.0, s2 = 0.0;
                        [[unroll]] for (uint q = 0u; q < 8u; q++) {
                            s += dot(w[q], xv[q]);
                            s2 += dot(w2[q], xv[q]);
                        }
                        acc[i] += s;
                        acc2[i] += s2;
                    }
                }
            } else {
                // flat unit t of the row: unit u of rank j (h [k, F] is contiguous, so h's unit is t). Two of the
                // lane's units an iteration, t and t2 = t + step, every load of both issued before any sum (one
                // memory round trip where a loop of one unit an iteration made two at OLMoE's k * F = 8 * 1024
                // with 128 lanes); no branch: a CPU rank (or a t2 past the end: t again) reads a device rank's
                // rows and adds them times weight 0 and h 0. Each lane still adds its units in order t, t + step, ...
                uint j = t / units, u = t - j * units;
                for (; t < total; t += 2u * step) {
                    uint t2 = t + step, u2 = u + step, j2 = j;
                    while (u2 >= units) { u2 -= units; j2++; }
                    bool two = t2 < total;
                    uint tr = two ? t2 : t, jr = two ? j2 : j, ur = two ? u2 : u;
                    uint64_t ea = EA[j], ea2 = EA[jr];
                    bool on = ea != 0ul, on2 = two && ea2 != 0ul;
                    // an off unit's h (a CPU rank's row holds no h of this token: maybe not even a number) as 0
                    vec4 hv[8], hv2[8];
                    [[unroll]] for (uint q = 0u; q < 8u; q++) {
                        hv[q] = on ? X.v[t * 8u + q] : vec4(0.0);
                        hv2[q] = on2 ? X.v[tr * 8u + q] : vec4(0.0);
                    }
                    float ew = on ? EW[j] : 0.0, ew2 = on2 ? EW[jr] : 0.0;
                    ea = on ? ea : wfb;
                    ea2 = ea2 != 0ul ? ea2 : wfb;
                    [[unroll]] for (uint i = 0u; i < RPC; i++) {
                        vec4 w[8], w2[8];
                        dec_unit(ea + ro[i], u, w);
                        dec_unit(ea2 + ro[i], ur, w2);
                        float s = 0.0, s2 = 0.0;
                        [[unroll]] for (uint q = 0u; q < 8u; q++) {
                            s += dot(w[q], hv[q]);
                            s2 += dot(w2[q], hv2[q]);
                        }
                        acc[i] += ew * s;
                        acc[i] += ew2 * s2;
                    }
                    u = u2 + step;
                    j = j2;
                    while (u >= units) { u -= units; j++; }
                }
            }
            [[unroll]] for (uint i = 0u; i < RPC; i++) {
                acc[i] = subgroupAdd(acc[i]);
                if (MODE == 1u) acc2[i] = subgroupAdd(acc2[i]);
            }
        }
        if (spg > 1u) {                               // uniform in the workgroup
            if (nrow > 0u && subgroupElect()) {
                [[unroll]] for (uint i = 0u; i < RPC; i++) {
                    RED[(sg * RPS + i) * 2u] = acc[i];
                    RED[(sg * RPS + i) * 2u + 1u] = acc2[i];
                }
            }
            barrier();
            if (part == 0u && nrow > 0u) {
                [[unroll]] for (uint i = 0u; i < RPC; i++) {
                    float a = 0.0, b = 0.0;
                    for (uint p = 0u; p < spg; p++) {
                        a += RED[((sg + p) * RPS + i) * 2u];
                        b += RED[((sg + p) * RPS + i) * 2u + 1u];
                    }
                    acc[i] = a;
                    acc2[i] = b;
                }
            }
            barrier();
        }
        if (part == 0u && nrow > 0u && subgroupElect()) {
            F32C Y = F32C(aY);
            [[unroll]] for (uint i = 0u; i < RPC; i++) {
                if (i < nrow) {
                    uint o = ob + i;
                    if (MODE == 1u) {
                        float g = acc[i], uu = acc2[i];
                        if ((pc.u[4] & 1u) != 0u) {
                            uint e = ROUTE.v[j1];
                            g += F32(pc.a[4]).v[e * O + o];
                            uu += F32(pc.a[5]).v[e * O + o];
                        }
                        Y.v[j1 * O + o] = glu(g, uu, pc.u[3], pcf(5u));
                    } else {
                        float b = 0.0;
                        if ((pc.u[4] & 1u) != 0u) {
                            for (uint j = 0u; j < k; j++)
                                if (EA[j] != 0ul) b += EW[j] * F32(pc.a[4]).v[EI[j] * O + o];
                        }
                        Y.v[o] += acc[i] + b;
                    }
                }
            }
        }
    }
    if (MODE == 0u) norm_tail(aY, O);
}
