#version 460
// Q8_0 x int8-activation GEMV with the device's integer dot product (OpSDot): see gemv_i8.glsl.
#extension GL_GOOGLE_include_directive : require
#extension GL_EXT_spirv_intrinsics : require
#define I8_DOT 1
#include "gemv_i8.glsl"
