// Q4_1: ggml block_q4_1 (ggml-common.h): { f16 d; f16 m; uint8 qs[16]; } = 20 bytes;
// element j < 16 is d * (qs[j] & 15) + m, element j + 16 is d * (qs[j] >> 4) + m.
void dec_unit(uint64_t row, uint u, out vec4 w[8]) {
    uint64_t b = row + uint64_t(u) * 20ul;
    RB32 p = RB32(b);
    vec2 dm = unpackHalf2x16(p.v[0]);
    [[unroll]] for (uint k = 0u; k < 4u; k++) {
        uint v = p.v[1u + k];
        w[k] = dm.x * vec4(v & 15u, (v >> 8) & 15u, (v >> 16) & 15u, (v >> 24) & 15u) + dm.y;
        w[k + 4u] = dm.x * vec4((v >> 4) & 15u, (v >> 12) & 15u, (v >> 20) & 15u, v >> 28) + dm.y;
    }
}
