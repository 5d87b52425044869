// Q5_1: ggml block_q5_1 (ggml-common.h): { f16 d; f16 m; uint8 qh[4]; uint8 qs[16]; } = 24 bytes;
// element j < 16: (qs[j] & 15) | bit j of qh << 4; j + 16: (qs[j] >> 4) | bit j+16 of qh << 4; w = d * q + m.
void dec_unit(uint64_t row, uint u, out vec4 w[8]) {
    RB32 p = RB32(row + uint64_t(u) * 24ul);
    vec2 dm = unpackHalf2x16(p.v[0]);
    uint qh = p.v[1];
    [[unroll]] for (uint k = 0u; k < 4u; k++) {
        uint v = p.v[2u + k];
        uint h0 = qh >> (4u * k), h1 = qh >> (16u + 4u * k);
        vec4 lo = vec4((v & 15u) | ((h0 & 1u) << 4), ((v >> 8) & 15u) | ((h0 & 2u) << 3),
                       ((v >> 16) & 15u) | ((h0 & 4u) << 2), ((v >> 24) & 15u) | ((h0 & 8u) << 1));
        vec4 hi = vec4(((v >> 4) & 15u) | ((h1 & 1u) << 4), ((v >> 12) & 15u) | ((h1 & 2u) << 3),
                       ((v >> 20) & 15u) | ((h1 & 4u) << 2), (v >> 28) | ((h1 & 8u) << 1));
        w[k] = dm.x * lo + dm.y;
        w[k + 4u] = dm.x * hi + dm.y;
    }
}
