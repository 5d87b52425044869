// Q8_0 GEMV on int8 activations with integer dot products (coli/vulkan/device.py, act "int8"): the body of
// gemv_i8dot.comp (OpSDot of SPV_KHR_integer_dot_product, where the device has
// VK_KHR_shader_integer_dot_product) and gemv_i8emu.comp (the same sums with plain integer multiplies).
// Per output row and activation row: sum over blocks b of float(q_w[b] . q_x[b]) * (d_w[b] * d_x[b]), the
// block dot exact in int32 (the CPU's VNNI GEMV, cpu_kernels/vnni.py row_q8, sums the same way).
// Activation rows are PACKED per block of 32 in the block's own 32 words: words 0-7 the 32 int8 codes
// (little-endian, element 4k in the low byte of word k), word 8 the f32 scale d (x ~= q * d); the host
// packs x with the CPU's quantize_act_int8, shaders/act_q8.comp (mode 1) packs h in place.
// A workgroup owns ROWS_PER_WG output rows of one group (at most MAXR activation rows); each subgroup takes
// one output row at a time, lanes stride over the blocks, then subgroupAdd.
#include "common.glsl"
#include "formats.glsl"

layout(local_size_x_id = 0) in;
layout(constant_id = 1) const uint ROWS_PER_WG = 16;   // output rows a workgroup owns
#define MAXR 4      // activation rows a GEMV group holds

#ifdef I8_DOT
// OpSDot (4450), capabilities DotProductInput4x8BitPacked (6018) and DotProduct (6019); the literal operand
// 0 is PackedVectorFormat4x8Bit: the two 32-bit operands are four signed 8-bit lanes each.
spirv_instruction(extensions = ["SPV_KHR_integer_dot_product"], capabilities = [6018, 6019], id = 4450)
int sdot4x8(int a, int b, spirv_literal int fmt);
int dot4(uint a, uint b) { return sdot4x8(int(a), int(b), 0); }
#else
int dot4(uint a, uint b) {
    ivec4 x = ivec4(bitfieldExtract(int(a), 0, 8), bitfieldExtract(int(a), 8, 8), bitfieldExtract(int(a), 16, 8), bitfieldExtract(int(a), 24, 8));
    ivec4 y = ivec4(bitfieldExtract(int(b), 0, 8), bitfieldExtract(int(b), 8, 8), bitfieldExtract(int(b), 16, 8), bitfieldExtract(int(b), 24, 8));
    return x.x * y.x + x.y * y.y + x.z * y.z + x.w * y.w;
}
#endif

// the u-th Q8_0 block of the weight row at `row` (ggml block_q8_0: f16 d, int8 qs[32]; 2-byte aligned):
// its scale and its codes as eight words
void q8_block(uint64_t row, uint u, out float d, out uint q[8]) {
    uint64_t b = row + uint64_t(u) * 34ul;
    RB32 p = RB32(b & ~3ul);
    uint s = 8u * uint(b & 3ul);
    uint a[9];
    [[unroll]] for (uint k = 0u; k < 9u; k++) a[k] = p.v[k];
    d = unpackHalf2x16(s == 0u ? a[0] & 0xffffu : a[0] >> 16).x;
    [[unroll]] for (uint k = 0u; k < 8u; k++) q[k] = s == 0u ? (a[k] >> 16) | (a[k + 1u] << 16) : a[k + 1u];
}

uint act_word(uint i) { return floatBitsToUint(MODE == 1u ? X[i] : H[i]); }
float act_scale(uint i) { return MODE == 1u ? X[i] : H[i]; }

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
        xrow[r] = r < nr ? (MODE == 1u ? TAB[pc.row_off + s0 + r] : s0 + r) * I : 0u;
    uint oend = min(o0 + ROWS_PER_WG, O);
    for (uint o = o0 + gl_SubgroupID; o < oend; o += gl_NumSubgroups) {
        float acc[MAXR], acc2[MAXR];
        [[unroll]] for (uint r = 0u; r < MAXR; r++) { acc[r] = 0.0; acc2[r] = 0.0; }
        for (uint u = gl_SubgroupInvocationID; u < units; u += gl_SubgroupSize) {
            float dw, du = 0.0;
            uint qw[8], qu[8];
            q8_block(wa + uint64_t(o) * rb, u, dw, qw);
            if (MODE == 1u) q8_block(wu + uint64_t(o) * rb, u, du, qu);
            [[unroll]] for (uint r = 0u; r < MAXR; r++) {
                if (r < nr) {
                    uint xb = xrow[r] + u * 32u;
                    int s = 0, s2 = 0;
                    [[unroll]] for (uint k = 0u; k < 8u; k++) {
                        uint xv = act_word(xb + k);
                        s += dot4(qw[k], xv);
                        if (MODE == 1u) s2 += dot4(qu[k], xv);
                    }
                    float dx = act_scale(xb + 8u);
                    acc[r] = fma(float(s), dw * dx, acc[r]);
                    if (MODE == 1u) acc2[r] = fma(float(s2), du * dx, acc2[r]);
                }
            }
        }
        [[unroll]] for (uint r = 0u; r < MAXR; r++) {
            if (r < nr) {
                float t = subgroupAdd(acc[r]);
                if (MODE == 1u) {
                    float t2 = subgroupAdd(acc2[r]);
                    if (subgroupElect()) H[(s0 + r) * O + o] = expert_act(g, o, t, t2);
                } else {
                    if (subgroupElect()) Y[TAB[pc.out_off + s0 + r] * O + o] = t;
                }
            }
        }
    }
}
