// IQ2_S: ggml block_iq2_s (ggml-common.h): { f16 d; uint8 qs[64]; uint8 qh[8]; uint8 scales[8]; } = 82
// bytes; qs[0..31] the low 8 bits of the grid indices, qs[32..63] plain sign bytes. Group l of sub-block ib:
// index qs[4ib + l] | ((qh[ib] >> 2l) & 3) << 8, signs qs[32 + 4ib + l]; scale nibble scales[ib] (low for
// l < 2); w = d * (0.5 + s) / 4 * grid * sign (dequantize_row_iq2_s).
#include "iq_common.glsl"
#include "iq_grids.glsl"
void dec_unit(uint64_t row, uint u, out vec4 w[8]) {
    uint ib = u & 7u;
    uint64_t b = row + uint64_t(u >> 3) * 82ul;
    RB8 q = RB8(b);
    float d = unpackHalf2x16(uint(RB16(b).v[0])).x;
    uint sc = uint(q.v[74u + ib]);
    uint qh = uint(q.v[66u + ib]);
    [[unroll]] for (uint l = 0u; l < 4u; l++) {
        uint gi = uint(q.v[2u + 4u * ib + l]) | (((qh >> (2u * l)) & 3u) << 8);
        uint s = uint(q.v[34u + 4u * ib + l]);
        float db = d * (0.5 + float((sc >> (4u * (l >> 1))) & 15u)) * 0.25;
        w[2u * l] = db * iq_signed4(IQ2S_GRID(2u * gi), s);
        w[2u * l + 1u] = db * iq_signed4(IQ2S_GRID(2u * gi + 1u), s >> 4);
    }
}
