// Shared declarations of the expert / matmul shaders (coli/vulkan/device.py fills these bindings).
// Weights are read through buffer device addresses (GL_EXT_buffer_reference): each expert's tensors
// sit at offsets inside 256 MiB device-memory blocks, and the per-step group table carries their
// 64-bit addresses, so one dispatch covers every expert of a step.
#extension GL_GOOGLE_include_directive : require
#include "bda.glsl"

// x [R, D] f32 (gate/up input rows), twice: as floats and as vec4
layout(std430, set = 0, binding = 0) readonly buffer XB { float X[]; };
layout(std430, set = 0, binding = 1) readonly buffer X4B { vec4 X4[]; };
// the step's table: groups (8 uints each), row index per sorted pair, output index per sorted pair,
// work items (4 uints each)
layout(std430, set = 0, binding = 2) readonly buffer TB { uint TAB[]; };
// h [P, F] f32: SwiGLU output of gate/up (mode 1 writes it), input rows of the plain matmul (mode 0)
layout(std430, set = 0, binding = 3) buffer HB { float H[]; };
layout(std430, set = 0, binding = 4) readonly buffer H4B { vec4 H4[]; };
// y [P, D] f32: output of the plain matmul (mode 0), row TAB[out_off + s]
layout(std430, set = 0, binding = 5) writeonly buffer YB { float Y[]; };

layout(push_constant) uniform PC {
    uint O;          // outputs of this pass (F for gate/up, D for down)
    uint I;          // inputs of this pass (D for gate/up, F for down); a multiple of 32
    uint grp_off;    // TAB offset of the group table
    uint row_off;    // TAB offset of the x-row index per sorted pair
    uint out_off;    // TAB offset of the output-row index per sorted pair
    uint work_off;   // TAB offset of the work items
    uint nwork;      // number of work items
    uint act_flags;  // mode 1's activation: bit 0 clamp (gate <= clamp_v, |up| <= clamp_v); bit 1 gpt-oss's
                     // SwiGLU (g * sigmoid(1.702 g) * (u + 1)); bit 2 gate/up biases at bias_off
    float clamp_v;   // the clamp (> 0)
    uint bias_off;   // TAB offset of the biases: per group row g, 2 * O floats (gate bias, then up bias)
} pc;

// mode 0: plain matmul h -> y; mode 1: gate and up from x, SwiGLU -> h
layout(constant_id = 2) const uint MODE = 0;

uint64_t grp_addr(uint g, uint which) {
    uint b = pc.grp_off + g * 8u + which * 2u;
    return packUint2x32(uvec2(TAB[b], TAB[b + 1u]));
}
uint grp_begin(uint g) { return TAB[pc.grp_off + g * 8u + 6u]; }
uint grp_count(uint g) { return TAB[pc.grp_off + g * 8u + 7u]; }

// the activation of mode 1 for output o of group row g: SwiGLU silu(g) * u, or gpt-oss's clamped form
// (transformers GptOssExperts._apply_gate; cpu_kernels/experts.py ACT_SWIGLU_OAI), biases added first
float expert_act(uint grp, uint o, float g, float u) {
    if ((pc.act_flags & 4u) != 0u) {
        uint b = pc.bias_off + grp * 2u * pc.O + o;
        g += uintBitsToFloat(TAB[b]);
        u += uintBitsToFloat(TAB[b + pc.O]);
    }
    if ((pc.act_flags & 1u) != 0u) {
        g = min(g, pc.clamp_v);
        u = clamp(u, -pc.clamp_v, pc.clamp_v);
    }
    if ((pc.act_flags & 2u) != 0u) return g / (1.0 + exp(-1.702 * g)) * (u + 1.0);
    return g / (1.0 + exp(-g)) * u;
}

// the work item of this workgroup (dispatches are 2-D past 65535 groups)
uint work_index() { return gl_WorkGroupID.y * 65535u + gl_WorkGroupID.x; }
