// F16: ggml GGML_TYPE_F16, IEEE half, 2 bytes an element, little endian (ggml.h).
void dec_unit(uint64_t row, uint u, out vec4 w[8]) {
    RB128 p = RB128(row + uint64_t(u) * 64ul);
    [[unroll]] for (uint q = 0u; q < 4u; q++) {
        uvec4 b = p.v[q];
        w[2u * q] = vec4(unpackHalf2x16(b.x), unpackHalf2x16(b.y));
        w[2u * q + 1u] = vec4(unpackHalf2x16(b.z), unpackHalf2x16(b.w));
    }
}
