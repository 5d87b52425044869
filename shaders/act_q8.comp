#version 460
// The int8 activations of the expert batch (coli/vulkan/device.py, act "int8"): each block of 32 values of
// H (f32 rows: the SwiGLU output of the gate/up pass, or the plain matmul's input) is rounded in place
// exactly as the CPU's int8 activations (cpu_kernels/formats.py `_round_act_int8` / `quantize_act_int8`,
// llama.cpp's quantize_row_q8_0 with an f32 block scale): d = amax / 127, q = roundEven(h * (1 / d)) (0
// when d is 0). MODE 0 writes h = q * d (for the f32 kernels); MODE 1 packs the block in its own words for
// gemv_i8.glsl: words 0-7 the 32 codes (element 4k in the low byte of word k), word 8 d. One invocation per
// block: pc.nwork blocks from block pc.grp_off (a range of pairs' rows).
#extension GL_GOOGLE_include_directive : require
#include "common.glsl"

layout(local_size_x = 64) in;

void main() {
    uint b = (gl_WorkGroupID.y * 65535u + gl_WorkGroupID.x) * 64u + gl_LocalInvocationID.x;
    if (b >= pc.nwork) return;
    uint base = (pc.grp_off + b) * 32u;
    float v[32];
    float amax = 0.0;
    [[unroll]] for (uint j = 0u; j < 32u; j++) { v[j] = H[base + j]; amax = max(amax, abs(v[j])); }
    precise float d = amax / 127.0;
    precise float idv = d != 0.0 ? 1.0 / d : 0.0;
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
