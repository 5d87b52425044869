#version 460
// The int8 activations of the expert batch (coli/vulkan/device.py, act "int8"): each block of 32 values of
// H (f32 rows: the SwiGLU output of the gate/up pass, or the plain matmul's input) is rounded in place
// exactly as the CPU's int8 activations (cpu_kernels/formats.py `_round_act_int8` / `quantize_act_int8`,
// llama.cpp's quantize_row_q8_0 with an f32 block scale): d = amax / 127, q = roundEven(h * (1 / d)); a block
// with amax < 127 * FLT_MIN has d = 0 and q = 0. MODE 0 writes h = q * d (for the f32 kernels); MODE 1 packs
// the block in its own words for gemv_i8.glsl: words 0-7 the 32 codes (element 4k in the low byte of word k),
// word 8 d. One invocation per block: pc.nwork blocks from block pc.grp_off (a range of pairs' rows).
#extension GL_GOOGLE_include_directive : require
#include "common.glsl"

layout(local_size_x = 64) in;

// a / b correctly rounded (round to nearest, ties to even) for positive normal floats, in integers: Vulkan lets
// OpFDiv be 2.5 ULP off (NVIDIA's is approximate), and the scale must be the CPU's bit for bit. The quotient
// of the 24-bit significands scaled by 2^40 has 40-41 bits; its top 24 are rounded by the rest and the
// remainder. Falls back to a / b where the result would not be a normal float.
float div_rn(float a, float b) {
    uint ab = floatBitsToUint(a), bb = floatBitsToUint(b);
    int ea = int((ab >> 23) & 0xffu), eb = int((bb >> 23) & 0xffu);
    if (ea == 0 || eb == 0 || ea == 255 || eb == 255) return a / b;
    uint64_t ma = uint64_t((ab & 0x7fffffu) | 0x800000u), mb = uint64_t((bb & 0x7fffffu) | 0x800000u);
    uint64_t n = ma << 40;
    uint64_t q = n / mb;
    bool rest = (n - q * mb) != 0ul;
    int s = (q >> 40) != 0ul ? 17 : 16;                  // q in [2^39, 2^41): keep its top 24 bits
    uint64_t mant = q >> s;
    uint64_t cut = q & ((uint64_t(1) << s) - 1ul), hf = uint64_t(1) << (s - 1);
    if (cut > hf || (cut == hf && (rest || (mant & 1ul) != 0ul))) mant += 1ul;
    if (mant == (uint64_t(1) << 24)) { mant >>= 1; s += 1; }
    // a / b = (q + rest) * 2^(ea - eb - 40) = mant * 2^(s + ea - eb - 40); exponent field = that + 150
    int e = s + ea - eb + 110;
    if (e <= 0 || e >= 255) return a / b;
    return uintBitsToFloat((uint(e) << 23) | (uint(mant) & 0x7fffffu));
}

void main() {
    uint b = (gl_WorkGroupID.y * 65535u + gl_WorkGroupID.x) * 64u + gl_LocalInvocationID.x;
    if (b >= pc.nwork) return;
    uint base = (pc.grp_off + b) * 32u;
    float v[32];
    float amax = 0.0;
    [[unroll]] for (uint j = 0u; j < 32u; j++) { v[j] = H[base + j]; amax = max(amax, abs(v[j])); }
    // a block with amax < 127 * FLT_MIN (zeros, or a scale that would be subnormal: 1 / d overflows, and the
    // device may flush it) is zeros with d = 0, as the CPU's ACT_AMAX_MIN; above it d and 1 / d are normal
    float d = amax >= uintBitsToFloat(0x03fe0000u) ? div_rn(amax, 127.0) : 0.0;
    float idv = d != 0.0 ? div_rn(1.0, d) : 0.0;
    if (MODE == 0u) {
        [[unroll]] for (uint j = 0u; j < 32u; j++) {
            precise float q = roundEven(v[j] * idv);
            H[base + j] = q * d;
        }
    } else {
        [[unroll]] for (uint k = 0u; k < 8u; k++) {
            uint w = 0u;
            [[unroll]] for (uint l = 0u; l < 4u; l++) {
                precise float q = roundEven(v[4u * k + l] * idv);
                w |= (uint(int(q)) & 0xffu) << (8u * l);
            }
            H[base + k] = uintBitsToFloat(w);
        }
        H[base + 8u] = d;
    }
}
