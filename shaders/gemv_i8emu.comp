#version 460
// Q8_0 x int8-activation GEMV, the integer dot product emulated with 32-bit multiplies: see gemv_i8.glsl.
#extension GL_GOOGLE_include_directive : require
#include "gemv_i8.glsl"
