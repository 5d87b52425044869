// Q4_0: ggml block_q4_0 (ggml-common.h): { f16 d; uint8 qs[16]; } = 18 bytes;
// element j < 16 is (qs[j] & 15) - 8, element j + 16 is (qs[j] >> 4) - 8, times d.
void dec_unit(uint64_t row, uint u, out vec4 w[8]) {
    uint64_t b = row + uint64_t(u) * 18ul;
    float d = unpackHalf2x16(uint(RB16(b).v[0])).x;
    RB16 q = RB16(b + 2ul);
    [[unroll]] for (uint k = 0u; k < 4u; k++) {
        uint v = uint(q.v[2u * k]) | (uint(q.v[2u * k + 1u]) << 16);
        w[k] = d * (vec4(v & 15u, (v >> 8) & 15u, (v >> 16) & 15u, (v >> 24) & 15u) - 8.0);
        w[k + 4u] = d * (vec4((v >> 4) & 15u, (v >> 12) & 15u, (v >> 20) & 15u, v >> 28) - 8.0);
    }
}
