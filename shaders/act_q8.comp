#version 460
// The int8-activation rounding of the expert batch (coli/vulkan/device.py, act "int8"): the SwiGLU rows in
// H (f32 [P, F], written by the gate/up pass) are rounded in place per block of 32 exactly as the CPU's
// int8 activations (cpu_kernels/formats.py `_round_act_int8` / `quantize_act_int8`, llama.cpp's
// quantize_row_q8_0 with an f32 block scale): d = amax / 127, q = roundEven(h * (1 / d)) (0 when d is 0),
// h = q * d. The down pass then reads the same numbers the CPU's int8 path multiplies. One invocation per
// block: pc.nwork blocks from block pc.grp_off (a range of pairs' rows).
#extension GL_GOOGLE_include_directive : require
#include "common.glsl"

layout(local_size_x = 64) in;

void main() {
    uint b = (gl_WorkGroupID.y * 65535u + gl_WorkGroupID.x) * 64u + gl_LocalInvocationID.x;
    if (b >= pc.nwork) return;
    uint base = (pc.grp_off + b) * 32u;
    float amax = 0.0;
    [[unroll]] for (uint j = 0u; j < 32u; j++) amax = max(amax, abs(H[base + j]));
    precise float d = amax / 127.0;
    precise float idv = d != 0.0 ? 1.0 / d : 0.0;
    [[unroll]] for (uint j = 0u; j < 32u; j++) {
        precise float q = roundEven(H[base + j] * idv);
        H[base + j] = q * d;
    }
}
