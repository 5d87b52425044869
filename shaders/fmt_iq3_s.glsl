// IQ3_S: ggml block_iq3_s (ggml-common.h): { f16 d; uint8 qs[64]; uint8 qh[8]; uint8 signs[32];
// uint8 scales[4]; } = 110 bytes. Sub-block ib: scale nibble (scales[ib/2] >> 4(ib&1)) & 15; group l:
// entries qs[8ib + 2l + h] | ((qh[ib] >> (2l + h)) & 1) << 8 for h = 0, 1, signs signs[4ib + l];
// w = d * (1 + 2s) * grid * sign (dequantize_row_iq3_s).
#include "iq_common.glsl"
#include "iq_grids.glsl"
void dec_unit(uint64_t row, uint u, out vec4 w[8]) {
    uint ib = u & 7u;
    uint64_t b = row + uint64_t(u >> 3) * 110ul;
    RB16 p = RB16(b);
    RB8 q = RB8(b);
    float d = unpackHalf2x16(uint(p.v[0])).x;
    float db = d * float(1u + 2u * ((uint(q.v[106u + (ib >> 1)]) >> (4u * (ib & 1u))) & 15u));
    uint qh = uint(q.v[66u + ib]);
    [[unroll]] for (uint l = 0u; l < 4u; l++) {
        uint g = uint(p.v[1u + 4u * ib + l]);
        uint s = uint(q.v[74u + 4u * ib + l]);
        uint g0 = (g & 255u) | (((qh >> (2u * l)) & 1u) << 8);
        uint g1 = (g >> 8) | (((qh >> (2u * l + 1u)) & 1u) << 8);
        w[2u * l] = db * iq_signed4(IQ3S_GRID(g0), s);
        w[2u * l + 1u] = db * iq_signed4(IQ3S_GRID(g1), s >> 4);
    }
}
