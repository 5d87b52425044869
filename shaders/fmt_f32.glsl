// F32: ggml GGML_TYPE_F32, 4 bytes an element (ggml.h). A unit is 32 consecutive elements.
void dec_unit(uint64_t row, uint u, out vec4 w[8]) {
    RB128 p = RB128(row + uint64_t(u) * 128ul);
    [[unroll]] for (uint q = 0u; q < 8u; q++) w[q] = uintBitsToFloat(p.v[q]);
}
