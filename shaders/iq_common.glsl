// Shared pieces of the i-quant decoders (fmt_iq*.glsl). The grids (ggml-common.h's iq2xxs_grid ... as
// gguf.quants carries them) live in a storage buffer the device uploads once from coli/types/iq_tables.py
// (device_grids); the generated iq_grids.glsl names each grid's offset in it. A const array in the shader
// made Lavapipe copy the whole table into every invocation.
layout(std430, set = 0, binding = 6) readonly buffer IQG { uint IQGRID[]; };
// ksigns_iq2xs[i] (ggml-common.h) is i with an 8th bit that makes the number of set bits even.
uint iq_ksigns(uint i) { return i | ((uint(bitCount(i)) & 1u) << 7); }
// four unsigned grid bytes of g, negated where bits 0..3 of s are set
vec4 iq_signed4(uint g, uint s) {
    vec4 v = vec4(g & 255u, (g >> 8) & 255u, (g >> 16) & 255u, g >> 24);
    return v * (vec4(1.0) - 2.0 * vec4(s & 1u, (s >> 1) & 1u, (s >> 2) & 1u, (s >> 3) & 1u));
}
// IQ1 grid entry e (2-bit codes value+1 per element): elements 4h..4h+3 plus delta
vec4 iq1_vals4(uint e, uint h, float delta) {
    uint v = e >> (8u * h);
    return vec4(float(v & 3u), float((v >> 2) & 3u), float((v >> 4) & 3u), float((v >> 6) & 3u)) - 1.0 + delta;
}
