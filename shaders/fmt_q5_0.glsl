// Q5_0: ggml block_q5_0 (ggml-common.h): { f16 d; uint8 qh[4]; uint8 qs[16]; } = 22 bytes;
// element j < 16: ((qs[j] & 15) | bit j of qh << 4) - 16; j + 16: ((qs[j] >> 4) | bit j+16 of qh << 4) - 16.
void dec_unit(uint64_t row, uint u, out vec4 w[8]) {
    uint64_t b = row + uint64_t(u) * 22ul;
    RB16 p = RB16(b);
    float d = unpackHalf2x16(uint(p.v[0])).x;
    uint qh = uint(p.v[1]) | (uint(p.v[2]) << 16);
    [[unroll]] for (uint k = 0u; k < 4u; k++) {
        uint v = uint(p.v[3u + 2u * k]) | (uint(p.v[4u + 2u * k]) << 16);
        uint h0 = qh >> (4u * k), h1 = qh >> (16u + 4u * k);
        vec4 lo = vec4((v & 15u) | ((h0 & 1u) << 4), ((v >> 8) & 15u) | ((h0 & 2u) << 3),
                       ((v >> 16) & 15u) | ((h0 & 4u) << 2), ((v >> 24) & 15u) | ((h0 & 8u) << 1));
        vec4 hi = vec4(((v >> 4) & 15u) | ((h1 & 1u) << 4), ((v >> 12) & 15u) | ((h1 & 2u) << 3),
                       ((v >> 20) & 15u) | ((h1 & 4u) << 2), (v >> 28) | ((h1 & 8u) << 1));
        w[k] = d * (lo - 16.0);
        w[k + 4u] = d * (hi - 16.0);
    }
}
