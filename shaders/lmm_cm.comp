#version 460
// lmm_cm: lmm.comp's three products on the device's cooperative matrices (VK_KHR_cooperative_matrix, 16 x 16 x 16,
// float16 inputs, float32 accumulators): the prompt route of devices that have them (coli/vulkan/layers.py,
// docs/vulkan.md "Prompt routes"). Same push constants, addresses, MODE (specialization constant 2) and output as
// lmm.comp (its header says which address is which); weights and activation rows are rounded to float16 in shared
// memory, so a product differs from lmm.comp's by float16 rounding (about 1e-3 relative), and a row's outputs
// still depend only on that row and the weights (batch invariant within the route).
// A workgroup of 128 invocations owns a 64-output x 64-row tile. Per 64 inputs (two 32-input units), invocations
// decode one weight row's unit each into shared memory (mode 1: gate's and up's), stage the activations, then
// subgroup s multiplies its 16-output blocks (OB of them: 4 subgroups of 32 take one each, 2 of 64 take two) by
// the tile's four 16-row blocks. Results go out through a per-subgroup 16 x 16 scratch (two in mode 1: gate, up):
// bias, sigmoid, the expert's biases, the gated activation (act.glsl: u7, u9), route weights, as lmm.comp.
#extension GL_GOOGLE_include_directive : require
#extension GL_KHR_cooperative_matrix : require
#extension GL_KHR_memory_scope_semantics : require
#extension GL_KHR_shader_subgroup_basic : require
#extension GL_EXT_shader_explicit_arithmetic_types_float16 : require
#include "layer_common.glsl"
#include "formats.glsl"
#include "act.glsl"

layout(local_size_x = 128) in;
layout(constant_id = 2) const uint MODE = 0;
layout(constant_id = 4) const uint OB = 1;     // 16-output blocks a subgroup owns: 4 / (subgroups in 128)
layout(constant_id = 5) const uint PIPE = 2;   // 0: 64 inputs a step, one buffer; 2: 32 a step, two buffers
#define BM 64u
#define BN 64u
#define LD 18u      // f16vec4 stride of a tile row: 64 inputs (16) + 2 pad
#define LD2 10u     // PIPE 2: 32 inputs (8) + 2 pad; buffer b at b * 640
#define NSG 4u      // scratch slots: the most subgroups a workgroup of 128 has here (subgroups of 32)

shared f16vec4 Wg[2u * BM * LD2];
shared f16vec4 Wu[2u * BM * LD2];
shared f16vec4 Xs[2u * BN * LD2];
shared float Cs[NSG * 512u];

#define ACC coopmat<float, gl_ScopeSubgroup, 16, 16, gl_MatrixUseAccumulator>

void main() {
    uint O = pc.u[0], I = pc.u[1], flags = pc.u[2], R = pc.u[3], k = pc.u[5];
    uint units = I / 32u;
    uint64_t rb = uint64_t(ROW_BYTES(I));
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
    // decoding: invocation t takes weight row dm's unit (step + dh) (and up's in mode 1)
    uint dm = t & 63u, dh = t >> 6;
    bool dec_on = o0 + dm < O;
    uint64_t orow_off = uint64_t(min(o0 + dm, O - 1u)) * rb;
    // staging: invocation t loads 32 inputs (8 vec4) of tile row t / 2, the half t & 1 of the 64
    uint xn = t >> 1, xh = t & 1u;
    bool x_on = n0 + xn < cnt;
    uint xbase = 0u;
    if (x_on) {
        uint xr = MODE == 0u || ident ? n0 + xn : PAIRS.v[beg + n0 + xn];
        if (MODE == 1u) xr /= k;
        xbase = xr * (I / 4u);
    }
    F32x4 X = F32x4(pc.a[1]);

    uint sg = gl_SubgroupID;
    ACC acc[OB][4], acc2[OB][4];
    [[unroll]] for (uint i = 0u; i < OB; i++) [[unroll]] for (uint j = 0u; j < 4u; j++) {
        acc[i][j] = ACC(0.0);
        acc2[i][j] = ACC(0.0);
    }
    coopmat<float16_t, gl_ScopeSubgroup, 16, 16, gl_MatrixUseA> a, a2;
    coopmat<float16_t, gl_ScopeSubgroup, 16, 16, gl_MatrixUseB> b;

    if (PIPE == 2u) {
    // two buffers: step s+1's weights and activations are read and decoded into registers before step s's products
    // (from the other buffer) are issued, so their latency hides behind the matrix units; one barrier a step
    uint pm = t >> 6;                             // mode 1: 0 gate, 1 up; else 0 (1: stage activations only)
    bool pdec = dec_on && (MODE == 1u || pm == 0u);
    uint64_t prow = (MODE == 1u && pm == 1u ? wbase2 : wbase) + orow_off;
    uint pxq = xh * 4u;                           // 16 of the row's 32 inputs: vec4 pxq .. pxq + 3
    vec4 w[8], xv[4];
    [[unroll]] for (uint q = 0u; q < 8u; q++) w[q] = vec4(0.0);
    if (pdec) dec_unit(prow, 0u, w);
    [[unroll]] for (uint q = 0u; q < 4u; q++) xv[q] = x_on ? X.v[xbase + pxq + q] : vec4(0.0);
    [[unroll]] for (uint q = 0u; q < 8u; q++) {
        if (MODE == 1u && pm == 1u) Wu[dm * LD2 + q] = f16vec4(w[q]);
        else if (pm == 0u) Wg[dm * LD2 + q] = f16vec4(w[q]);
    }
    [[unroll]] for (uint q = 0u; q < 4u; q++) Xs[xn * LD2 + pxq + q] = f16vec4(xv[q]);
    barrier();
    for (uint s = 0u; s < units; s++) {
        uint cur = (s & 1u) * 640u, nxt = 640u - cur;
        bool more = s + 1u < units;
        if (more) {
            if (pdec) dec_unit(prow, s + 1u, w);
            [[unroll]] for (uint q = 0u; q < 4u; q++) xv[q] = x_on ? X.v[xbase + (s + 1u) * 8u + pxq + q] : vec4(0.0);
        }
        [[unroll]] for (uint kk = 0u; kk < 2u; kk++) {
            [[unroll]] for (uint i = 0u; i < OB; i++) {
                uint ob = sg * OB + i;
                coopMatLoad(a, Wg, cur + ob * 16u * LD2 + kk * 4u, LD2, gl_CooperativeMatrixLayoutRowMajor);
                if (MODE == 1u) coopMatLoad(a2, Wu, cur + ob * 16u * LD2 + kk * 4u, LD2, gl_CooperativeMatrixLayoutRowMajor);
                [[unroll]] for (uint j = 0u; j < 4u; j++) {
                    coopMatLoad(b, Xs, cur + j * 16u * LD2 + kk * 4u, LD2, gl_CooperativeMatrixLayoutColumnMajor);
                    acc[i][j] = coopMatMulAdd(a, b, acc[i][j]);
                    if (MODE == 1u) acc2[i][j] = coopMatMulAdd(a2, b, acc2[i][j]);
                }
            }
        }
        if (more) {
            [[unroll]] for (uint q = 0u; q < 8u; q++) {
                if (MODE == 1u && pm == 1u) Wu[nxt + dm * LD2 + q] = f16vec4(w[q]);
                else if (pm == 0u) Wg[nxt + dm * LD2 + q] = f16vec4(w[q]);
            }
            [[unroll]] for (uint q = 0u; q < 4u; q++) Xs[nxt + xn * LD2 + pxq + q] = f16vec4(xv[q]);
        }
        barrier();
    }
    } else
    for (uint s = 0u; s < units; s += 2u) {
        uint u = s + dh;
        vec4 w[8], w2[8];
        if (dec_on && u < units) {
            dec_unit(wbase + orow_off, u, w);
            if (MODE == 1u) dec_unit(wbase2 + orow_off, u, w2);
        } else {
            [[unroll]] for (uint q = 0u; q < 8u; q++) { w[q] = vec4(0.0); w2[q] = vec4(0.0); }
        }
        vec4 xv[8];
        uint xu = s + xh;
        [[unroll]] for (uint q = 0u; q < 8u; q++) xv[q] = (x_on && xu < units) ? X.v[xbase + xu * 8u + q] : vec4(0.0);
        barrier();
        [[unroll]] for (uint q = 0u; q < 8u; q++) {
            Wg[dm * LD + dh * 8u + q] = f16vec4(w[q]);
            if (MODE == 1u) Wu[dm * LD + dh * 8u + q] = f16vec4(w2[q]);
            Xs[xn * LD + xh * 8u + q] = f16vec4(xv[q]);
        }
        barrier();
        [[unroll]] for (uint kk = 0u; kk < 4u; kk++) {
            [[unroll]] for (uint i = 0u; i < OB; i++) {
                uint ob = sg * OB + i;
                coopMatLoad(a, Wg, ob * 16u * LD + kk * 4u, LD, gl_CooperativeMatrixLayoutRowMajor);
                if (MODE == 1u) coopMatLoad(a2, Wu, ob * 16u * LD + kk * 4u, LD, gl_CooperativeMatrixLayoutRowMajor);
                [[unroll]] for (uint j = 0u; j < 4u; j++) {
                    coopMatLoad(b, Xs, j * 16u * LD + kk * 4u, LD, gl_CooperativeMatrixLayoutColumnMajor);
                    acc[i][j] = coopMatMulAdd(a, b, acc[i][j]);
                    if (MODE == 1u) acc2[i][j] = coopMatMulAdd(a2, b, acc2[i][j]);
                }
            }
        }
    }

    F32 Y = F32(pc.a[2]);
    U32 ROUTE = U32(pc.a[3]);
    uint ldy = MODE == 0u ? (pc.u[4] == 0u ? O : pc.u[4]) : O;
    uint lane = gl_SubgroupInvocationID, nl = gl_SubgroupSize;
    [[unroll]] for (uint i = 0u; i < OB; i++) [[unroll]] for (uint j = 0u; j < 4u; j++) {
        // element (o, n) of the 16 x 16 block at Cs[sg * 512 + n * 16 + o]; mode 1's up product at + 256
        coopMatStore(acc[i][j], Cs, sg * 512u, 16u, gl_CooperativeMatrixLayoutColumnMajor);
        if (MODE == 1u) coopMatStore(acc2[i][j], Cs, sg * 512u + 256u, 16u, gl_CooperativeMatrixLayoutColumnMajor);
        subgroupMemoryBarrierShared();
        subgroupBarrier();
        bool eb = (pc.u[8] & 1u) != 0u;             // the expert's biases (modes 1 and 2)
        uint eo = gl_WorkGroupID.z * O;
        for (uint el = lane; el < 256u; el += nl) {
            uint o = o0 + (sg * OB + i) * 16u + (el & 15u);
            uint n = n0 + j * 16u + (el >> 4);
            if (o >= O || n >= cnt) continue;
            float r = Cs[sg * 512u + el];
            uint orow = n;
            if (MODE != 0u) orow = ident ? n : PAIRS.v[beg + n];
            uint yi = orow * ldy + o;
            if (MODE == 0u) {
                if ((flags & 2u) != 0u) r += F32(pc.a[3]).v[o];
                if ((flags & 4u) != 0u) r = 1.0 / (1.0 + exp(-r));
                if ((flags & 1u) != 0u) r += Y.v[yi];
            } else if (MODE == 1u) {
                float uu = Cs[sg * 512u + 256u + el];
                if (eb) {
                    r += F32(pc.a[6]).v[eo + o];
                    uu += F32(pc.a[7]).v[eo + o];
                }
                r = glu(r, uu, pc.u[7], pcf(9u));
            } else {
                if (eb) r += F32(pc.a[6]).v[eo + o];
                r *= uintBitsToFloat(ROUTE.v[(orow / k) * 2u * k + k + orow % k]);
            }
            Y.v[yi] = r;
        }
        subgroupMemoryBarrierShared();
        subgroupBarrier();
    }
}
