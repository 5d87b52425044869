// TQ2_0: ggml block_tq2_0 (ggml-common.h): { uint8 qs[64]; f16 d; } = 66 bytes for 256 elements (2-byte
// aligned only: 16-bit reads). Element 128n + 32j + l: q = (qs[32n + l] >> 2j) & 3; w = d * (q - 1)
// (dequantize_row_tq2_0).
void dec_unit(uint64_t row, uint u, out vec4 w[8]) {
    uint uu = u & 7u, n = uu >> 2, j = uu & 3u;
    uint64_t b = row + uint64_t(u >> 3) * 66ul;
    float d = unpackHalf2x16(uint(RB16(b + 64ul).v[0])).x;
    RB16 q = RB16(b + uint64_t(n) * 32ul);
    uint sh = 2u * j;
    [[unroll]] for (uint k = 0u; k < 8u; k++) {
        uint v = (uint(q.v[2u * k]) | (uint(q.v[2u * k + 1u]) << 16)) >> sh;
        w[k] = d * (vec4(v & 3u, (v >> 8) & 3u, (v >> 16) & 3u, (v >> 24) & 3u) - 1.0);
    }
}
