// IQ3_XXS: ggml block_iq3_xxs (ggml-common.h): { f16 d; uint8 qs[96]; } = 98 bytes: qs[0..63] grid
// indices (4 elements each), then u32 scales_and_signs[8]. Sub-block ib: a = that u32; group l: signs
// ksigns[(a >> 7l) & 127], entries qs[8ib + 2l], qs[8ib + 2l + 1]; w = d * (0.5 + (a >> 28)) / 2 * grid *
// sign (dequantize_row_iq3_xxs).
#include "iq_common.glsl"
#include "iq_grids.glsl"
void dec_unit(uint64_t row, uint u, out vec4 w[8]) {
    uint ib = u & 7u;
    RB16 p = RB16(row + uint64_t(u >> 3) * 98ul);
    float d = unpackHalf2x16(uint(p.v[0])).x;
    uint a = uint(p.v[33u + 2u * ib]) | (uint(p.v[34u + 2u * ib]) << 16);
    float db = d * (0.5 + float(a >> 28)) * 0.5;
    [[unroll]] for (uint l = 0u; l < 4u; l++) {
        uint g = uint(p.v[1u + 4u * ib + l]);
        uint s = iq_ksigns((a >> (7u * l)) & 127u);
        w[2u * l] = db * iq_signed4(IQ3XXS_GRID(g & 255u), s);
        w[2u * l + 1u] = db * iq_signed4(IQ3XXS_GRID(g >> 8), s >> 4);
    }
}
