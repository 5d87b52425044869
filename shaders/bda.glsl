// The extensions and read-only buffer-reference types every kernel that reads weights by device address
// needs (GL_EXT_buffer_reference); the weight decoders (fmt_*.glsl) read through RB8..RB128.
#extension GL_EXT_buffer_reference : require
#extension GL_EXT_buffer_reference2 : require
#extension GL_EXT_shader_explicit_arithmetic_types_int64 : require
#extension GL_EXT_shader_8bit_storage : require
#extension GL_EXT_shader_16bit_storage : require
#extension GL_KHR_shader_subgroup_basic : require
#extension GL_KHR_shader_subgroup_arithmetic : require
#extension GL_EXT_control_flow_attributes : require

layout(buffer_reference, std430, buffer_reference_align = 1) readonly buffer RB8 { uint8_t v[]; };
layout(buffer_reference, std430, buffer_reference_align = 2) readonly buffer RB16 { uint16_t v[]; };
layout(buffer_reference, std430, buffer_reference_align = 4) readonly buffer RB32 { uint v[]; };
layout(buffer_reference, std430, buffer_reference_align = 16) readonly buffer RB128 { uvec4 v[]; };

