// Shared declarations of the whole-layer kernels (coli/vulkan/layers.py, docs/vulkan.md "Device layers").
// Every buffer is reached through its device address: the push constants carry up to 8 addresses (a[])
// and 16 words (u[]; a float travels as its bits, read with uintBitsToFloat), so one pipeline layout
// serves every kernel and a token's command buffer is recorded once. Set 0 binding 6 is the i-quant grid
// table (iq_common.glsl) for the weight decoders that need it.
#extension GL_GOOGLE_include_directive : require
#include "bda.glsl"

layout(buffer_reference, std430, buffer_reference_align = 4) buffer F32 { float v[]; };
layout(buffer_reference, std430, buffer_reference_align = 16) buffer F32x4 { vec4 v[]; };
layout(buffer_reference, std430, buffer_reference_align = 4) buffer U32 { uint v[]; };
layout(buffer_reference, std430, buffer_reference_align = 8) readonly buffer U64 { uint64_t v[]; };

layout(push_constant) uniform PC {
    uint64_t a[8];   // buffer addresses (each kernel's header says which is which)
    uint u[16];      // sizes, flags, float bits
} pc;

float pcf(uint i) { return uintBitsToFloat(pc.u[i]); }
