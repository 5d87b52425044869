#version 460
// Device-to-device copy through a compute shader (16 bytes a load), the bandwidth reference of
// scripts/bench/vulkan.py: every byte is read once and written once.
#extension GL_EXT_buffer_reference : require
#extension GL_EXT_shader_explicit_arithmetic_types_int64 : require
layout(local_size_x = 256) in;
layout(buffer_reference, std430, buffer_reference_align = 16) readonly buffer Src { uvec4 v[]; };
layout(buffer_reference, std430, buffer_reference_align = 16) writeonly buffer Dst { uvec4 v[]; };
layout(push_constant) uniform PC { uint64_t src; uint64_t dst; uint n; } pc;   // n: 16-byte words
void main() {
    Src s = Src(pc.src);
    Dst d = Dst(pc.dst);
    uint stride = gl_NumWorkGroups.x * 256u;
    for (uint i = gl_GlobalInvocationID.x; i < pc.n; i += stride) d.v[i] = s.v[i];
}
