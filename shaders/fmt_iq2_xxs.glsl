// IQ2_XXS: ggml block_iq2_xxs (ggml-common.h): { f16 d; uint16 qs[32]; } = 66 bytes for 256 elements.
// Sub-block ib (32 elements): two u32 a0 = qs[4ib..4ib+1], a1 = qs[4ib+2..4ib+3]; group l (8 elements):
// grid entry byte l of a0, signs ksigns[(a1 >> 7l) & 127]; w = d * (0.5 + (a1 >> 28)) / 4 * grid * sign
// (dequantize_row_iq2_xxs, ggml-quants.c).
#include "iq_common.glsl"
#include "iq_grids.glsl"
void dec_unit(uint64_t row, uint u, out vec4 w[8]) {
    uint ib = u & 7u;
    RB16 p = RB16(row + uint64_t(u >> 3) * 66ul);
    float d = unpackHalf2x16(uint(p.v[0])).x;
    uint o = 1u + 4u * ib;
    uint a0 = uint(p.v[o]) | (uint(p.v[o + 1u]) << 16);
    uint a1 = uint(p.v[o + 2u]) | (uint(p.v[o + 3u]) << 16);
    float db = d * (0.5 + float(a1 >> 28)) * 0.25;
    [[unroll]] for (uint l = 0u; l < 4u; l++) {
        uint gi = (a0 >> (8u * l)) & 255u;
        uint s = iq_ksigns((a1 >> (7u * l)) & 127u);
        w[2u * l] = db * iq_signed4(IQ2XXS_GRID(2u * gi), s);
        w[2u * l + 1u] = db * iq_signed4(IQ2XXS_GRID(2u * gi + 1u), s >> 4);
    }
}
