// BF16: ggml GGML_TYPE_BF16, the top 16 bits of an f32 (ggml-impl.h ggml_compute_bf16_to_fp32).
vec2 bf2(uint b) { return vec2(uintBitsToFloat(b << 16), uintBitsToFloat(b & 0xffff0000u)); }
void dec_unit(uint64_t row, uint u, out vec4 w[8]) {
    RB128 p = RB128(row + uint64_t(u) * 64ul);
    [[unroll]] for (uint q = 0u; q < 4u; q++) {
        uvec4 b = p.v[q];
        w[2u * q] = vec4(bf2(b.x), bf2(b.y));
        w[2u * q + 1u] = vec4(bf2(b.z), bf2(b.w));
    }
}
